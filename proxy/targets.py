"""The workers behind the proxy (targets), and which one serves each request.

A target is one worker URL; its id (the URL) is the ledger's `worker` column, so the ledger
records which target holds each anchor, under that target's epoch. A server of several
workers (SGLang's data-parallel ranks) lists them in its `/model_info` (`ranks`: `dp/0`,
`dp/1`, ...): each is a target of its own, `URL/dp/K`, with its own anchors and epoch.
Each target has its own `WorkerClient` and its own `AnchorLifecycle` (planner, index,
epoch), so everything the single-worker proxy did per worker (reconcile, re-warm pinned
toolsets, quotas) happens per target unchanged. `Targets` adds what is between them:

- **Routing** (`route`), by policy (`ProxyConfig.route`):
  - `affinity` (default): the target whose anchors give the request the deepest restore
    (its planner's probe: the chain `begin` then plans from, for the target chosen alone),
    among the targets whose load is at most `route_max_imbalance` above the least-loaded
    one; ties go to the less loaded, then to the one holding fewer anchors (all processes'
    anchors, as the ledger has them: the processes of one proxy place new toolsets alike),
    then to the one that got fewer requests. So a conversation's next turn goes where its
    chain is, a new conversation goes to the least-loaded target that holds its instruction
    anchor, a new toolset to the target holding the least, and a toolset whose target is
    busy gets its instruction anchor written on a second target by the request that
    overflows there.
  - `least_load`: the least-loaded target; `round_robin`: each in turn (for comparison).
  Load is the larger of the requests this proxy has in flight on the target and the running
  plus queued requests the worker's `/health` reported at the last check (other clients').
- **Failover**: a target that refuses connections, or fails its health check, is taken out
  (`down`): its anchors are marked lost in the ledger and forgotten by its planner; the
  pipeline retries a request that has not streamed anything on the next target. A health
  check every `health_interval_s` brings it back; its life cycle then reconciles under the
  epoch it answers with (a restarted worker's anchors stay lost; a worker that was only
  unreachable gets back those it still lists). With every target out, requests are still
  tried on them (the answer is then the worker's own 503).
- **Live changes**: `add(url)` (checked to serve the same model and tokenizer), `drain(id)`
  (no new requests; removed once its in-flight requests end).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from anchorcache.state.ledger import Ledger
from anchorcache.wire import ModelInfo

from .config import ProxyConfig
from .errors import ApiError
from .lifecycle import AnchorLifecycle, Caller
from .planner import PrefixKeys, Probe
from .splitter.types import SplitResult
from .worker_client import WorkerClient

log = logging.getLogger("anchorcache.proxy")

@dataclass(eq=False)
class Target:
    name: str  # w0, w1, ... in the order added (the admin API's and ops' handle)
    id: str  # the worker's URL: the ledger's `worker` column
    worker: WorkerClient
    lifecycle: AnchorLifecycle
    healthy: bool = True
    verified: bool = True  # it answered /model_info with this proxy's model
    draining: bool = False
    in_flight: int = 0  # this proxy's requests on it now
    reported: int = 0  # running + queued requests at its last health check
    routed: int = 0  # requests routed to it since it was added
    error: str | None = None  # why it is out, while it is
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while in_flight is 0

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self) -> None:
        """A request of this proxy starts on it."""
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported)

    @property
    def serving(self) -> bool:
        return self.healthy and not self.draining

    def to_json(self) -> dict[str, Any]:
        lc = self.lifecycle
        n = lc.counters["count"]
        return {"name": self.name, "url": self.id, "healthy": self.healthy,
                "draining": self.draining, "error": self.error, "epoch": lc.epoch, "load": self.load,
                "in_flight": self.in_flight, "reported_load": self.reported,
                "routed": self.routed, "anchors": lc.anchor_count(),
                "bytes": lc.anchor_bytes(), "requests": n,
                "hit_rate": round(lc.counters["hits"] / n, 4) if n else None,
                "prompt_tokens": lc.counters["prompt_tokens"],
                "cached_tokens": lc.counters["cached_tokens"], "leases": len(lc.leases),
                "leased_bytes": lc.leases.protected_bytes()}


class Targets:
    def __init__(self, config: ProxyConfig, session: aiohttp.ClientSession, ledger: Ledger,
                 info: ModelInfo, shared_namespace: bytes, *,
                 on_lease: Callable[[str, str], None] | None = None) -> None:
        """`on_lease(tenant, outcome)`: each target's anchor leases, as they change (metrics)."""
        self.config = config
        self.on_lease = on_lease
        self.session = session
        self.ledger = ledger
        self.info = info  # the first worker's: every other must serve the same model
        self.shared_namespace = shared_namespace
        self.prefix_keys = PrefixKeys(info.model_id)  # every target's planner's (one model)
        self.all: list[Target] = []
        self._turn = itertools.count()
        self._names = itertools.count()
        self._watch: asyncio.Task[None] | None = None

    # ---- membership -----------------------------------------------------------------------
    def find(self, handle: str) -> Target | None:
        """A target by name (w0...) or URL."""
        url = handle.rstrip("/")
        return next((t for t in self.all if handle == t.name or url == t.id), None)

    def serving(self) -> list[Target]:
        return [t for t in self.all if t.serving]

    @property
    def primary(self) -> Target:
        """The first serving target (or the first at all): for single-worker callers."""
        return next((t for t in self.all if t.serving), self.all[0])

    def _new(self, url: str, info: ModelInfo | None) -> Target:
        worker = WorkerClient(self.session, url)
        lifecycle = AnchorLifecycle(
            worker, self.ledger, model_id=self.info.model_id,
            epoch=info.epoch if info is not None else "", worker_id=worker.base_url,
            shared_namespace=self.shared_namespace,
            single_flight_wait_s=self.config.single_flight_wait_s, hybrid=self.info.hybrid,
            tool_gap=self.config.tool_anchor_gap,
            tenant_anchor_share=self.config.tenant_anchor_share,
            lease_budget_bytes=self.config.process_lease_budget_bytes, on_lease=self.on_lease,
            processes=self.config.processes, unpin_strays=self.config.leads_processes,
            prefix_keys=self.prefix_keys)
        return Target(f"w{next(self._names)}", worker.base_url, worker, lifecycle,
                      healthy=info is not None, verified=info is not None,
                      error=None if info is not None else "not reached yet")

    async def _model_info(self, worker: WorkerClient) -> ModelInfo:
        """`worker`'s `/model_info`; ApiError if it does not answer or serves another model."""
        info, mine = await worker.model_info(), self.info
        if (info.model_id, info.tokenizer_path, info.eos_token_ids) != \
                (mine.model_id, mine.tokenizer_path, mine.eos_token_ids):
            raise ApiError("invalid_request", f"that worker serves {info.model_id!r} "
                           f"(tokenizer {info.tokenizer_path!r}); this proxy serves "
                           f"{mine.model_id!r} ({mine.tokenizer_path!r})")
        return info

    async def _try_info(self, url: str) -> ModelInfo | None:
        try:
            return await self._model_info(WorkerClient(self.session, url))
        except ApiError as e:
            log.warning("worker %s is out for now: %s", url, e.message)
            return None

    async def _workers(self, url: str, info: ModelInfo | None) -> list[tuple[str, ModelInfo | None]]:
        """The targets behind `url` (which answered `info`): itself, or each of its ranks."""
        if info is None or not info.ranks:
            return [(url, info)]
        base = url.rstrip("/")
        return [(f"{base}/{rank}", await self._try_info(f"{base}/{rank}")) for rank in info.ranks]

    async def _append(self, url: str, info: ModelInfo | None) -> Target:
        target = self._new(url, info)
        self.all.append(target)
        if info is not None and self.config.anchors:
            await target.lifecycle.start()
        return target

    async def start(self, reached: str, info: ModelInfo) -> None:
        """Make the configured targets (`reached` answered `info`); start those that answer,
        keep the others out until their health answers; start the health checks."""
        for url in self.config.worker_urls:
            got = info if url == reached else await self._try_info(url)
            for worker_url, worker_info in await self._workers(url, got):
                await self._append(worker_url, worker_info)
        self._watch = asyncio.get_running_loop().create_task(self._watch_health())

    async def add(self, url: str) -> list[Target]:
        """Add a worker live (for a server of several, each of its ranks that is not a target
        yet); 400 if it serves another model, 503 if it does not answer, 409 if it (every
        rank) is a target already."""
        client = WorkerClient(self.session, url)
        info = await self._model_info(client)
        found = [(u, i) for u, i in await self._workers(client.base_url, info)
                 if self.find(u) is None]  # a server's ranks: those not targets already
        if not found:
            raise ApiError("conflict", f"worker {client.base_url} is already a target")
        added = []
        for worker_url, worker_info in found:
            if worker_info is None:
                raise ApiError("worker_unavailable", f"worker {worker_url} does not answer")
            target = await self._append(worker_url, worker_info)
            self.ledger.event("worker_added", None, worker=target.id, epoch=worker_info.epoch)
            log.info("worker %s added (epoch %s)", target.id, worker_info.epoch)
            added.append(target)
        return added

    async def drain(self, target: Target, timeout_s: float) -> bool:
        """Route nothing new to `target`, wait (up to `timeout_s`) for its in-flight requests
        to end, then remove it. Returns whether they all ended in time."""
        target.draining = True
        self.ledger.event("worker_draining", None, worker=target.id, in_flight=target.in_flight)
        try:
            await asyncio.wait_for(target.idle.wait(), timeout_s)
        except TimeoutError:
            pass
        drained = target.in_flight == 0
        await target.lifecycle.idle()
        self.all.remove(target)
        await target.lifecycle.close()
        self.ledger.event("worker_removed", None, worker=target.id, drained=drained)
        log.info("worker %s removed (%s)", target.id, "drained" if drained else "timed out")
        return drained

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for target in self.all:
            await target.lifecycle.close()

    # ---- routing ----------------------------------------------------------------------------
    def route(self, split: SplitResult, caller: Caller | None,
              exclude: frozenset[str] = frozenset()) -> tuple[Target, Probe | None]:
        """The target for a request (see the module's docstring); `caller` None: anchors off
        (affinity then routes by load). Counts it as routed; the caller `enter`s and `leave`s it.
        With the target comes its probe where routing made one (affinity), for its
        `lifecycle.begin` to plan from: each request is probed once per candidate and
        planned once, for the one chosen."""
        pool = [t for t in self.all if t.serving and t.id not in exclude]
        if not pool:  # every target is out: try them anyway, the worker's answer decides
            pool = [t for t in self.all if not t.draining and t.id not in exclude]
        if not pool:
            raise ApiError("worker_unavailable", "no worker can serve this request"
                           + (" (all tried)" if exclude else ""))
        policy = self.config.route
        probes: dict[str, Probe] = {}
        if policy == "round_robin":
            target = pool[next(self._turn) % len(pool)]
        else:
            least = min(t.load for t in pool)
            if policy == "affinity" and caller is not None:
                near = [t for t in pool if t.load - least <= self.config.route_max_imbalance]
                probes = self._probes(near, split, caller)
                target = max(near, key=lambda t: (probes[t.id].restore_depth, -t.load,
                                                  -t.lifecycle.anchor_count(), -t.routed))
            else:
                target = min(pool, key=lambda t: (t.load, t.routed))
        target.routed += 1
        return target, probes.get(target.id)

    @staticmethod
    def _probes(near: list[Target], split: SplitResult, caller: Caller) -> dict[str, Probe]:
        """Each target's probe of `split`, exact where it may win: first down the
        conversation's own anchors on each (cheap: a few keys), then, where that found
        nothing, a scan of the caller's anchors there from the depth the deepest of the
        others restores (below it a target loses whatever it holds). A target that does not
        hold the conversation thus costs routing a few keys, not a scan of its anchors."""
        if len(near) == 1:
            return {near[0].id: near[0].lifecycle.probe(split, caller)}
        probes = {t.id: t.lifecycle.probe(split, caller, floor=None) for t in near}
        floor = max(p.restore_depth for p in probes.values())
        for t in near:
            if not probes[t.id].whole:  # (its cuts and keys as the first pass made them)
                probes[t.id] = t.lifecycle.deepen(probes[t.id], floor)
        return probes

    # ---- health -----------------------------------------------------------------------------
    def down(self, target: Target, why: str) -> None:
        """Take `target` out: its anchors are lost (ledger and planner) until it answers again."""
        target.error = why
        if not target.healthy:
            return
        target.healthy = False
        lost = target.lifecycle.lose(why)
        log.warning("worker %s taken out (%s): %d anchors marked lost", target.id, why, lost)

    async def check(self, target: Target) -> bool:
        """Ask `target`'s health; bring it back or take it out. Returns whether it is healthy."""
        try:
            if not target.verified:
                info = await self._model_info(target.worker)
                if info.ranks:  # a server of several workers: each rank is the target
                    await self._split(target, info)
                    return True
                target.verified = True
            health = await target.worker.health()  # its life cycle observes the epoch
        except ApiError as e:
            self.down(target, e.message)
            return False
        target.reported = len(health.running_requests) + len(health.queued_requests)
        if not target.healthy:  # its life cycle reconciles under the epoch it just saw
            target.healthy, target.error = True, None
            self.ledger.event("worker_back", None, worker=target.id, epoch=health.epoch)
            log.info("worker %s is back (epoch %s)", target.id, health.epoch)
        return True

    async def _split(self, target: Target, info: ModelInfo) -> None:
        """`target`, not reached at start, turns out to be a server of several workers: its
        ranks replace it."""
        self.all.remove(target)
        await target.lifecycle.close()
        for worker_url, worker_info in await self._workers(target.id, info):
            if self.find(worker_url) is None:
                await self._append(worker_url, worker_info)
        log.info("worker %s serves %d ranks: %s", target.id, len(info.ranks),
                 ", ".join(info.ranks))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(t) for t in list(self.all)))

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # a bug here must not end the checks
                log.exception("health check failed")
