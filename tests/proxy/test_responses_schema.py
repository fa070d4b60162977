"""Responses request parsing and reply framing, without a server: the mapping of input items
and tools to the neutral chat form, a continued conversation rendering as the one sent
whole, the 400s (for any body: never another exception), and the output-item events."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.pipeline import Usage
from anchorcache.proxy.responses_api import ItemFramer, responses_usage
from anchorcache.proxy.responses_items import encrypt_reasoning, parse_items, to_messages
from anchorcache.proxy.responses_schema import parse_responses_request
from anchorcache.proxy.schema import ToolChoice
from anchorcache.proxy.splitter.types import OutputDelta, SplitError, ToolCallDelta
from anchorcache.testing.adapters import chatml_adapter
from anchorcache.testing.bodies import RESPONSES_WEATHER, responses_bodies

WEATHER = RESPONSES_WEATHER


def _parse(**body):
    return parse_responses_request({"model": "default", **body}, max_tokens_limit=8192)


def test_a_string_input_is_one_user_message_after_the_instructions():
    req = _parse(input="Hi", instructions="Be brief.", max_output_tokens=8, temperature=0,
                 store=False, stream=True, include=["reasoning.encrypted_content"])
    gen = req.generation()
    assert list(gen.messages) == [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}]
    assert (gen.max_tokens, gen.temperature, gen.tool_choice) == (8, 0.0, ToolChoice("none"))
    assert (req.stream, req.store, req.encrypted_reasoning) == (True, False, True)
    assert _parse(input="Hi").store  # OpenAI's default


def test_a_tool_conversation_maps_to_chat_messages_in_item_order():
    req = _parse(tools=[WEATHER], input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Rome"}, {"type": "input_text", "text": "Oslo"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Two cities."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Rome"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
         "encrypted_content": "gAAAAopaque"},
        {"role": "assistant", "content": "Sunny and rain."},
        {"role": "user", "content": "Thanks"}])
    gen = req.generation()
    assert list(gen.messages) == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Rome\nOslo"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.",
         "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
             {"id": "call_2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain", "name": "get_weather"},
        {"role": "assistant", "content": "Sunny and rain."},  # OpenAI's reasoning: dropped
        {"role": "user", "content": "Thanks"}]
    assert gen.tools == ({"type": "function", "function": {
        "name": "get_weather", "description": "Current weather.",
        "parameters": WEATHER["parameters"], "strict": True}},)
    assert gen.tool_choice == ToolChoice("auto")


def test_our_encrypted_reasoning_comes_back_as_the_reasoning_text():
    items = parse_items([{"type": "reasoning", "summary": [],
                          "encrypted_content": encrypt_reasoning("Think é.")},
                         {"role": "assistant", "content": "A"}, {"role": "user", "content": "B"}])
    assert to_messages(items)[0] == {"role": "assistant", "content": "A",
                                     "reasoning_content": "Think é."}
    assert to_messages(parse_items(list(items)))[0]["reasoning_content"] == "Think é."


def test_hosted_tools_are_left_out_and_named_and_namespaces_flattened():
    req = _parse(input="Hi", tool_choice={"type": "function", "name": "lookup"}, tools=[
        {"type": "web_search"}, WEATHER, {"type": "custom", "name": "apply_patch"},
        {"type": "namespace", "name": "crm", "description": "CRM tools.", "tools": [
            {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
            {"type": "custom", "name": "free"}]},
        {"type": "web_search"}, {"type": "mcp", "server_label": "x"}])
    assert [t["function"]["name"] for t in req.tools] == ["get_weather", "lookup"]
    assert req.namespaces == {"lookup": "crm"}
    assert req.ignored_tools == ("web_search", "custom", "mcp")
    assert req.tool_choice == ToolChoice("function", "lookup")
    only_hosted = _parse(input="Hi", tools=[{"type": "web_search"}], tool_choice="auto")
    assert only_hosted.tools == () and only_hosted.tool_choice == ToolChoice("none")


def test_text_format_json_schema_is_the_chat_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = _parse(input="Hi", text={"format": {"type": "json_schema", "name": "out",
                                              "schema": schema, "strict": True}})
    assert req.response_format is not None and req.response_format.schema == schema
    assert _parse(input="Hi", text={"format": {"type": "json_object"}}).response_format.type \
        == "json_object"
    assert _parse(input="Hi", text={"format": {"type": "text"}, "verbosity": "low"}
                  ).response_format is None


def test_codex_shaped_request_parses():
    req = _parse(
        instructions="You are Codex.", store=False, stream=True, tool_choice="auto",
        parallel_tool_calls=True, reasoning={"effort": "medium", "summary": "auto"},
        include=["reasoning.encrypted_content"], prompt_cache_key="conv-1",
        input=[{"type": "message", "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions>"}]},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "list files"}]}],
        tools=[{"type": "function", "name": "shell", "description": "Run a command.",
                "strict": False, "parameters": {"type": "object", "properties": {
                    "command": {"type": "array", "items": {"type": "string"}}}}},
               {"type": "namespace", "name": "mcp__fs", "description": "fs",
                "tools": [{"type": "function", "name": "read", "parameters": {}}]},
               {"type": "web_search", "external_web_access": False}],
        text={"verbosity": "medium"}, service_tier="auto", metadata={"k": "v"})
    assert [m["role"] for m in req.generation().messages] == ["system", "developer", "user"]
    assert req.ignored_tools == ("web_search",)
    assert req.generation().reasoning_effort == "medium"


def test_a_continued_conversation_renders_as_the_one_sent_whole():
    turn1 = [{"role": "user", "content": "What is 2+2?"}]
    output1 = [{"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": "Easy."}],
                "encrypted_content": encrypt_reasoning("Easy.")},
               {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "4", "annotations": []}]},
               {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                "arguments": "{}", "status": "completed"}]
    turn2 = [{"type": "function_call_output", "call_id": "call_1", "output": "ok"},
             {"role": "user", "content": "And 3+3?"}]
    # as the ledger keeps it (JSON) and reads it back
    stored = parse_items(json.loads(json.dumps(parse_items(turn1) + parse_items(output1,
                                                                               "output"))))
    continued = _parse(input=turn2, instructions="Be brief.", tools=[WEATHER]).generation(stored)
    whole = _parse(input=turn1 + output1 + turn2, instructions="Be brief.", tools=[WEATHER]
                   ).generation()
    assert continued.messages == whole.messages
    assert continued.messages[2]["reasoning_content"] == "Easy."
    adapter = chatml_adapter()
    assert adapter.split([dict(m) for m in continued.messages], [dict(t) for t in continued.tools]
                         ).input_ids == adapter.split([dict(m) for m in whole.messages],
                                                      [dict(t) for t in whole.tools]).input_ids


@pytest.mark.parametrize(("body", "param"), [
    ({"input": 3}, "input"),
    ({}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"input": "x", "tools": "web_search"}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
     "tool_choice.name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "stream": 1}, "stream"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "include": "reasoning.encrypted_content"}, "include"),
    ({"input": "x", "instructions": ["x"]}, "instructions"),
    ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
    ({"input": "x", "reasoning": {"effort": 5}}, "reasoning.effort"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "reasoning", "encrypted_content": "anchorcache-reasoning-v1:%%"}]},
     "input[0].encrypted_content"),
])
def test_bad_requests_are_400s_naming_the_parameter(body, param):
    with pytest.raises(ApiError) as err:
        _parse(**body).generation()
    assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_harmless_fields_are_accepted_and_echoed():
    req = _parse(input="x", user="u", safety_identifier="s", service_tier="flex",
                 truncation="auto", prompt_cache_retention="24h", top_logprobs=0,
                 metadata={"a": "b"}, reasoning={"effort": "xhigh"})
    assert req.echo["metadata"] == {"a": "b"} and req.echo["truncation"] == "auto"
    assert req.echo["tool_choice"] == "auto" and req.reasoning_effort is None


# ---- framing -------------------------------------------------------------------------------

def test_framer_opens_an_item_per_run_and_per_call():
    framer = ItemFramer(namespaces={"lookup": "crm"}, encrypted_reasoning=True)
    events = []
    for delta in [OutputDelta(reasoning="Hm"), OutputDelta(reasoning="m."),
                  OutputDelta(content="Let me "), OutputDelta(content="check."),
                  OutputDelta(tool_call=ToolCallDelta(0, "call_ab", "get_weather", '{"city": ')),
                  OutputDelta(tool_call=ToolCallDelta(0, None, None, '"Rome"}')),
                  OutputDelta(tool_call=ToolCallDelta(1, "call_cd", "lookup", "{}"))]:
        events += framer.feed(delta)
    events += framer.close()
    assert [(e["type"].removeprefix("response."), e.get("output_index")) for e in events] == [
        ("output_item.added", 0), ("content_part.added", 0), ("reasoning_text.delta", 0),
        ("reasoning_text.delta", 0), ("reasoning_text.done", 0), ("content_part.done", 0),
        ("output_item.done", 0),
        ("output_item.added", 1), ("content_part.added", 1), ("output_text.delta", 1),
        ("output_text.delta", 1), ("output_text.done", 1), ("content_part.done", 1),
        ("output_item.done", 1),
        ("output_item.added", 2), ("function_call_arguments.delta", 2),
        ("function_call_arguments.delta", 2), ("function_call_arguments.done", 2),
        ("output_item.done", 2),
        ("output_item.added", 3), ("function_call_arguments.delta", 3),
        ("function_call_arguments.done", 3), ("output_item.done", 3)]
    rs, msg, fc1, fc2 = framer.items
    assert rs["content"] == [{"type": "reasoning_text", "text": "Hmm."}]
    assert rs["encrypted_content"] == encrypt_reasoning("Hmm.") and rs["summary"] == []
    assert msg["content"] == [{"type": "output_text", "text": "Let me check.",
                               "annotations": [], "logprobs": []}]
    assert msg["status"] == "completed" and msg["id"].startswith("msg_")
    assert fc1 == {"id": "fc_ab", "type": "function_call", "status": "completed",
                   "arguments": '{"city": "Rome"}', "call_id": "call_ab", "name": "get_weather"}
    assert fc2["namespace"] == "crm"
    assert events[14]["item"]["arguments"] == "" and events[14]["item"]["status"] == "in_progress"
    # the output reads back as input: reasoning, one assistant turn with text and two calls
    messages = to_messages(parse_items(framer.items, "output"))
    assert messages[0]["reasoning_content"] == "Hmm." and len(messages[0]["tool_calls"]) == 2


def test_framer_marks_a_cut_call_and_the_last_item_incomplete():
    framer = ItemFramer()
    list(framer.feed(OutputDelta(tool_call=ToolCallDelta(0, "call_x", "f", '{"a": 1',
                                                         partial=True))))
    list(framer.close("incomplete"))
    assert framer.items[0]["status"] == "incomplete"
    text = ItemFramer()
    list(text.feed(OutputDelta(content="abc")))
    list(text.close("incomplete"))
    assert text.items[0]["status"] == "incomplete"


def test_usage_has_the_responses_fields_and_timings():
    u = Usage(prompt_tokens=100, completion_tokens=30, cached_tokens=40, prefill_tokens=60,
              snapshot_tokens=55, restore_ms=1.0, prefill_ms=2.0, decode_ms=3.0, anchor_hits=())
    usage = responses_usage(u)
    assert {k: v for k, v in usage.items() if k != "timings"} == {
        "input_tokens": 100, "input_tokens_details": {"cached_tokens": 40,
                                                       "cache_write_tokens": 55},
        "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 130}
    assert usage["timings"]["prefill_tokens"] == 60


# ---- any body: a 400 or a chat the splitter renders, never another exception ---------------

@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=responses_bodies)
def test_any_body_is_a_400_or_a_chat_the_splitter_renders(body):
    try:
        req = parse_responses_request(body, max_tokens_limit=8192)
        gen = req.generation()
    except ApiError as e:
        assert e.status == 400 and e.message
        return
    # canonical items are plain JSON and read back as themselves (a stored conversation)
    stored = json.loads(json.dumps(req.input_items))
    assert parse_items(stored) == req.input_items
    assert to_messages(parse_items(stored), req.instructions) == list(gen.messages)
    try:
        chatml_adapter().split([dict(m) for m in gen.messages], [dict(t) for t in gen.tools] or None)
    except SplitError:
        return  # a 400 on the live route too
