"""HTTP face of the embedded worker: the worker contract of docs/worker-protocol.md.

SGLang's native API is the base (`/generate`, `/abort_request`, `/health`, `/model_info`,
`/flush_cache`); anchor operations live under `/anchor/`. Every reply carries `epoch`, a
fresh id per process start: anchors never outlive the epoch that wrote them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from anchorcache.wire import (
    AbortReply,
    FlushReply,
    GenerateRequest,
    ModelInfo,
    WireError,
    WorkerHealth,
    parse_generate,
)

from .engine import Engine, ErrorEvent, FinishEvent, Job, TokenEvent

log = logging.getLogger("anchorcache.worker")


ENGINE = web.AppKey("engine", Engine)
INFO = web.AppKey("info", ModelInfo)
EPOCH = web.AppKey("epoch", str)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_body(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _json(error_body(e.reason, "invalid_request_error" if e.status < 500 else "server_error",
                                str(e.status)), e.status)
    except (WireError, orjson.JSONDecodeError) as e:
        return _json(error_body(str(e), "invalid_request_error", "invalid_request"), 400)
    except (HttpProcessingError, web.RequestPayloadError) as e:  # e.g. gzip that is not
        return _json(error_body(f"unreadable request body: {e}", "invalid_request_error",
                                "invalid_request"), 400)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("worker request failed")
        return _json(error_body(f"{type(e).__name__}: {e}", "server_error", "worker_error"), 500)


async def _body(request: web.Request) -> Any:
    return orjson.loads(await request.read())


def _check_input(request: web.Request, req: GenerateRequest) -> None:
    """What the parser cannot know: the model's vocabulary and context."""
    info = request.app[INFO]
    lo, hi = min(req.input_ids), max(req.input_ids)
    if lo < 0 or hi >= info.vocab_size:
        bad = lo if lo < 0 else hi
        raise WireError(f"'input_ids' holds {bad}, outside the vocabulary [0, {info.vocab_size})")
    n_prompt, max_new = len(req.input_ids), req.sampling.max_new_tokens
    if n_prompt + max_new > info.max_context_tokens:
        raise WireError(f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new}) exceeds the "
                        f"model's context of {info.max_context_tokens} tokens")


async def _events(request: web.Request, job: Job) -> AsyncIterator[TokenEvent | FinishEvent]:
    """Yield the job's events up to its last finish; abort the job if this handler is
    cancelled (client gone)."""
    engine = request.app[ENGINE]
    done = False
    try:
        while True:
            event = await job.events.get()
            if isinstance(event, ErrorEvent):
                done = True
                raise event.error
            if isinstance(event, FinishEvent) and event.last:
                done = True  # before the yield: the consumer may stop right after it
                yield event
                return
            yield event
    finally:
        if not done:
            engine.abort(job.rid)


def _meta(request: web.Request, event: FinishEvent) -> dict[str, Any]:
    return replace(event.meta, epoch=request.app[EPOCH]).to_json()


def _token_json(job: Job, event: TokenEvent) -> dict[str, Any]:
    data: dict[str, Any] = {"rid": job.rid, "output_ids": list(event.output_ids)}
    if job.req.sampling.n > 1:
        data["index"] = event.index
    if event.picks is not None:
        # SGLang's shapes: [logprob, token_id, text] with text left out (null)
        data["output_token_logprobs"] = [[p.logprob, p.token, None] for p in event.picks]
        if job.req.top_logprobs_num:
            data["output_top_logprobs"] = [[[lp, t, None] for t, lp in p.top] for p in event.picks]
    return data


async def _compile(request: web.Request, req: GenerateRequest) -> Any:
    """The request's compiled constraint (None without one); WireError (400) if invalid."""
    constraint = req.sampling.constraint
    if constraint is None:
        return None
    grammars = request.app[ENGINE].grammars
    if grammars is None:
        raise WireError("this worker does not support constrained decoding")
    # compiling a large schema takes a while: off the event loop
    return await asyncio.get_running_loop().run_in_executor(None, grammars.compile, *constraint)


async def generate(request: web.Request) -> web.StreamResponse:
    req = parse_generate(await _body(request))
    _check_input(request, req)
    grammar = await _compile(request, req)
    try:
        job = request.app[ENGINE].submit(req, grammar=grammar)
    except ValueError as e:
        raise WireError(str(e)) from None
    n = req.sampling.n
    if not req.stream:
        outputs: list[dict[str, Any]] = [{"rid": job.rid, "output_ids": []} for _ in range(n)]
        async for event in _events(request, job):
            out = outputs[event.index]
            if isinstance(event, TokenEvent):
                token = _token_json(job, event)
                out["output_ids"].extend(event.output_ids)
                for key in ("output_token_logprobs", "output_top_logprobs"):
                    if key in token:
                        out.setdefault(key, []).extend(token[key])
            else:
                out["meta_info"] = _meta(request, event)
                if n > 1:
                    out["index"] = event.index
        # n > 1: a list of replies, one per sample (SGLang's batch shape)
        return _json(outputs if n > 1 else outputs[0])

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async for event in _events(request, job):
            data: dict[str, Any]
            if isinstance(event, TokenEvent):
                data = _token_json(job, event)
            else:
                data = {"rid": job.rid, "output_ids": [], "meta_info": _meta(request, event)}
                if n > 1:
                    data["index"] = event.index
            await resp.write(b"data: " + orjson.dumps(data) + b"\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # headers are sent: report the error in-band, then end the stream
        log.exception("streamed generate failed")
        body = error_body(f"{type(e).__name__}: {e}", "server_error", "worker_error")
        await resp.write(b"data: " + orjson.dumps(body) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request)
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise WireError("'rid' must be a string")
    return _json(AbortReply(rid, request.app[ENGINE].abort(rid), request.app[EPOCH]).to_json())


async def health(request: web.Request) -> web.Response:
    jobs = request.app[ENGINE].jobs()
    return _json(WorkerHealth("ok", request.app[EPOCH],
                              tuple(j.rid for j in jobs if j.started),
                              tuple(j.rid for j in jobs if not j.started)).to_json())


async def model_info(request: web.Request) -> web.Response:
    return _json(replace(request.app[INFO], epoch=request.app[EPOCH]).to_json())


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    flushed = engine.anchors.flush() if engine.anchors is not None else 0
    return _json(FlushReply(flushed, request.app[EPOCH]).to_json())


async def inject_fault(request: web.Request) -> web.Response:
    """Arm one fault: the next time the engine passes `where` it raises, or with
    `"hang": true` its thread blocks there for good, while the HTTP side keeps answering
    (a wedged engine: what `serve`'s supervisor must notice). Tests only."""
    body = await _body(request)
    where = body.get("where") if isinstance(body, dict) else None
    if where not in ("start", "prefill", "decode", "snapshot", "restore"):
        raise WireError("'where' must be start, prefill, decode, snapshot or restore")
    hang = body.get("hang", False)
    if not isinstance(hang, bool):
        raise WireError("'hang' must be a boolean")
    engine = request.app[ENGINE]

    def hook(at: str) -> None:
        if at == where:
            engine.fault_hook = None
            if hang:
                threading.Event().wait()  # never set: only the process's end frees the thread
            raise RuntimeError(f"injected fault at {at}")

    engine.fault_hook = hook
    return _json({"armed": where, "hang": hang})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/health", health)
    app.router.add_get("/model_info", model_info)
    app.router.add_post("/flush_cache", flush_cache)
