"""Output parsing: round trips through each adapter's own rendering, and streaming."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from anchorcache.proxy.splitter.mistral import TOOL_CALLS
from anchorcache.proxy.splitter.partial_json import close_json
from anchorcache.proxy.splitter.types import SplitError
from anchorcache.testing.strategies import arguments, is_prefix, names

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "ls", "cd", "send_message", "book_flight", "mv")]
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
calls_strategy = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)


def _assistant_text(adapter, calls) -> str:
    """What the model would have generated: the assistant turn as the template renders it."""
    user = [{"role": "user", "content": "do it"}]
    tool_calls = [{"id": f"c{i}", "type": "function",
                   "function": {"name": n, "arguments": json.dumps(a)}}
                  for i, (n, a) in enumerate(calls)]
    msgs = [*user, {"role": "assistant", "content": "", "tool_calls": tool_calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in tool_calls)]
    if adapter.name == "mistral":
        ids = list(adapter.split(msgs, TOOLS).input_ids)
        inner = adapter.tokenizer.tokenizer.instruct_tokenizer.tokenizer
        start = ids.index(inner.get_special_token(TOOL_CALLS))
        end = ids.index(inner.eos_id, start)
        return TOOL_CALLS + inner.decode(ids[start + 1: end])
    if adapter.name == "harmony":  # after the prompt's `<|start|>assistant`, up to the results
        prompt = adapter.tokenizer.decode(list(adapter.split(user, TOOLS).input_ids))
        full = adapter.tokenizer.decode(list(adapter.split(msgs, TOOLS).input_ids))
        assert full.startswith(prompt)
        return full[len(prompt): full.index("<|start|>functions.")]
    prompt = adapter.render_text(user, TOOLS)
    full = adapter.render_text(msgs, TOOLS)
    assert full.startswith(prompt[: prompt.rindex("<|")])
    end_marker = "<|eot_id|>" if adapter.name == "llama3" else "<|im_end|>"
    head = "<|start_header_id|>assistant<|end_header_id|>\n\n" if adapter.name == "llama3" \
        else "<|im_start|>assistant\n"
    start = full.index(head, len(prompt) - len(head)) + len(head)
    return full[start: full.index(end_marker, start)]


@pytest.mark.parametrize("name", ["qwen3", "chatml", "llama3", "mistral", "harmony",
                                  "generic-smollm2"])
@SETTINGS
@given(calls=calls_strategy)
def test_round_trip(adapters, name, calls):
    adapter = adapters[name]
    # a template's end marker (`<|im_end|>`, `<|eot_id|>`, harmony's) inside the arguments
    # ends the message there: decoded text is ambiguous, as it is to a real parser
    assume(name == "mistral" or name.startswith("generic")
           or "<|" not in json.dumps(calls, ensure_ascii=False))
    if name.startswith("generic"):  # tools lowered Hermes-style: the assistant text is ours
        text = "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}'
                         "\n</tool_call>" for n, a in calls)
    else:
        text = _assistant_text(adapter, calls)
    parser = adapter.output_parser(TOOLS)
    parser.feed(text)
    parsed = parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize("name", ["qwen3", "llama3", "mistral", "harmony"])
@SETTINGS
@given(calls=calls_strategy, prose=st.text(min_size=1, max_size=20).filter(
    lambda s: s.strip() and "<" not in s and "{" not in s and "[" not in s))
def test_streaming_equals_whole_and_never_leaks_markers(adapters, name, calls, prose):
    adapter = adapters[name]
    # the parser reads decoded text: a marker written inside the arguments is ambiguous there
    # (Hypothesis draws such strings from the code's constants)
    assume(name != "harmony" or "<|" not in json.dumps(calls, ensure_ascii=False))
    body = _assistant_text(adapter, calls)
    text = body if name == "llama3" else prose + body
    if name == "harmony":  # prose as the preamble message before the calls
        text = f"<|channel|>commentary<|message|>{prose}<|end|><|start|>assistant{body}"
    stream = adapter.output_parser(TOOLS)
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.flush()
    streamed = stream.finish()
    whole = adapter.output_parser(TOOLS)
    whole.feed(text)
    once = whole.finish()
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == \
        [(c.name, c.arguments) for c in once.tool_calls]
    assert streamed.content == once.content
    content = "".join(d.content for d in deltas if d.content)
    assert content == (streamed.content or "")
    for marker in ("<tool_call", "[TOOL_CALLS", "<|python_tag", "<|"):
        assert marker not in content
    assert [d.tool_call.index for d in deltas if d.tool_call] == list(range(len(calls)))


def test_plain_text_and_invalid_calls_are_content(adapters):
    parser = adapters["qwen3"].output_parser(TOOLS)
    out = parser.feed("Hello <tool_")
    assert [d.content for d in out] == ["Hello"]  # " <tool_" is held back
    parser.feed("call>{not json}</tool_call> bye")
    result = parser.finish()
    assert result.tool_calls == ()
    assert result.content == "Hello <tool_call>{not json}</tool_call> bye"


def test_tool_choice_none_and_forced(adapters):
    text = '<tool_call>\n{"name": "ls", "arguments": {"a": 1}}\n</tool_call>'
    none = adapters["qwen3"].output_parser(TOOLS, tool_choice="none")
    none.feed(text)
    assert none.finish().content == text
    forced = {"type": "function", "function": {"name": "cd"}}
    prefix = adapters["qwen3"].forced_prefix(forced)
    assert prefix == '<tool_call>\n{"name": "cd", "arguments": '
    parser = adapters["qwen3"].output_parser(TOOLS, tool_choice=forced)
    parser.feed('{"folder": "x"}}\n</tool_call>')
    result = parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("cd", {"folder":
                                                                                       "x"})]
    required = adapters["qwen3"].output_parser(TOOLS, tool_choice="required")
    required.feed('{"name": "ls", "arguments": {}}\n</tool_call>')
    assert required.finish().tool_calls[0].name == "ls"


def test_stop_tokens(adapters, tokenizers_by_name):
    assert tokenizers_by_name["qwen3"].token_to_id("<|im_end|>") in adapters["qwen3"].stop_token_ids
    assert tokenizers_by_name["llama3"].token_to_id("<|eot_id|>") in \
        adapters["llama3"].stop_token_ids
    assert adapters["mistral"].stop_token_ids


def _cut_parse(adapter, text: str, *, truncated: bool = True):
    parser = adapter.output_parser(TOOLS)
    deltas = parser.feed(text) + parser.flush(truncated=truncated)
    return deltas, parser.finish()


@pytest.mark.parametrize("name", ["qwen3", "chatml", "llama3", "mistral", "harmony"])
@SETTINGS
@given(calls=calls_strategy, data=st.data())
def test_a_call_cut_short_comes_back_as_far_as_it_was_written(adapters, name, calls, data):
    adapter = adapters[name]
    assume(name != "harmony" or "<|" not in json.dumps(calls, ensure_ascii=False))
    text = _assistant_text(adapter, calls)
    cut = data.draw(st.integers(0, len(text)), label="cut")
    deltas, parsed = _cut_parse(adapter, text[:cut])
    got = parsed.tool_calls
    assert [c.name for c in got] == [n for n, _ in calls][:len(got)]
    assert not any(c.partial for c in got[:-1])
    for call, (_, args) in zip(got, calls, strict=False):
        if not call.partial:
            assert json.loads(call.arguments) == args
            continue
        # the arguments' text as written before the cut, and what it says so far
        assert text[:cut].rstrip().endswith(call.arguments.rstrip())
        value = close_json(call.arguments) if call.arguments.strip() else {}
        assert isinstance(value, dict) and is_prefix(value, args), (call.arguments, args)
    streamed = [d.tool_call for d in deltas if d.tool_call]
    assert [(d.name, d.arguments_delta, d.partial) for d in streamed] == \
        [(c.name, c.arguments, c.partial) for c in got]
    if cut < len(text):  # an output that was not cut short keeps today's reading
        _, whole = _cut_parse(adapter, text[:cut], truncated=False)
        assert not any(c.partial for c in whole.tool_calls)


@pytest.mark.parametrize("name", ["qwen3", "chatml", "llama3", "mistral", "harmony"])
def test_every_cut_after_the_name_keeps_the_call(adapters, name):
    args = {"city": "Paris", "days": 3, "tags": ["old", "new"]}
    adapter = adapters[name]
    text = _assistant_text(adapter, [("get_weather", args)])
    start = text.index("<|message|>") + len("<|message|>") if name == "harmony" \
        else text.index('"get_weather"') + len('"get_weather"')
    for cut in range(start, len(text) + 1):
        _, parsed = _cut_parse(adapter, text[:cut])
        [call] = parsed.tool_calls
        assert call.name == "get_weather"
        assert parsed.content is None, (cut, parsed.content)
        value = json.loads(call.arguments) if not call.partial else \
            close_json(call.arguments) if call.arguments.strip() else {}
        assert is_prefix(value, args), (cut, call)
    # cut within its name, the call is not one: content (the pipeline cuts it at its marker)
    _, parsed = _cut_parse(adapter, text[:start - 3])
    assert parsed.tool_calls == ()


@pytest.mark.parametrize(("text", "value"), [
    ('{"city": "Par', {"city": "Par"}), ('{"a": 1, "b', {"a": 1}), ('{"a": 1,', {"a": 1}),
    ('{"a": ', {}), ('{"a": tr', {}), ('[1, 2', [1, 2]), ('{"a": {"b": [1, {"c": "d', {
        "a": {"b": [1, {"c": "d"}]}}), ('{"a": "x\\', {"a": "x"}), ('{"a": "x\\u00', {"a": "x"}),
    ('{"a": "x\\\\', {"a": "x\\"}), ('{"a": "\\u00e9t', {"a": "\u00e9t"}), ('{"k": "}"', {"k": "}"}),
    ('{"a": 1}', {"a": 1}), ("", None), ("nul", None), ('{"a": 1} x', None), ('{"a": 1}}', None)])
def test_close_json(text, value):
    assert close_json(text) == value


def _history(call) -> list[dict]:
    """The next turn's request after `call`: what an agent SDK sends back (the call as the
    proxy returned it, the tool's answer)."""
    return [{"role": "user", "content": "do it"},
            {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
            {"role": "tool", "tool_call_id": call.id, "content": "error: arguments cut off"}]


def _render(adapter, msgs) -> str:
    if adapter.name in ("mistral", "harmony"):  # rendered by their own libraries, as ids
        return adapter.tokenizer.decode(list(adapter.split(msgs, TOOLS).input_ids))
    return adapter.render_text(msgs, TOOLS)


@pytest.mark.parametrize("name", ["qwen3", "chatml", "llama3", "mistral", "harmony"])
def test_a_partial_call_sent_back_renders(adapters, name):
    """A call cut anywhere after its name, sent back in the history, is accepted. Templates
    that take arguments as a string (Qwen3's, the Hermes lowering, harmony's message text)
    render the text as written, so the prompt holds what the model wrote (the response
    anchor's tokens); the others (Llama 3's and Mistral's `tojson`) the object it says."""
    args = {"city": "Paris", "days": 3, "tags": ["old", "new"]}
    adapter = adapters[name]
    text = _assistant_text(adapter, [("get_weather", args)])
    start = text.index("<|message|>") + len("<|message|>") if name == "harmony" \
        else text.index('"get_weather"') + len('"get_weather"')
    raw = name in ("qwen3", "chatml", "harmony")
    seen_partial = 0
    for cut in range(start, len(text) + 1):
        _, parsed = _cut_parse(adapter, text[:cut])
        [call] = parsed.tool_calls
        if not call.partial or not call.arguments.strip():
            continue
        seen_partial += 1
        adapter.split(_history(call), TOOLS)  # no SplitError
        render = _render(adapter, _history(call))
        if raw:
            assert text[:cut].rstrip() in render, (cut, call.arguments)
        else:
            assert json.dumps(close_json(call.arguments), ensure_ascii=False) in render
    assert seen_partial > 10


def test_qwen3_renders_a_partial_call_as_its_own_template_renders_a_string(adapters,
                                                                           tokenizers_by_name):
    partial = '{"city": "Par'
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": partial}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "cut off"}]
    own = tokenizers_by_name["qwen3"].render(msgs, TOOLS, add_generation_prompt=True)
    assert adapters["qwen3"].render_text(msgs, TOOLS) == own
    assert '"arguments": {"city": "Par}\n</tool_call>' in own
    # a template that renders calls itself with `tojson` gets the object the text says
    generic = adapters["generic-qwen3"]
    ids = generic.split(msgs, TOOLS).input_ids
    assert '"arguments": {"city": "Par"}}' in generic.tokenizer.decode(list(ids))


@pytest.mark.parametrize("arguments", ["hello", "[1, 2", "5", '"{}"', '{"a": 1} x', "{]"])
def test_arguments_that_are_not_an_objects_json_nor_its_start_are_refused(adapters,
                                                                          arguments):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    with pytest.raises(SplitError) as e:
        adapters["qwen3"].split(msgs, TOOLS)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


@given(text=st.text("<tol_c/>x\n", max_size=30),
       marker=st.sampled_from(["<tool_call>", "</tool_call>", "</think>", "<|channel|>", "<<"]))
def test_a_held_back_suffix_is_the_longest_start_of_the_marker(text, marker):
    """`_partial_suffix`, which tries only where the marker's first character is, against
    every suffix tried longest first."""
    from anchorcache.proxy.splitter.parsers import _partial_suffix

    longest = next((n for n in range(min(len(text), len(marker) - 1), 0, -1)
                    if marker.startswith(text[-n:])), 0)
    assert _partial_suffix(text, marker) == longest
