"""Anthropic conversions resumed from a caller's earlier turn (anthropic_schema `_convert`,
splitter/memo.py `PrefixStates`) equal conversions from nothing.

An agent resends its whole conversation with each turn; the edge converts only the turns
after where the caller's last request's last turn started. Property: over sequences of
requests one caller sends (a conversation growing, repeated, cut back, branching, with
another system prompt or tools, with a message edited, a turn continued by a message of the
same role, a system message that hides itself once a user message follows), each parse with
the memos gives exactly the request, or exactly the error, that a parse without them
gives; no state crosses callers. The Responses edge's input items, likewise.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchorcache.proxy.anthropic_schema import parse_messages_request
from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.responses_schema import parse_responses_request
from anchorcache.proxy.splitter.memo import ConversionMemos, MessageMemo
from anchorcache.testing.bodies import ANTHROPIC_WEATHER, anthropic_bodies, responses_bodies

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def parse(body: Any, memos: ConversionMemos | None = None, scope: bytes = b"a") -> Any:
    try:
        return _headed(parse_messages_request(copy.deepcopy(body), memos=memos, scope=scope,
                                              max_tokens_limit=10**6))
    except ApiError as e:
        return ("error", e.kind, str(e), e.param)


def _headed(req: Any) -> Any:
    """`req`, its messages' bytes for the splitter (where the memos gave them) checked to be
    orjson's bytes of its messages: what the splitter keys its memos by."""
    head = req.generation.messages_head
    assert head is None or head == orjson.dumps(list(req.generation.messages))[:-1]
    return req


FORMS = [orjson.dumps, lambda b: json.dumps(b, ensure_ascii=False, separators=(",", ":")).encode(),
         lambda b: json.dumps(b).encode(), lambda b: json.dumps(b, indent=1).encode()]


def parse_raw(body: Any, memos: ConversionMemos, form: Any, scope: bytes = b"a") -> Any:
    """`parse`, from the body's bytes (`form(body)`) read through the memos (the edge's
    way: `MessageMemo.read`)."""
    try:
        raw = form(body)
    except (TypeError, ValueError):
        return parse(body)  # (a value JSON cannot carry: the dict's own parse)
    try:
        return _headed(parse_messages_request(memos.shapes.read(scope, raw, "messages"),
                                              memos=memos, scope=scope,
                                              max_tokens_limit=10**6))
    except orjson.JSONDecodeError:
        return parse(body)
    except ApiError as e:
        return ("error", e.kind, str(e), e.param)


def with_messages(body: dict[str, Any], messages: list[Any]) -> dict[str, Any]:
    return {**body, "messages": messages}


def _variants(body: Any, draw: Any) -> list[Any]:
    """A caller's requests around `body`: its conversation's leading parts in order, then
    some of them again, changed."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return [body]
    msgs = body["messages"]
    out = [with_messages(body, msgs[:k]) for k in range(1, len(msgs) + 1)]
    for _ in range(draw(st.integers(0, 4))):
        k = draw(st.integers(1, max(1, len(msgs))))
        change = draw(st.sampled_from(["repeat", "system", "tools", "edit", "same_role",
                                       "clear_at", "extend"]))
        m = copy.deepcopy(msgs[:k])
        if change == "system":
            out.append({**with_messages(body, m), "system": "another system prompt"})
        elif change == "tools":
            out.append({**with_messages(body, m), "tools": [ANTHROPIC_WEATHER] * 0})
        elif change == "edit" and m:
            j = draw(st.integers(0, len(m) - 1))
            m[j] = {"role": "user", "content": "edited"} if isinstance(m[j], dict) else m[j]
            out.append(with_messages(body, m))
        elif change == "same_role" and m and isinstance(m[-1], dict):
            out.append(with_messages(body, [*m, {**m[-1]}, *msgs[k:]]))
        elif change == "clear_at":
            hide = {"role": "system", "content": "until the next user message",
                    "clear_at": "next_user_message"}
            # shown while no user message follows it (here, a request that ends with a
            # system turn after it), hidden once one does
            shown = [*m, hide, {"role": "assistant", "content": "noted"},
                     {"role": "system", "content": "plain"}]
            out.append(with_messages(body, shown))
            out.append(with_messages(body, [*shown, {"role": "user", "content": "go on"}]))
        elif change == "extend":
            out.append(with_messages(body, [*m, {"role": "assistant", "content": "ok"},
                                            {"role": "user", "content": "and then?"}]))
        else:
            out.append(with_messages(body, m))
    return out


_mark = st.sampled_from([{}, {}, {}, {"cache_control": {"type": "ephemeral"}}])


@st.composite
def agent_bodies(draw: Any) -> dict[str, Any]:
    """Valid agent conversations: text, thinking and tool calls answered by tool results,
    turns split over messages of one role, marks, system messages along the way (some
    hidden once a user message follows)."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": draw(st.sampled_from(
        ["hi", [{"type": "text", "text": "hi", **draw(_mark)}]]))}]
    n = 0
    for _ in range(draw(st.integers(1, 5))):
        blocks: list[dict[str, Any]] = []
        if draw(st.booleans()):
            blocks.append({"type": "thinking", "thinking": f"think {n}", "signature": "s"})
        if draw(st.booleans()):
            blocks.append({"type": "text", "text": f"say {n}"})
        calls = [f"t{n}-{k}" for k in range(draw(st.integers(0 if blocks else 1, 2)))]
        blocks += [{"type": "tool_use", "id": c, "name": "get_weather",
                    "input": {"city": c}, **draw(_mark)} for c in calls]
        n += 1
        split = draw(st.integers(0, len(blocks) - 1))
        if split and draw(st.booleans()):  # one turn over two assistant messages
            msgs += [{"role": "assistant", "content": blocks[:split]},
                     {"role": "assistant", "content": blocks[split:]}]
        else:
            msgs.append({"role": "assistant", "content": blocks})
        results: list[dict[str, Any]] = [{"type": "tool_result", "tool_use_id": c,
                                          "content": f"result {c}", **draw(_mark)}
                                         for c in calls]
        if draw(st.booleans()) or not results:
            results.append({"type": "text", "text": f"next {n}"})
        if len(results) > 1 and draw(st.booleans()):  # one turn over two user messages
            msgs += [{"role": "user", "content": results[:1]},
                     {"role": "user", "content": results[1:]}]
        else:
            msgs.append({"role": "user", "content": results})
        extra = draw(st.sampled_from([None, None, None, "plain", "hidden"]))
        if extra is not None and not calls:
            msgs.append({"role": "system", "content": "mind the budget",
                         **({"clear_at": "next_user_message"} if extra == "hidden" else {})})
            msgs.append({"role": "user", "content": "go on"})
    body = {"model": "m", "max_tokens": 8, "messages": msgs,
            "tools": [draw(st.sampled_from([ANTHROPIC_WEATHER, {
                **ANTHROPIC_WEATHER, "cache_control": {"type": "ephemeral"}}]))]}
    if draw(st.booleans()):
        body["system"] = draw(st.sampled_from(["be brief", [{"type": "text", "text": "be brief",
                                                              "cache_control": {
                                                                  "type": "ephemeral"}}]]))
    return body


@SETTINGS
@given(body=st.one_of(agent_bodies(), agent_bodies(), anthropic_bodies), data=st.data())
def test_a_resumed_conversion_equals_one_from_nothing(body, data):
    memos, raw_memos = ConversionMemos(), ConversionMemos()
    form = FORMS[data.draw(st.integers(0, len(FORMS) - 1))]
    for request in _variants(body, data.draw):
        fresh = parse(request)
        assert parse(request, memos) == fresh, request
        assert parse_raw(request, raw_memos, form) == fresh, request


def tool_conversation(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "weather in three cities?"}]
    for i in range(turns):
        msgs += [{"role": "assistant", "content": [
                     {"type": "thinking", "thinking": f"step {i}", "signature": "s"},
                     {"type": "tool_use", "id": f"t{i}", "name": "get_weather",
                      "input": {"city": f"c{i}"}}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"{i} C",
                      **({"cache_control": {"type": "ephemeral"}} if i == turns - 1 else {})}]}]
    return msgs


def test_an_agent_turn_resumes_from_its_last_one_and_callers_never_share():
    body = {"model": "m", "max_tokens": 8, "system": "be brief", "tools": [ANTHROPIC_WEATHER]}
    memos, raw_memos = ConversionMemos(), ConversionMemos()
    for turns in range(1, 6):
        request = with_messages(body, tool_conversation(turns))
        before = memos.turns.hits
        got = parse(request, memos)
        assert got == parse(request) and not isinstance(got, tuple)
        assert memos.turns.hits == before + (turns > 1)  # from the turn before
        # from the body's bytes: only the turn before's last message on is decoded
        raw = orjson.dumps({**request, "messages": request["messages"]})
        read = raw_memos.shapes.read(b"a", raw, "messages")
        assert read.start == (2 * turns - 2 if turns > 1 else 0)
        assert parse_messages_request(read, memos=raw_memos, scope=b"a") == got
    # (messages first, as an SDK sends them) a turn under another system prompt, then one
    # under the first again: the bytes are read from the other's last turn on (the longest
    # kept), but the state kept under this system prompt is a turn earlier, so the body is
    # decoded whole, not resumed at the wrong place
    for turns, system in ((4, "be brief"), (5, "be brief"), (6, "be verbose"), (7, "be brief")):
        request = {"messages": tool_conversation(turns), **body, "system": system}
        read = raw_memos.shapes.read(b"a", orjson.dumps(request), "messages")
        assert read.start == (2 * turns - 2 if turns > 4 else 0)
        assert parse_messages_request(read, memos=raw_memos, scope=b"a") == parse(request)
    # another caller sending the same conversation converts it from nothing
    before = memos.turns.hits
    assert parse(request, memos, scope=b"b") == parse(request)
    assert memos.turns.hits == before
    # a turn that answers the last tool call twice is refused as from nothing
    bad = with_messages(body, tool_conversation(5) + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t9", "name": "get_weather",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"},
                                     {"type": "tool_result", "tool_use_id": "t9"}]}])
    refused = parse(bad, memos)
    assert refused == parse(bad) and refused[0] == "error"


def parse_responses(body: Any, memo: MessageMemo | None = None, scope: bytes = b"a") -> Any:
    try:
        return parse_responses_request(copy.deepcopy(body), memo=memo, scope=scope)
    except ApiError as e:
        return ("error", e.kind, str(e), e.param)


def parse_responses_raw(body: Any, memo: MessageMemo, form: Any, scope: bytes = b"a") -> Any:
    """`parse_responses`, from the body's bytes read through the memo (the edge's way)."""
    try:
        raw = form(body)
    except (TypeError, ValueError):
        return parse_responses(body)
    try:
        return parse_responses_request(memo.read(scope, raw, "input"), memo=memo, scope=scope)
    except orjson.JSONDecodeError:
        return parse_responses(body)
    except ApiError as e:
        return ("error", e.kind, str(e), e.param)


@SETTINGS
@given(body=responses_bodies, data=st.data())
def test_responses_items_a_caller_sent_before_parse_as_from_nothing(body, data):
    """The Responses edge's items (stateless, one by one: the message memo's own rule),
    from dicts and from the body's bytes."""
    memo, raw_memo = MessageMemo(), MessageMemo()
    form = FORMS[data.draw(st.integers(0, len(FORMS) - 1))]
    items = body.get("input") if isinstance(body, dict) else None
    requests = [body] if not isinstance(items, list) else \
        [{**body, "input": items[:k]} for k in range(1, len(items) + 1)] * 2
    for request in requests:
        fresh = parse_responses(request)
        assert parse_responses(request, memo) == fresh, request
        assert parse_responses_raw(request, raw_memo, form) == fresh, request
