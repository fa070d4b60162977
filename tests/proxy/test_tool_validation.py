"""One rule for tools on every API (proxy/splitter/validate_tools.py): duplicate tool names and
a named tool_choice that names no tool are 400s on chat completions, the Responses API and
Anthropic messages alike, each in its own API's error shape; the splitter refuses the same."""

from __future__ import annotations

import pytest

from anchorcache.proxy.anthropic_schema import parse_messages_request
from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.responses_schema import parse_responses_request
from anchorcache.proxy.schema import parse_chat_request
from anchorcache.proxy.splitter.normalize import canonical_tools, normalize_tools
from anchorcache.proxy.splitter.types import SplitError
from anchorcache.testing.bodies import ANTHROPIC_WEATHER, RESPONSES_WEATHER

CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
USER = [{"role": "user", "content": "Weather in Rome?"}]


def _chat(**body):
    return parse_chat_request({"model": "default", "messages": USER, **body})


def _responses(**body):
    return parse_responses_request({"model": "default", "input": "Weather in Rome?", **body})


def _anthropic(**body):
    return parse_messages_request({"model": "default", "max_tokens": 16, "messages": USER,
                                   **body})


# (parser, duplicate tools, param of the repeat)
DUPLICATES = [
    pytest.param(_chat, [CHAT_WEATHER, CHAT_WEATHER], "tools[1].function.name", id="chat"),
    pytest.param(_responses, [RESPONSES_WEATHER, RESPONSES_WEATHER], "tools[1].name",
                 id="responses"),
    pytest.param(_responses, [RESPONSES_WEATHER, {"type": "namespace", "name": "ns",
                                                  "tools": [RESPONSES_WEATHER]}],
                 "tools[1].tools[0].name", id="responses-namespace"),
    pytest.param(_anthropic, [ANTHROPIC_WEATHER, ANTHROPIC_WEATHER], "tools.1.name",
                 id="anthropic"),
]


@pytest.mark.parametrize(("parse", "tools", "param"), DUPLICATES)
def test_duplicate_tool_names_are_refused_on_every_api(parse, tools, param):
    with pytest.raises(ApiError) as e:
        parse(tools=tools)
    assert (e.value.kind, e.value.param) == ("invalid_request", param)
    assert e.value.message == "tool names must be unique; 'get_weather' repeats"


# (parser, tools, a tool_choice naming no tool, its param)
UNKNOWN_CHOICES = [
    pytest.param(_chat, [CHAT_WEATHER], {"type": "function", "function": {"name": "nope"}},
                 "tool_choice", id="chat"),
    pytest.param(_responses, [RESPONSES_WEATHER], {"type": "function", "name": "nope"},
                 "tool_choice.name", id="responses"),
    pytest.param(_anthropic, [ANTHROPIC_WEATHER], {"type": "tool", "name": "nope"},
                 "tool_choice.name", id="anthropic"),
]


@pytest.mark.parametrize(("parse", "tools", "choice", "param"), UNKNOWN_CHOICES)
def test_a_tool_choice_naming_no_tool_is_refused_on_every_api(parse, tools, choice, param):
    with pytest.raises(ApiError) as e:
        parse(tools=tools, tool_choice=choice)
    assert (e.value.kind, e.value.param) == ("invalid_request", param)
    assert e.value.message == "tool_choice names an unknown tool 'nope'"


def test_a_named_choice_must_be_a_string_naming_a_tool_of_the_request():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _chat(tools=[CHAT_WEATHER], tool_choice=named).tool_choice.function == "get_weather"
    with pytest.raises(ApiError):
        _chat(tools=[CHAT_WEATHER], tool_choice={"type": "function", "function": {"name": 7}})


def test_distinct_names_pass_everywhere():
    other = {"type": "function", "function": {**CHAT_WEATHER["function"], "name": "get_time"}}
    assert len(_chat(tools=[CHAT_WEATHER, other]).tools) == 2
    assert len(_responses(tools=[RESPONSES_WEATHER, {**RESPONSES_WEATHER,
                                                     "name": "get_time"}]).tools) == 2
    assert len(_anthropic(tools=[ANTHROPIC_WEATHER, {**ANTHROPIC_WEATHER,
                                                     "name": "get_time"}]).generation.tools) == 2


@pytest.mark.parametrize("normalize", [normalize_tools, canonical_tools])
def test_the_splitter_refuses_duplicate_names_too(normalize):
    with pytest.raises(SplitError) as e:
        normalize([CHAT_WEATHER, CHAT_WEATHER])
    assert e.value.param == "tools[1].function.name"


# ---- through the proxy: each API's own error shape ----------------------------------------

async def test_duplicate_names_are_a_400_in_each_apis_shape(client):
    chat = await client.post("/v1/chat/completions", json={
        "model": "default", "messages": USER, "tools": [CHAT_WEATHER, CHAT_WEATHER]})
    assert chat.status == 400
    assert (await chat.json())["error"] == {
        "message": "tool names must be unique; 'get_weather' repeats",
        "type": "invalid_request_error", "code": "invalid_request",
        "param": "tools[1].function.name"}

    responses = await client.post("/v1/responses", json={
        "model": "default", "input": "Weather in Rome?",
        "tools": [RESPONSES_WEATHER, RESPONSES_WEATHER]})
    assert responses.status == 400
    error = (await responses.json())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "tools[1].name")

    messages = await client.post("/v1/messages", json={
        "model": "default", "max_tokens": 16, "messages": USER,
        "tools": [ANTHROPIC_WEATHER, ANTHROPIC_WEATHER]})
    assert messages.status == 400
    assert await messages.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "tools.1.name: tool names must be unique; 'get_weather' repeats"}}


async def test_an_unknown_named_choice_is_a_400_in_each_apis_shape(client):
    chat = await client.post("/v1/chat/completions", json={
        "model": "default", "messages": USER, "tools": [CHAT_WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert chat.status == 400 and (await chat.json())["error"]["param"] == "tool_choice"

    responses = await client.post("/v1/responses", json={
        "model": "default", "input": "Weather in Rome?", "tools": [RESPONSES_WEATHER],
        "tool_choice": {"type": "function", "name": "nope"}})
    assert responses.status == 400
    assert (await responses.json())["error"]["param"] == "tool_choice.name"

    messages = await client.post("/v1/messages", json={
        "model": "default", "max_tokens": 16, "messages": USER, "tools": [ANTHROPIC_WEATHER],
        "tool_choice": {"type": "tool", "name": "nope"}})
    assert messages.status == 400
    assert (await messages.json())["error"]["message"] == \
        "tool_choice.name: tool_choice names an unknown tool 'nope'"
