"""Reasoning output (`splitter/reasoning.py`, harmony's analysis channel) with the real Qwen3
tokenizer and template and openai-harmony: streaming token by token, or in any chunks,
equals parsing the whole text; no part of a think tag reaches content or reasoning; the
block is reasoning however the prompt leaves it; calls after it parse; and a reply sent
back renders as it was generated."""

from __future__ import annotations

import itertools

import openai_harmony as h
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchorcache.proxy.detokenizer import IncrementalDetokenizer
from anchorcache.proxy.splitter.parsers import OutputParser, TagParser
from anchorcache.proxy.splitter.reasoning import (
    ThinkParser,
    ThinkState,
    effort_template_kwargs,
    response_parser,
    think_state,
)
from anchorcache.testing.adapters import harmony_completion

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "Weather in Rome?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
# what Qwen3 writes with thinking on (the template's own layout) and what it is made of
OUTPUTS = [
    ("<think>\nThe user asks for Rome.\nI call the tool.\n</think>\n\n" + CALL,
     "The user asks for Rome.\nI call the tool.", None, ["get_weather"]),
    ("<think>\nSimple.\n</think>\n\nIt is sunny in Rome.", "Simple.", "It is sunny in Rome.", []),
    ("<think>\n\n</think>\n\nNo thoughts.", None, "No thoughts.", []),
    ("Hello <think>x</think> there", None, "Hello <think>x</think> there", []),  # not at the start
    ("\n<think>\na < b, and </thinking> is not the tag\n</think>\n\nDone.",
     "a < b, and </thinking> is not the tag", "Done.", []),
    ("<think>\nTwo calls.\n</think>\n\nChecking.\n" + CALL + "\n" + CALL, "Two calls.",
     "Checking.", ["get_weather", "get_weather"]),
]


@pytest.fixture(scope="module")
def qwen3(adapters):
    return adapters["qwen3"]


def _parse_stream(parser, pieces, *, truncated: bool = False):
    deltas = [d for piece in pieces for d in parser.feed(piece)]
    deltas += parser.flush(truncated=truncated)
    return deltas, parser.finish()


def _joined(deltas, field: str) -> str:
    return "".join(getattr(d, field) or "" for d in deltas)


def _check(deltas, parsed, reasoning, content, calls) -> None:
    assert parsed.reasoning == reasoning
    assert parsed.content == content
    assert [c.name for c in parsed.tool_calls] == calls
    # the deltas are the result, piece by piece, one field each
    assert _joined(deltas, "reasoning") == (reasoning or "")
    assert _joined(deltas, "content") == (content or "")
    assert [d.tool_call.name for d in deltas if d.tool_call] == calls
    assert all(sum(x is not None for x in (d.content, d.tool_call, d.reasoning)) == 1
               for d in deltas)


def _token_texts(tokenizer, text: str) -> list[str]:
    """`text` as the model streams it: its Qwen3 tokens, detokenized one at a time."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in tokenizer.encode(text)]
    assert "".join(pieces) + detok.flush() == text
    return pieces


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), OUTPUTS)
def test_token_by_token_equals_whole(qwen3, text, reasoning, content, calls):
    whole = _parse_stream(response_parser(qwen3, TOOLS), [text])
    _check(*whole, reasoning, content, calls)
    streamed = _parse_stream(response_parser(qwen3, TOOLS), _token_texts(qwen3.tokenizer, text))
    _check(*streamed, reasoning, content, calls)
    assert len([d for d in streamed[0] if d.reasoning]) >= (reasoning or "").count(" ")


@SETTINGS
@given(case=st.sampled_from(OUTPUTS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_chunking_equals_whole_and_never_leaks_a_tag(qwen3, case, cuts):
    text, reasoning, content, calls = case
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    deltas, parsed = _parse_stream(response_parser(qwen3, TOOLS), pieces)
    _check(deltas, parsed, reasoning, content, calls)
    if text.startswith("<think>"):  # a tag split anywhere is never emitted in part
        for d in deltas:
            for part in (d.content or "", d.reasoning or ""):
                assert not any(part.endswith(tag[:n]) for tag in ("<think>", "</think>")
                               for n in range(2, len(tag) + 1))


def test_tool_choice_none_still_splits_reasoning(qwen3):
    deltas, parsed = _parse_stream(response_parser(qwen3, TOOLS, tool_choice="none"),
                                   [OUTPUTS[0][0]])
    _check(deltas, parsed, OUTPUTS[0][1], CALL, [])


@pytest.mark.parametrize("pieces", [["<think>\nStill think"], ["<think>\nStill think\n</thi"],
                                    ["<think>\nStill think\n", "\n"]])
def test_cut_inside_the_block_is_all_reasoning(qwen3, pieces):
    deltas, parsed = _parse_stream(response_parser(qwen3, TOOLS), pieces, truncated=True)
    _check(deltas, parsed, "Still think", None, [])


def test_a_call_cut_after_the_block_comes_back_partial(qwen3):
    text = '<think>\nok\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    deltas, parsed = _parse_stream(response_parser(qwen3, TOOLS),
                                   _token_texts(qwen3.tokenizer, text), truncated=True)
    assert parsed.reasoning == "ok" and parsed.content is None
    [call] = parsed.tool_calls
    assert call.partial and call.name == "get_weather"
    assert [d.tool_call.partial for d in deltas if d.tool_call] == [True]


def test_the_generation_prompt_decides_where_the_output_starts(qwen3):
    on = qwen3.split(USER, TOOLS).input_ids
    off = qwen3.split(USER, TOOLS, template_kwargs={"enable_thinking": False}).input_ids
    assert qwen3.generation_prompt(on) == "<|im_start|>assistant\n"
    assert qwen3.generation_prompt(off) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert think_state(qwen3.generation_prompt(on)) is ThinkState.NONE
    assert think_state(qwen3.generation_prompt(off)) is ThinkState.CLOSED
    # thinking off: the template wrote an empty block, the output is parsed as it is
    parser = response_parser(qwen3, TOOLS, prompt_ids=off)
    assert isinstance(parser, TagParser) and not isinstance(parser, ThinkParser)
    deltas, parsed = _parse_stream(parser, ["Sunny."])
    _check(deltas, parsed, None, "Sunny.", [])
    # a template that opens the block (Qwen3-Thinking, Qwen3.5): only `</think>` is written
    opened = (*on, *qwen3.tokenizer.encode("<think>\n"))
    assert think_state(qwen3.generation_prompt(opened)) is ThinkState.OPEN
    text = OUTPUTS[0][0].removeprefix("<think>")
    for pieces in ([text], _token_texts(qwen3.tokenizer, text)):
        deltas, parsed = _parse_stream(response_parser(qwen3, TOOLS, prompt_ids=opened), pieces)
        _check(deltas, parsed, OUTPUTS[0][1], None, ["get_weather"])
    deltas, parsed = _parse_stream(response_parser(qwen3, TOOLS, prompt_ids=opened),
                                   ["Cut in the middle of"], truncated=True)
    _check(deltas, parsed, "Cut in the middle of", None, [])


def test_a_forced_call_has_no_block_before_it(qwen3):
    forced = qwen3.forced_prefix("required")
    parser = response_parser(qwen3, TOOLS, tool_choice="required")
    assert not isinstance(parser, ThinkParser)  # the prompt ends in the call's opening
    deltas, parsed = _parse_stream(parser, [CALL.removeprefix(forced)])
    _check(deltas, parsed, None, None, ["get_weather"])


def test_other_adapters_have_no_think_blocks(adapters):
    for name in ("chatml", "llama3", "mistral", "generic-smollm2"):
        parser = response_parser(adapters[name], None)
        assert not isinstance(parser, ThinkParser)
        assert type(parser) is type(adapters[name].output_parser(None))
    assert isinstance(ThinkParser(OutputParser()).inner, OutputParser)


def test_a_reply_sent_back_renders_as_generated(qwen3):
    """The assistant turn rebuilt from the parsed output (reasoning_content, content, tool
    calls) renders exactly the generated text while the template keeps reasoning (after a
    call, up to the next user query): the response anchor of the reply is a prefix of the
    next prompt."""
    for text, _, _, _ in (OUTPUTS[0], OUTPUTS[5]):
        prompt = qwen3.split(USER, TOOLS).input_ids
        parser = response_parser(qwen3, TOOLS, prompt_ids=prompt)
        parser.feed(text)
        parsed = parser.finish()
        reply = {"role": "assistant", "content": parsed.content or "",
                 "reasoning_content": parsed.reasoning,
                 "tool_calls": [c.to_openai() for c in parsed.tool_calls]}
        results = [{"role": "tool", "tool_call_id": c.id, "content": "18C"}
                   for c in parsed.tool_calls]
        after = qwen3.split([*USER, reply, *results], TOOLS).input_ids
        generated = (*prompt, *qwen3.tokenizer.encode(text + "<|im_end|>"))
        assert after[: len(generated)] == generated


def test_reasoning_effort_becomes_the_templates_switch(adapters):
    qwen3, harmony, smol = adapters["qwen3"], adapters["harmony"], adapters["chatml"]
    assert effort_template_kwargs(qwen3, "none") == {"enable_thinking": False}
    assert effort_template_kwargs(qwen3, "minimal") == {"enable_thinking": False}
    assert effort_template_kwargs(qwen3, "high") == {}
    assert effort_template_kwargs(harmony, "high") == {"reasoning_effort": "high"}
    assert effort_template_kwargs(harmony, "minimal") == {"reasoning_effort": "low"}
    assert effort_template_kwargs(smol, "none") == {}
    low = harmony.split(USER, template_kwargs=effort_template_kwargs(harmony, "none"))
    assert "Reasoning: low" in harmony.tokenizer.decode(list(low.input_ids))


# -- harmony: the analysis channel is reasoning ----------------------------------------------

def _assistant(text: str, channel: str) -> h.Message:
    return h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel(channel)


@pytest.mark.parametrize("ending", ["final", "call", "cut"])
def test_harmony_analysis_is_reasoning_token_by_token(adapters, ending):
    adapter = adapters["harmony"]
    msgs = [_assistant("The user wants <b>Rome</b>.\nCheck it.", "analysis")]
    if ending == "call":
        msgs.append(_assistant('{"city": "Rome"}', "commentary")
                    .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"))
    else:
        msgs.append(_assistant("Sunny.", "final"))
    ids, _ = harmony_completion(adapter, *msgs)
    if ending == "cut":
        ids = ids[: ids.index(adapter.tokenizer.encode("<|end|>")[0]) - 2]
    library = h.StreamableParser(adapter.tokenizer.encoding, h.Role.ASSISTANT)
    for t in ids:
        library.process(t)
    expected = "".join(m.content[0].text for m in library.messages if m.channel == "analysis")
    if library.current_channel == "analysis":  # cut inside it
        expected += library.current_content
    pieces = [adapter.tokenizer.decode([t]) for t in ids]
    deltas, parsed = _parse_stream(adapter.output_parser(TOOLS), pieces,
                                   truncated=ending == "cut")
    assert parsed.reasoning == expected == _joined(deltas, "reasoning")
    assert expected.startswith("The user wants")
    assert parsed.content == ("Sunny." if ending == "final" else None)
    assert [c.name for c in parsed.tool_calls] == (["get_weather"] if ending == "call" else [])


def test_harmony_analysis_messages_are_joined_by_a_newline(adapters):
    adapter = adapters["harmony"]
    _, text = harmony_completion(adapter, _assistant("First.", "analysis"),
                                  _assistant("Second.", "analysis"), _assistant("Done.", "final"))
    deltas, parsed = _parse_stream(adapter.output_parser(None), list(text))
    assert parsed.reasoning == "First.\nSecond." == _joined(deltas, "reasoning")
    assert parsed.content == "Done."
    none = adapter.output_parser(TOOLS, tool_choice="none")
    none.feed(text)
    assert none.finish().reasoning == "First.\nSecond."

