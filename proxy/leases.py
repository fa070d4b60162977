"""Anchor leases: a client's `cache_control.ttl` kept. Pure bookkeeping, no I/O.

A lease keeps one anchor on one worker at least `ttl_s` seconds after the last request that
wrote or used it, for the tenant whose namespace the anchor's key is in. It is a pin with
an expiry: the anchor life cycle (`lifecycle.py`) pins the anchor when it grants the lease,
and unpins it when the lease expires; until then neither the worker's LRU nor the tenant's
anchor-bytes quota evicts it (a pin protects the anchor's ancestors too). Every later request
of the tenant that restores the anchor, or marks it again, pushes the expiry out (as
Anthropic refreshes a cache entry on each use); a lease never shortens. A new worker epoch
drops the leases of the old one: their anchors went with it.

The worker's pin is one flag per anchor, shared with pinned toolsets (`toolsets.py`): the life
cycle leaves a pinned toolset's anchor pinned when a lease on it expires, and a toolset unpin
leaves a leased anchor pinned, so a key pinned for both reasons stays pinned until both are
gone.

Budget: a lease costs the bytes it protects, its anchor's whole chain (the pin keeps the
ancestors); leases that share ancestors share their cost. A tenant's leases together may
protect at most its anchor-bytes limit, and all leases on a worker at most the lease budget
(`ProxyConfig.lease_budget_bytes`). Past either the lease is refused and the anchor stays
an ordinary one: a request is never refused for it, and a lease never evicts anything.
`fits` / `grant` are the check and the act (no await between them in the caller, so two
requests settling at once cannot both take the last bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

# what Anthropic's `cache_control.ttl` values mean; a mark without one is "5m"
CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}
DEFAULT_CACHE_TTL = "5m"


@dataclass(frozen=True)
class Lease:
    key: bytes
    tenant: str
    epoch: str  # the worker epoch it was granted in
    ttl_s: float  # how far each use pushes the expiry out (the longest asked for)
    expires_at: float  # on the table's clock
    chain: Mapping[bytes, int]  # the keys it protects (its anchor and ancestors) → bytes


class LeaseTable:
    """The leases of one worker's anchors, one per key (a key is one tenant's: it is derived
    in that tenant's namespace)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._leases: dict[bytes, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, key: bytes) -> Lease | None:
        return self._leases.get(key)

    def keys(self) -> set[bytes]:
        return set(self._leases)

    def protected_bytes(self, tenant: str | None = None,
                        extra: Mapping[bytes, int] | None = None) -> int:
        """Bytes the leases of `tenant` (None: every tenant) protect, with `extra`'s."""
        protected = dict(extra or {})
        for lease in self._leases.values():
            if tenant is None or lease.tenant == tenant:
                protected.update(lease.chain)
        return sum(protected.values())

    def fits(self, tenant: str, chain: Mapping[bytes, int], *, tenant_limit: int | None,
             budget: int) -> bool:
        """Whether a new lease protecting `chain` keeps `tenant` within `tenant_limit`
        (None: no limit of its own) and every lease within `budget`."""
        if tenant_limit is not None and self.protected_bytes(tenant, chain) > tenant_limit:
            return False
        return self.protected_bytes(None, chain) <= budget

    def grant(self, key: bytes, tenant: str, epoch: str, chain: Mapping[bytes, int],
              ttl_s: float) -> Lease:
        """A new lease on `key` (checked with `fits` first), or the existing one with its
        expiry pushed out to at least `ttl_s` from now."""
        now, old = self.clock(), self._leases.get(key)
        if old is not None:
            ttl_s = max(ttl_s, old.ttl_s)
            lease = replace(old, ttl_s=ttl_s, expires_at=max(old.expires_at, now + ttl_s))
        else:
            lease = Lease(key, tenant, epoch, ttl_s, now + ttl_s, dict(chain))
        self._leases[key] = lease
        return lease

    def refresh(self, keys: Iterable[bytes], tenant: str) -> int:
        """`tenant` used the anchors `keys` (a restore): push its leases among them out by
        their TTL. Returns how many it had."""
        if not self._leases:  # (most proxies: no lease, and a chain's keys are not read)
            return 0
        now, n = self.clock(), 0
        for key in keys:
            lease = self._leases.get(key)
            if lease is not None and lease.tenant == tenant:
                self._leases[key] = replace(lease, expires_at=max(lease.expires_at,
                                                                  now + lease.ttl_s))
                n += 1
        return n

    def due(self, at: float | None = None) -> list[Lease]:
        """The leases expired by `at` (None: now), soonest first (held until `drop`ped)."""
        now = self.clock() if at is None else at
        return sorted((lease for lease in self._leases.values() if lease.expires_at <= now),
                      key=lambda lease: lease.expires_at)

    def drop(self, key: bytes) -> Lease | None:
        return self._leases.pop(key, None)

    def put_back(self, lease: Lease) -> None:
        """A dropped lease again (its unpin failed), unless its key was leased anew."""
        self._leases.setdefault(lease.key, lease)

    def keep_epoch(self, epoch: str) -> list[Lease]:
        """Drop (and return) every lease granted in another epoch than `epoch`."""
        gone = [lease for lease in self._leases.values() if lease.epoch != epoch]
        for lease in gone:
            del self._leases[lease.key]
        return gone
