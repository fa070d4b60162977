"""The proxy's aiohttp application: routes, lifecycle, middlewares (errors, admin, tenants)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from anchorcache.state.ledger import HITS_FLUSH_S, Ledger
from anchorcache.wire import ModelInfo

from . import admin
from .anthropic_api import count_tokens, messages
from .completions_api import completions
from .config import ProxyConfig
from .errors import ApiError, error_middleware, json_response
from .lifecycle import pid_alive
from .metrics import METRICS, ProxyMetrics, metrics_endpoint, metrics_middleware
from .openai_api import chat_completions
from .planner import tenant_namespace
from .responses_api import add_routes as add_responses_routes
from .running import STATE, ProxyState
from .split_pool import SplitPool, TokenBudget
from .splitter import get_adapter
from .splitter.tokenizers import load_tokenizer
from .splitter.tool_cuts import ToolCutLimits
from .targets import Targets
from .tenants import TENANTS, Tenants, local_caller, tenant_middleware
from .toolsets import SHARED_TENANT
from .worker_client import WorkerClient

log = logging.getLogger("anchorcache.proxy")


class HasStatus(Protocol):
    def to_json(self) -> dict[str, Any]: ...


# set by `anchorcache serve`, which supervises the worker process (anchorcache/supervise.py)
WORKER_STATUS = web.AppKey[Callable[[], HasStatus] | None]("worker_status")
PROCESS_HEADER = "X-Anchorcache-Process"  # which process of several answered (its index)


class AnchorSync:
    """One of several processes of a proxy: the anchors the other processes committed or
    let go since this one last looked, read from the ledger (`Ledger.anchor_changes`, one
    indexed read, empty when nothing changed) and folded into each worker's index before
    every request, so a conversation whose turns land on different processes restores its
    chain. The workers' slot listings stay the truth: the worker verifies every link it is
    asked to restore, and a stale entry costs a miss, never a wrong restore."""

    def __init__(self, ledger: Ledger, targets: Targets) -> None:
        self.ledger = ledger
        self.targets = targets
        self.seq = ledger.anchor_seq()  # before the targets' start loads what is committed

    def pull(self) -> int:
        """Fold the changes in; how many rows were read."""
        n = 0
        while True:
            self.seq, rows = self.ledger.anchor_changes(self.seq)
            if not rows:
                return n
            n += len(rows)
            for target in self.targets.all:
                target.lifecycle.absorb(rows)


ANCHOR_SYNC = web.AppKey("anchor_sync", AnchorSync)


@web.middleware
async def sync_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Several processes: the other processes' anchors before each request (`AnchorSync`)."""
    sync = request.app.get(ANCHOR_SYNC)
    if sync is not None:
        sync.pull()
    return await handler(request)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response({"object": "list", "data": [
        {"id": state.info.model_id, "object": "model", "created": 0, "owned_by": "anchorcache",
         "max_context_tokens": state.info.max_context_tokens}]})


def _public(worker: dict[str, Any]) -> dict[str, Any]:
    """A worker's health as anyone may see it: no URL, no request ids (those are the
    admin's: other tenants' requests, the worker network's addresses)."""
    return {k: v for k, v in worker.items()
            if k not in ("url", "running_requests", "queued_requests")}


async def health(request: web.Request) -> web.Response:
    """`ok` while any worker serves (each worker's state under `workers`), else 503. The
    workers' URLs and the ids of the requests they hold only for the admin token."""
    full = admin.is_admin(request)
    shown = (lambda w: w) if full else _public
    state = request.app[STATE]
    status = request.app[WORKER_STATUS]
    process = status().to_json() if status is not None else None
    extra = {"worker_process": process} if process is not None else {}
    if process is not None and process["state"] != "running":  # `serve` is restarting it
        return json_response({"status": "degraded", "worker": None, **extra,
                              "error": f"worker {process['state']}"}, 503)
    targets = [t for t in state.targets.all if not t.draining]
    replies = await asyncio.gather(*(t.worker.health() for t in targets), return_exceptions=True)
    workers, first = [], None
    for t, reply in zip(targets, replies, strict=True):
        if isinstance(reply, ApiError):
            workers.append({"name": t.name, "url": t.id, "status": "unavailable",
                            "error": reply.message})
        elif isinstance(reply, BaseException):
            raise reply
        else:
            workers.append({"name": t.name, "url": t.id, **reply.to_json()})
            first = first or reply
    if first is None:
        return json_response({"status": "degraded", "worker": None,
                              "workers": [shown(w) for w in workers], **extra,
                              "error": "; ".join(w.get("error", "") for w in workers)
                              or "no worker"}, 503)
    return json_response({"status": "ok", "model": state.info.model_id,
                          "anchors": state.config.anchors, "worker": shown(first.to_json()),
                          "workers": [shown(w) for w in workers], **extra})


async def metrics(request: web.Request) -> web.StreamResponse:
    """`/metrics` names tenants: for the admin token, or a scraper on this machine."""
    if not (admin.is_admin(request) or local_caller(request)):
        raise ApiError("unauthorized", "/metrics is for callers on this machine or with "
                       "'Authorization: Bearer ADMIN_TOKEN' (it names tenants)")
    return await metrics_endpoint(request)


async def refresh_worker_epoch(app: web.Application) -> None:
    """A (re)started worker is a new epoch: ask every worker's health, whose epoch its anchor
    life cycle observes, so the old one's anchors are forgotten now (and the ledger
    reconciled, pinned toolsets re-warmed in the background)."""
    await app[STATE].targets.check_all()


async def _first_answer(session: aiohttp.ClientSession,
                        urls: tuple[str, ...]) -> tuple[str, ModelInfo]:
    """The first worker that answers `/model_info`, and its answer (the proxy needs one to
    load the tokenizer; the others may come later)."""
    error: ApiError | None = None
    for url in urls:
        try:
            return url, await WorkerClient(session, url).model_info()
        except ApiError as e:
            log.warning("worker %s: %s", url, e.message)
            error = error or e
    assert error is not None
    raise error


async def _housekeep(ledger: Ledger, config: ProxyConfig) -> None:
    """Delete the ledger's dead rows at start and then every `housekeeping_interval_s` (on
    the loop, which owns the connection: indexed deletes, milliseconds)."""
    while True:
        try:
            deleted = ledger.housekeep(config.ledger_retention_s)
            if any(deleted.values()):
                log.info("ledger housekeeping deleted %s", deleted)
        except Exception:  # a busy or failing disk: tried again next time
            log.exception("ledger housekeeping failed")
        await asyncio.sleep(config.housekeeping_interval_s)


async def _write_hits(ledger: Ledger) -> None:
    """Write the anchor hits requests counted in memory (`Ledger.note_hits`) every
    `HITS_FLUSH_S`, so that the other processes' reads see them while this one is idle."""
    while True:
        await asyncio.sleep(HITS_FLUSH_S)
        try:
            ledger.flush_hits()
        except Exception:  # a busy or failing disk: tried again next time
            log.exception("writing anchor hits failed")


def create_app(config: ProxyConfig, *,
               worker_status: Callable[[], HasStatus] | None = None) -> web.Application:
    """`worker_status`: given when this process supervises the worker (`anchorcache serve`);
    `/health` then reports the worker process's state, and `degraded` while it restarts."""
    # metrics outermost: it counts the status the other middlewares made of a request
    several = config.processes > 1  # one of several processes (proxy/processes.py)
    app = web.Application(middlewares=[metrics_middleware, error_middleware,
                                       admin.admin_middleware, tenant_middleware,
                                       *([sync_middleware] if several else [])],
                          client_max_size=config.max_body_bytes)
    app[METRICS] = ProxyMetrics(max_tenants=config.metrics_max_tenants,
                                worker_timeout_s=config.metrics_worker_timeout_s,
                                multiprocess_dir=config.metrics_dir)
    app[WORKER_STATUS] = worker_status
    if several:
        async def name_process(request: web.Request, response: web.StreamResponse) -> None:
            response.headers[PROCESS_HEADER] = str(config.process_index)

        app.on_response_prepare.append(name_process)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=config.worker_timeout_s, sock_connect=5)
        # every worker call carries the shared secret (a worker given one refuses the rest)
        secret = ({"Authorization": f"Bearer {config.worker_secret}"}
                  if config.worker_secret is not None else None)
        # several processes: their parent holds the ledger's lock (proxy/processes.py)
        ledger = Ledger.open(config.state_dir, exclusive=not several)
        if several:
            ledger.number_anchor_changes()
        try:
            async with aiohttp.ClientSession(timeout=timeout, headers=secret) as session:
                reached, info = await _first_answer(session, config.worker_urls)
                tokenizer = load_tokenizer(info.tokenizer_path)
                adapter = get_adapter(config.adapter, tokenizer,
                                      canonical_tools=config.canonical_tools)
                # tool cuts for tool anchors (and, anchors off, for chunking as they would:
                # on and off compute alike), none for a prompt the context cannot hold
                adapter.tool_cut_limits = ToolCutLimits(
                    spacing_tokens=config.tool_anchor_gap,
                    max_prompt_tokens=info.max_context_tokens)
                splits = SplitPool(adapter, max_pending=config.max_pending_splits)
                budget = TokenBudget.for_tokenizer(tokenizer, info.max_context_tokens)
                shared = ledger.ensure_tenant(SHARED_TENANT)
                targets = Targets(config, session, ledger, info,
                                  tenant_namespace(shared.salt, shared.name),
                                  on_lease=app[METRICS].record_lease)
                app[METRICS].watch(session, lambda: targets.all)
                app[STATE] = ProxyState(config, targets, info, tokenizer, adapter, splits, budget,
                                        ledger, app[METRICS])
                app[TENANTS] = Tenants(ledger, anonymous=config.anonymous_access,
                                       placeholder_keys=config.placeholder_keys,
                                       default_quotas=config.default_quotas,
                                       across_processes=several)
                if several:
                    ledger.forget_flights(pid_alive)  # a dead sibling's (or pid's) requests
                    app[ANCHOR_SYNC] = AnchorSync(ledger, targets)
                await targets.start(reached, info)
                log.info("proxy ready: model %s, %d worker(s) routed by %s, adapter %s, "
                         "anchors %s, tools in %s order, ledger %s", info.model_id,
                         len(targets.all), config.route, adapter.name,
                         "on" if config.anchors else "off",
                         "canonical" if config.canonical_tools else "client", config.state_dir)
                if adapter.deviation:
                    log.info("adapter %s deviates from the chat template on purpose: %s",
                             adapter.name, adapter.deviation)
                housekeeping = asyncio.create_task(_housekeep(ledger, config))
                hits = asyncio.create_task(_write_hits(ledger))
                try:
                    yield
                finally:
                    housekeeping.cancel()
                    hits.cancel()
                    await targets.close()
                    splits.close()
        finally:
            ledger.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    add_responses_routes(app)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    admin.add_routes(app)
    app.router.add_get("/metrics", metrics)
    return app
