"""Tools through the proxy with the real default model and the openai SDK: tool_choice
auto/none/required/named, tool calls parsed into OpenAI `tool_calls`, streamed the same."""

from __future__ import annotations

import json

import pytest

from anchorcache.testing.data import conversations, turn_requests

pytestmark = pytest.mark.slow

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _few_shot() -> list[dict]:
    """Three solved examples, so the 135M model reliably answers with a tool call."""
    shots: list[dict] = []
    for i, city in enumerate(["Rome", "Berlin", "Madrid"]):
        shots += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"c{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny"},
            {"role": "assistant", "content": f"It is sunny in {city}."}]
    return shots + [{"role": "user", "content": "What is the weather in Paris?"}]


ASK = _few_shot()


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED], ids=["auto", "required", "named"])
def test_tool_choice_gives_a_tool_call(openai_client, tool_choice):
    reply = openai_client.chat.completions.create(model="default", messages=ASK, tools=WEATHER,
                                                  tool_choice=tool_choice, temperature=0,
                                                  max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id and call.type == "function"


def test_streamed_tool_calls_equal_non_streamed(openai_client):
    kw = dict(model="default", messages=ASK, tools=WEATHER, tool_choice=NAMED, temperature=0,
              max_tokens=40)
    whole = openai_client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in openai_client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not (delta.content or "").count("<tool_call>")  # never leaked as content
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_tool_choice_none_returns_content(openai_client):
    reply = openai_client.chat.completions.create(model="default", messages=ASK, tools=WEATHER,
                                                  tool_choice="none", temperature=0, max_tokens=30)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content  # the model's text, unparsed


def test_unknown_named_tool_is_400(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(
            model="default", messages=ASK, tools=WEATHER,
            tool_choice={"type": "function", "function": {"name": "nope"}})


def test_agent_history_with_tool_calls_is_served(openai_client):
    conv = sorted(conversations("base"), key=lambda c: len(str(c)))[0]
    messages = turn_requests(conv, 2)[-1]
    assert any(m.get("tool_calls") for m in messages) and any(m["role"] == "tool" for m in messages)
    reply = openai_client.chat.completions.create(model="default", messages=messages,
                                                  tools=conv["tools"], temperature=0, max_tokens=8)
    assert reply.usage.prompt_tokens > 1000
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
