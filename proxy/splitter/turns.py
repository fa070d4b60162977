"""The last turns' splits, so that a conversation's next turn renders and tokenizes only
what is new.

An agent resends its whole conversation with each turn. Rendering it again is a Python pass
over every message (2,400 of them at 100k tokens: render, chunk, hash, classify, about 9 ms
a turn), a cost that grows with the conversation, not the turn. `TextAdapter.split` keeps
each split's chunks (their text, the messages they end after, their token ends and the
prefix hash after each) and its ids here, and the next request whose messages extend the
kept request's (its messages' JSON bytes start with the kept ones', up to a message
boundary: a memcmp), with the same tools and template arguments, reuses the chunks up to
where the adapter says the render cannot have changed (`TextAdapter.stable_messages`),
then renders, chunks and encodes only from there. `tests/proxy/splitter/test_split_turns.py`
checks, over random conversations and their extensions, that every such split equals a
whole one.

Kept in a `memo.PrefixStates` (`turns_memo`): scoped like every memo of the splitter (the
caller's namespace: no caller's split is faster for another's request), bounded per scope
and in bytes over all scopes, locked (the split threads share it). Kept turns are never
mutated: a new turn builds new lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from anchorcache.defaults import CONVERSATIONS_PER_SCOPE
from anchorcache.wire import TokenIds

from .memo import PrefixStates
from .types import Cut

TURNS_PER_SCOPE = CONVERSATIONS_PER_SCOPE  # a scope's conversations in flight at once
_OVERHEAD = 4096


@dataclass(frozen=True)
class Turn:
    """A split kept for the next turn of its conversation."""

    count: int  # messages
    chunks: list[str]  # `TextAdapter._chunks` of its render
    consumed: list[int | None]  # messages rendered at the end of each chunk
    ends: list[int]  # token count at the end of each chunk
    hashes: list[Any]  # the prefix cache's hash state after each chunk but the last
    ids: TokenIds  # its `buf`: SplitResult.token_bytes; its `json` text, always made
    json_ends: list[int]  # where that text is at each chunk's end (`json_ends`)
    cuts: tuple[Cut, ...]  # the split's cuts (an adapter with no instruction text has none)
    cut_msgs: tuple[int, ...]  # how many messages each cut ends after
    anchor_cuts: tuple[Cut, ...]  # the cuts but the TURN ones (SplitResult.anchor_cuts)
    lead: int  # leading system messages
    newest: int  # where the newest messages start (normalize.newest_start)
    # what the adapter's render reads of all its messages that a next turn's render needs
    # again (`TextAdapter._turn_facts`: Qwen3's last real user query), None where nothing
    facts: Any = None

    @property
    def size(self) -> int:
        # the ids' bytes and JSON, the text and the hash states, roughly
        return 5 * len(self.ids.buf) + 2 * len(self.ids.json or b"") + 256 * len(self.chunks) \
            + _OVERHEAD


def json_ends(text: bytes, counts: Iterable[int]) -> list[int]:
    """Where the JSON array of ids `text` is after each of `counts` (ascending) of its ids:
    at the comma after that many, at the closing bracket after all, after the opening one
    for none. (The ids of a turn and of the next share a prefix: so does their JSON, cut at
    a chunk's end, `TextAdapter._extend`.)"""
    commas = np.flatnonzero(np.frombuffer(text, np.uint8) == ord(","))
    last = len(text) - 1
    return [1 if k == 0 else int(commas[k - 1]) if k <= len(commas) else last for k in counts]


def extend_json(text: bytes, at: int, base: int, new_ids: list[int], counts: Iterable[int]
                ) -> tuple[bytes, list[int]]:
    """The JSON array of ids `text` cut after its first `base` ids (at `at`, `json_ends`),
    then `new_ids`: one copy of the kept text, the new ids' JSON alone; and where it is
    after each of `counts` (ascending, from `base`) of its ids."""
    new = orjson.dumps(new_ids)  # "[a,b]", or "[]"
    sep = b"," if base and new_ids else b""
    out = b"".join((memoryview(text)[:at], sep, memoryview(new)[1:]))
    shift = at + len(sep) - 1  # where the new text's "[" would be
    counts = [k - base for k in counts]
    return out, [at if k == 0 else p + shift for k, p in zip(counts, json_ends(new, counts),
                                                              strict=True)]


def turns_memo(max_bytes: int = 128 << 20) -> PrefixStates:
    """Where an adapter keeps its scopes' last turns (`Turn`s, found for a request that
    extends or repeats one)."""
    return PrefixStates(max_bytes, TURNS_PER_SCOPE, repeats=True)
