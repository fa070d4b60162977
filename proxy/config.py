"""The proxy's one frozen config; the CLI fills it from flags and ANCHORCACHE_* variables."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from anchorcache.defaults import LEASE_BUDGET_BYTES, PIN_BUDGET_BYTES, TOOL_ANCHOR_GAP_TOKENS
from anchorcache.paths import default_state_dir
from anchorcache.state.records import Quotas
from anchorcache.wire import check_secret

ROUTES = ("affinity", "least_load", "round_robin")  # how a request picks a worker (targets.py)
# what a max_tokens beyond the room the prompt leaves in the context gets (pipeline.py)
MAX_TOKENS_POLICIES = ("clamp", "refuse")


@dataclass(frozen=True)
class ProxyConfig:
    # the workers (targets) behind the proxy; see proxy/targets.py for routing and failover
    worker_urls: tuple[str, ...] = ("http://127.0.0.1:8001",)
    route: str = "affinity"  # affinity | least_load | round_robin
    route_max_imbalance: int = 2  # affinity yields to a target this many requests less loaded
    health_interval_s: float = 2.0  # how often every target's /health is asked
    drain_timeout_s: float = 600.0  # how long removing a worker waits for its requests
    host: str = "127.0.0.1"
    port: int = 8000
    anchors: bool = True  # plan/restore/snapshot anchors; off: same chunking, no anchor traffic
    adapter: str = "auto"  # splitter adapter name (see `anchorcache split --help`)
    # Sort tools and schema keys before rendering (more sharing between clients that send one
    # toolset in different orders; the prompt then differs from the template's). Off: the
    # client's order, byte-identical to the model's own template. See docs/splitter.md.
    canonical_tools: bool = False
    # tool anchors inside the instruction prefix at least this many tokens apart (0: none),
    # so toolsets that share their first tools share that prefix (proxy/planner.py)
    tool_anchor_gap: int = TOOL_ANCHOR_GAP_TOKENS
    max_body_bytes: int = 32 << 20
    default_max_tokens: int = 1024
    # max_tokens beyond the room the prompt leaves: "clamp" it to that room (the reply ends
    # with finish_reason "length" if it reaches it) or "refuse" it (400)
    max_tokens_policy: str = "clamp"
    # more names the model answers to besides its own id and "default" (vLLM's
    # --served-model-name): an agent CLI that sends its vendor's model names (Claude Code's
    # "claude-sonnet-...") works unchanged; "*" answers to any name
    served_model_names: tuple[str, ...] = ()
    worker_timeout_s: float = 600.0
    metrics_max_tenants: int = 100  # distinct tenant label values; later tenants → "other"
    metrics_worker_timeout_s: float = 1.0  # /metrics waits this long for the worker's stats
    state_dir: str = str(default_state_dir())  # the ledger's directory
    admin_token: str | None = None  # None: the admin API is off
    # the secret the workers require (`Authorization: Bearer` on every call but /health)
    worker_secret: str | None = None
    anonymous: bool | None = None  # None: on when listening on loopback, off otherwise
    # An unknown API key is a 401 even while no tenant exists. Off: with anonymous access on
    # and no tenant yet, any key (`EMPTY`, `sk-no-key`) runs as the anonymous tenant.
    strict_keys: bool = False
    default_quotas: Quotas = field(default_factory=lambda: Quotas(
        max_pinned_toolsets=8, max_anchor_bytes=None, max_in_flight=64))
    pin_budget_bytes: int = PIN_BUDGET_BYTES  # all pinned toolsets' anchors together
    # what all cache_control TTL leases on a worker may protect together (and at most half
    # of its anchor memory); past it a lease is refused, the anchor stays (proxy/leases.py)
    lease_budget_bytes: int = LEASE_BUDGET_BYTES
    # a tenant without a byte quota of its own holds at most this share of each worker's
    # anchor memory (1: no limit), so one tenant's traffic cannot evict everyone else's
    tenant_anchor_share: float = 0.5
    ledger_retention_s: float = 7 * 24 * 3600.0  # dead ledger rows are kept this long
    housekeeping_interval_s: float = 3600.0
    # how long a stored Responses API response (`store`) can be continued or read back
    response_ttl_s: float = 24 * 3600.0
    # stored responses' bytes per tenant: past it the tenant's oldest are deleted (the one
    # just stored is kept whatever its size)
    response_store_bytes: int = 256 << 20
    single_flight_wait_s: float = 60.0  # how long a request waits for another one's new toolset
    # requests waiting for the split threads (one tenant: half of them); more get 503 overloaded
    max_pending_splits: int = 64
    # processes of this proxy on one port and one ledger (proxy/processes.py), and which one
    # this is; `process_restarts`: how often this one was restarted (see `leads_processes`)
    processes: int = 1
    process_index: int = 0
    process_restarts: int = 0
    # the processes' prometheus-client multiprocess directory (None: one process)
    metrics_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.worker_urls:
            raise ValueError("at least one worker URL is needed")
        for url in self.worker_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a worker URL must be http(s), not {url!r}")
        if len({u.rstrip("/") for u in self.worker_urls}) != len(self.worker_urls):
            raise ValueError("a worker URL is given twice")
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, not {self.route!r}")
        if self.route_max_imbalance < 0:
            raise ValueError("route_max_imbalance must be >= 0")
        if not 0 < self.health_interval_s <= 3600:
            raise ValueError("health_interval_s must be in (0, 3600]")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, not {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.max_pending_splits < 1:
            raise ValueError("max_pending_splits must be positive")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be positive")
        if self.max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ValueError(f"max_tokens_policy must be one of {', '.join(MAX_TOKENS_POLICIES)}, "
                             f"not {self.max_tokens_policy!r}")
        if self.metrics_max_tenants < 1:
            raise ValueError("metrics_max_tenants must be positive")
        if not 0 < self.metrics_worker_timeout_s <= 60:
            raise ValueError("metrics_worker_timeout_s must be in (0, 60]")
        check_secret(self.admin_token, "admin token")
        check_secret(self.worker_secret, "worker secret")
        if self.tool_anchor_gap < 0:
            raise ValueError("tool_anchor_gap must be >= 0")
        if self.ledger_retention_s < 0 or self.housekeeping_interval_s <= 0:
            raise ValueError("ledger_retention_s must be >= 0, housekeeping_interval_s > 0")
        if self.response_ttl_s <= 0:
            raise ValueError("response_ttl_s must be positive")
        if self.response_store_bytes < 1:
            raise ValueError("response_store_bytes must be positive")
        if not 0 < self.tenant_anchor_share <= 1:
            raise ValueError("tenant_anchor_share must be in (0, 1]")
        if self.pin_budget_bytes < 0:
            raise ValueError("pin_budget_bytes must be >= 0")
        if self.lease_budget_bytes < 0:
            raise ValueError("lease_budget_bytes must be >= 0")
        if self.processes < 1 or not 0 <= self.process_index < self.processes:
            raise ValueError("processes must be >= 1 (process_index in 0..processes-1)")

    @property
    def leads_processes(self) -> bool:
        """Whether this process cleans up after an earlier proxy at start (unpins the leases
        it left pinned): the only one, or the first of several at the proxy's start (later,
        a pinned anchor may be a sibling's lease)."""
        return self.process_index == 0 and self.process_restarts == 0

    @property
    def process_lease_budget_bytes(self) -> int:
        """This process's part of `lease_budget_bytes`: leases are kept per process, so each
        of several keeps to an equal share and all together to the whole."""
        return self.lease_budget_bytes // self.processes

    @property
    def worker_url(self) -> str:
        """The first worker (the one `anchorcache serve` supervises)."""
        return self.worker_urls[0]

    @property
    def anonymous_access(self) -> bool | str:
        """Who may call without a key: everyone (True), nobody (False), or by default, when
        listening on loopback, callers on this machine only ("local", proxy/tenants.py)."""
        if self.anonymous is not None:
            return self.anonymous
        return "local" if is_loopback(self.host) else False

    @property
    def placeholder_keys(self) -> bool:
        """Whether any key is the anonymous tenant until the first tenant is created (for a
        caller with anonymous access)."""
        return self.anonymous_access is not False and not self.strict_keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
