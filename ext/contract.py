"""The worker contract's HTTP layer (docs/worker-protocol.md), one for both workers.

One route table (`ROUTES`, and `/generate`), one body parser (`read_body`), one error table
(`error_reply`), over a `Backend`: the embedded worker's (`ext/embedded/backend.py`) queues
every call onto its engine thread, SGLang's (`ext/sglang/http.py`) runs them on the
scheduler's loop through the scheduler RPC. The two serve different HTTP frameworks
(aiohttp; SGLang's own Starlette app), so this layer speaks bytes: `handle` answers a
`Reply` (status, JSON body) and `generate` a `Reply` or a `Stream` of server-sent events;
each worker's adapter hands those to its framework in a few lines.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import cachetools
import msgspec
import orjson

from anchorcache import wire
from anchorcache.wire import (
    KEY_BYTES,
    Confirmation,
    GenerateMeta,
    GenerateRequest,
    WireError,
    decode,
    encode,
    parse_ids,
)

log = logging.getLogger("anchorcache.worker")


class ContractError(Exception):
    """A call the backend refuses with this HTTP status (404: not on this worker, 409:
    not now, 503: not ready)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Tokens:
    """New output ids of one sample; with their logprobs when the request asked for them."""

    output_ids: tuple[int, ...]
    index: int = 0
    logprobs: tuple[tuple[float, int], ...] | None = None  # (logprob, token) per id
    top_logprobs: tuple[tuple[tuple[float, int], ...], ...] | None = None  # most likely first


Event = Tokens | GenerateMeta


IN_BAND_KEPT_S = 60.0  # as long as a finished request's unconfirmed anchors are (ext/store.py)
IN_BAND_KEPT = 4096


class InBandConfirms:
    """The anchors each recent request had confirmed as it ended (`AnchorPlan.confirm`), by
    rid, for `IN_BAND_KEPT_S` (at most `IN_BAND_KEPT` requests): a request the proxy aborts
    after that (its client went away before the proxy settled it) was never recorded by the
    proxy, so its abort drops them, as it drops a request's staged anchors (else a client
    that leaves at the right moment would keep anchors outside its tenant's quota)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_rid: cachetools.TTLCache[str, list[bytes]] = cachetools.TTLCache(
            IN_BAND_KEPT, IN_BAND_KEPT_S, timer=clock)

    def note(self, rid: str, keys: list[bytes]) -> None:
        self._by_rid[rid] = [*self._by_rid.get(rid, ()), *keys]

    def take(self, rid: str) -> list[bytes]:
        return self._by_rid.pop(rid, [])


class Backend(ABC):
    """What a worker does for the contract; the HTTP layer does the rest (parsing, errors,
    the reply's framing). Replies are the records of `anchorcache/wire/`, with `epoch` set.

    Every call that reads or changes the anchor store runs on the backend's own loop (the
    embedded engine thread; SGLang's scheduler), so the store has one owner. Errors: a
    WireError is a 400 (the call cannot be served as asked; nothing changed), a
    ContractError its status, anything else a 500 (the store is left as the failed call
    found it or with its change complete, never half done).
    """

    _in_band: InBandConfirms | None = None

    @property
    def in_band(self) -> InBandConfirms:
        """What recent requests confirmed as they ended (the contract layer's)."""
        if self._in_band is None:
            self._in_band = InBandConfirms()
        return self._in_band

    @property
    @abstractmethod
    def epoch(self) -> str:
        """A fresh id per process start; anchors never outlive it."""

    @abstractmethod
    async def prepare(self, req: GenerateRequest, context: Any) -> Any:
        """Admit `req` (its `rid` is set): check what the parser cannot know (vocabulary,
        context, constraint, an id already running) and queue it. Returns the handle the
        other generate calls take. Raises WireError, changing nothing. `context` is the
        framework's request (SGLang watches it for a client that went away)."""

    @abstractmethod
    def generate(self, handle: Any) -> AsyncGenerator[Event, None]:
        """Run the prepared request: each sample's `Tokens` as they come, then its
        `GenerateMeta`. Restores and stages the request's anchors. Raises when the request
        fails (SGLang: also when it aborted it); closing the iterator early aborts it."""

    @abstractmethod
    async def finish(self, handle: Any, ok: bool) -> None:
        """End the request, once, after `generate` ended, failed or was cancelled: release
        what it holds (restore locks); unless `ok`, its staged anchors are dropped. Never
        raises for a request the backend already ended."""

    @abstractmethod
    async def abort(self, rid: str) -> wire.AbortReply:
        """Cancel request `rid`, queued or running, and drop its unconfirmed anchors."""

    @abstractmethod
    async def stop(self, rid: str, output_tokens: int | None) -> wire.StopReply:
        """End running request `rid` as a stop (the proxy found a stop sequence): every
        sample still generating finishes with `{"type": "stop", "matched": null}` and the
        request ends as a finished one, its snapshots staged; with one sample and
        `snapshot_response`, the response anchor is prompt + its first `output_tokens`
        output ids, when the worker still holds their state. `stopped` is false when no such
        request is running (it already ended: its reply is on its way)."""

    @abstractmethod
    async def confirm(self, slots: list[int], rid: str | None) -> wire.ConfirmReply:
        """Make the staged anchors in `slots` visible and evict their victims; slots not
        staged (by request `rid`, when given) are left out of the reply."""

    @abstractmethod
    async def abort_slots(self, slots: list[int]) -> wire.SlotsAborted:
        """Drop the staged anchors in `slots` (their victims survive)."""

    @abstractmethod
    async def lookup(self, namespace: bytes, ids: tuple[int, ...],
                     depths: tuple[int, ...]) -> wire.LookupReply:
        """Which prefixes `ids[:d]` are committed. Changes nothing (no LRU touch); WireError
        for a depth outside `[1, len(ids)]`."""

    @abstractmethod
    async def pin(self, key: bytes, cache_key: str | None, device: bool) -> wire.PinReply:
        """Keep the committed anchor `key` from eviction (SGLang, with `device`: also lock its
        prefix on the device, within a budget, under the engine cache key `cache_key`, where
        requests that carry that key find it; the reply's `device` says how)."""

    @abstractmethod
    async def unpin(self, key: bytes) -> wire.UnpinReply:
        """Undo `pin`; false when `key` was not pinned."""

    @abstractmethod
    async def evict(self, key: bytes) -> wire.EvictReply:
        """Drop the committed anchor `key`; false when it holds none."""

    @abstractmethod
    async def flush(self, device: bool) -> wire.FlushReply:
        """`device=False`: drop every anchor, staged ones included. `device=True`
        (`/flush_cache`): the worker's own prefix cache (SGLang: its device tree, the host
        anchors survive; ContractError 409 while requests run; embedded: every anchor)."""

    @abstractmethod
    async def slots(self) -> wire.SlotsReply:
        """Every committed anchor and pending reservation. Changes nothing."""

    @abstractmethod
    async def stats(self) -> wire.StatsReply:
        """The slot table's counters. Changes nothing."""

    @abstractmethod
    async def model_info(self) -> wire.ModelInfo:
        """The model served and its limits. Changes nothing."""

    @abstractmethod
    async def health(self) -> wire.WorkerHealth:
        """Answered even while the engine is busy or wedged: never waits for its loop.
        ContractError 503 while the worker is not ready."""

    async def verify(self, key: bytes, cache_key: str | None) -> wire.VerifyReply:
        """Compare the device rows of the committed anchor `key` (as requests with the engine
        cache key `cache_key` find them) with its host slabs."""
        raise ContractError(404, "this worker has no device rows to verify")

    async def import_slab(self, data: bytes) -> wire.ImportReply:
        """Take in a slab file (another worker's `export_slab`) onto this worker's disk tier,
        every check of a load made first (docs/disk-tier.md). ContractError 409 without a
        disk tier; a file that fails a check is a 400 (`CorruptSlab`) and is not kept."""
        raise ContractError(409, "this worker has no disk tier to import into")

    async def export_slab(self, key: bytes) -> bytes:
        """The slab file of anchor `key` on this worker's disk tier (ContractError 404 when
        the tier holds none, 409 without a disk tier)."""
        raise ContractError(409, "this worker has no disk tier to export from")

    async def fault(self, body: dict[str, Any]) -> dict[str, Any]:
        """Arm one injected fault (tests; only with --fault-injection)."""
        raise ContractError(404, "fault injection is off")


def import_into(disk: Any, data: bytes, epoch: str) -> wire.ImportReply:
    """`Backend.import_slab` over a worker's disk tier (`ext/disk_tier.DiskTier`, or None)."""
    if disk is None:
        raise ContractError(409, "this worker has no disk tier to import into")
    entry, imported = disk.import_file(data)
    return wire.ImportReply(entry.key, entry.depth, entry.parent, imported, epoch)


def export_from(disk: Any, key: bytes) -> bytes:
    """`Backend.export_slab` over a worker's disk tier (`ext/disk_tier.DiskTier`, or None)."""
    if disk is None:
        raise ContractError(409, "this worker has no disk tier to export from")
    try:
        data: bytes = disk.export_file(key)
    except KeyError:
        raise ContractError(404, "this worker's disk tier holds no file of that anchor (a "
                                 "slab is written shortly after it is confirmed)") from None
    return data


# ---- bodies and errors ---------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes  # JSON, unless `content_type` says otherwise
    content_type: str = "application/json"


Stream = AsyncGenerator[bytes, None]  # server-sent events, `data: [DONE]` last; aclose() it


def read_body(raw: bytes) -> Any:
    """A request body: JSON, or `{}` when empty. JSONDecodeError (a 400) otherwise."""
    return orjson.loads(raw) if raw.strip() else {}


def _obj(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise WireError("body must be an object")
    return body


def slots_arg(body: Any) -> list[int]:
    slots = _obj(body).get("slots")
    if not isinstance(slots, list) or not all(isinstance(s, int) and not isinstance(s, bool)
                                              for s in slots):
        raise WireError("'slots' must be a list of integers")
    return slots


def key_arg(body: Any) -> bytes:
    try:
        key = bytes.fromhex(_obj(body)["key"])
    except (TypeError, KeyError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise WireError(f"'key' must be a hex string of {KEY_BYTES} bytes")
    return key


def cache_key_arg(body: Any) -> str | None:
    return wire.parse_cache_key(_obj(body).get("cache_key"))


def _pin(backend: Backend, body: Any) -> Awaitable[wire.PinReply]:
    device = _obj(body).get("device", True)
    if not isinstance(device, bool):
        raise WireError("'device' must be a boolean")
    return backend.pin(key_arg(body), cache_key_arg(body), device)


def _confirm(backend: Backend, body: Any) -> Awaitable[wire.ConfirmReply]:
    """`/anchor/confirm`: `slots`, and (what the proxy always sends) the request `rid` that
    staged them and the `epoch` it saw, so a confirm can only ever make visible what that
    request wrote in this process: after a restart its slot numbers name nothing (409)."""
    d = _obj(body)
    epoch, rid = d.get("epoch"), d.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise WireError("'rid' must be a string")
    if epoch is not None and epoch != backend.epoch:
        raise ContractError(409, f"epoch {epoch!r} is not this worker's ({backend.epoch}): it "
                                 "restarted, and the slots of that epoch are gone")
    return backend.confirm(slots_arg(body), rid)


async def _abort(backend: Backend, rid: str) -> wire.AbortReply:
    """`/abort_request`: the backend's abort, and the anchors the request confirmed as it
    ended dropped (`InBandConfirms`)."""
    reply = await backend.abort(rid)
    dropped = False
    for key in backend.in_band.take(rid):
        try:
            dropped = (await backend.evict(key)).evicted or dropped
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the abort itself is done: say so all the same
            log.warning("request %s: dropping an anchor it confirmed failed: %s", rid, e)
    return msgspec.structs.replace(reply, aborted=True) if dropped else reply


def _rid(body: Any) -> str:
    rid = _obj(body).get("rid")
    if not isinstance(rid, str):
        raise WireError("'rid' must be a string")
    return rid


def _output_tokens(body: Any) -> int | None:
    n = _obj(body).get("output_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise WireError("'output_tokens' must be a non-negative integer or null")
    return n


def _lookup(backend: Backend, body: Any) -> Awaitable[wire.LookupReply]:
    d = _obj(body)
    try:
        namespace = bytes.fromhex(d.get("namespace", ""))
    except (TypeError, ValueError) as e:
        raise WireError(f"lookup needs namespace, input_ids and depths: {e}") from None
    ids, depths = parse_ids(d.get("input_ids"), "input_ids"), parse_ids(d.get("depths"), "depths")
    if any(not 1 <= depth <= len(ids) for depth in depths):
        raise WireError(f"every depth must be in [1, {len(ids)}] (the input ids' length)")
    return backend.lookup(namespace, ids, depths)


def _json(data: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(data))


def error_json(message: str, status: int) -> bytes:
    """`{"error": {"message", "type", "code"}}`, the contract's (and OpenAI's) error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = "invalid_request" if status == 400 else "worker_error" if status == 500 else str(status)
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


OPEN_PATHS = ("/health",)  # answered without the worker secret (probes, the proxy's health)


def authorized(path: str, authorization: str | None, secret: str | None) -> bool:
    """Whether a call to `path` with this `Authorization` header may be served: always
    without a secret, else only with `Bearer SECRET` (compared in constant time) or on
    `OPEN_PATHS`."""
    if secret is None or path in OPEN_PATHS:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              secret.encode())


UNAUTHORIZED = Reply(401, error_json("this worker needs its secret: send 'Authorization: Bearer "
                                     "SECRET' (the proxy's --worker-secret)", 401))


def _status(e: BaseException) -> int | None:
    if isinstance(e, (WireError, orjson.JSONDecodeError)):
        return 400
    status = getattr(e, "status", None)  # ContractError, SGLang's SchedulerError and Aborted
    return status if isinstance(status, int) and 400 <= status < 600 else None


def error_reply(e: Exception) -> Reply:
    """The one error table: WireError and bad JSON are 400s, an error that carries an HTTP
    `status` that status, anything else a 500 (logged)."""
    status = _status(e)
    if status is None:
        log.error("worker request failed", exc_info=e)
        return Reply(500, error_json(f"{type(e).__name__}: {e}", 500))
    return Reply(status, error_json(str(e), status))


# ---- routes --------------------------------------------------------------------------------

Call = Callable[[Backend, Any], Awaitable[Any]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    call: Call  # (backend, parsed body) → a wire record (a dict: /debug/fault; bytes: a file)
    raw: bool = False  # the body is handed over as bytes, not parsed as JSON


SLAB_CONTENT_TYPE = "application/octet-stream"


ROUTES: tuple[Route, ...] = (
    Route("POST", "/abort_request", lambda b, body: _abort(b, _rid(body))),
    Route("POST", "/stop_request", lambda b, body: b.stop(_rid(body), _output_tokens(body))),
    Route("GET", "/health", lambda b, _: b.health()),
    Route("GET", "/model_info", lambda b, _: b.model_info()),
    Route("POST", "/flush_cache", lambda b, _: b.flush(device=True)),
    Route("POST", "/anchor/flush", lambda b, _: b.flush(device=False)),
    Route("POST", "/anchor/confirm", _confirm),
    Route("POST", "/anchor/abort", lambda b, body: b.abort_slots(slots_arg(body))),
    Route("POST", "/anchor/lookup", _lookup),
    Route("GET", "/anchor/slots", lambda b, _: b.slots()),
    Route("GET", "/anchor/stats", lambda b, _: b.stats()),
    Route("POST", "/anchor/pin", _pin),
    Route("POST", "/anchor/unpin", lambda b, body: b.unpin(key_arg(body))),
    Route("POST", "/anchor/evict", lambda b, body: b.evict(key_arg(body))),
    Route("POST", "/anchor/verify",
          lambda b, body: b.verify(key_arg(body), cache_key_arg(body))),
    Route("POST", "/anchor/export", lambda b, body: b.export_slab(key_arg(body))),
    Route("POST", "/anchor/import", lambda b, body: b.import_slab(body), raw=True),
)
FAULT_ROUTE = Route("POST", "/debug/fault", lambda b, body: b.fault(_obj(body)))


def routes(fault_injection: bool) -> tuple[Route, ...]:
    """The contract's routes but `/generate` (see `generate`)."""
    return ROUTES + ((FAULT_ROUTE,) if fault_injection else ())


async def handle(backend: Backend, route: Route, raw: bytes) -> Reply:
    try:
        body = raw if route.raw else read_body(raw) if route.method == "POST" else {}
        result = await route.call(backend, body)
        if isinstance(result, bytes):
            return Reply(200, result, SLAB_CONTENT_TYPE)
        return Reply(200, encode(result))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        return error_reply(e)


# ---- /generate -----------------------------------------------------------------------------

def _token_json(rid: str, req: GenerateRequest, ev: Tokens) -> dict[str, Any]:
    data: dict[str, Any] = {"rid": rid, "output_ids": list(ev.output_ids)}
    if req.sampling.n > 1:
        data["index"] = ev.index
    if ev.logprobs is not None:  # SGLang's shapes: [logprob, token_id, text], text left out
        data["output_token_logprobs"] = [[lp, t, None] for lp, t in ev.logprobs]
        if req.top_logprobs_num:
            data["output_top_logprobs"] = [[[lp, t, None] for lp, t in top]
                                           for top in ev.top_logprobs or ()]
    return data


def _meta_json(rid: str, req: GenerateRequest, meta: GenerateMeta) -> dict[str, Any]:
    data: dict[str, Any] = {"rid": rid, "output_ids": [],
                            "meta_info": orjson.Fragment(encode(meta))}
    if req.sampling.n > 1:
        data["index"] = meta.index
    return data


async def _run(backend: Backend, req: GenerateRequest, handle_: Any
               ) -> AsyncGenerator[Event, None]:
    """The request's events, then `finish` (also when the consumer stops early: an async
    generator left at a yield runs its `finally` only when closed, so each is closed). With
    the plan's `confirm`, a meta goes out with the anchors it lists written confirmed."""
    events = backend.generate(handle_)
    kept = Confirmation() if req.anchor is not None and req.anchor.confirm else None
    ok = False
    try:
        async for ev in events:
            if kept is not None and isinstance(ev, GenerateMeta) and ev.anchors.written:
                ev, kept = await _confirmed(backend, req, ev, kept)
            yield ev
        ok = True
    finally:
        try:
            await events.aclose()
        finally:
            await asyncio.shield(backend.finish(handle_, ok))


async def _confirmed(backend: Backend, req: GenerateRequest, meta: GenerateMeta,
                     kept: Confirmation) -> tuple[GenerateMeta, Confirmation]:
    """`meta` (a sample's end) with its written anchors confirmed, as `/anchor/confirm`
    would (`kept`: what the request's earlier samples confirmed, their victims included,
    and the same with this one's). A confirm that fails leaves `meta` unconfirmed: the
    proxy confirms it itself."""
    written = {w.slot for w in meta.anchors.written}
    todo = sorted(written - set(kept.slots))
    if todo:
        try:
            reply = await backend.confirm(todo, req.rid)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("request %s: confirming its anchors failed: %s", req.rid, e)
            return meta, kept
        kept = Confirmation(kept.slots + reply.confirmed, kept.evicted + reply.evicted)
        done = set(reply.confirmed)
        backend.in_band.note(req.rid or "", [w.key for w in meta.anchors.written
                                            if w.slot in done])
    mine = Confirmation(tuple(s for s in kept.slots if s in written), kept.evicted)
    return msgspec.structs.replace(
        meta, anchors=msgspec.structs.replace(meta.anchors, confirmed=mine)), kept


async def generate(backend: Backend, raw: bytes, context: Any = None) -> Reply | Stream:
    """`POST /generate`: a JSON reply (a list of them for n > 1, SGLang's batch shape), or
    with `stream` a `Stream` whose errors after the first event are sent in-band."""
    try:
        req = decode(raw if raw.strip() else b"{}", GenerateRequest)
        if not req.rid:
            req = msgspec.structs.replace(req, rid=uuid.uuid4().hex)
        handle_ = await backend.prepare(req, context)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        return error_reply(e)
    rid = req.rid
    assert rid is not None
    if req.stream:
        return _stream(backend, req, handle_)
    outputs: list[dict[str, Any]] = [{"rid": rid, "output_ids": []} for _ in range(req.sampling.n)]
    events = _run(backend, req, handle_)
    try:
        async for ev in events:
            out = outputs[ev.index or 0]
            if isinstance(ev, Tokens):
                token = _token_json(rid, req, ev)
                out["output_ids"].extend(ev.output_ids)
                for key in ("output_token_logprobs", "output_top_logprobs"):
                    if key in token:
                        out.setdefault(key, []).extend(token[key])
            else:
                out["meta_info"] = orjson.Fragment(encode(ev))
                if req.sampling.n > 1:
                    out["index"] = ev.index
    except asyncio.CancelledError:
        raise
    except Exception as e:
        return error_reply(e)
    finally:
        await events.aclose()
    return _json(outputs if req.sampling.n > 1 else outputs[0])


async def _stream(backend: Backend, req: GenerateRequest, handle_: Any) -> Stream:
    rid = req.rid or ""
    events = _run(backend, req, handle_)
    try:
        async for ev in events:
            data = _token_json(rid, req, ev) if isinstance(ev, Tokens) else _meta_json(rid, req, ev)
            yield b"data: " + orjson.dumps(data) + b"\n\n"
    except (asyncio.CancelledError, ConnectionResetError, GeneratorExit):
        await events.aclose()
        raise
    except Exception as e:  # headers are sent: the error goes in-band, then the stream ends
        status = _status(e)
        if status is None:
            log.exception("streamed generate failed")
        message = str(e) if status is not None else f"{type(e).__name__}: {e}"
        err = {"error": {"message": message, "type": "server_error", "code": "worker_error"}}
        yield b"data: " + orjson.dumps(err) + b"\n\n"
    yield b"data: [DONE]\n\n"
