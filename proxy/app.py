"""The proxy's aiohttp application: routes, lifecycle, one error middleware."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from .config import ProxyConfig
from .errors import ApiError, error_middleware, json_response
from .metrics import METRICS, ProxyMetrics, metrics_endpoint, metrics_middleware
from .openai_api import chat_completions
from .planner import Planner
from .splitter import get_adapter
from .state import STATE, ProxyState
from .tokenizers import load_tokenizer
from .worker_client import WorkerClient

log = logging.getLogger("anchorcache.proxy")


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response({"object": "list", "data": [
        {"id": state.info.model_id, "object": "model", "created": 0, "owned_by": "anchorcache",
         "max_context_tokens": state.info.max_context_tokens}]})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        worker = await state.worker.health()
    except ApiError as e:
        return json_response({"status": "degraded", "worker": None, "error": e.message}, 503)
    state.planner.observe_epoch(worker.get("epoch"))
    return json_response({"status": "ok", "model": state.info.model_id,
                          "anchors": state.config.anchors, "worker": worker})


def create_app(config: ProxyConfig) -> web.Application:
    # metrics outermost: it counts the status the error middleware made of a failure
    app = web.Application(middlewares=[metrics_middleware, error_middleware],
                          client_max_size=config.max_body_bytes)
    app[METRICS] = ProxyMetrics(max_tenants=config.metrics_max_tenants,
                                worker_timeout_s=config.metrics_worker_timeout_s)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=config.worker_timeout_s, sock_connect=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            worker = WorkerClient(session, config.worker_url)
            info = await worker.model_info()
            tokenizer = load_tokenizer(info.tokenizer_path)
            adapter = get_adapter(config.adapter, tokenizer)
            planner = Planner(info.model_id, info.epoch, salt=config.tenant_salt, worker=worker)
            app[STATE] = ProxyState(config, worker, info, tokenizer, adapter, planner,
                                    app[METRICS])
            log.info("proxy ready: model %s, adapter %s, anchors %s", info.model_id,
                     adapter.name, "on" if config.anchors else "off")
            yield

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
