"""The proxy's index of committed anchors (pure, in memory).

It mirrors what the worker confirmed, per namespace (tenant). It is advisory: the worker
re-verifies every link (depth and prefix hash) before restoring, so a stale entry costs a
miss, never a wrong restore; misses and evictions the worker reports are dropped here.
The SQLite ledger (state/) will persist the same records behind this interface.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from anchorcache.wire import AnchorKind, AnchorRef


@dataclass(frozen=True)
class AnchorRecord:
    namespace: bytes
    key: bytes
    depth: int
    parent: bytes | None
    kind: AnchorKind
    slot: int | None  # None: on the worker's disk tier (it loads it when a restore names it)
    nbytes: int
    epoch: str

    @cached_property
    def ref(self) -> AnchorRef:
        """This anchor as a link of a restore chain in its own namespace (made once: a long
        conversation's chain names every turn's anchors on every request)."""
        return AnchorRef(self.key, self.depth)


class AnchorIndex:
    def __init__(self) -> None:
        self._by_key: dict[bytes, AnchorRecord] = {}
        self._depths: dict[bytes, Counter[int]] = {}
        self._sorted: dict[bytes, list[int]] = {}  # each namespace's depths, ascending
        self._children: dict[bytes, set[bytes]] = {}  # parent key → its children's keys

    def __len__(self) -> int:
        return len(self._by_key)

    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._by_key.values())

    def get(self, key: bytes) -> AnchorRecord | None:
        return self._by_key.get(key)

    def depths(self, namespace: bytes, below: int | None = None, floor: int = 0) -> list[int]:
        """Depths at which `namespace` has committed anchors (under `below`, if given; from
        `floor`), ascending: kept sorted as anchors come and go, not sorted per request."""
        depths = self._sorted.get(namespace, [])
        return depths[bisect.bisect_left(depths, floor) if floor else 0:
                      bisect.bisect_left(depths, below) if below is not None else None]

    def add(self, rec: AnchorRecord) -> None:
        self.remove(rec.key)
        self._by_key[rec.key] = rec
        counts = self._depths.setdefault(rec.namespace, Counter())
        counts[rec.depth] += 1
        if counts[rec.depth] == 1:
            bisect.insort(self._sorted.setdefault(rec.namespace, []), rec.depth)
        if rec.parent is not None:
            self._children.setdefault(rec.parent, set()).add(rec.key)

    def remove(self, key: bytes) -> AnchorRecord | None:
        rec = self._by_key.pop(key, None)
        if rec is not None:
            depths = self._depths[rec.namespace]
            depths[rec.depth] -= 1
            if depths[rec.depth] <= 0:
                del depths[rec.depth]
                ordered = self._sorted[rec.namespace]
                del ordered[bisect.bisect_left(ordered, rec.depth)]
            if rec.parent is not None:
                siblings = self._children[rec.parent]
                siblings.discard(key)
                if not siblings:
                    del self._children[rec.parent]
        return rec

    def children(self, key: bytes) -> list[AnchorRecord]:
        """The records whose parent is `key` (whether or not `key` itself is here)."""
        return [self._by_key[k] for k in self._children.get(key, ())]

    def chain(self, key: bytes) -> list[AnchorRecord] | None:
        """Root→leaf records ending at `key`, or None if any link is missing (or the links
        loop: a walk longer than the index)."""
        out: list[AnchorRecord] = []
        get = self._by_key.get
        cur: bytes | None = key
        while cur is not None:
            rec = get(cur)
            if rec is None or len(out) == len(self._by_key):
                return None
            out.append(rec)
            cur = rec.parent
        out.reverse()
        return out

    def clear(self) -> int:
        n = len(self._by_key)
        self._by_key.clear()
        self._depths.clear()
        self._sorted.clear()
        self._children.clear()
        return n
