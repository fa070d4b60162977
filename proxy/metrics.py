"""Prometheus metrics of the proxy, on a registry held by the app (never the global default).

Three sources feed it:
- `metrics_middleware` (outermost): every request by method, route template and status.
- the request pipeline, once per request as it ends (`Completion._observe`): `record_ttft`,
  `record_completion_tokens` (every choice's, as the reply's usage counts them),
  `record_generation` (the worker's prefill, restore and snapshot times, anchor hits by
  kind, misses by kind and reason, prompt tokens prefilled vs restored, snapshot and
  restore bytes) and `record_reservations` (how the request's reserved snapshot slots
  ended: confirmed, or aborted and why).
- each worker's anchor life cycle, as its `cache_control` leases change: `record_lease`.
- `WorkerCollector`, at scrape time: every worker's own `/anchor/stats` counters (label
  `worker`; its disk tier's block as `anchorcache_worker_disk_*`: bytes, files, budget,
  writes, loads, skips, evictions, imports, enabled), fetched at once with a short timeout so a dead or hung worker costs one gauge
  (`anchorcache_worker_up` 0), never the whole `/metrics` reply.

Several processes of one proxy (`--processes`, proxy/processes.py) write their counters and
histograms to files in one directory (prometheus-client's multiprocess mode: its parent sets
`PROMETHEUS_MULTIPROC_DIR` before any child imports prometheus-client, and gives the same
directory as `ProxyConfig.metrics_dir`); whichever process answers `/metrics` sums them all
(`MultiProcessCollector`), so one scrape shows the whole proxy. The workers' own numbers
come from the workers, the same whichever process asks; `anchorcache_worker_load` and
`anchorcache_worker_routed` are the answering process's view. There are no prometheus
`Gauge`s of the proxy's own (they would need a `multiprocess_mode`).

Per-tenant series take their label from `TenantLabels`, the one place that maps a tenant id
to a label: the first `max_tenants` distinct ids pass, later ones become "other", so a flood
of API keys cannot grow the series without bound.
"""

from __future__ import annotations

import asyncio
import collections
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from anchorcache.wire import GenerateMeta

from .planner import Plan

OTHER = "other"
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
# seconds: a cached agent turn on a GPU is milliseconds, a cold 100k-token prefill on CPU minutes
_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0)
# the worker's cumulative slot-table counters; every other number in /anchor/stats is a gauge
_WORKER_COUNTERS = frozenset({"hits", "misses", "stale_evictions", "reservations", "confirms",
                              "aborts", "evictions", "disk_writes", "disk_loads", "disk_skips",
                              "disk_evictions", "disk_imports"})


class TenantLabels:
    """Tenant id → label value, with at most `max_tenants` distinct values besides "other".

    First come, first kept: a tenant that got its own label keeps it for the life of the
    process (a label that changed meaning between scrapes would corrupt rates).
    """

    def __init__(self, max_tenants: int) -> None:
        if max_tenants < 1:
            raise ValueError("max_tenants must be positive")
        self.max_tenants = max_tenants
        self._known: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._known:
            return tenant
        if len(self._known) < self.max_tenants:
            self._known.add(tenant)
            return tenant
        return OTHER


class WorkerView(Protocol):
    """What the collector reads of a target (`proxy/targets.py`)."""

    @property
    def name(self) -> str: ...
    @property
    def id(self) -> str: ...  # its URL
    @property
    def serving(self) -> bool: ...
    @property
    def load(self) -> int: ...
    @property
    def routed(self) -> int: ...


class WorkerCollector:
    """Every worker's `/anchor/stats` as `anchorcache_worker_*` metrics, labelled `worker`
    (its name, w0, w1...), with the proxy's view of it: `anchorcache_worker_healthy`,
    `anchorcache_worker_load` and `anchorcache_worker_routed`.

    `refresh` (async, before each scrape) fetches the numbers; `collect` (sync, called by the
    registry right after, with no await in between) turns them into metric families.
    """

    def __init__(self) -> None:
        self._stats: dict[str, dict[str, float] | None] = {}
        self._view: dict[str, tuple[bool, int, int]] = {}  # worker → healthy, load, routed

    async def refresh(self, session: aiohttp.ClientSession, targets: Sequence[WorkerView],
                      timeout_s: float) -> None:
        stats = await asyncio.gather(*(self._fetch(session, t.id, timeout_s) for t in targets))
        self._stats = {t.name: s for t, s in zip(targets, stats, strict=True)}
        self._view = {t.name: (t.serving, t.load, t.routed) for t in targets}

    @staticmethod
    async def _fetch(session: aiohttp.ClientSession, base_url: str,
                     timeout_s: float) -> dict[str, float] | None:
        """The numbers of `/anchor/stats`, or None if the worker did not answer in time."""
        try:
            async with session.get(base_url.rstrip("/") + "/anchor/stats",
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return None
                data = orjson.loads(await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError):
            return None
        if not isinstance(data, dict):
            return None
        out = {k: float(v) for k, v in data.items()
               if isinstance(v, int | float) and not isinstance(v, bool)}
        disk = data.get("disk")  # the disk tier's block (docs/disk-tier.md), as `disk_*`
        if isinstance(disk, dict):
            out.update({f"disk_{k}": float(v) for k, v in disk.items()
                        if isinstance(v, int | float)})  # `enabled` (a bool) as 1 or 0
        return out

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("anchorcache_worker_up",
                               "1 if the worker answered /anchor/stats at this scrape, else 0",
                               labels=["worker"])
        healthy = GaugeMetricFamily("anchorcache_worker_healthy",
                                    "1 while the proxy routes to the worker, else 0",
                                    labels=["worker"])
        load = GaugeMetricFamily("anchorcache_worker_load",
                                 "the worker's load as routing sees it (requests)",
                                 labels=["worker"])
        routed = CounterMetricFamily("anchorcache_worker_routed",
                                     "requests routed to the worker", labels=["worker"])
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for worker, stats in sorted(self._stats.items()):
            up.add_metric([worker], 0 if stats is None else 1)
            ok, n, r = self._view[worker]
            healthy.add_metric([worker], int(ok))
            load.add_metric([worker], n)
            routed.add_metric([worker], r)
            for name, value in sorted((stats or {}).items()):
                family = families.get(name)
                if family is None:
                    family = families[name] = (
                        CounterMetricFamily(f"anchorcache_worker_{name}",
                                            f"worker anchor store: {name} (cumulative)",
                                            labels=["worker"])
                        if name in _WORKER_COUNTERS else
                        GaugeMetricFamily(f"anchorcache_worker_{name}",
                                          f"worker anchor store: {name}", labels=["worker"]))
                family.add_metric([worker], value)
        yield from (up, healthy, load, routed)
        yield from (families[k] for k in sorted(families))


class ProxyMetrics:
    """Every metric of one proxy app, on its own registry."""

    def __init__(self, *, max_tenants: int = 100, worker_timeout_s: float = 1.0,
                 multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: one of several processes, whose metrics files are there;
        `scrape` then reads every process's."""
        self.registry = CollectorRegistry()
        self.tenant = TenantLabels(max_tenants)
        self.worker_timeout_s = worker_timeout_s
        self.worker = WorkerCollector()
        r = self.registry
        self.requests = Counter("anchorcache_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=r)
        self.request_seconds = Histogram("anchorcache_http_request_duration_seconds",
                                         "HTTP request handling time, streaming included",
                                         ["route"], buckets=_TIME_BUCKETS, registry=r)
        self.ttft = Histogram("anchorcache_ttft_seconds",
                              "the request entering the pipeline to its first generated token",
                              ["tenant"], buckets=_TIME_BUCKETS, registry=r)
        self.prefill_seconds = Histogram("anchorcache_prefill_seconds",
                                         "worker prefill time of the tokens not restored",
                                         ["tenant"], buckets=_TIME_BUCKETS, registry=r)
        self.restore_seconds = Histogram("anchorcache_restore_seconds",
                                         "worker restore time, requests that planned a restore",
                                         ["tenant"], buckets=_TIME_BUCKETS, registry=r)
        self.snapshot_seconds = Histogram("anchorcache_snapshot_seconds",
                                          "worker snapshot time, requests that wrote anchors",
                                          ["tenant"], buckets=_TIME_BUCKETS, registry=r)
        self.lookups = Counter("anchorcache_anchor_lookups",
                               "anchors-on generations by what the restore gave: restored "
                               "(some prefix), missed (planned, nothing restored), cold (none known)",
                               ["tenant", "result"], registry=r)
        self.hits = Counter("anchorcache_anchor_hits", "anchors restored (each link of a chain)",
                            ["tenant", "kind"], registry=r)
        self.misses = Counter("anchorcache_anchor_misses",
                              "planned anchors the worker could not restore",
                              ["tenant", "kind", "reason"], registry=r)
        self.prompt_tokens = Counter("anchorcache_prompt_tokens",
                                     "prompt tokens by source: prefilled or restored",
                                     ["tenant", "source"], registry=r)
        self.completion_tokens = Counter("anchorcache_completion_tokens",
                                         "generated tokens (all choices)", ["tenant"], registry=r)
        self.restore_bytes = Counter("anchorcache_restore_bytes", "anchor bytes restored",
                                     ["tenant"], registry=r)
        self.snapshots = Counter("anchorcache_snapshots", "anchor snapshots written (staged)",
                                 ["tenant", "kind"], registry=r)
        self.snapshot_bytes = Counter("anchorcache_snapshot_bytes", "anchor bytes written",
                                      ["tenant", "kind"], registry=r)
        self.reservations = Counter("anchorcache_reservations",
                                    "requests' staged anchors by how they ended",
                                    ["tenant", "outcome", "reason"], registry=r)
        self.leases = Counter("anchorcache_anchor_leases",
                              "cache_control TTL leases on anchors: granted, refreshed (marked again), refused "
                              "(past the budget), expired, dropped (worker restarted)",
                              ["tenant", "outcome"], registry=r)
        r.register(self.worker)
        self.scrape = r  # what /metrics encodes
        if multiprocess_dir is not None:
            from prometheus_client import multiprocess

            self.scrape = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.scrape, path=multiprocess_dir)
            self.scrape.register(self.worker)
        # the workers `/metrics` scrapes: none until the app hands them over (`watch`)
        self._session: aiohttp.ClientSession | None = None
        self._workers: Callable[[], Sequence[WorkerView]] = tuple

    def watch(self, session: aiohttp.ClientSession,
              workers: Callable[[], Sequence[WorkerView]]) -> None:
        """Scrape `workers()` over `session`: the proxy's workers as they are at each scrape
        (added and drained live)."""
        self._session, self._workers = session, workers

    async def refresh_workers(self) -> None:
        """Fetch every watched worker's `/anchor/stats` (before each scrape)."""
        if self._session is not None:
            await self.worker.refresh(self._session, list(self._workers()), self.worker_timeout_s)

    def record_ttft(self, tenant: str, seconds: float) -> None:
        self.ttft.labels(self.tenant(tenant)).observe(seconds)

    def record_generation(self, tenant: str, plan: Plan, meta: GenerateMeta) -> None:
        """One finished generation: its plan and the worker's final meta info."""
        t = self.tenant(tenant)
        self.prefill_seconds.labels(t).observe(meta.prefill_ms / 1e3)
        self.prompt_tokens.labels(t, "prefilled").inc(meta.prefill_tokens)
        self.prompt_tokens.labels(t, "restored").inc(meta.cached_tokens)
        if not plan.namespace:  # anchors off
            return
        report = meta.anchors
        if plan.chain:
            self.restore_seconds.labels(t).observe(meta.restore_ms / 1e3)
        self.lookups.labels(t, "restored" if report.restored else "missed" if plan.chain
                            else "cold").inc()
        links = plan.restored(report)
        if links:  # (a chain's links: one label lookup per kind, not per link)
            kinds = collections.Counter(map(operator.attrgetter("kind"), links))
            for kind, n in kinds.items():
                self.hits.labels(t, kind.value).inc(n)
            # the planned links restored (of a late chain, those the plan holds too)
            if report.late_lookup:
                late = {h.key for h in links}
                restored = sum(rec.nbytes for rec in plan.chain if rec.key in late)
            else:  # a leading part of the plan's chain
                restored = sum(rec.nbytes for rec in plan.chain[:len(links)])
            if restored:
                self.restore_bytes.labels(t).inc(restored)
        for miss in report.restore_miss:  # the plan's leaf, or an ancestor the worker lacks
            rec = next((r for r in reversed(plan.chain) if r.key == miss.key), None)
            self.misses.labels(t, rec.kind.value if rec else "unknown", miss.reason).inc()
        for w in report.written:
            self.snapshots.labels(t, w.kind.value).inc()
            self.snapshot_bytes.labels(t, w.kind.value).inc(w.nbytes)
        if report.written and meta.snapshot_ms is not None:
            self.snapshot_seconds.labels(t).observe(meta.snapshot_ms / 1e3)

    def record_completion_tokens(self, tenant: str, num_tokens: int) -> None:
        """The tokens one request generated, every choice of it (`n > 1`) together: the
        worker's meta info is per sample, so this count is the pipeline's."""
        self.completion_tokens.labels(self.tenant(tenant)).inc(num_tokens)

    def record_lease(self, tenant: str, outcome: str) -> None:
        """A lease (proxy/leases.py) granted, refreshed, refused, expired or dropped."""
        self.leases.labels(self.tenant(tenant), outcome).inc()

    def record_reservations(self, tenant: str, outcome: str, reason: str, count: int = 1) -> None:
        """`outcome` "confirmed" (reason "ok") or "aborted" (reason: why)."""
        self.reservations.labels(self.tenant(tenant), outcome, reason).inc(count)


METRICS = web.AppKey("metrics", ProxyMetrics)


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def metrics_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Outermost: counts what the client got, error replies of the error middleware included."""
    t0 = time.perf_counter()
    status = "499"  # the handler was cancelled: the client went away
    try:
        resp = await handler(request)
        status = str(resp.status)
        return resp
    except web.HTTPException as e:
        status = str(e.status)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # "499": the client went away
    except Exception:
        status = "500"
        raise
    finally:
        metrics = request.app[METRICS]
        route = _route(request)
        method = request.method if request.method in _METHODS else "other"
        metrics.requests.labels(method, route, status).inc()
        metrics.request_seconds.labels(route).observe(time.perf_counter() - t0)


async def metrics_endpoint(request: web.Request) -> web.Response:
    """`GET /metrics`: the app's registry, the worker's counters refreshed first."""
    metrics = request.app[METRICS]
    await metrics.refresh_workers()
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encoder(metrics.scrape), headers={"Content-Type": content_type})
