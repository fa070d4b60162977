"""Per-scope memo of per-message work, keyed by each message's exact JSON bytes.

An agent resends every earlier message of its conversation with each turn. Validating,
normalizing and rendering them again made the proxy's CPU per request grow with the
conversation (55 ms a turn at 100k tokens, against 9 ms at 5k) rather than with the turn.
What the proxy derives from one message (its validated record, its normalized and defused
copy, its tool calls' argument text) is a pure function of the message and of the
process's fixed configuration, so it is keyed by the message's JSON bytes (`orjson.dumps`,
in C: about 1 ms for a 100k-token conversation), and a hit is exactly what the work would
give. Derived values are shared between requests: whoever gets one must not mutate it.

Scopes never mix: the scope is the caller's namespace (a tenant, narrowed by its cache
salt), as for `planner.PrefixKeys`, so no caller's request can hit, and so time, another's
messages. Bounded by bytes over all scopes (least recently used entries go first);
thread-safe, since the split threads share it. An `OrderedDict` rather than cachetools'
`LRUCache`: a lookup is on the path of every message of every request, and cachetools'
Python-level `get` cost 1.7 µs of it, the dict's C-level `get` and `move_to_end` 0.2.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson

T = TypeVar("T")
_OVERHEAD = 512  # bytes counted per entry beyond 3× its key (the key, and the values' copies)


class MessageMemo:
    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        self._lru: OrderedDict[tuple[bytes, bytes], tuple[int, Any]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def map(self, scope: bytes, items: Sequence[Any], derive: Callable[[int, Any], T]) -> list[T]:
        """`[derive(i, item) for i, item in enumerate(items)]`, each result taken from the
        memo where `scope` saw an item of the same JSON bytes before. `derive` depends only on
        the item (the index is for its error messages: an item that raises is not kept, so a
        hit was derived without error). Items that are not JSON (or nest past orjson's
        limit) are derived every time."""
        out: list[T] = []
        for i, item in enumerate(items):
            try:
                key = (scope, orjson.dumps(item))
            except (TypeError, orjson.JSONEncodeError):
                out.append(derive(i, item))
                continue
            with self._lock:
                entry = self._lru.get(key)
                if entry is None:
                    self.misses += 1
                else:
                    self.hits += 1
                    self._lru.move_to_end(key)
            if entry is not None:
                out.append(entry[1])
                continue
            value = derive(i, item)
            size = 3 * len(key[1]) + _OVERHEAD
            if size <= self.max_bytes:
                with self._lock:
                    self._put(key, size, value)
            out.append(value)
        return out

    def _put(self, key: tuple[bytes, bytes], size: int, value: Any) -> None:
        old = self._lru.pop(key, None)  # another thread derived it meanwhile
        if old is not None:
            self._bytes -= old[0]
        self._lru[key] = (size, value)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (dropped, _) = self._lru.popitem(last=False)
            self._bytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._bytes = 0
