"""The proxy's one frozen config; the CLI fills it from flags and ANCHORCACHE_* variables."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from anchorcache.paths import default_state_dir
from anchorcache.state.records import Quotas


@dataclass(frozen=True)
class ProxyConfig:
    worker_url: str = "http://127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 8000
    anchors: bool = True  # plan/restore/snapshot anchors; off: same chunking, no anchor traffic
    adapter: str = "auto"  # splitter adapter name (see `anchorcache split --help`)
    # Sort tools and schema keys before rendering (more sharing between clients that send one
    # toolset in different orders; the prompt then differs from the template's). Off: the
    # client's order, byte-identical to the model's own template. See docs/splitter.md.
    canonical_tools: bool = False
    max_body_bytes: int = 32 << 20
    default_max_tokens: int = 1024
    worker_timeout_s: float = 600.0
    metrics_max_tenants: int = 100  # distinct tenant label values; later tenants → "other"
    metrics_worker_timeout_s: float = 1.0  # /metrics waits this long for the worker's stats
    state_dir: str = str(default_state_dir())  # the ledger's directory
    admin_token: str | None = None  # None: the admin API is off
    anonymous: bool | None = None  # None: on when listening on loopback, off otherwise
    # An unknown API key is a 401 even while no tenant exists. Off: with anonymous access on
    # and no tenant yet, any key (`EMPTY`, `sk-no-key`) runs as the anonymous tenant.
    strict_keys: bool = False
    default_quotas: Quotas = field(default_factory=lambda: Quotas(
        max_pinned_toolsets=8, max_anchor_bytes=None, max_in_flight=64))
    pin_budget_bytes: int = 1 << 30  # all pinned toolsets' anchors together
    single_flight_wait_s: float = 60.0  # how long a request waits for another one's new toolset
    max_pending_splits: int = 64  # requests waiting for the split thread; more get 503 overloaded

    def __post_init__(self) -> None:
        if not self.worker_url.startswith(("http://", "https://")):
            raise ValueError(f"worker_url must be an http(s) URL, not {self.worker_url!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, not {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.max_pending_splits < 1:
            raise ValueError("max_pending_splits must be positive")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be positive")
        if self.metrics_max_tenants < 1:
            raise ValueError("metrics_max_tenants must be positive")
        if not 0 < self.metrics_worker_timeout_s <= 60:
            raise ValueError("metrics_worker_timeout_s must be in (0, 60]")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        if self.pin_budget_bytes < 0:
            raise ValueError("pin_budget_bytes must be >= 0")

    @property
    def anonymous_access(self) -> bool:
        if self.anonymous is not None:
            return self.anonymous
        return is_loopback(self.host)

    @property
    def placeholder_keys(self) -> bool:
        """Whether any key is the anonymous tenant until the first tenant is created."""
        return self.anonymous_access and not self.strict_keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
