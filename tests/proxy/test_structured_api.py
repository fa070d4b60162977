"""Structured output through the proxy, with the real default model and the openai SDK:
forced tool calls over the shared data's tools parse and validate, response_format output
validates, greedy output under a grammar is the same with anchors on and off, n choices
share one prefill, logprobs, and an unparsed call never leaks as content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.servers import Endpoint, Server
from anchorcache.testing.turns import TRIP, agent_cases, validate_calls

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
@pytest.fixture(scope="module")
def proxy_off(worker: Server) -> Iterator[Endpoint]:
    with proxy_in_process(worker.url, anchors=False) as server:
        yield server


@pytest.fixture()
def client_off(proxy_off: Endpoint) -> Any:
    import openai

    return openai.OpenAI(base_url=proxy_off.url + "/v1", api_key="", max_retries=0,
                         timeout=300)


def test_forced_calls_over_agent_tools_parse_and_validate(openai_client) -> None:
    """12 agent turns (12 toolsets), tool_choice required / named: every reply is one call
    whose arguments validate. (With the mask alone, one turn looped inside a free string
    argument until max_tokens: greedy decoding had spelled a forced tool name with a token
    the tokenizer never writes there; forced text is now spelled the tokenizer's way,
    grammar.py, which test_structured_grammar.py checks token by token. Each turn is a cold
    prefill of ~700 tokens and a decode of the call: 20 turns took 90 s of the suite.)"""
    for i, (msgs, tools, name) in enumerate(agent_cases(12)):
        choice: Any = "required" if i % 2 else {"type": "function", "function": {"name": name}}
        reply = openai_client.chat.completions.create(
            model="default", messages=msgs, tools=tools, tool_choice=choice, temperature=0,
            max_tokens=80, parallel_tool_calls=False)
        c = reply.choices[0]
        assert c.message.content is None, (i, c)
        assert c.finish_reason == "tool_calls", (i, c)
        validate_calls(c.message, tools)
        assert len(c.message.tool_calls) == 1
        if choice != "required":
            assert c.message.tool_calls[0].function.name == name


def test_response_format_json_schema_validates(openai_client) -> None:
    msgs = [{"role": "user", "content": "Suggest a city to visit and for how many days."}]
    reply = openai_client.chat.completions.create(
        model="default", messages=msgs, temperature=0, max_tokens=60,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "trip", "strict": True, "schema": TRIP}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), TRIP)
    ask = [{"role": "user", "content": 'Reply in JSON, like {"capital": "..."}: what is the '
                                       "capital of France?"}]
    reply = openai_client.chat.completions.create(
        model="default", messages=ask, temperature=0, max_tokens=60,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_grammar_output_is_the_same_with_anchors_on_and_off(openai_client, client_off) -> None:
    msgs, tools, _ = agent_cases(4)[3]
    kw: dict[str, Any] = dict(model="default", messages=msgs, tools=tools, tool_choice="required",
                              temperature=0, max_tokens=80, logprobs=True,
                              parallel_tool_calls=False)
    off = client_off.chat.completions.create(**kw)
    cold = openai_client.chat.completions.create(**kw)
    warm = openai_client.chat.completions.create(**kw)  # restores the anchors cold saved
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    tokens = [[t.token for t in r.choices[0].logprobs.content] for r in (off, cold, warm)]
    assert tokens[0] == tokens[1] == tokens[2] and tokens[0]
    calls = [[(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
             for r in (off, cold, warm)]
    assert calls[0] == calls[1] == calls[2]


def test_n_choices_share_one_prefill_and_a_seed_reproduces_them(client_off) -> None:
    kw: dict[str, Any] = dict(model="default", messages=FRANCE, temperature=1.0, seed=42, n=4,
                              max_tokens=16, logprobs=True)
    first = client_off.chat.completions.create(**kw)
    again = client_off.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    usage = first.usage.model_dump()
    assert usage["timings"]["prefill_tokens"] == usage["prompt_tokens"]  # once, not 4 times
    generated = sum(len(c.logprobs.content) for c in first.choices)
    stops = sum(c.finish_reason == "stop" for c in first.choices)  # their stop token
    assert usage["completion_tokens"] == generated + stops


def test_logprobs_spell_the_content(openai_client) -> None:
    reply = openai_client.chat.completions.create(model="default", messages=FRANCE,
                                                  temperature=0, max_tokens=12, logprobs=True,
                                                  top_logprobs=3)
    c = reply.choices[0]
    assert "".join(t.token for t in c.logprobs.content) == c.message.content
    for t in c.logprobs.content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token


def test_streamed_choices_and_logprobs(openai_client) -> None:
    text: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in openai_client.chat.completions.create(
            model="default", messages=FRANCE, temperature=0.7, seed=3, n=2, max_tokens=10,
            logprobs=True, stream=True):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            tokens[c.index] += "".join(t.token for t in (c.logprobs.content if c.logprobs else []))
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(finish) == [0, 1]
    assert text == tokens and all(text.values())
    whole = openai_client.chat.completions.create(model="default", messages=FRANCE,
                                                  temperature=0.7, seed=3, n=2, max_tokens=10)
    assert [c.message.content for c in whole.choices] == [text[0], text[1]]


def test_a_cut_off_call_never_leaks_markup(openai_client) -> None:
    msgs, tools, _ = agent_cases(1)[0]
    kw: dict[str, Any] = dict(model="default", messages=msgs, tools=tools,
                              tool_choice="required", temperature=0, max_tokens=8)
    reply = openai_client.chat.completions.create(**kw)
    c = reply.choices[0]
    assert c.finish_reason == "length"
    assert c.message.content is None and c.message.tool_calls is None
    assert "cut off by max_tokens" in c.model_extra["tool_call_error"]
    streamed = ""
    finish = None
    for chunk in openai_client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            streamed += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert streamed == "" and finish == "length"
