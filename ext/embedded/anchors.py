"""The embedded worker's anchor store: `anchorcache.ext.store` over a transformers cache.

The backend-neutral part (slot table use, staging, TTL, tips, confirm/abort, the three-way
restore check) lives in `ext/store.py`; this module supplies the cache access for the
embedded worker's `bhtd` cache: a restore builds a fresh cache from the chain's slabs, a
snapshot copies rows `[start, depth)` (and, on recurrent models, the state at `depth`).

Late lookup (a queued request restores what the request ahead of it just wrote) and the
`held` report live in the store too (`ext/store.py`, `ext/held_chain.py`).

Thread model: the engine thread alone uses the store: it snapshots and restores, and runs
the contract's confirm, abort, pin and list calls queued to it (`backend.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from anchorcache.ext import kernels
from anchorcache.ext.disk_tier import DiskTier
from anchorcache.ext.slots import SlotTable
from anchorcache.ext.store import STAGED_TTL_S, AnchorStore, Slab
from anchorcache.wire import (
    AnchorHeld,
    AnchorKind,
    AnchorPlan,
    AnchorReport,
    AnchorWritten,
    Region,
    SnapshotSpec,
    anchor_keys,
)

from . import cache_io

__all__ = ["STAGED_TTL_S", "AnchorHeld", "EmbeddedAnchors", "Slab", "cache_from_slabs", "capture_slabs"]


class EmbeddedAnchors(AnchorStore):
    """The embedded worker's anchor store: `AnchorStore` over its transformers cache layout."""

    def __init__(self, model_id: str, spec: cache_io.CacheSpec, table: SlotTable, *,
                 disk: DiskTier | None = None) -> None:
        super().__init__(model_id, table, kv_bytes_per_token=spec.kv_bytes_per_token,
                         state_bytes=spec.state_bytes, disk=disk)
        self.spec = spec

    @classmethod
    def create(cls, model: torch.nn.Module, model_id: str, spec: cache_io.CacheSpec, *,
               num_slots: int, capacity_bytes: int, pinned_slots: int,
               disk: DiskTier | None = None) -> EmbeddedAnchors:
        table = SlotTable(num_slots, capacity_bytes, slot_base=0, pinned_slots=pinned_slots)
        return cls(model_id, spec, table, disk=disk)

    # ---- engine thread ------------------------------------------------------------------
    def restore(self, model: torch.nn.Module, rid: str, ids: tuple[int, ...],
                plan: AnchorPlan) -> tuple[Any, int, AnchorReport]:
        """Restore the verified prefix of `plan.restore`; (cache or None, depth, the
        reply's anchor record so far)."""
        return self.restore_chain(rid, ids, plan,
                                  lambda chain: cache_from_slabs(model, self.spec, chain))

    def snapshot(self, rid: str, cache: Any, ids: tuple[int, ...], depth: int,
                 spec: SnapshotSpec, plan: AnchorPlan) -> AnchorWritten | AnchorHeld | None:
        """Save K/V rows up to `depth` (and, on recurrent models, the state: the cache must
        then end exactly at `depth`) as a staged anchor of `rid`."""
        key = anchor_keys(plan.namespace, self.model_id, ids, [depth])[depth]
        return self._save(rid, cache, key, depth, spec.kind, spec.region, ids)

    def snapshot_response(self, rid: str, cache: Any, full_ids: tuple[int, ...],
                          plan: AnchorPlan) -> AnchorWritten | AnchorHeld | None:
        depth = len(full_ids)
        key = anchor_keys(plan.namespace, self.model_id, full_ids, [depth])[depth]
        return self._save(rid, cache, key, depth, AnchorKind.RESPONSE, Region.THICK, full_ids)

    def _save(self, rid: str, cache: Any, key: bytes, depth: int, kind: AnchorKind,
              region: Region, ids: tuple[int, ...]) -> AnchorWritten | AnchorHeld | None:
        # a cache that cannot be snapshot at `depth` is a bug of the caller: raise, uncaught
        # `ids`: the slab keeps its tokens (a disk file is checked against the prompt's)
        return self.write(rid, key, depth, kind, region,
                          lambda start, depth: capture_slabs(self.spec, cache, start, depth),
                          check=lambda: cache_io.check_snapshot_depth(cache, depth), ids=ids)


def capture_slabs(spec: cache_io.CacheSpec, cache: Any, start: int, depth: int
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(KV slab of rows `[start, depth)`, state slab) of `cache`, whose states must be at
    `depth`: the slabs docs/ext.md describes, the same the SGLang worker writes (the states
    through `cache_io.slab_state_views`). None where the model has no such layers."""
    kv = None
    if spec.kv_layers:
        k, v = cache_io.kv_views(cache)
        kv = kernels.snapshot_kv(k, v, (start, depth), layout="bhtd")
    state = None
    if spec.states:
        state = kernels.snapshot_state(cache_io.slab_state_views(spec, cache_io.state_views(cache)), 0)
    return kv, state


def cache_from_slabs(model: torch.nn.Module, spec: cache_io.CacheSpec,
                     chain: tuple[Slab, ...] | list[Slab]) -> Any:
    """A fresh cache holding a root → leaf chain's rows and the leaf's state (the oldest
    conv column, which no later step reads, as zeros). Raises RuntimeError (`kernels`) on
    slabs of the wrong size or dtype."""
    depth = chain[-1].depth
    kv_shape = (1, spec.num_kv_heads or 0, depth, spec.head_dim or 0)
    keys_t = [torch.empty(kv_shape, dtype=spec.kv_dtype) for _ in spec.kv_layers]
    values_t = [torch.empty(kv_shape, dtype=spec.kv_dtype) for _ in spec.kv_layers]
    states = [torch.zeros(s.shape, dtype=s.dtype) for s in spec.states]
    slabs = [s.kv for s in chain if s.kv is not None] if keys_t else []
    rows = [(s.start, s.depth) for s in chain] if keys_t else []
    kernels.restore_chain(slabs, rows, keys_t, values_t, layout="bhtd",
                      state_slab=chain[-1].state if states else None,
                      states=cache_io.slab_state_views(spec, states) or None)
    return cache_io.cache_from_tensors(model, keys_t, values_t, states, spec=spec, adopt=True)
