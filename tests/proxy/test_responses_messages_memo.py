"""The Responses edge's conversion memo: an agent resends its whole conversation each turn
(Codex, `store: false`); only the items after those it sent before are converted, and the
messages and their JSON bytes equal a conversion from nothing, whatever the requests do."""

from __future__ import annotations

import random

import orjson
import pytest

from anchorcache.proxy.responses_items import MessagesMemo, to_messages
from anchorcache.proxy.schema import ApiError


def _item(rng: random.Random, n: int) -> dict:
    kind = rng.choice(["user", "user", "developer", "assistant", "call", "call", "output",
                       "output", "reasoning"])
    call = f"call_{rng.randrange(6)}"
    if kind in ("user", "developer", "assistant"):
        return {"type": "message", "role": kind, "content": f"{kind} {n}"}
    if kind == "call":
        return {"type": "function_call", "call_id": call, "name": f"tool_{rng.randrange(3)}",
                "arguments": f'{{"n": {n}}}'}
    if kind == "output":
        return {"type": "function_call_output", "call_id": call, "output": f"out {n}"}
    return {"type": "reasoning", "content": [{"type": "reasoning_text", "text": f"think {n}"}]}


def _expected(items, instructions):
    try:
        messages = to_messages(items, instructions)
    except ApiError as e:
        return e.message
    return messages, orjson.dumps(messages)[:-1]


def _converted(memo, scope, items, instructions):
    try:
        return memo.convert(scope, items, instructions)
    except ApiError as e:
        return e.message


def test_resumed_conversions_equal_conversions_from_nothing():
    """Conversations that grow, fork from an earlier request, repeat one, end inside an
    assistant turn, change their instructions, in two scopes: every request's messages and
    bytes are those of a conversion from nothing, and most requests resume."""
    rng = random.Random(3)
    memo = MessagesMemo()
    sent: list[tuple[bytes, tuple[dict, ...], str | None]] = []
    n = 0
    for _ in range(600):
        r = rng.random()
        if sent and r < 0.6:  # the next turn of an earlier request (the same item objects)
            scope, items, instructions = rng.choice(sent[-8:])
            items += tuple(_item(rng, n := n + 1) for _ in range(rng.randrange(1, 4)))
        elif sent and r < 0.75:  # a fork: a leading part of one, then other items
            scope, items, instructions = rng.choice(sent)
            items = items[:rng.randrange(len(items) + 1)] + (_item(rng, n := n + 1),)
        elif sent and r < 0.8:  # the same request again
            scope, items, instructions = rng.choice(sent)
        elif sent and r < 0.85:  # the same items under other instructions
            scope, items, _ = rng.choice(sent)
            instructions = rng.choice([None, "be brief", "be kind"])
        else:
            scope, items = rng.choice([b"a", b"b"]), (_item(rng, n := n + 1),)
            instructions = rng.choice([None, "be brief"])
        assert _converted(memo, scope, items, instructions) == _expected(items, instructions)
        sent.append((scope, items, instructions))
    assert memo.hits > 200


def test_a_scope_never_resumes_from_another_scopes_items():
    memo = MessagesMemo()
    items = ({"type": "message", "role": "user", "content": "hi"},)
    memo.convert(b"a", items, None)
    more = items + ({"type": "message", "role": "user", "content": "again"},)
    memo.convert(b"b", more, None)
    assert memo.hits == 0
    memo.convert(b"a", more, None)
    assert memo.hits == 1


def test_it_stays_within_its_bytes():
    memo = MessagesMemo(max_bytes=64 << 10)
    for i in range(200):
        items = ({"type": "message", "role": "user", "content": f"{i} " + "x" * 2000},)
        memo.convert(b"s%d" % (i % 9), items, None)
        assert memo.size_bytes <= 64 << 10
    with pytest.raises(ApiError):
        memo.convert(b"s", (), "only instructions")
