"""Toolset anchors, and the anchor-bytes quota that spares the pinned ones.

A toolset (the leading system/developer messages and tool schemas a tenant's requests start
with) is an instruction anchor in the tenant's namespace and, when an admin shares it, a copy
in the shared namespace. `ToolsetAnchors` warms both (each warm-up a request through the
anchor life cycle, `lifecycle.py`), pins and unpins them on the worker, re-warms the pinned
ones at proxy start and after a worker restart (one whose anchors reconcile recovered from the
worker's disk tier is pinned from there, which loads it, rather than prefilled), and keeps a
tenant under its anchor-bytes quota by evicting its least recently hit anchors, never a pinned
toolset's (nor the tool anchors it chains from), nor a leased one's (`leases.py`: the anchors
a client's `cache_control` keeps for a while, and their chains). A tenant without a byte
quota of its own may hold a share of each worker's anchor memory
(`ProxyConfig.tenant_anchor_share`, half by default), so no one tenant's traffic evicts
every other tenant's anchors. A leased anchor shares the worker's pin with a toolset's: an
unpinned toolset's anchor that is leased stays pinned (the lease's expiry unpins it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Set

from anchorcache.state.ledger import Ledger
from anchorcache.state.records import AnchorStatus, Toolset
from anchorcache.wire import engine_cache_key

from .anchor_index import AnchorRecord
from .errors import ApiError
from .worker_client import WorkerClient

log = logging.getLogger("anchorcache.proxy")

SHARED_TENANT = "@shared"  # holds the shared-toolset namespace's secret salt; not a real tenant


class ToolsetAnchors:
    """The toolsets of one worker. The life cycle that owns the worker's anchors builds it
    and hands it the calls it needs from there: `epoch()` (the worker's current epoch),
    `key(namespace, ids)` (an instruction prefix's anchor key), `warm(tenant, namespace,
    ids)` (make that prefix a committed anchor), `evict(key)` and `leased()` (the keys
    leased now); it reads the ledger and asks the worker to pin, unpin and report its
    capacity, and owns nothing else."""

    def __init__(self, worker: WorkerClient, ledger: Ledger, *, worker_id: str,
                 shared_namespace: bytes, tenant_anchor_share: float,
                 epoch: Callable[[], str],
                 key: Callable[[bytes, tuple[int, ...]], bytes],
                 warm: Callable[[str, bytes, tuple[int, ...]], Awaitable[AnchorRecord]],
                 evict: Callable[[bytes], Awaitable[bool]],
                 leased: Callable[[], Set[bytes]] = frozenset) -> None:
        self.worker = worker
        self.ledger = ledger
        self.worker_id = worker_id
        self.shared_namespace = shared_namespace
        self.tenant_anchor_share = tenant_anchor_share  # of the worker's bytes, per tenant
        self._epoch = epoch
        self._key = key
        self._warm = warm
        self._evict = evict
        self._leased = leased
        self._capacity: tuple[str, int] | None = None  # (epoch, the worker's anchor bytes)

    def keys(self, ts: Toolset) -> list[tuple[str, bytes, bytes]]:
        """(tenant, namespace, key) of a toolset's anchors: its own, and the shared one."""
        out = [(ts.tenant, ts.namespace, ts.key)]
        if ts.shared:
            shared = self.shared_namespace
            out.append((SHARED_TENANT, shared, self._key(shared, ts.input_ids)))
        return out

    async def ensure(self, ts: Toolset) -> AnchorRecord:
        """Warm a toolset's anchors (the shared copy too), pinning them if it is pinned."""
        first: AnchorRecord | None = None
        for tenant, ns, key in self.keys(ts):
            rec = await self._warm(tenant, ns, ts.input_ids)
            # the tenant's own copy may stay on the device, where its requests find it (the
            # worker's cache is keyed by namespace); no request runs in the shared namespace,
            # so the shared copy is pinned in the host tier only
            cache_key = engine_cache_key(ns) if tenant != SHARED_TENANT else None
            pinned = not ts.pinned or await self.worker.pin(key, cache_key)
            if not pinned and rec.slot is None:
                # recovered from the worker's disk tier (reconcile), whose pin loads it from
                # there; its file did not load (damaged, gone): prefill it after all
                await self._evict(key)
                rec = await self._warm(tenant, ns, ts.input_ids)
                pinned = await self.worker.pin(key, cache_key)
            if not pinned:
                raise ApiError("worker_error", "the worker refused to pin the toolset anchor")
            first = first or rec
        assert first is not None
        return first

    def pinned_keys(self) -> set[bytes]:
        """The keys of every pinned toolset's anchors (the shared copies too)."""
        return {key for ts in self.ledger.toolsets(pinned=True) for _, _, key in self.keys(ts)}

    async def unpin(self, ts: Toolset) -> None:
        """Unpin a toolset's anchors, but not a leased one (its lease's expiry does)."""
        leased = self._leased()
        for _, _, key in self.keys(ts):
            if key not in leased:
                await self.worker.unpin(key)

    async def rewarm_pinned(self) -> None:
        for ts in self.ledger.toolsets(pinned=True):
            try:
                await self.ensure(ts)
            except ApiError as e:
                log.warning("re-warming pinned toolset %s failed: %s", ts.toolset, e.message)
                return

    async def enforce_quota(self, tenant: str, max_anchor_bytes: int | None) -> None:
        """Keep `tenant` under its anchor-bytes quota (`max_anchor_bytes`, its own; None: its
        share of the worker's): evict its least recently hit anchors (never a pinned
        toolset's) until it fits. A worker failure is logged, not raised."""
        try:
            await self._enforce_bytes(tenant, max_anchor_bytes)
        except ApiError as e:
            log.warning("could not enforce the anchor-bytes quota of %s: %s", tenant, e.message)

    async def limit(self, max_anchor_bytes: int | None) -> int | None:
        """A tenant's anchor bytes on this worker: its own quota, else its share of the
        worker's anchor memory (`tenant_anchor_share`; 1: no default limit)."""
        if max_anchor_bytes is not None:
            return max_anchor_bytes
        share = self.tenant_anchor_share
        if share >= 1:
            return None
        return int(share * (await self.capacity() or 0)) or None

    async def capacity(self) -> int | None:
        """The worker's anchor memory in bytes (None: it does not say), asked once an epoch."""
        epoch = self._epoch()
        if self._capacity is None or self._capacity[0] != epoch:
            capacity = int((await self.worker.stats()).get("bytes_capacity") or 0)
            self._capacity = (epoch, capacity)
        return self._capacity[1] or None

    async def _enforce_bytes(self, tenant: str, max_anchor_bytes: int | None) -> None:
        limit = await self.limit(max_anchor_bytes)
        if limit is None:
            return
        epoch = self._epoch()
        used = self.ledger.anchor_bytes(tenant, self.worker_id, epoch)
        if used <= limit:
            return
        rows = self.ledger.anchors(worker=self.worker_id, epoch=epoch, tenant=tenant,
                                   status=AnchorStatus.COMMITTED)
        # a pinned toolset's anchor, a leased one, and their ancestors (a toolset's tool
        # anchors): the pin needs the whole chain
        parent = {r.key: r.parent for r in rows}
        pinned: set[bytes] = set()
        seeds = {key for ts in self.ledger.toolsets(tenant, pinned=True)
                 for _, _, key in self.keys(ts)} | set(self._leased())
        for key in seeds:
            cur: bytes | None = key
            while cur is not None and cur not in pinned:
                pinned.add(cur)
                cur = parent.get(cur)
        rows.sort(key=lambda r: (r.last_hit or r.created_at, -r.depth))
        for row in rows:
            if used <= limit:
                break
            if row.key not in pinned:
                await self._evict(row.key)
                used -= row.nbytes
