"""aiohttp face of the embedded worker: the contract's routes (`anchorcache.ext.contract`,
docs/worker-protocol.md) over its `EmbeddedBackend` (`backend.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from anchorcache.ext import contract

from .backend import EmbeddedBackend

BACKEND = web.AppKey("backend", EmbeddedBackend)
EPOCH = web.AppKey("epoch", str)


def _response(reply: contract.Reply) -> web.Response:
    return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """What aiohttp raises itself (no route, a body it cannot read) in the contract's error
    shape; the contract answers everything else."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _response(contract.Reply(e.status, contract.error_json(e.reason, e.status)))
    except (HttpProcessingError, web.RequestPayloadError) as e:  # e.g. gzip that is not
        return _response(contract.Reply(400, contract.error_json(
            f"unreadable request body: {e}", 400)))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        return _response(contract.error_reply(e))


def auth_middleware(secret: str | None) -> Any:
    """Refuse every call but `/health` that does not carry the worker secret (401)."""
    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if not contract.authorized(request.path, request.headers.get("Authorization"), secret):
            return _response(contract.UNAUTHORIZED)
        return await handler(request)

    return auth


def _route(route: contract.Route) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return _response(await contract.handle(request.app[BACKEND], route, await request.read()))

    return handler


async def generate(request: web.Request) -> web.StreamResponse:
    out = await contract.generate(request.app[BACKEND], await request.read(), request)
    if isinstance(out, contract.Reply):
        return _response(out)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        async for chunk in out:
            await resp.write(chunk)
    finally:  # a client that went away cancels this handler: the request is aborted
        await out.aclose()
    await resp.write_eof()
    return resp


def add_routes(app: web.Application, *, fault_injection: bool) -> None:
    for route in contract.routes(fault_injection):
        app.router.add_route(route.method, route.path, _route(route))
    app.router.add_post("/generate", generate)
