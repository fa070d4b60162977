"""HTTP side of the SGLang worker: the worker contract served by SGLang's own HTTP process.

`install(app, worker)` replaces SGLang's native `/generate`, `/health`, `/model_info`,
`/flush_cache` and `/abort_request` routes on SGLang's FastAPI app with the contract's
(docs/worker-protocol.md) and adds `/anchor/*`. A contract `/generate` is a `Run`
(`run.py`); every anchor operation crosses to the scheduler's loop through the scheduler
RPC (`rpc.py`); the worker's state and limits are `SGLangWorker` (`worker.py`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from anchorcache.wire import (
    AbortReply,
    FlushReply,
    ModelInfo,
    WireError,
    WorkerHealth,
    parse_confirm,
    parse_flush,
    parse_generate,
    parse_key_op,
    parse_lookup,
    parse_slots,
    parse_slots_aborted,
    parse_stats,
    parse_verify,
)

from .config import SGLangAnchorConfig
from .rpc import SchedulerError
from .run import Aborted, Run
from .worker import SGLangWorker

log = logging.getLogger("anchorcache.sglang")

OUR_ROUTES = ("/generate", "/health", "/model_info", "/flush_cache", "/abort_request")


# ---- replies -----------------------------------------------------------------------------

def _json(data: Any, status: int = 200) -> Any:
    from fastapi.responses import Response

    return Response(content=orjson.dumps(data), status_code=status, media_type="application/json")


def _error(message: str, status: int) -> Any:
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = "invalid_request" if status == 400 else str(status)
    return _json({"error": {"message": message, "type": kind, "code": code}}, status)


def _handler(fn: Callable[[Any, SGLangWorker], Awaitable[Any]], worker: SGLangWorker
             ) -> Callable[[Any], Awaitable[Any]]:
    async def route(request: Any) -> Any:
        try:
            return await fn(request, worker)
        except (WireError, orjson.JSONDecodeError) as e:
            return _error(str(e), 400)
        except SchedulerError as e:
            return _error(str(e), e.status)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("worker request failed")
            return _error(f"{type(e).__name__}: {e}", 500)

    route.__name__ = fn.__name__
    return route


async def _body(request: Any) -> Any:
    raw = await request.body()
    return orjson.loads(raw) if raw.strip() else {}


# ---- /generate ---------------------------------------------------------------------------

async def generate(request: Any, worker: SGLangWorker) -> Any:
    from fastapi.responses import StreamingResponse

    req = parse_generate(await _body(request))
    await worker.ready()
    worker.check_input(req)
    rid = req.rid or uuid.uuid4().hex
    run = Run(worker, req, rid, request)
    if rid in worker.samples or any(r in worker.tm.rid_to_state for r in run.sglang_rids()):
        raise WireError(f"request id {rid!r} (or one of its samples' ids) is already running")
    if not req.stream:
        outputs: list[dict[str, Any]] = [{"rid": rid, "output_ids": []} for _ in run.samples]
        try:
            async for event in run.events():
                out = outputs[event.get("index", 0)]
                out["output_ids"].extend(event["output_ids"])
                for key in ("output_token_logprobs", "output_top_logprobs"):
                    if key in event:
                        out.setdefault(key, []).extend(event[key])
                if "meta_info" in event:
                    out["meta_info"] = event["meta_info"]
                    if "index" in event:
                        out["index"] = event["index"]
        except Aborted as e:
            return _error(str(e), e.status)
        return _json(outputs if len(outputs) > 1 else outputs[0])

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in run.events():
                yield b"data: " + orjson.dumps(event) + b"\n\n"
        except (Aborted, WireError, SchedulerError) as e:
            err = {"error": {"message": str(e), "type": "server_error", "code": "worker_error"}}
            yield b"data: " + orjson.dumps(err) + b"\n\n"
        except Exception as e:
            log.exception("streamed generate failed")
            err = {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                             "code": "worker_error"}}
            yield b"data: " + orjson.dumps(err) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ---- other contract routes ---------------------------------------------------------------

async def health(request: Any, worker: SGLangWorker) -> Any:
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    if not await worker.ready():
        return _error("the scheduler is not ready", 503)
    samples = {r for rids in worker.samples.values() for r in rids}
    rids = [r for r in worker.tm.rid_to_state
            if not str(r).startswith(HEALTH_CHECK_RID_PREFIX) and r not in samples]
    rids += [r for r in worker.samples if r not in rids]
    return _json(WorkerHealth("ok", worker.epoch or "", tuple(rids)).to_json())


async def model_info(request: Any, worker: SGLangWorker) -> Any:
    await worker.ready()
    tm = worker.tm
    hf = tm.model_config.hf_config
    eos: set[int] = set()
    for value in (getattr(tm.model_config, "hf_eos_token_id", None),
                  getattr(hf, "eos_token_id", None),
                  getattr(tm.tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, (list, tuple, set)):
            eos.update(int(v) for v in value)
    archs = getattr(hf, "architectures", None) or [type(hf).__name__]
    return _json(ModelInfo(
        model_id=worker.model_id, model_path=worker.model_path,
        tokenizer_path=worker.model_path, architecture=archs[0],
        max_context_tokens=worker.max_request_tokens(), eos_token_ids=tuple(sorted(eos)),
        hybrid=False, vocab_size=int(getattr(hf, "vocab_size", 0)), backend="sglang",
        epoch=worker.epoch or "").to_json())


async def flush_cache(request: Any, worker: SGLangWorker) -> Any:
    """SGLang's own flush of its device tree; the host anchors survive it (see the docs)."""
    ret = await worker.tm.flush_cache()
    if not ret.success:
        return _error(ret.message or "SGLang refused to flush: requests are running", 409)
    await worker.ready()
    return _json(FlushReply(0, worker.epoch or "", flushed_device=True).to_json())


async def abort_request(request: Any, worker: SGLangWorker) -> Any:
    body = await _body(request)
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise WireError("'rid' must be a string")
    running = False
    for r in {rid, *worker.samples.get(rid, ())}:
        if r in worker.tm.rid_to_state:
            worker.tm.abort_request(rid=r)
            running = True
    dropped = (await worker.call("abort_request", {"rid": rid}))["dropped"]
    return _json(AbortReply(rid, running or bool(dropped), worker.epoch or "").to_json())


# each anchor operation's reply record (wire.py): the scheduler's reply is parsed and
# served again, so a reply that does not fit its record is a 500, never passed on
_RECORDS: dict[str, Callable[[Any], Any]] = {
    "confirm": parse_confirm, "abort": parse_slots_aborted, "lookup": parse_lookup,
    "slots": parse_slots, "stats": parse_stats,
    "pin": lambda d: parse_key_op(d, "pinned"), "unpin": lambda d: parse_key_op(d, "unpinned"),
    "evict": lambda d: parse_key_op(d, "evicted"), "flush_anchors": parse_flush,
    "verify": parse_verify}


def _anchor_route(op: str, has_body: bool) -> Callable[[Any, SGLangWorker], Awaitable[Any]]:
    async def route(request: Any, worker: SGLangWorker) -> Any:
        body = await _body(request) if has_body else {}
        if not isinstance(body, dict):
            raise WireError("body must be an object")
        reply = {**await worker.call(op, body), "epoch": worker.epoch}
        record = _RECORDS.get(op)
        if record is None:  # /debug/fault
            return _json(reply)
        try:
            return _json(record(reply).to_json())
        except WireError as e:
            raise RuntimeError(f"malformed scheduler reply to {op}: {e}") from None

    route.__name__ = f"anchor_{op}"
    return route


def install(app: Any, worker: SGLangWorker) -> None:
    """Put the contract's routes on SGLang's FastAPI `app` (before it starts serving)."""
    app.router.routes = [r for r in app.router.routes
                         if getattr(r, "path", None) not in OUR_ROUTES]

    def add(path: str, fn: Callable[[Any, SGLangWorker], Awaitable[Any]], method: str) -> None:
        # a plain Starlette route: the handler gets the Request itself, no FastAPI injection
        app.add_route(path, _handler(fn, worker), methods=[method])

    add("/generate", generate, "POST")
    add("/health", health, "GET")
    add("/model_info", model_info, "GET")
    add("/flush_cache", flush_cache, "POST")
    add("/abort_request", abort_request, "POST")
    for path, op, method in [("/anchor/confirm", "confirm", "POST"),
                             ("/anchor/abort", "abort", "POST"),
                             ("/anchor/lookup", "lookup", "POST"),
                             ("/anchor/slots", "slots", "GET"),
                             ("/anchor/stats", "stats", "GET"),
                             ("/anchor/pin", "pin", "POST"),
                             ("/anchor/unpin", "unpin", "POST"),
                             ("/anchor/evict", "evict", "POST"),
                             ("/anchor/flush", "flush_anchors", "POST"),
                             ("/anchor/verify", "verify", "POST")]:
        add(path, _anchor_route(op, method == "POST"), method)
    if SGLangAnchorConfig.from_env().fault_injection:
        add("/debug/fault", _anchor_route("fault", True), "POST")
