"""Toolset anchors, and the anchor-bytes quota that spares the pinned ones.

A toolset (the leading system/developer messages and tool schemas a tenant's requests start
with) is an instruction anchor in the tenant's namespace and, when an admin shares it, a copy
in the shared namespace. `ToolsetAnchors` warms both (each warm-up a request through the
anchor life cycle, `lifecycle.py`), pins and unpins them on the worker, re-warms the pinned
ones at proxy start and after a worker restart, and keeps a tenant under its anchor-bytes
quota by evicting its least recently hit anchors, never a pinned toolset's (nor the tool
anchors it chains from). A tenant without a byte quota of its own may hold a share of each
worker's anchor memory (`ProxyConfig.tenant_anchor_share`, half by default), so no one
tenant's traffic evicts every other tenant's anchors.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from anchorcache.state.records import AnchorStatus, Toolset
from anchorcache.wire import engine_cache_key

from .anchor_index import AnchorRecord
from .errors import ApiError

if TYPE_CHECKING:  # the life cycle builds this over itself
    from .lifecycle import AnchorLifecycle, Caller

log = logging.getLogger("anchorcache.proxy")

SHARED_TENANT = "@shared"  # holds the shared-toolset namespace's secret salt; not a real tenant


class ToolsetAnchors:
    def __init__(self, lifecycle: AnchorLifecycle) -> None:
        self.lifecycle = lifecycle
        self._capacity: tuple[str, int] | None = None  # (epoch, the worker's anchor bytes)

    def keys(self, ts: Toolset) -> list[tuple[str, bytes, bytes]]:
        """(tenant, namespace, key) of a toolset's anchors: its own, and the shared one."""
        out = [(ts.tenant, ts.namespace, ts.key)]
        if ts.shared:
            shared = self.lifecycle.shared_namespace
            out.append((SHARED_TENANT, shared, self.lifecycle.key(shared, ts.input_ids)))
        return out

    async def ensure(self, ts: Toolset) -> AnchorRecord:
        """Warm a toolset's anchors (the shared copy too), pinning them if it is pinned."""
        first: AnchorRecord | None = None
        for tenant, ns, key in self.keys(ts):
            rec = await self.lifecycle.warm(tenant, ns, ts.input_ids)
            # the tenant's own copy may stay on the device, where its requests find it (the
            # worker's cache is keyed by namespace); no request runs in the shared namespace,
            # so the shared copy is pinned in the host tier only
            cache_key = engine_cache_key(ns) if tenant != SHARED_TENANT else None
            if ts.pinned and not await self.lifecycle.worker.pin(key, cache_key):
                raise ApiError("worker_error", "the worker refused to pin the toolset anchor")
            first = first or rec
        assert first is not None
        return first

    async def unpin(self, ts: Toolset) -> None:
        for _, _, key in self.keys(ts):
            await self.lifecycle.worker.unpin(key)

    async def rewarm_pinned(self) -> None:
        for ts in self.lifecycle.ledger.toolsets(pinned=True):
            try:
                await self.ensure(ts)
            except ApiError as e:
                log.warning("re-warming pinned toolset %s failed: %s", ts.toolset, e.message)
                return

    async def enforce_quota(self, caller: Caller) -> None:
        """Keep a tenant under its anchor-bytes quota: evict its least recently hit anchors
        (never a pinned toolset's) until it fits. A worker failure is logged, not raised."""
        try:
            await self._enforce_bytes(caller)
        except ApiError as e:
            log.warning("could not enforce the anchor-bytes quota of %s: %s",
                        caller.tenant, e.message)

    async def _limit(self, caller: Caller) -> int | None:
        """The tenant's anchor bytes on this worker: its own quota, else its share of the
        worker's anchor memory (`tenant_anchor_share`; 1: no default limit)."""
        if caller.max_anchor_bytes is not None:
            return caller.max_anchor_bytes
        share = self.lifecycle.tenant_anchor_share
        if share >= 1:
            return None
        if self._capacity is None or self._capacity[0] != self.lifecycle.epoch:
            capacity = int((await self.lifecycle.worker.stats()).get("bytes_capacity") or 0)
            self._capacity = (self.lifecycle.epoch, capacity)
        return int(share * self._capacity[1]) or None

    async def _enforce_bytes(self, caller: Caller) -> None:
        lc = self.lifecycle
        limit = await self._limit(caller)
        if limit is None:
            return
        used = lc.ledger.anchor_bytes(caller.tenant, lc.worker_id, lc.epoch)
        if used <= limit:
            return
        rows = lc.ledger.anchors(worker=lc.worker_id, epoch=lc.epoch, tenant=caller.tenant,
                                 status=AnchorStatus.COMMITTED)
        # a pinned toolset's anchor and its ancestors (its tool anchors): the pin needs the
        # whole chain
        parent = {r.key: r.parent for r in rows}
        pinned: set[bytes] = set()
        for ts in lc.ledger.toolsets(caller.tenant, pinned=True):
            for _, _, key in self.keys(ts):
                cur: bytes | None = key
                while cur is not None and cur not in pinned:
                    pinned.add(cur)
                    cur = parent.get(cur)
        rows.sort(key=lambda r: (r.last_hit or r.created_at, -r.depth))
        for row in rows:
            if used <= limit:
                break
            if row.key not in pinned:
                await lc.evict(row.key)
                used -= row.nbytes
