"""`/anchor/*` routes of the worker contract (docs/worker-protocol.md). Every reply has `epoch`."""

from __future__ import annotations

from aiohttp import web

from anchorcache.wire import (
    KEY_BYTES,
    ConfirmReply,
    FlushReply,
    KeyOpReply,
    SlotsAborted,
    WireError,
)

from .anchors import AnchorStore
from .server import ENGINE, EPOCH, _body, _json


def _store(request: web.Request) -> AnchorStore:
    store = request.app[ENGINE].anchors
    if store is None:
        raise web.HTTPNotFound(reason="this worker runs without an anchor store")
    return store


async def _slots_arg(request: web.Request) -> list[int]:
    body = await _body(request)
    slots = body.get("slots") if isinstance(body, dict) else None
    if not isinstance(slots, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in slots):
        raise WireError("'slots' must be a list of integers")
    return slots


async def _key_arg(request: web.Request) -> bytes:
    body = await _body(request)
    try:
        key = bytes.fromhex(body["key"])
    except (TypeError, KeyError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise WireError(f"'key' must be a hex string of {KEY_BYTES} bytes")
    return key


async def confirm(request: web.Request) -> web.Response:
    confirmed, evicted = _store(request).confirm(await _slots_arg(request))
    return _json(ConfirmReply(tuple(confirmed), tuple(evicted), request.app[EPOCH]).to_json())


async def abort(request: web.Request) -> web.Response:
    aborted = _store(request).abort(await _slots_arg(request))
    return _json(SlotsAborted(tuple(aborted), request.app[EPOCH]).to_json())


async def lookup(request: web.Request) -> web.Response:
    """`{namespace, input_ids, depths}` → which of those prefixes are committed (no LRU touch)."""
    store = _store(request)
    body = await _body(request)
    if not isinstance(body, dict):
        raise WireError("body must be an object")
    try:
        hits = store.lookup(bytes.fromhex(body.get("namespace", "")), body.get("input_ids"),
                            body.get("depths"), request.app[EPOCH])
    except (TypeError, ValueError) as e:
        raise WireError(f"lookup needs namespace, input_ids and depths: {e}") from None
    return _json(hits.to_json())


async def slots(request: web.Request) -> web.Response:
    return _json(_store(request).slots(request.app[EPOCH]).to_json())


async def stats(request: web.Request) -> web.Response:
    return _json(_store(request).stats(request.app[EPOCH]).to_json())


async def pin(request: web.Request) -> web.Response:
    pinned = _store(request).table.pin(await _key_arg(request))
    # no device tier: nothing is locked beyond the host slot table
    return _json(KeyOpReply("pinned", pinned, request.app[EPOCH], "none").to_json())


async def unpin(request: web.Request) -> web.Response:
    unpinned = _store(request).table.unpin(await _key_arg(request))
    return _json(KeyOpReply("unpinned", unpinned, request.app[EPOCH]).to_json())


async def evict(request: web.Request) -> web.Response:
    evicted = _store(request).evict(await _key_arg(request))
    return _json(KeyOpReply("evicted", evicted, request.app[EPOCH]).to_json())


async def flush(request: web.Request) -> web.Response:
    """Drop every anchor (on this worker, `/flush_cache` does the same)."""
    return _json(FlushReply(_store(request).flush(), request.app[EPOCH]).to_json())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/anchor/confirm", confirm)
    app.router.add_post("/anchor/abort", abort)
    app.router.add_post("/anchor/lookup", lookup)
    app.router.add_get("/anchor/slots", slots)
    app.router.add_get("/anchor/stats", stats)
    app.router.add_post("/anchor/pin", pin)
    app.router.add_post("/anchor/unpin", unpin)
    app.router.add_post("/anchor/evict", evict)
    app.router.add_post("/anchor/flush", flush)
