"""Renders equal the models' own templates; normalization; torch stays out of the proxy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from anchorcache.proxy.splitter import SplitError, get_adapter, normalize_messages, normalize_tools
from anchorcache.proxy.splitter.tokenizers import load_hf_dir
from anchorcache.testing.strategies import conversation

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(conv=conversation())
def test_qwen3_render_is_the_qwen3_template(adapters, tokenizers_by_name, conv):
    msgs, tools = conv
    ours = adapters["qwen3"].render_text(msgs, tools)
    theirs = tokenizers_by_name["qwen3"].render(normalize_messages(msgs), normalize_tools(tools),
                                                add_generation_prompt=True)
    assert ours == theirs


def test_qwen3_thinking_off_and_reasoning(adapters, tokenizers_by_name):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA", "tool_calls": [
                {"id": "1", "function": {"name": "ls", "arguments": "{}"}}]},
            {"role": "tool", "content": "x"}]
    for kw in ({"enable_thinking": False}, {}):
        ours = adapters["qwen3"].render_text(msgs, None, template_kwargs=kw)
        assert ours == tokenizers_by_name["qwen3"].render(normalize_messages(msgs), None,
                                                          add_generation_prompt=True, **kw)
    assert ours.count("<think>") == 1  # reasoning after the last query is kept


@SETTINGS
@given(conv=conversation())
def test_chatml_equals_smollm2_template_without_tools(adapters, tokenizers_by_name, conv):
    msgs, _ = conv
    plain = [m for m in normalize_messages(msgs) if m["role"] in ("system", "user")]
    ours = adapters["chatml"].render_text(plain, None)
    assert ours == tokenizers_by_name["smollm2"].render(plain, None, add_generation_prompt=True)


def test_chatml_renders_tools_calls_and_results(adapters):
    msgs = [{"role": "user", "content": "list"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    text = adapters["chatml"].render_text(msgs, tools)
    assert '<tools>\n{"type": "function", "function": {"name": "ls"' in text
    assert '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\na.txt\n</tool_response>" in text
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_toolset_order_is_the_clients_unless_canonical(adapters, tokenizers_by_name):
    """By default the tools and their keys render in the client's order (as the template
    does); with canonical ordering on, one toolset in any order renders the same."""
    tools = [{"type": "function", "function": {"name": n, "description": "d",
                                               "parameters": {"type": "object",
                                                              "properties": {"b": {}, "a": {}}}}}
             for n in ("zeta", "alpha", "mid")]
    shuffled = [tools[2], tools[0], tools[1]]
    shuffled[0] = {"function": {"parameters": {"properties": {"a": {}, "b": {}},
                                               "type": "object"},
                                "description": "d", "name": "mid"}, "type": "function"}
    msgs = [{"role": "user", "content": "hi"}]
    for name in ("qwen3", "chatml", "llama3", "mistral", "harmony", "generic-qwen3",
                 "generic-smollm2"):
        adapter = adapters[name]
        a, b = adapter.split(msgs, tools), adapter.split(msgs, shuffled)
        assert a.input_ids != b.input_ids, name
        a = adapter.split(msgs, tools, canonical_tools=True)
        b = adapter.split(msgs, shuffled, canonical_tools=True)
        assert a.input_ids == b.input_ids, name
    qwen3 = tokenizers_by_name["qwen3"]
    text = qwen3.decode(list(adapters["qwen3"].split(msgs, shuffled).input_ids))
    assert text == qwen3.render(msgs, shuffled)
    assert text.index('"mid"') < text.index('"zeta"') < text.index('"alpha"')
    assert text.index('{"function": {"parameters": {"properties": {"a"') > 0
    canonical = get_adapter("auto", qwen3, canonical_tools=True)
    assert canonical.split(msgs, shuffled) == adapters["qwen3"].split(
        msgs, tools, canonical_tools=True)


def test_string_and_object_arguments_render_the_same(adapters):
    def msgs(args):
        return [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "cd",
                                                                   "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    for name in ("qwen3", "chatml", "llama3", "mistral", "generic-smollm2"):
        a = adapters[name].split(msgs('{"folder":  "docs"}'), None)
        b = adapters[name].split(msgs({"folder": "docs"}), None)
        assert a.input_ids == b.input_ids


@pytest.mark.parametrize("bad, param", [
    ('{"folder": 1} x', "messages[1].tool_calls[0].function.arguments"),
    ("hello", "messages[1].tool_calls[0].function.arguments"),
    ("[1, 2]", "messages[1].tool_calls[0].function.arguments"),
])
def test_invalid_arguments_are_a_split_error(adapters, bad, param):
    """Not an object's JSON, nor its start (JSON cut short, a call max_tokens cut, renders:
    test_split_parsers.test_a_partial_call_sent_back_renders)."""
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "cd", "arguments": bad}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    for adapter in adapters.values():
        with pytest.raises(SplitError) as err:
            adapter.split(msgs, None)
        assert err.value.param == param


def test_bad_roles_and_parts_are_split_errors(adapters):
    with pytest.raises(SplitError) as err:
        adapters["qwen3"].split([{"role": "robot", "content": "x"}])
    assert err.value.param == "messages[0].role"
    with pytest.raises(SplitError) as err:
        adapters["qwen3"].split([{"role": "user", "content": [{"type": "image_url"}]}])
    assert err.value.param == "messages[0].content[0]"


def test_template_that_needs_a_user_turn_still_splits(tmp_path, tokenizers_by_name):
    """A strict template: raises unless the conversation has a user message. The instruction
    cut comes from slicing the full render, never from rendering the system part alone."""
    src = Path(tokenizers_by_name["qwen3"].source)
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    template = ("{% if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
                "{{ raise_exception('need a user turn') }}{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_hf_dir(tmp_path, name="strict")
    with pytest.raises(Exception, match="need a user turn"):
        tok.render([{"role": "system", "content": "S"}])
    adapter = get_adapter("generic", tok)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    result = adapter.split(msgs)
    assert result.instruction_cut is not None and result.conversation_cut is not None
    text = tok.render(msgs)
    assert tok.encode(text) == list(result.input_ids)
    head = tok.decode(list(result.input_ids[: result.instruction_cut]))
    # the whole system turn, plus at most the next turn's header (the probe agrees with it)
    assert head.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert head.endswith(("<|im_end|>\n", "<|im_start|>", "<|im_start|>user\n"))
    assert tok.encode(text[: len(head)]) == list(result.input_ids[: result.instruction_cut])


def test_proxy_side_never_imports_torch():
    code = ("import sys, json\n"
            "from anchorcache.proxy.splitter.tokenizers import load_tokenizer\n"
            "from anchorcache.proxy.splitter import get_adapter\n"
            "for n in ('qwen3', 'smollm2', 'llama3', 'mistral'):\n"
            "    a = get_adapter('auto', load_tokenizer(n))\n"
            "    a.split([{'role': 'user', 'content': 'hi'}])\n"
            "    p = a.output_parser(None); p.feed('x'); p.finish()\n"
            "print(json.dumps(['torch' in sys.modules, 'transformers' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]
