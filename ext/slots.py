"""Typed wrapper over the C++ slot table (ext/csrc/slot_table.h): which anchor is in which slot.

The table is bookkeeping only: slab memory belongs to the worker (slot -> slab tensors). Keys
are 16-byte prefix hashes ``H(tenant_salt, model_id, P[:d])``; every key carries its depth.

Rules (the model in tests/ext/test_slot_table_model.py is their executable form):

- Regions: slots ``[slot_base, slot_base + pinned_slots)`` are the thin region (tool anchors),
  all others the thick region. ``reserve`` takes the lowest free slot of the region, else the
  least-recently-used evictable slot: committed, not pinned, not reserved, not already claimed
  and not protected (below).
- Chains: an anchor may name a ``parent`` key. Its ancestors are the walk parent key -> the
  slot where that key is committed (and not stale) -> its parent -> ..., stopping at a missing
  parent and at a slot already on the walk (a parent may name a descendant: cycles end there).
- Touch: a commit or a lookup hit gives the anchor a fresh ``last_use`` tick, then each
  ancestor a fresher one (child t, parent t + 1, grandparent t + 2, ...); only the anchor's own
  ``hits`` grows. A chain restored root first still ends with its root the newest, so LRU
  evicts leaves before their ancestors.
- Deferred eviction: ``reserve`` evicts nothing. It claims victims (the slot's occupant, then
  LRU slots of the same region, then of the other region, until
  ``bytes_used - claimed + reserved + nbytes <= capacity_bytes``); claimed anchors still hit.
  ``confirm`` evicts them, and any other key mapped to the slot, then commits the new key;
  ``abort`` releases them, so a failed snapshot never costs the old anchor.
- ``lookup`` hits only if the slot's committed key and depth equal the query's; a map entry
  whose slot now holds something else is stale and is evicted on sight.
- Pinned anchors are never victims, nor are their ancestors (protected): a pinned chain keeps
  its parents. ``reserve(..., slot=S)`` refuses a pinned, claimed or protected occupant.
  ``pin`` returns False if the anchor or any ancestor is claimed (the pending reservation
  would evict it at confirm). ``evict`` and ``clear`` remove pinned and protected anchors too.
- ``last_use`` is a logical clock (one tick per touch of the anchor or of a descendant), not
  wall time.

Thread-safe: every call takes the table's mutex (the GIL is released meanwhile).
"""

from __future__ import annotations

from typing import NamedTuple

import torch  # noqa: F401  (loads libc10/libtorch, which the compiled _C links against)

from anchorcache.ext import _C
from anchorcache.wire import KEY_BYTES, Region, SlotCounters, SlotEntry


class Reservation(NamedTuple):
    slot: int
    victims: tuple[bytes, ...]  # keys evicted at confirm; still visible until then


def _key(key: bytes, what: str = "key") -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"{what} must be {KEY_BYTES} bytes, got {key!r}")
    return key


class SlotTable:
    """Slot bookkeeping for anchors; see the module docstring for the rules."""

    def __init__(self, num_slots: int, capacity_bytes: int, *, slot_base: int = 0,
                 pinned_slots: int = 0) -> None:
        self._table = _C.SlotTable(num_slots, capacity_bytes, slot_base, pinned_slots)
        self.num_slots = num_slots
        self.capacity_bytes = capacity_bytes
        self.slot_base = slot_base
        self.pinned_slots = pinned_slots

    def reserve(self, key: bytes, depth: int, nbytes: int, *, parent: bytes | None = None,
                region: Region = Region.THICK, slot: int | None = None) -> Reservation | None:
        """Reserves a slot for ``key`` at ``depth``; None if nothing can be reserved.

        ``slot`` asks for an in-place refresh of that slot (None if it is pinned, reserved,
        claimed or an ancestor of a pinned anchor). A key already committed or reserved is
        refused (None). Raises ValueError on a malformed key or negative sizes, IndexError
        on a slot out of range.
        """
        if parent is not None:
            _key(parent, "parent")
        if region not in ("thin", "thick"):
            raise ValueError(f"region must be 'thin' or 'thick', got {region!r}")
        got = self._table.reserve(_key(key), depth, nbytes, parent, Region(region).value, slot)
        return None if got is None else Reservation(got[0], tuple(got[1]))

    def confirm(self, slot: int) -> list[bytes]:
        """Commits the reservation of ``slot``; returns the keys evicted now.

        Raises ValueError if the slot holds no reservation.
        """
        return list(self._table.confirm(slot))

    def abort(self, slot: int) -> None:
        """Drops the reservation of ``slot``; its victims survive. ValueError if none."""
        self._table.abort(slot)

    def lookup(self, key: bytes, depth: int) -> int | None:
        """The slot of a committed ``key`` at exactly ``depth``, else None.

        A hit touches the anchor (hits++) and its ancestors (fresh ticks, hits unchanged).
        """
        return self._table.lookup(_key(key), depth)

    def contains(self, key: bytes, depth: int) -> bool:
        """Same check as lookup without touching anything (for planning)."""
        return self._table.contains(_key(key), depth)

    def pin(self, key: bytes) -> bool:
        """Pins a committed ``key`` (and so protects its ancestors); False if it is not
        committed, or it or an ancestor is claimed by a pending reservation."""
        return self._table.pin(_key(key))

    def unpin(self, key: bytes) -> bool:
        return self._table.unpin(_key(key))

    def evict(self, key: bytes) -> bool:
        """Removes a committed key now (pinned or not); False if it is not committed."""
        return self._table.evict(_key(key))

    def clear(self) -> list[bytes]:
        """Evicts every committed anchor (pinned too); pending reservations stay."""
        return list(self._table.clear())

    def entries(self) -> list[SlotEntry]:
        """Committed anchors and pending reservations, by slot (committed first)."""
        return [SlotEntry(*row) for row in self._table.entries()]

    def stats(self) -> SlotCounters:
        return SlotCounters(**self._table.stats())
