"""A forced tool call cut short by max_tokens, on the real default model: the partial call
comes back with finish_reason "length" (OpenAI) or a `tool_use` block with what was parsed
and stop_reason "max_tokens" (Anthropic), streamed and not, as a prefix of the call the
same greedy request writes with room to finish."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import pytest

from anchorcache.proxy.splitter.partial_json import close_json
from anchorcache.testing.servers import Server, tenant_key
from anchorcache.testing.strategies import is_prefix

pytestmark = pytest.mark.slow

NOTE_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                                "text": {"type": "string"}},
               "required": ["title", "text"]}
TOOLS = [{"type": "function", "function": {"name": "write_note", "description": "Save a note.",
                                           "parameters": NOTE_SCHEMA}}]
NAMED = {"type": "function", "function": {"name": "write_note"}}
ASK = [{"role": "user", "content": "Write a long note about the history of Paris."}]
CUT = 24  # tokens: the call's markup and name, then a few tokens into its arguments


@pytest.fixture(scope="module")
def full_call(proxy: Server) -> dict[str, Any]:
    """The call's arguments when max_tokens leaves room for all of it."""
    import openai

    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0, timeout=300)
    choice = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                            tool_choice=NAMED, temperature=0,
                                            max_tokens=400).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "write_note"
    return json.loads(call.function.arguments)


def test_openai_returns_the_partial_call_with_finish_reason_length(openai_client, full_call):
    kw: dict[str, Any] = dict(model="default", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                              temperature=0, max_tokens=CUT)
    choice = openai_client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    assert "tool_call_error" not in (choice.model_extra or {})
    [call] = choice.message.tool_calls
    assert call.function.name == "write_note" and call.id and call.type == "function"
    arguments = call.function.arguments
    with pytest.raises(ValueError):
        json.loads(arguments)  # the text written before the cut, as OpenAI returns it
    parsed = close_json(arguments)
    assert isinstance(parsed, dict) and parsed != full_call and is_prefix(parsed, full_call)

    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in openai_client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            for tc in c.delta.tool_calls or ():
                entry = streamed.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += tc.id or ""
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "length"
    assert [(e["name"], e["arguments"]) for e in streamed.values()] == [("write_note", arguments)]


def test_openai_history_with_the_partial_call_is_accepted(openai_client, full_call):
    """What an agent SDK sends next (the OpenAI Agents SDK does): the partial call as it came
    back, arguments that are not valid JSON, and the tool's answer to it. The prompt renders
    the call as the model wrote it (docs/structured-output.md), so the turn runs."""
    choice = openai_client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
        max_tokens=CUT).choices[0]
    assert choice.finish_reason == "length"
    [call] = choice.message.tool_calls
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": "An error occurred: the arguments were cut off."}]
    assert history[1]["tool_calls"][0]["function"]["arguments"] == call.function.arguments
    reply = openai_client.chat.completions.create(model="default", messages=history,
                                                  tools=TOOLS, temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 0
    streamed = list(openai_client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, temperature=0, max_tokens=8,
        stream=True))
    assert streamed[-1].choices == [] or streamed[-1].choices[0].finish_reason

    # wrong types stay a 400 with the OpenAI error shape
    import openai

    bad = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "write_note", "arguments": 5}}]}, history[2]]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="default", messages=bad, max_tokens=8)
    assert e.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
    bad[1]["tool_calls"][0]["function"]["arguments"] = "not json"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="default", messages=bad, max_tokens=8)
    assert "not valid JSON" in e.value.body["message"]


def test_anthropic_returns_a_tool_use_block_with_what_was_parsed(proxy: Server, full_call):
    client = anthropic.Anthropic(base_url=proxy.url, api_key=tenant_key(proxy, "partial-" + uuid.uuid4().hex[:8]),
                                 max_retries=0, timeout=300)
    kw: dict[str, Any] = dict(
        model="default", max_tokens=CUT, extra_body={"temperature": 0}, messages=ASK,
        tools=[{"name": "write_note", "description": "Save a note.", "input_schema": NOTE_SCHEMA}],
        tool_choice={"type": "tool", "name": "write_note"})
    reply = client.messages.create(**kw)
    assert reply.stop_reason == "max_tokens"
    [block] = reply.content
    assert block.type == "tool_use" and block.name == "write_note" and block.id.startswith("toolu_")
    assert isinstance(block.input, dict) and block.input != full_call
    assert is_prefix(block.input, full_call)

    with client.messages.stream(**kw) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in streamed.content] == \
        [("tool_use", "write_note", block.input)]
    # the input streamed as one valid JSON text (what the non-streamed block holds)
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == block.input

    # sent back with its tool_result, as a client's next turn does: the turn runs
    nxt = client.messages.create(
        model="default", max_tokens=8, extra_body={"temperature": 0}, tools=kw["tools"],
        messages=[*ASK, {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                "content": "cut off"}]}])
    assert nxt.stop_reason in ("end_turn", "max_tokens", "tool_use")
