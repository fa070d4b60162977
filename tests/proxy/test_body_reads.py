"""Chat bodies read through the message memo (splitter/memo.py `MessageMemo.read`): the
messages a kept body's bytes already held are not decoded again, and the request is exactly
the one (or the error exactly the one) a whole decode gives.

Property, over sequences of raw bodies one caller sends: conversations growing, repeated,
cut back, edited, in the serializations clients use (compact, Python's separators,
pretty-printed, ASCII-escaped) and member orders (messages first, last, between), with a
second `messages` member after the first (the last one counts), text that spells
`"messages":[` inside strings and tool schemas, a trailing comma, content that is not JSON
after the kept messages, and messages that fail their checks. Each read equals the whole
decode. A conversation growing turn by turn spares every message its last body held (so
the property cannot hold by never sparing), and callers never share a kept body."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.schema import parse_chat_request
from anchorcache.proxy.splitter.memo import MessageMemo

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
TRICKY = ['"messages":[', "], \"messages\": [1]}", "é😀 \u2028", "\\\"]", "a,]", "1e5"]

text = st.one_of(st.sampled_from(TRICKY), st.text(max_size=8))
call = st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]), "type": st.just("function"),
                              "function": st.fixed_dictionaries({
                                  "name": st.just("search"),
                                  "arguments": st.sampled_from(['{"q": "x"}', '{"q": "]"}'])})})
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": text}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": text},
                          optional={"tool_calls": st.lists(call, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("c1"),
                           "content": text}),
    st.sampled_from([{"role": "robot", "content": "x"}, 7, [], {"content": "no role"}]))
TOOLS = [{"type": "function", "function": {
    "name": "search", "description": 'finds "messages":[ in text',
    "parameters": {"type": "object", "properties": {"messages": {"type": "array"}}}}}]

SERIALIZE = {
    "compact": orjson.dumps,
    "python": lambda b: json.dumps(b).encode(),
    "pretty": lambda b: json.dumps(b, indent=2, ensure_ascii=False).encode(),
    "ascii": lambda b: json.dumps(b, separators=(",", ":")).encode(),
}
ORDERS = {
    "first": lambda msgs: {"messages": msgs, "model": "m", "tools": TOOLS, "max_tokens": 5},
    "between": lambda msgs: {"model": "m", "messages": msgs, "tools": TOOLS},
    "last": lambda msgs: {"model": "m", "tools": TOOLS, "stream": True, "messages": msgs},
}


def decoded(memo: MessageMemo | None, raw: bytes, scope: bytes) -> Any:
    """The request (or the error) parsed from `raw`: through `memo.read` and the memo, or
    decoded whole without a memo."""
    try:
        if memo is None:
            body = orjson.loads(raw)
            return parse_chat_request(body, max_tokens_limit=10**6)
        return parse_chat_request(memo.read(scope, raw, "messages"), memo=memo, scope=scope,
                                  max_tokens_limit=10**6)
    except orjson.JSONDecodeError as e:
        return ("json", str(e))
    except ApiError as e:
        return ("error", e.kind, str(e), e.param)


def damaged(raw: bytes, how: str) -> bytes:
    if how == "duplicate":  # a second messages member after the first: the last one counts
        return raw.rstrip()[:-1] + b', "messages": [{"role": "user", "content": "dup"}]}'
    if how == "trailing_comma":
        return raw.replace(b"}]", b"},]", 1) if b"}]" in raw else raw
    if how == "junk":  # not JSON after the messages
        return raw.rstrip()[:-1] + b", junk}"
    return raw


@st.composite
def requests(draw: Any) -> list[bytes]:
    """One caller's raw bodies: a conversation's leading parts in order (one serialization
    and member order), then some of them again, changed."""
    msgs = draw(st.lists(message, min_size=1, max_size=6))
    form = SERIALIZE[draw(st.sampled_from(sorted(SERIALIZE)))]
    order = ORDERS[draw(st.sampled_from(sorted(ORDERS)))]
    out = [form(order(msgs[:k])) for k in range(1, len(msgs) + 1)]
    for _ in range(draw(st.integers(0, 4))):
        k = draw(st.integers(1, len(msgs)))
        m = copy.deepcopy(msgs[:k])
        change = draw(st.sampled_from(["repeat", "edit", "extend", "form", "duplicate",
                                       "trailing_comma", "junk"]))
        if change == "edit":
            m[draw(st.integers(0, k - 1))] = {"role": "user", "content": "edited"}
        elif change == "extend":
            m += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "]"}]
        raw = (SERIALIZE[draw(st.sampled_from(sorted(SERIALIZE)))] if change == "form"
               else form)(order(m))
        out.append(damaged(raw, change))
    return out


@SETTINGS
@given(bodies=requests())
def test_a_body_read_through_the_memo_parses_as_one_decoded_whole(bodies):
    memo = MessageMemo()
    for raw in bodies:
        assert decoded(memo, raw, b"a") == decoded(None, raw, b"a"), raw


def test_a_growing_conversation_is_read_from_its_last_body_and_callers_never_share():
    memo = MessageMemo()
    for form in ("compact", "pretty"):
        memo.clear()
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "question ]"}]
        for turn in range(6):
            if turn:
                msgs = msgs + [{"role": "assistant", "content": f"answer {turn}"},
                               {"role": "user", "content": f"question {turn} ]"}]
            raw = SERIALIZE[form](ORDERS["first"](msgs))
            read = memo.read(b"a", raw, "messages")
            # every turn after the first spares the messages of the turn before
            assert read.start == (0 if turn == 0 else len(msgs) - 2), (form, turn)
            assert len(read.body["messages"]) == len(msgs) - read.start
            got = parse_chat_request(read, memo=memo, scope=b"a")
            assert got == parse_chat_request(orjson.loads(raw))
            # another caller's identical body spares nothing
            assert memo.read(b"b", raw, "messages").start == 0


def test_whitespace_between_the_kept_messages_and_the_next_is_read_through():
    """Any run of JSON whitespace after the kept items (skipped in C: a body may hold
    megabytes of it) still reads from the last turn, equal to a whole decode."""
    memo = MessageMemo()
    msgs = [{"role": "user", "content": "hi"}]
    for turn in range(3):
        raw = b'{"model": "m", "messages": [' + (b" " * 1000 + b",\n").join(
            orjson.dumps(m) for m in msgs) + b"\t\r\n" * 500 + b"]}"
        read = memo.read(b"a", raw, "messages")
        assert read.start == (len(msgs) - 2 if turn else 0)
        assert parse_chat_request(read, memo=memo, scope=b"a") == \
            parse_chat_request(orjson.loads(raw))
        msgs = msgs + [{"role": "assistant", "content": f"ok {turn}"},
                       {"role": "user", "content": "more"}]
