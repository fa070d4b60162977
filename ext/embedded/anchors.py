"""The embedded worker's anchor store: slabs of saved cache state behind the slot table.

The C++ `SlotTable` keeps the bookkeeping (reservations, depth/hash-checked lookup, LRU,
pinning); this store keeps the data: one slab per slot, K/V rows `[start, depth)` of every
attention layer (the rows past the parent anchor) plus, on recurrent models, the conv and
recurrent state at `depth`. A snapshot is written into a *staged* slab, invisible to
lookups until the proxy confirms it; the slot's previous anchor stays readable until then
(deferred eviction), and an abort simply drops the staged slab.

Restores are verified three ways before any row is written: the worker recomputes each
link's key over the prompt it was actually given, the slot table checks the slot's
committed key and depth, and the slab's own (key, start, parent) must continue the chain.
A failed link ends the chain there: the request still runs, it just prefills more.

Late lookup (`restore`, with ext/held_chain.py): a request also restores the deepest chain
the store holds at one of its own snapshot depths, keyed here over its prompt; a staged slab
counts once its request finished well. A queued request thus restores what the request
ahead of it just wrote, though the proxy planned both before either ran.

Thread model: the engine thread snapshots and restores; HTTP handlers confirm, abort, pin
and list. One lock guards the slab maps; the slot table is itself thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from anchorcache.ext import ops
from anchorcache.ext.slots import SlotTable
from anchorcache.wire import (
    AnchorHeld,
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    AnchorWritten,
    SnapshotSpec,
    anchor_keys,
)

from ..held_chain import deepest_held_chain
from . import cache_io

log = logging.getLogger("anchorcache.worker")

STAGED_TTL_S = 60.0  # an unconfirmed snapshot of a finished request is dropped after this


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


@dataclass
class _Tip:
    key: bytes | None = None
    depth: int = 0


class AnchorStore:
    def __init__(self, model_id: str, spec: cache_io.CacheSpec, table: SlotTable) -> None:
        self.model_id = model_id
        self.spec = spec
        self.table = table
        self.fault: Callable[[str], None] = lambda where: None
        self._lock = threading.RLock()
        self._live: dict[int, Slab] = {}
        self._slot_of: dict[bytes, int] = {}
        self._staged: dict[int, tuple[Slab, str]] = {}  # slot → (slab, rid)
        self._staged_deadline: dict[int, float] = {}
        self._tips: dict[str, _Tip] = {}  # rid → deepest anchor restored or written so far

    @classmethod
    def create(cls, model: torch.nn.Module, model_id: str, spec: cache_io.CacheSpec, *,
               num_slots: int, capacity_bytes: int, pinned_slots: int) -> AnchorStore:
        table = SlotTable(num_slots, capacity_bytes, slot_base=0, pinned_slots=pinned_slots)
        return cls(model_id, spec, table)

    # ---- engine thread ------------------------------------------------------------------
    def restore(self, model: torch.nn.Module, rid: str, ids: tuple[int, ...],
                plan: AnchorPlan) -> tuple[Any, int, dict[str, Any]]:
        """Restore the verified prefix of `plan.restore`, or the deepest held chain ending at
        a snapshot depth of `plan` if that is deeper; (cache or None, depth, info)."""
        keys = _link_keys(plan, self.model_id, ids)
        chain: list[Slab] = []
        misses: list[dict[str, Any]] = []
        with self._lock:
            prev = _Tip()
            for ref in plan.restore:
                reason = None
                slot = None
                if ref.depth >= len(ids):
                    reason = "covers_prompt"  # at least the last token must be prefilled
                elif keys[ref] != ref.key:
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
            # Late lookup (ext/held_chain.py): a cut this request would snapshot may have
            # been written since the proxy planned it, by the request ahead of it in the
            # queue; restore it instead of prefilling it again.
            late = deepest_held_chain(plan.namespace, self.model_id, ids,
                                      [s.depth for s in plan.snapshot], self._held_locked)
            held: list[AnchorHeld] = []
            if late and late[-1].depth > prev.depth:
                planned = {r.key for r in plan.restore}
                for slab in late:
                    if slab.key in self._slot_of:  # committed: LRU touch and a hit
                        self.table.lookup(slab.key, slab.depth)
                        if slab.key not in planned:  # the proxy may not know it: report it
                            held.append(AnchorHeld(self._slot_of[slab.key], slab.key, slab.depth,
                                                   slab.parent, slab.nbytes, slab.kind))
                chain, prev = late, _Tip(late[-1].key, late[-1].depth)
        info: dict[str, Any] = {"restored": [{"key": s.key.hex(), "depth": s.depth, "kind": s.kind.value}
                                             for s in chain],
                                "restore_miss": misses,
                                "late_lookup": bool(late) and chain is late,
                                "held": held}
        if not chain:
            return None, 0, info
        self.fault("restore")
        depth = chain[-1].depth
        spec = self.spec
        kv_shape = (1, spec.num_kv_heads or 0, depth, spec.head_dim or 0)
        keys_t = [torch.empty(kv_shape, dtype=spec.kv_dtype) for _ in spec.kv_layers]
        values_t = [torch.empty(kv_shape, dtype=spec.kv_dtype) for _ in spec.kv_layers]
        states = [torch.empty(s.shape, dtype=s.dtype) for s in spec.states]
        if keys_t:
            ops.restore_chain([s.kv for s in chain], [(s.start, s.depth) for s in chain],
                              keys_t, values_t, layout="bhtd",
                              state_slab=chain[-1].state if states else None,
                              states=states or None)
        elif states:
            ops.restore_chain([], [], [], [], layout="bhtd", state_slab=chain[-1].state,
                              states=states)
        cache = cache_io.cache_from_tensors(model, keys_t, values_t, states, spec=spec, adopt=True)
        self._tips[rid] = prev
        return cache, depth, info

    def _held_locked(self, key: bytes, depth: int) -> Slab | None:
        """The slab of `key` at `depth` if it may be restored: committed (slot-checked), or
        staged by a request that finished well and awaits the proxy's confirm. Such a slab is
        complete and was keyed by this worker over the prompt it prefilled; confirmation
        decides what the proxy may plan on, not whether the data is right."""
        slot = self._slot_of.get(key)
        if slot is not None and self.table.contains(key, depth):
            slab = self._live.get(slot)
            if slab is not None and slab.key == key and slab.depth == depth:
                return slab
        for slot, (slab, _) in self._staged.items():
            if slab.key == key and slab.depth == depth and slot in self._staged_deadline:
                return slab
        return None

    def snapshot(self, rid: str, cache: Any, ids: tuple[int, ...], depth: int,
                 spec: SnapshotSpec, plan: AnchorPlan) -> AnchorWritten | None:
        """Save K/V rows up to `depth` (and, on recurrent models, the state: the cache must
        then end exactly at `depth`) as a staged anchor of `rid`."""
        key = anchor_keys(plan.namespace, self.model_id, ids, [depth])[depth]
        return self._write(rid, cache, key, depth, spec.kind, spec.region.value)

    def snapshot_response(self, rid: str, cache: Any, full_ids: tuple[int, ...],
                          plan: AnchorPlan) -> AnchorWritten | None:
        depth = len(full_ids)
        key = anchor_keys(plan.namespace, self.model_id, full_ids, [depth])[depth]
        return self._write(rid, cache, key, depth, AnchorKind.RESPONSE, "thick")

    def _write(self, rid: str, cache: Any, key: bytes, depth: int, kind: AnchorKind,
               region: str) -> AnchorWritten | None:
        tip = self._tips.setdefault(rid, _Tip())
        if self.table.contains(key, depth):
            self._tips[rid] = _Tip(key, depth)  # already saved by an earlier request: chain on
            with self._lock:
                held = self._live.get(self._slot_of.get(key, -1))
            if held is None or held.key != key:
                return None
            return AnchorHeld(self._slot_of[key], key, depth, held.parent, held.nbytes, held.kind)
        cache_io.check_snapshot_depth(cache, depth)
        start = tip.depth
        nbytes = self.spec.kv_bytes_per_token * (depth - start) + self.spec.state_bytes
        res = self.table.reserve(key, depth, nbytes, parent=tip.key, region=region)
        if res is None:
            return None
        try:
            self.fault("snapshot")
            kv = None
            if self.spec.kv_layers:
                k, v = cache_io.kv_views(cache)
                kv = ops.snapshot_kv(k, v, (start, depth), layout="bhtd")
            state = None
            if self.spec.states:
                state = ops.snapshot_state(cache_io.state_views(cache), 0)
        except Exception:
            # a failed snapshot costs this anchor only: the request goes on, the old one stays
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

    # ---- HTTP side ----------------------------------------------------------------------
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


def _link_keys(plan: AnchorPlan, model_id: str, ids: tuple[int, ...]) -> dict[AnchorRef, bytes]:
    """Each restore link's key recomputed over `ids`, in the link's own namespace (a shared
    toolset's root) or the plan's."""
    out: dict[AnchorRef, bytes] = {}
    for ns in {r.namespace or plan.namespace for r in plan.restore}:
        links = [r for r in plan.restore if (r.namespace or plan.namespace) == ns]
        keys = anchor_keys(ns, model_id, ids, [r.depth for r in links if r.depth <= len(ids)])
        out.update({r: keys[r.depth] for r in links if r.depth in keys})
    return out
