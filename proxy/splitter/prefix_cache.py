"""Bounded LRU of prefix token ids, keyed by a digest of the exact prefix text.

The text of a prefix is a pure function of the normalized messages/tools that produced it
(adapters render deterministically), so keying by its BLAKE2b digest is keying by those
messages/tools, without a second canonical serialization. Token ids are a pure function of
the text, so a hit can only return the ids a whole render would give; the digest covers every
character (a one-character change in the system prompt is a different key).

Each entry holds the prefix ids and the token positions of the chunk ends inside it, so a
hit restores the earlier cuts too. Bounded by entry count and by total tokens. One per
adapter; every method takes a lock, so splits may run in an executor's threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple


class CachedPrefix(NamedTuple):
    """A prefix's ids, the first `tokens` of `ids`, in `chunks` chunks: the first `chunks` of
    `chunk_ends` (token count at the end of each). Both may run on past the prefix: an
    agent's prompt keeps two of its prefixes, which share the prompt's tuples, not copies."""

    ids: Sequence[int]
    chunk_ends: tuple[int, ...]
    chunks: int

    @property
    def tokens(self) -> int:
        return self.chunk_ends[self.chunks - 1]


class PrefixCache:
    def __init__(self, max_entries: int = 256, max_tokens: int = 4_000_000) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, CachedPrefix] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def get(self, key: bytes) -> CachedPrefix | None:
        with self._lock:
            return self._get(key)

    def _get(self, key: bytes) -> CachedPrefix | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def deepest(self, keys: list[bytes]) -> tuple[int, CachedPrefix] | None:
        """The last of `keys` (prefix digests, shortest first) that is cached, with its
        index; counts one hit or one miss."""
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                entry = self._get(keys[i])
                if entry is not None:
                    self.hits += 1
                    return i, entry
            self.misses += 1
            return None

    def put(self, key: bytes, entry: CachedPrefix) -> None:
        with self._lock:
            if len(entry.ids) > self.max_tokens or key in self._entries:
                return
            self._entries[key] = entry
            self._num_tokens += len(entry.ids)
            while len(self._entries) > self.max_entries or self._num_tokens > self.max_tokens:
                _, old = self._entries.popitem(last=False)
                self._num_tokens -= len(old.ids)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._num_tokens = 0
