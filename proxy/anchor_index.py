"""The proxy's index of committed anchors (pure, in memory).

It mirrors what the worker confirmed, per namespace (tenant). It is advisory: the worker
re-verifies every link (depth and prefix hash) before restoring, so a stale entry costs a
miss, never a wrong restore; misses and evictions the worker reports are dropped here.
The SQLite ledger (state/) will persist the same records behind this interface.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from anchorcache.wire import AnchorKind


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


class AnchorIndex:
    def __init__(self) -> None:
        self._by_key: dict[bytes, AnchorRecord] = {}
        self._depths: dict[bytes, Counter[int]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._by_key.values())

    def get(self, key: bytes) -> AnchorRecord | None:
        return self._by_key.get(key)

    def depths(self, namespace: bytes) -> list[int]:
        """Depths at which `namespace` has committed anchors, ascending."""
        return sorted(self._depths.get(namespace, ()))

    def add(self, rec: AnchorRecord) -> None:
        self.remove(rec.key)
        self._by_key[rec.key] = rec
        self._depths.setdefault(rec.namespace, Counter())[rec.depth] += 1

    def remove(self, key: bytes) -> AnchorRecord | None:
        rec = self._by_key.pop(key, None)
        if rec is not None:
            depths = self._depths[rec.namespace]
            depths[rec.depth] -= 1
            if depths[rec.depth] <= 0:
                del depths[rec.depth]
        return rec

    def chain(self, key: bytes) -> list[AnchorRecord] | None:
        """Root→leaf records ending at `key`, or None if any link is missing."""
        out: list[AnchorRecord] = []
        seen: set[bytes] = set()
        cur: bytes | None = key
        while cur is not None:
            rec = self._by_key.get(cur)
            if rec is None or cur in seen:
                return None
            seen.add(cur)
            out.append(rec)
            cur = rec.parent
        out.reverse()
        return out

    def clear(self) -> int:
        n = len(self._by_key)
        self._by_key.clear()
        self._depths.clear()
        return n
