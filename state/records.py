"""Records the ledger hands out (frozen, parsed once at the SQLite edge).

They live here, not in the proxy, because `state/` never imports `proxy/`; the proxy and
the admin API use them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class AnchorStatus(str, Enum):
    RESERVED = "reserved"  # the worker wrote it into a reserved slot; not visible yet
    COMMITTED = "committed"  # the worker acknowledged it (confirm, or reported it held)
    ABORTED = "aborted"  # the reservation was dropped (request failed, confirm refused)
    EVICTED = "evicted"  # the worker reported it evicted, or no longer lists it
    LOST = "lost"  # its worker epoch ended (worker restart)


class ReservationOutcome(str, Enum):
    OPEN = "open"
    CONFIRMED = "confirmed"  # the request succeeded and its snapshots were confirmed
    ABORTED = "aborted"  # the request failed or was cancelled; the worker dropped its snapshots
    ABANDONED = "abandoned"  # closed by reconcile (proxy restart, worker epoch change)


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits; None: unlimited (the proxy's defaults apply at creation)."""

    max_pinned_toolsets: int | None = None
    max_anchor_bytes: int | None = None
    max_in_flight: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"max_pinned_toolsets": self.max_pinned_toolsets,
                "max_anchor_bytes": self.max_anchor_bytes, "max_in_flight": self.max_in_flight}


@dataclass(frozen=True)
class Tenant:
    name: str
    salt: bytes  # server-side secret mixed into every anchor key of the tenant; never shown
    quotas: Quotas
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "quotas": self.quotas.to_json(), "created_at": self.created_at}


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    tenant: str
    created_at: float
    revoked_at: float | None

    def to_json(self) -> dict[str, Any]:
        return {"key_id": self.key_id, "tenant": self.tenant, "created_at": self.created_at,
                "revoked": self.revoked_at is not None}


@dataclass(frozen=True)
class Toolset:
    """A tenant's leading instructions + tools, named by its instruction anchor."""

    toolset: str  # id: the instruction anchor key, hex
    tenant: str
    namespace: bytes  # the namespace its anchor key was derived in
    depth: int
    input_ids: tuple[int, ...]  # the instruction prefix, to re-warm it after a worker restart
    pinned: bool
    shared: bool
    created_at: float

    @property
    def key(self) -> bytes:
        return bytes.fromhex(self.toolset)

    def to_json(self) -> dict[str, Any]:
        return {"toolset": self.toolset, "tenant": self.tenant, "depth": self.depth,
                "pinned": self.pinned, "shared": self.shared, "created_at": self.created_at}


@dataclass(frozen=True)
class AnchorRow:
    key: bytes
    depth: int
    parent: bytes | None
    namespace: bytes
    tenant: str
    worker: str
    epoch: str
    slot: int | None  # None: on the worker's disk tier only
    nbytes: int
    kind: str
    status: AnchorStatus
    hits: int
    last_hit: float | None
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key.hex(), "depth": self.depth,
                "parent": self.parent.hex() if self.parent else None, "tenant": self.tenant,
                "worker": self.worker, "epoch": self.epoch, "slot": self.slot,
                "nbytes": self.nbytes, "kind": self.kind, "status": self.status.value,
                "hits": self.hits, "last_hit": self.last_hit, "created_at": self.created_at}


@dataclass(frozen=True)
class NewAnchor:
    """An anchor the worker reported for a request (written into a slot, or already held)."""

    key: bytes
    depth: int
    parent: bytes | None
    slot: int
    nbytes: int
    kind: str


@dataclass(frozen=True)
class HeldSlot:
    """One committed entry of the worker's slot listing, as reconcile needs it (`slot`
    None: an anchor only its disk tier holds)."""

    slot: int | None
    key: bytes
    depth: int
    parent: bytes | None
    nbytes: int


@dataclass(frozen=True)
class ReconcileReport:
    worker: str
    epoch: str
    kept: int  # committed anchors the worker still holds
    adopted: int  # reserved anchors the worker holds committed (confirm reply lost)
    lost: int  # anchors of an older epoch
    evicted: int  # committed anchors of this epoch the worker no longer holds
    aborted: int  # reserved anchors the worker does not hold committed
    reservations_closed: int
    stale_reserved_slots: tuple[int, ...]  # slots to abort on the worker (staged, orphaned)
    # anchors of an earlier epoch or another worker (its disk tier, a shared directory) that
    # the worker lists under this epoch: committed again for the tenant they were recorded for
    recovered: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.worker, "epoch": self.epoch, "kept": self.kept,
                "adopted": self.adopted, "lost": self.lost, "evicted": self.evicted,
                "aborted": self.aborted, "reservations_closed": self.reservations_closed,
                "recovered": self.recovered}
