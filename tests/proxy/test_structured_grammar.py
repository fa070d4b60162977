"""The grammars the proxy builds, checked with xgrammar itself (no model): for every adapter
family, the call markup the adapter renders and parses is exactly what the grammar allows,
arguments must validate, `auto` leaves text free but completes a started call, the
embedded worker spells forced text the tokenizer's way; bad schemas are 400s naming the
field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.splitter import get_adapter
from anchorcache.proxy.splitter.memo import MessageMemo
from anchorcache.proxy.splitter.tokenizers import load_tokenizer
from anchorcache.proxy.structured import (
    ResponseFormat,
    build_constraint,
    check_schema,
    normalize_schema,
    parse_response_format,
)

TOOLS = (
    {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"},
                                             "days": {"type": "int"}},  # BFCL-style type name
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
)
ARGS = {"city": "Paris", "days": 2}
# what each family's adapter renders for a call and its parser reads back
CALL_TEXT = {
    "chatml": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
              '\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               '{"city": "Paris", "days": 2}',
}
CALL_TEXT["qwen3"] = CALL_TEXT["chatml"]
BAD_ARGS = {k: v.replace('"days": 2', '"days": "two"') for k, v in CALL_TEXT.items()}
SECOND = {
    "chatml": '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "llama3": '; {"name": "get_time", "parameters": {"zone": "CET"}}',
}
SECOND["qwen3"] = SECOND["chatml"]


@pytest.fixture(scope="module")
def adapters() -> dict[str, Any]:
    return {"chatml": get_adapter("auto", load_tokenizer("smollm2")),
            "qwen3": get_adapter("auto", load_tokenizer("qwen3")),
            "llama3": get_adapter("auto", load_tokenizer("llama3")),
            "mistral": get_adapter("auto", load_tokenizer("mistral")),
            "harmony": get_adapter("auto", load_tokenizer("gpt-oss"))}


@pytest.fixture(scope="module")
def compiler() -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from anchorcache.ext.embedded.model_store import prepare_default_model

    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok), max_threads=1)


def accepts(compiler: Any, family: str, mode: str, text: str, **kw: Any) -> bool:
    import xgrammar as xgr

    c = build_constraint(adapter=family, tools=TOOLS, mode=mode,
                         function="get_weather" if mode == "function" else None,
                         response_format=None, grammar=None, **kw)
    assert c is not None and c.kind == "structural_tag"
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(c.text))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("family", list(CALL_TEXT))
def test_the_grammar_allows_what_the_adapter_parses(adapters, compiler, family) -> None:
    adapter = adapters[family]
    parser = adapter.output_parser(list(TOOLS), tool_choice="auto")
    parser.feed(CALL_TEXT[family])
    parsed = parser.finish()
    [call] = parsed.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", ARGS)
    assert not parsed.content
    for mode in ("required", "function", "auto"):
        assert accepts(compiler, family, mode, CALL_TEXT[family]), mode
        assert not accepts(compiler, family, mode, BAD_ARGS[family]), mode
    assert not accepts(compiler, family, "required", "It is sunny.")
    assert accepts(compiler, family, "auto", "It is sunny.")


@pytest.mark.parametrize("family", list(SECOND))
def test_parallel_calls(adapters, compiler, family) -> None:
    two = CALL_TEXT[family] + SECOND[family]
    assert accepts(compiler, family, "required", two)
    assert not accepts(compiler, family, "required", two, parallel_tool_calls=False)
    assert not accepts(compiler, family, "function", two)  # named: that one call only
    parser = adapters[family].output_parser(list(TOOLS), tool_choice="auto")
    parser.feed(two)
    assert [c.name for c in parser.finish().tool_calls] == ["get_weather", "get_time"]


def test_auto_completes_a_started_call(compiler) -> None:
    started = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
    import xgrammar as xgr

    c = build_constraint(adapter="chatml", tools=TOOLS, mode="auto", function=None,
                         response_format=None, grammar=None)
    assert c is not None
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(c.text))
    assert matcher.accept_string(started)
    assert not matcher.accept_string('{"town": "Paris"}')  # not the tool's schema
    assert matcher.accept_string('{"city": "Paris"}}\n</tool_call>')
    assert not matcher.accept_string("<tool_call>\n{\"name\": \"nope\"")  # unknown tool


def test_forced_text_is_spelled_the_tokenizers_way() -> None:
    """The embedded worker's mask and greedy sampler (no model): where the grammar forces
    a name, a token shorter than the tokenizer's own first one is refused and the next
    choice taken; inside a string any token goes."""
    import torch
    from transformers import AutoTokenizer

    from anchorcache.ext.embedded.grammar import Grammars
    from anchorcache.ext.embedded.model_store import prepare_default_model
    from anchorcache.ext.embedded.sampling import Sampler
    from anchorcache.wire import SamplingParams

    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    grammars = Grammars(tok, len(tok))
    c = build_constraint(adapter="chatml", tools=TOOLS, mode="required", function=None,
                         response_format=None, grammar=None)
    assert c is not None
    mask = grammars.mask(grammars.compile(c.kind, c.text), [tok.eos_token_id])
    flat = torch.zeros(len(tok))

    def write(text: str) -> None:
        for token in tok.encode(text, add_special_tokens=False):
            mask.apply(flat)
            assert mask.canonical(token), tok.decode([token])
            mask.accept(token)

    g, get = tok.convert_tokens_to_ids(["g", "get"])
    write('<tool_call>\n{"name": "')
    assert torch.isfinite(mask.apply(flat)[[g, get]]).all()  # the mask allows both
    assert not mask.canonical(g) and mask.canonical(get)
    logits = flat.clone()
    logits[g], logits[get] = 5.0, 1.0
    assert Sampler(SamplingParams(temperature=0.0), mask=mask)(logits).token == get
    write('_weather", "arguments": {"city": "')
    mask.apply(flat)
    assert mask.canonical(g)  # free text


def test_qwen3_thinking_comes_before_the_call(compiler) -> None:
    text = "<think>\nThe user wants weather.\n</think>\n\n" + CALL_TEXT["qwen3"]
    assert accepts(compiler, "qwen3", "required", text, thinking=True)
    assert not accepts(compiler, "qwen3", "required", text)


def test_response_format_and_schema_errors() -> None:
    assert parse_response_format({"type": "text"}) is None
    rf = parse_response_format({"type": "json_schema", "json_schema": {
        "name": "trip", "strict": True, "schema": {"type": "object", "properties": {
            "n": {"type": "float"}}}}})
    assert rf == ResponseFormat("json_schema", {"type": "object", "properties": {
        "n": {"type": "number"}}}, "trip", True)
    c = build_constraint(adapter="chatml", tools=(), mode="none", function=None,
                         response_format=rf, grammar=None)
    assert c is not None and c.kind == "json_schema" and json.loads(c.text) == rf.schema
    cases = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}},
              "response_format.json_schema.schema"),
             ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
             ({"type": "yaml"}, "response_format")]
    for body, param in cases:
        with pytest.raises(ApiError) as e:
            parse_response_format(body)
        assert e.value.status == 400 and e.value.param == param
    bad_tools = ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "city"}}},)
    with pytest.raises(ApiError) as e:
        build_constraint(adapter="chatml", tools=bad_tools, mode="required", function=None,
                         response_format=None, grammar=None)
    assert e.value.param == "tools[0].function.parameters"
    # auto only helps: a bad schema leaves that tool's arguments any JSON object
    assert build_constraint(adapter="chatml", tools=bad_tools, mode="auto", function=None,
                            response_format=None, grammar=None) is not None


def test_normalize_schema_rewrites_python_type_names() -> None:
    schema = {"type": "dict", "properties": {"a": {"type": "tuple", "items": {"type": "float"}},
                                             "type": {"type": "any"}}}
    assert normalize_schema(schema) == {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "number"}}, "type": {}}}
    check_schema(schema, "x")  # valid once normalized


def test_a_toolsets_constraint_is_kept_per_caller_and_equals_a_fresh_one() -> None:
    """An agent sends its tools every turn: the constraint is built once per caller (scope)
    and toolset; another caller's is never the same object (no caller times another's), a
    changed toolset gets its own, and a toolset that fails is refused every time."""
    kw: dict[str, Any] = dict(adapter="chatml", mode="auto", function=None,
                              response_format=None, grammar=None)
    memo = MessageMemo()
    first = build_constraint(tools=TOOLS, memo=memo, scope=b"caller a", **kw)
    assert build_constraint(tools=TOOLS, memo=memo, scope=b"caller a", **kw) is first
    other = build_constraint(tools=TOOLS, memo=memo, scope=b"caller b", **kw)
    assert other == first and other is not first
    assert first == build_constraint(tools=TOOLS, **kw)
    renamed = tuple({**t, "function": {**t["function"], "name": t["function"]["name"] + "_2"}}
                    for t in TOOLS)
    changed = build_constraint(tools=renamed, memo=memo, scope=b"caller a", **kw)
    assert changed is not None and first is not None and changed.text != first.text
    assert "get_weather_2" in changed.text
    bad_tools = ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "city"}}},)
    for _ in range(2):
        with pytest.raises(ApiError):
            build_constraint(adapter="chatml", tools=bad_tools, mode="required", function=None,
                             response_format=None, grammar=None, memo=memo, scope=b"caller a")
