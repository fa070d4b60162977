"""The backend-neutral anchor store: slabs of saved cache state behind the slot table.

Both workers keep their anchors here; they differ only in how rows get out of and back
into their cache, which they pass in as callables (`capture`, `load`):

- the embedded worker reads a transformers cache (`bhtd`, one sequence per cache);
- the SGLang worker reads SGLang's token pool (`thd`, rows addressed by token slot,
  from `req_to_token`) and, on hybrid models, its Mamba pool.

The C++ `SlotTable` keeps the bookkeeping (reservations, depth/hash-checked lookup, LRU,
pinning); this store keeps the data: one slab per slot, K/V rows `[start, depth)` of every
attention layer (the rows past the parent anchor) plus, on recurrent models, the state at
`depth`. A snapshot is written into a *staged* slab, invisible to lookups until the proxy
confirms it; the slot's previous anchor stays readable until then (deferred eviction),
and an abort simply drops the staged slab. An unconfirmed slab of a finished request is
dropped after `STAGED_TTL_S`.

Restores are verified three ways before any row is written: the store recomputes each
link's key over the prompt it was actually given, the slot table checks the slot's
committed key and depth, and the slab's own (key, start, parent) must continue the chain.
A failed link ends the chain there: the request still runs, it just prefills more.

Tips: per request, the deepest anchor restored, held or written so far; a new snapshot
stores only the rows past it and names it as parent.

Thread model: `restore`, `write` and `release_request` run on the worker's owning loop
(embedded: the engine thread; SGLang: the scheduler); confirm/abort/pin/list may come
from another thread (embedded: the HTTP handlers). One lock guards the slab maps; the
slot table is itself thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from anchorcache.ext.slots import Region, SlotTable
from anchorcache.wire import AnchorKind, AnchorPlan, AnchorWritten, anchor_keys

log = logging.getLogger("anchorcache.worker")

STAGED_TTL_S = 60.0  # an unconfirmed snapshot of a finished request is dropped after this

T = TypeVar("T")
# (start, depth) -> (kv slab or None, state slab or None); raises on failure
Capture = Callable[[int, int], tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass(frozen=True)
class Slab:
    key: bytes
    depth: int
    start: int  # = parent's depth (0 for a root)
    parent: bytes | None
    kind: AnchorKind
    kv: torch.Tensor | None  # [kv_layers, 2, depth - start, kv_heads, head_dim]; None: no KV layers
    state: torch.Tensor | None  # flat uint8 states at `depth`; None on dense models
    nbytes: int


@dataclass(frozen=True)
class AnchorHeld:
    """A snapshot asked for a prefix the store already holds (committed): nothing was
    written, the request chains on from it. Reported in `meta_info.anchors.held`."""

    slot: int
    key: bytes
    depth: int
    kind: AnchorKind

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "key": self.key.hex(), "depth": self.depth,
                "kind": self.kind.value}


@dataclass(frozen=True)
class RestoreCheck:
    """The verified prefix of a restore chain and what the reply reports about it."""

    chain: tuple[Slab, ...]
    restored: tuple[dict[str, Any], ...]
    misses: tuple[dict[str, Any], ...]

    @property
    def depth(self) -> int:
        return self.chain[-1].depth if self.chain else 0

    def info(self) -> dict[str, Any]:
        return {"restored": list(self.restored), "restore_miss": list(self.misses)}


@dataclass
class _Tip:
    key: bytes | None = None
    depth: int = 0


def written_json(w: AnchorWritten) -> dict[str, Any]:
    return {"slot": w.slot, "key": w.key.hex(), "depth": w.depth,
            "parent": w.parent.hex() if w.parent else None, "nbytes": w.nbytes,
            "kind": w.kind.value}


class AnchorStore:
    """Slabs by slot, staged and committed; see the module docstring.

    `kv_bytes_per_token` and `state_bytes` size a slab for the slot table's byte budget.
    """

    def __init__(self, model_id: str, table: SlotTable, *, kv_bytes_per_token: int,
                 state_bytes: int = 0) -> None:
        self.model_id = model_id
        self.table = table
        self.kv_bytes_per_token = kv_bytes_per_token
        self.state_bytes = state_bytes
        self.fault: Callable[[str], None] = lambda where: None
        self._lock = threading.RLock()
        self._live: dict[int, Slab] = {}
        self._slot_of: dict[bytes, int] = {}
        self._staged: dict[int, tuple[Slab, str]] = {}  # slot → (slab, rid)
        self._staged_deadline: dict[int, float] = {}
        self._tips: dict[str, _Tip] = {}  # rid → deepest anchor restored, held or written

    # ---- owning loop --------------------------------------------------------------------
    def check_chain(self, ids: tuple[int, ...], plan: AnchorPlan) -> RestoreCheck:
        """Verify `plan.restore` against the prompt `ids`; the verified prefix (LRU touched)."""
        keys = anchor_keys(plan.namespace, self.model_id, ids, [r.depth for r in plan.restore
                                                                if r.depth <= len(ids)])
        chain: list[Slab] = []
        misses: list[dict[str, Any]] = []
        with self._lock:
            prev = _Tip()
            for ref in plan.restore:
                reason = None
                slot = None
                if ref.depth >= len(ids):
                    reason = "covers_prompt"  # at least the last token must be prefilled
                elif keys[ref.depth] != ref.key:
                    reason = "key_mismatch"  # the proxy's key is not this prompt's prefix
                elif (slot := self.table.lookup(ref.key, ref.depth)) is None:
                    reason = "not_resident"
                else:
                    slab = self._live.get(slot)
                    if slab is None or slab.key != ref.key or slab.depth != ref.depth \
                            or slab.start != prev.depth or slab.parent != prev.key:
                        reason = "chain_mismatch"
                if reason is not None:
                    misses.append({"key": ref.key.hex(), "depth": ref.depth, "reason": reason})
                    break
                assert slot is not None
                chain.append(self._live[slot])
                prev = _Tip(ref.key, ref.depth)
        restored = tuple({"key": s.key.hex(), "depth": s.depth, "kind": s.kind.value}
                         for s in chain)
        return RestoreCheck(tuple(chain), restored, tuple(misses))

    def restore_chain(self, rid: str, ids: tuple[int, ...], plan: AnchorPlan,
                      load: Callable[[tuple[Slab, ...]], T]) -> tuple[T | None, int, dict[str, Any]]:
        """Restore the verified prefix of `plan.restore` with `load(chain)`;
        (what load returned or None, depth restored, reply info)."""
        check = self.check_chain(ids, plan)
        if not check.chain:
            return None, 0, check.info()
        self.fault("restore")
        loaded = load(check.chain)
        self.chained(rid, check.chain[-1].key, check.depth)
        return loaded, check.depth, check.info()

    def chained(self, rid: str, key: bytes | None, depth: int) -> None:
        """Record that request `rid` holds the anchor `key` at `depth` (its next parent)."""
        tip = self._tips.setdefault(rid, _Tip())
        if depth >= tip.depth:
            self._tips[rid] = _Tip(key, depth)

    def tip_depth(self, rid: str) -> int:
        tip = self._tips.get(rid)
        return tip.depth if tip is not None else 0

    def write(self, rid: str, key: bytes, depth: int, kind: AnchorKind, region: Region,
              capture: Capture, *, check: Callable[[], None] | None = None
              ) -> AnchorWritten | AnchorHeld | None:
        """Stage the anchor `key` at `depth` of request `rid` with the rows past its tip:
        `capture(start, depth)` copies them (and the state at `depth`). A prefix the store
        already holds is reported as held; None when nothing could be reserved or the
        capture failed (the request goes on; the slot's old anchor stays). `check` runs
        before anything is reserved and may raise (a caller bug, not a failed snapshot)."""
        tip = self._tips.setdefault(rid, _Tip())
        with self._lock:
            held_slot = self._slot_of.get(key)
            if held_slot is not None and self.table.contains(key, depth):
                self._tips[rid] = _Tip(key, depth)  # saved by an earlier request: chain on
                return AnchorHeld(held_slot, key, depth, kind)
        if check is not None:
            check()
        start = tip.depth
        if not 0 <= start < depth:
            return None
        nbytes = self.kv_bytes_per_token * (depth - start) + self.state_bytes
        res = self.table.reserve(key, depth, nbytes, parent=tip.key, region=region)
        if res is None:
            return None
        try:
            self.fault("snapshot")
            kv, state = capture(start, depth)
        except Exception:
            log.exception("snapshot at depth %d failed; reservation aborted", depth)
            self.table.abort(res.slot)
            return None
        slab = Slab(key, depth, start, tip.key, kind, kv, state, nbytes)
        with self._lock:
            self._staged[res.slot] = (slab, rid)
        self._tips[rid] = _Tip(key, depth)
        return AnchorWritten(res.slot, key, depth, tip.key, nbytes, kind)

    def release_request(self, rid: str, *, ok: bool) -> None:
        """The request ended: on failure drop its staged anchors now, else start their TTL."""
        self._tips.pop(rid, None)
        with self._lock:
            self._sweep_locked()
            mine = [slot for slot, (_, r) in self._staged.items() if r == rid]
            if not ok:
                self._abort_locked(mine)
            else:
                deadline = time.monotonic() + STAGED_TTL_S
                for slot in mine:
                    self._staged_deadline[slot] = deadline

    # ---- any thread ---------------------------------------------------------------------
    def confirm(self, slots: list[int]) -> tuple[list[int], list[bytes]]:
        """Make staged anchors visible; returns (confirmed slots, keys evicted)."""
        confirmed, evicted = [], []
        with self._lock:
            self._sweep_locked()
            for slot in slots:
                entry = self._staged.pop(slot, None)
                self._staged_deadline.pop(slot, None)
                if entry is None:
                    continue
                slab = entry[0]
                gone = self.table.confirm(slot)
                for key in gone:
                    old = self._slot_of.pop(key, None)
                    if old is not None and old != slot:
                        self._live.pop(old, None)
                prev = self._live.get(slot)
                if prev is not None:
                    self._slot_of.pop(prev.key, None)
                self._live[slot] = slab
                self._slot_of[slab.key] = slot
                confirmed.append(slot)
                evicted.extend(gone)
        return confirmed, evicted

    def abort(self, slots: list[int]) -> list[int]:
        with self._lock:
            return self._abort_locked([s for s in slots if s in self._staged])

    def abort_request(self, rid: str) -> list[int]:
        with self._lock:
            return self._abort_locked([slot for slot, (_, r) in self._staged.items() if r == rid])

    def _abort_locked(self, slots: list[int]) -> list[int]:
        for slot in slots:
            self._staged.pop(slot, None)
            self._staged_deadline.pop(slot, None)
            self.table.abort(slot)
        return slots

    def _sweep_locked(self) -> None:
        now = time.monotonic()
        self._abort_locked([s for s, t in self._staged_deadline.items() if t < now])

    def lookup(self, namespace: bytes, ids: list[int], depths: list[int]) -> list[dict[str, Any]]:
        """Which prefixes `ids[:d]` are committed (no LRU touch). ValueError on bad depths."""
        keys = anchor_keys(namespace, self.model_id, ids, depths)
        return [{"depth": d, "key": keys[d].hex(), "committed": self.table.contains(keys[d], d)}
                for d in depths]

    def evict(self, key: bytes) -> bool:
        with self._lock:
            if not self.table.evict(key):
                return False
            slot = self._slot_of.pop(key, None)
            if slot is not None:
                self._live.pop(slot, None)
            return True

    def flush(self) -> int:
        with self._lock:
            self._abort_locked(list(self._staged))
            self.table.clear()
            n = len(self._live)
            self._live.clear()
            self._slot_of.clear()
            return n

    def staged_count(self) -> int:
        with self._lock:
            return len(self._staged)

    def slots_json(self) -> list[dict[str, Any]]:
        return [_entry_json(e) for e in self.table.entries()]

    def stats_json(self) -> dict[str, Any]:
        return {**self.table.stats()._asdict(), "staged": self.staged_count()}


def _entry_json(e: Any) -> dict[str, Any]:
    d = e._asdict()
    for name in ("key", "parent"):
        if isinstance(d.get(name), bytes):
            d[name] = d[name].hex()
    return d
