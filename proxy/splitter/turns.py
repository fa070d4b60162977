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

Scoped like every memo of the splitter (the caller's namespace: no caller's split is
faster for another's request), bounded per scope and in bytes over all scopes, locked (the
split threads share it). Kept turns are never mutated: a new turn builds new lists.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .types import Cut

TURNS_PER_SCOPE = 4  # a scope's conversations in flight at once
_OVERHEAD = 4096


@dataclass(frozen=True)
class Turn:
    """A split kept for the next turn of its conversation."""

    head: bytes  # the messages' JSON bytes, less the closing bracket
    count: int  # messages
    context: bytes  # the tools, template arguments and tool order it was rendered with
    chunks: list[str]  # `TextAdapter._chunks` of its render
    consumed: list[int | None]  # messages rendered at the end of each chunk
    ends: list[int]  # token count at the end of each chunk
    hashes: list[Any]  # the prefix cache's hash state after each chunk but the last
    ids: tuple[int, ...]
    token_bytes: bytes  # `ids` as int64s (SplitResult.token_bytes)
    cuts: tuple[Cut, ...]  # the split's cuts (an adapter with no instruction text has none)
    cut_msgs: tuple[int, ...]  # how many messages each cut ends after
    lead: int  # leading system messages
    newest: int  # where the newest messages start (normalize.newest_start)

    @property
    def size(self) -> int:
        # the ids' tuple and objects, the bytes, the text and the hash states, roughly
        return 5 * len(self.token_bytes) + 2 * len(self.head) + 256 * len(self.chunks) + _OVERHEAD


class TurnMemo:
    def __init__(self, max_bytes: int = 128 << 20) -> None:
        self.max_bytes = max_bytes
        self._scopes: OrderedDict[bytes, list[Turn]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def extended(self, scope: bytes, context: bytes, head: bytes) -> Turn | None:
        """The longest of `scope`'s kept turns rendered with `context` whose messages are
        the leading messages of the request whose messages' JSON bytes (less the closing
        bracket) are `head`."""
        best: Turn | None = None
        with self._lock:
            for turn in self._scopes.get(scope, ()):
                if turn.context == context and len(turn.head) <= len(head) and (
                        best is None or turn.count > best.count) and head.startswith(turn.head) \
                        and (len(turn.head) == len(head) or head[len(turn.head)] == 0x2C):  # ","
                    best = turn
            if best is not None:
                self.hits += 1
                self._scopes.move_to_end(scope)
        return best

    def keep(self, scope: bytes, turn: Turn) -> None:
        size = turn.size
        if size > self.max_bytes:
            return
        with self._lock:
            turns = self._scopes.setdefault(scope, [])
            self._scopes.move_to_end(scope)
            if any(t.context == turn.context and t.head.startswith(turn.head) for t in turns):
                return  # a leading part of a kept turn (a retry, a hint's sub-split): kept
            for old in [t for t in turns if t.context == turn.context
                        and turn.head.startswith(t.head)]:  # this turn supersedes it
                turns.remove(old)
                self._bytes -= old.size
            turns.insert(0, turn)
            self._bytes += size
            while len(turns) > TURNS_PER_SCOPE:
                self._bytes -= turns.pop().size
            while self._bytes > self.max_bytes:
                oldest_scope, oldest = next(iter(self._scopes.items()))
                self._bytes -= oldest.pop().size
                if not oldest:
                    del self._scopes[oldest_scope]

    def clear(self) -> None:
        with self._lock:
            self._scopes.clear()
            self._bytes = 0
