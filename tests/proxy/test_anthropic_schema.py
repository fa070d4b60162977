"""Anthropic request parsing and reply framing, without a server: the mapping to the neutral
chat form, the cache_control hints, the 400s (for any body: never another exception), and the
content-block event sequence."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings

from anchorcache.proxy.anthropic_api import BlockFramer, usage_json
from anchorcache.proxy.anthropic_messages import fold_system_messages
from anchorcache.proxy.anthropic_schema import parse_messages_request
from anchorcache.proxy.cut_hints import with_hint_cuts
from anchorcache.proxy.errors import ApiError, anthropic_body
from anchorcache.proxy.pipeline import Usage
from anchorcache.proxy.splitter.types import OutputDelta, SplitError, ToolCallDelta
from anchorcache.testing.adapters import chatml_adapter, split_fn
from anchorcache.testing.bodies import ANTHROPIC_WEATHER, CACHE_CONTROL, anthropic_bodies

CC = CACHE_CONTROL
WEATHER = ANTHROPIC_WEATHER


def _parse(**body):
    return parse_messages_request({"model": "default", "max_tokens": 16, **body})


def test_a_tool_conversation_maps_to_openai_messages_in_block_order():
    req = _parse(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Rome and Oslo?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Rome"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "data"}]},
                {"type": "text", "text": "Thanks; and tomorrow?"}]},
        ],
        stop_sequences=["\n\nHuman:"], temperature=0, top_k=5, stream=True,
        metadata={"user_id": "u-1"})
    chat = req.generation
    assert list(chat.messages) == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Rome and Oslo?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [
             {"id": "toolu_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
             {"id": "toolu_2", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "name": "get_weather", "content": "no\ndata"},
        {"role": "user", "content": "Thanks; and tomorrow?"},
    ]
    assert chat.tools == ({"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": WEATHER["input_schema"]}},)
    assert chat.tool_choice.mode == "auto"
    assert chat.stop == ("\n\nHuman:",) and chat.max_tokens == 16
    assert (chat.temperature, chat.top_k, req.stream) == (0.0, 5, True)
    assert req.user_id == "u-1" and req.generation.cut_after == () and not req.single_tool_use


def test_cache_control_marks_the_end_of_the_rendered_message_holding_the_block():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": CC}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {},
             "cache_control": CC}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "x"},
            {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
    ]
    # system (1 message) + user + assistant + tool + user: hints after 2, 3 and 5, each
    # with its mark's TTL (5 minutes without one)
    gen = _parse(system="s", tools=[WEATHER], messages=msgs).generation
    assert (gen.cut_after, gen.cut_ttl_s) == ((2, 3, 5), {2: 300.0, 3: 300.0, 5: 3600.0})
    # a marked tool hints at the end of the system part, as a marked system block does;
    # without system text, at the instruction prefix (after 0 messages)
    assert _parse(system="s", tools=[{**WEATHER, "cache_control": CC}],
                  messages=[{"role": "user", "content": "q"}]).generation.cut_after == (1,)
    assert _parse(tools=[{**WEATHER, "cache_control": CC}],
                  messages=[{"role": "user", "content": "q"}]).generation.cut_after == (0,)
    assert _parse(system=[{"type": "text", "text": "s", "cache_control": CC}],
                  messages=[{"role": "user", "content": "q"}]).generation.cut_after == (1,)


def test_consecutive_messages_of_one_role_are_one_turn():
    req = _parse(messages=[
        {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]}])
    assert [(m["role"], len(m.get("tool_calls", ()))) for m in req.generation.messages] == [
        ("user", 0), ("assistant", 2), ("tool", 0), ("tool", 0)]
    assert req.generation.messages[0]["content"] == "a\nb"


def test_top_level_cache_control_is_validated_and_counted():
    # automatic caching marks the end of the messages (a cut made anyway; the mark leases it)
    gen = _parse(cache_control={"type": "ephemeral", "ttl": "1h"}, messages=USER).generation
    assert (gen.cut_after, gen.cut_ttl_s) == ((1,), {1: 3600.0})
    with pytest.raises(ApiError, match="ephemeral"):
        _parse(cache_control={"type": "x"}, messages=USER)
    marked = [{"type": "text", "text": str(i), "cache_control": CC} for i in range(4)]
    with pytest.raises(ApiError, match="at most 4"):
        _parse(cache_control=CC, messages=[{"role": "user", "content": marked}])


@pytest.mark.parametrize("choice,mode,function", [
    ({"type": "auto"}, "auto", None), ({"type": "any"}, "required", None),
    ({"type": "tool", "name": "get_weather"}, "function", "get_weather"),
    ({"type": "none"}, "none", None)])
def test_tool_choice(choice, mode, function):
    req = _parse(tools=[WEATHER], tool_choice=choice, messages=[{"role": "user", "content": "q"}])
    assert (req.generation.tool_choice.mode, req.generation.tool_choice.function) == (mode, function)


def test_a_system_message_in_messages_stays_in_place_and_can_be_folded():
    req = _parse(system="s", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "system", "content": [{"type": "text", "text": "<reminder>", "cache_control": CC}]},
        {"role": "user", "content": [{"type": "text", "text": "list files",
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])
    gen = req.generation
    assert [(m["role"], m["content"]) for m in gen.messages] == [
        ("system", "s"), ("user", "hi"), ("assistant", "Hello"), ("system", "<reminder>"),
        ("user", "list files")]
    assert gen.cut_after == (4, 5)
    folded = fold_system_messages(gen)
    assert folded is not None
    # the reminder joins the next user message as its first text block; the hint after it
    # moves before that message
    assert [(m["role"], m["content"]) for m in folded.messages] == [
        ("system", "s"), ("user", "hi"), ("assistant", "Hello"),
        ("user", "<reminder>\nlist files")]
    assert (folded.cut_after, folded.cut_ttl_s) == ((3, 4), {3: 300.0, 4: 3600.0})
    assert fold_system_messages(_parse(system="s", messages=USER).generation) is None


def test_folded_system_messages_without_a_user_message_after_them_become_one():
    gen = _parse(tools=[WEATHER], messages=[
        *TOOL_TURN, {"role": "system", "content": "a"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        {"role": "system", "content": "b"}, {"role": "system", "content": "c"},
        {"role": "assistant", "content": "done"}, {"role": "system", "content": "d"}]).generation
    assert [m["role"] for m in gen.messages] == [
        "user", "assistant", "system", "tool", "system", "assistant", "system"]
    folded = fold_system_messages(gen)
    assert folded is not None
    assert [(m["role"], m.get("content")) for m in folded.messages] == [
        ("user", "q"), ("assistant", None), ("tool", ""), ("user", "a\nb\nc"),
        ("assistant", "done"), ("user", "d")]


def test_cleared_system_messages_are_not_rendered():
    msgs = [{"role": "user", "content": "a"},
            {"role": "system", "content": "once", "clear_at": "next_user_message",
             "output_config": {"effort": "low"}},
            {"role": "system", "content": "always", "clear_at": "never"}]
    gen = _parse(messages=msgs).generation
    assert [m["content"] for m in gen.messages] == ["a", "once\nalways"]
    gen = _parse(messages=[*msgs, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}]).generation
    assert [m["content"] for m in gen.messages] == ["a", "always", "b", "c"]


@pytest.mark.parametrize("thinking,output_config,asked,effort", [
    (None, None, None, "none"),
    ({"type": "disabled"}, {"effort": "high"}, False, "none"),
    ({"type": "enabled", "budget_tokens": 31999}, None, True, None),
    ({"type": "enabled", "budget_tokens": 1}, {"effort": "medium"}, True, "medium"),
    ({"type": "adaptive"}, {"effort": "max"}, True, "high"),
    ({"type": "adaptive", "display": "omitted"}, {"effort": "ultra"}, True, None)])
def test_thinking_becomes_the_reasoning_effort(thinking, output_config, asked, effort):
    body = {k: v for k, v in (("thinking", thinking), ("output_config", output_config)) if v}
    req = _parse(messages=USER, **body)
    assert (req.thinking, req.generation.reasoning_effort) == (asked, effort)
    assert req.omit_thinking == (thinking is not None and thinking.get("display") == "omitted")


def test_thinking_blocks_sent_back_become_reasoning_content():
    req = _parse(messages=[*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Let me see.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Sunny."}]}, *USER])
    assert req.generation.messages[1] == {"role": "assistant", "content": "Sunny.",
                                          "reasoning_content": "Let me see."}
    req = _parse(messages=[*USER, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "a"}]}, *USER])
    assert "reasoning_content" not in req.generation.messages[1]


def test_agent_fields_are_accepted_and_output_format_is_a_response_format():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    req = _parse(messages=USER, metadata={"user_id": "u" * 400, "session": 1},
                 output_config={"effort": "xhigh", "format": {"type": "json_schema",
                                                              "schema": schema}},
                 context_management={"edits": [{"type": "clear_thinking_20251015",
                                                "keep": "all"}]},
                 service_tier="auto", container="c1", mcp_servers=[], speed="fast")
    fmt = req.generation.response_format
    assert fmt is not None and (fmt.type, fmt.schema) == ("json_schema", schema)
    assert req.user_id == "u" * 400


@pytest.mark.parametrize("single", [False, True])
def test_disable_parallel_tool_use_asks_the_grammar_for_one_call(single):
    req = _parse(tools=[WEATHER], messages=USER,
                 tool_choice={"type": "any", "disable_parallel_tool_use": single})
    assert req.single_tool_use == single
    assert req.generation.parallel_tool_calls is not single


def test_max_tokens_beyond_any_context_is_left_to_the_pipeline():
    assert _parse(max_tokens=10**9, messages=USER).generation.max_tokens == 10**9


USER = [{"role": "user", "content": "q"}]
TOOL_TURN = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                "input": {}}]}]
BAD = [
    ("missing max_tokens", {"max_tokens": None, "messages": USER}, "max_tokens"),
    ("max_tokens zero", {"max_tokens": 0, "messages": USER}, "max_tokens"),
    ("missing model", {"model": None, "messages": USER}, "model"),
    ("no messages", {"messages": []}, "messages"),
    ("unknown role", {"messages": [{"role": "developer", "content": "x"}]}, "role"),
    ("max_tokens not an integer", {"max_tokens": 1.5, "messages": USER}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -1, "messages": USER}, "max_tokens"),
    ("max_tokens past 64 bits", {"max_tokens": 1 << 63, "messages": USER}, "max_tokens"),
    ("only empty system messages", {"messages": [
        {"role": "system", "content": "", "output_config": {"effort": "low"}}]}, "no message"),
    ("system message image", {"messages": [{"role": "system", "content": [
        {"type": "image", "source": {}}]}, *USER]}, "text blocks"),
    ("system message tool_addition", {"messages": [{"role": "system", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "f"}}]}, *USER]},
     "text blocks"),
    ("system message bad clear_at", {"messages": [
        {"role": "system", "content": "x", "clear_at": "later"}, *USER]}, "clear_at"),
    ("system message output_config not an object", {"messages": [
        {"role": "system", "content": "x", "output_config": "high"}, *USER]}, "output_config"),
    ("tool_use answered only after an assistant turn", {"messages": [
        *TOOL_TURN, {"role": "system", "content": "x"}, {"role": "assistant", "content": "a"},
        *USER]}, "without tool_result"),
    ("tool_use left unanswered at a final system message", {"messages": [
        *TOOL_TURN, {"role": "system", "content": "x"}]}, "without tool_result"),
    ("thinking block without text", {"messages": [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "signature": "s"}, {"type": "text", "text": "a"}]}, *USER]},
     "thinking"),
    ("thinking block in a user message", {"messages": [{"role": "user", "content": [
        {"type": "thinking", "thinking": "t", "signature": "s"}]}]}, "thinking"),
    ("empty content", {"messages": [{"role": "user", "content": []}]}, "content"),
    ("image block", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "image"),
    ("tool_use in a user message", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "assistant messages"),
    ("tool_result in an assistant message", {"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}, *USER]}, "user messages"),
    ("block without type", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "type"),
    ("text block without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "text"),
    ("tool_result without tool_use", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]}, "no matching tool_use"),
    ("tool_result for another id", {"messages": [*TOOL_TURN, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t2", "content": "x"}]}]}, "no matching tool_use"),
    ("tool_use left unanswered", {"messages": [*TOOL_TURN, *USER]}, "without tool_result"),
    ("tool_use input not an object", {"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "[]"}]}, *USER]}, "input"),
    ("final assistant message", {"messages": [*USER, {"role": "assistant", "content": "a"}]},
     "prefill"),
    ("cache_control wrong type", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}]}, "ephemeral"),
    ("cache_control not an object", {"system": [{"type": "text", "text": "s",
                                                 "cache_control": "yes"}], "messages": USER},
     "ephemeral"),
    ("cache_control bad ttl", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1d"}}]}]},
     "ttl"),
    ("five cache breakpoints", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": str(i), "cache_control": CC} for i in range(5)]}]}, "at most 4"),
    ("temperature above 1", {"temperature": 1.5, "messages": USER}, "temperature"),
    ("stop_sequences not a list", {"stop_sequences": "x", "messages": USER}, "stop_sequences"),
    ("tool without input_schema", {"tools": [{"name": "f"}], "messages": USER}, "input_schema"),
    ("server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}],
                     "messages": USER}, "unsupported tool type"),
    ("tool_choice any without tools", {"tool_choice": {"type": "any"}, "messages": USER},
     "needs tools"),
    ("tool_choice unknown tool", {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"},
                                  "messages": USER}, "unknown tool"),
    ("system image", {"system": [{"type": "image"}], "messages": USER}, "text blocks"),
    ("thinking not an object", {"thinking": True, "messages": USER}, "thinking"),
    ("thinking type unknown", {"thinking": {"type": "maximal"}, "messages": USER}, "thinking.type"),
    ("thinking budget not an integer", {"thinking": {"type": "enabled", "budget_tokens": "1k"},
                                        "messages": USER}, "budget_tokens"),
    ("thinking budget zero", {"thinking": {"type": "enabled", "budget_tokens": 0},
                              "messages": USER}, "budget_tokens"),
    ("thinking display not a string", {"thinking": {"type": "adaptive", "display": 1},
                                       "messages": USER}, "display"),
    ("metadata not an object", {"metadata": "u", "messages": USER}, "metadata"),
    ("metadata.user_id not a string", {"metadata": {"user_id": 7}, "messages": USER}, "user_id"),
    ("output_config not an object", {"output_config": "high", "messages": USER}, "output_config"),
    ("effort not a string", {"output_config": {"effort": 3}, "messages": USER}, "effort"),
    ("output format not a schema", {"output_config": {"format": {"type": "json_schema",
                                                                 "schema": {"type": "objec"}}},
                                    "messages": USER}, "output_config.format.schema"),
    ("output format of another type", {"output_config": {"format": {"type": "xml"}},
                                       "messages": USER}, "json_schema"),
    ("context_management not an object", {"context_management": [], "messages": USER},
     "context_management"),
    ("service_tier not a string", {"service_tier": 1, "messages": USER}, "service_tier"),
    ("container of a wrong type", {"container": 5, "messages": USER}, "container"),
    ("mcp servers", {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}],
                     "messages": USER}, "MCP"),
]


@pytest.mark.parametrize("name,body,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_invalid_request_errors(name, body, needle):
    with pytest.raises(ApiError) as e:
        _parse(**body)
    assert e.value.kind == "invalid_request" and e.value.status == 400
    err = e.value.anthropic_body()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]


@pytest.mark.parametrize("status,kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (413, "request_too_large"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"),
    (503, "overloaded_error"), (504, "timeout_error")])
def test_anthropic_error_types_follow_the_status(status, kind):
    assert anthropic_body(status, "m", "messages.0") == {
        "type": "error", "error": {"type": kind, "message": "messages.0: m"}}


def _events(chunks: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().strip().split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_framer_opens_a_block_per_text_run_and_per_tool_call():
    framer = BlockFramer()
    chunks: list[bytes] = []
    for delta in [OutputDelta(content="Let me "), OutputDelta(content="check."),
                  OutputDelta(tool_call=ToolCallDelta(0, "call_ab", "get_weather", '{"city": ')),
                  OutputDelta(tool_call=ToolCallDelta(0, None, None, '"Rome"}')),
                  OutputDelta(tool_call=ToolCallDelta(1, "call_cd", "get_weather", "{}"))]:
        chunks += framer.feed(delta)
    chunks += framer.close()
    events = _events(chunks)
    assert [(e, d.get("index"), d.get("delta", {}).get("type")) for e, d in events] == [
        ("content_block_start", 0, None), ("content_block_delta", 0, "text_delta"),
        ("content_block_delta", 0, "text_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "input_json_delta"),
        ("content_block_delta", 1, "input_json_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None)]
    assert events[4][1]["content_block"] == {"type": "tool_use", "id": "toolu_ab",
                                             "name": "get_weather", "input": {}}
    assert framer.blocks == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_ab", "name": "get_weather", "input": {"city": "Rome"}},
        {"type": "tool_use", "id": "toolu_cd", "name": "get_weather", "input": {}}]


def test_framer_keeps_one_tool_use_when_parallel_use_is_disabled():
    framer = BlockFramer(single_tool_use=True)
    for i in range(3):
        list(framer.feed(OutputDelta(tool_call=ToolCallDelta(i, f"call_{i}", "f", "{}"))))
    list(framer.close())
    assert [b["id"] for b in framer.blocks] == ["toolu_0"]


def test_framer_frames_reasoning_as_thinking_blocks_with_a_signature():
    framer = BlockFramer()
    chunks: list[bytes] = []
    for delta in [OutputDelta(reasoning="The user "), OutputDelta(reasoning="wants Rome."),
                  OutputDelta(content="Checking."),
                  OutputDelta(tool_call=ToolCallDelta(0, "call_ab", "get_weather", "{}")),
                  OutputDelta(reasoning="Done.")]:
        chunks += framer.feed(delta)
    chunks += framer.close()
    events = _events(chunks)
    assert [(e, d.get("index"), d.get("delta", {}).get("type")) for e, d in events] == [
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, None), ("content_block_delta", 3, "thinking_delta"),
        ("content_block_delta", 3, "signature_delta"), ("content_block_stop", 3, None)]
    assert events[0][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    first = framer.blocks[0]
    assert first["type"] == "thinking" and first["thinking"] == "The user wants Rome."
    assert first["signature"] == events[3][1]["delta"]["signature"] and first["signature"]
    assert [b["type"] for b in framer.blocks] == ["thinking", "text", "tool_use", "thinking"]


def test_framer_omits_thinking_text_when_asked_and_opens_no_block_without_reasoning():
    framer = BlockFramer(omit_thinking=True)
    events = _events([*framer.feed(OutputDelta(reasoning="secret")),
                      *framer.feed(OutputDelta(content="Hi.")), *framer.close()])
    assert [d.get("delta", {}).get("type") for _, d in events if _ == "content_block_delta"] \
        == ["signature_delta", "text_delta"]
    assert framer.blocks[0]["thinking"] == "" and framer.blocks[0]["signature"]
    plain = BlockFramer()
    list(plain.feed(OutputDelta(content="Hi.")))
    list(plain.feed(OutputDelta(reasoning="")))
    list(plain.close())
    assert [b["type"] for b in plain.blocks] == ["text"]


def test_usage_splits_the_prompt_into_read_created_and_uncached_tokens():
    u = Usage(prompt_tokens=100, completion_tokens=30, cached_tokens=40, prefill_tokens=60,
              snapshot_tokens=55, restore_ms=1.0, prefill_ms=2.0, decode_ms=3.0, anchor_hits=())
    assert usage_json(u) == {"input_tokens": 5, "output_tokens": 30,
                             "cache_creation_input_tokens": 55, "cache_read_input_tokens": 40}


# ---- any body: a 400 or a chat the splitter renders, never another exception ----------

@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=anthropic_bodies)
def test_any_body_is_a_400_or_a_chat_the_splitter_renders(body):
    try:
        req = parse_messages_request(body)
    except ApiError as e:
        assert e.status == 400 and e.message
        return
    gen = req.generation
    answered = set()
    for m in gen.messages:  # every tool result answers a call made before it
        answered |= {c["id"] for c in m.get("tool_calls", ())}
        assert m["role"] != "tool" or m["tool_call_id"] in answered
    assert gen.messages[-1]["role"] in ("user", "tool", "system")
    msgs, tools = [dict(m) for m in gen.messages], [dict(t) for t in gen.tools] or None
    try:
        split = chatml_adapter().split(msgs, tools)
    except SplitError:
        return
    hinted = asyncio.run(with_hint_cuts(split_fn(chatml_adapter()), split, msgs, tools, None,
                                        req.generation.cut_after))
    assert hinted.input_ids == split.input_ids
    positions = [c.position for c in hinted.cuts]
    assert positions == sorted(set(positions)) and all(0 < p < len(split.input_ids)
                                                       for p in positions)
