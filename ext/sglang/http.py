"""HTTP side of the SGLang worker: the worker contract served by SGLang's own HTTP process.

`install(app, worker)` replaces SGLang's native `/generate`, `/health`, `/model_info`,
`/flush_cache` and `/abort_request` routes on SGLang's FastAPI app with the contract's
(docs/worker-protocol.md) and adds `/anchor/*`. A contract `/generate` runs as:

1. `prepare` (RPC to the scheduler): verify and restore the anchor chain into SGLang's
   pool and tree, lock it, register the snapshot cuts;
2. SGLang's own `TokenizerManager.generate_request`, exactly as its `/generate` route
   calls it, so requests are batched by SGLang as usual;
3. `finish` (RPC): snapshots taken at SGLang's checkpoints come back, locks are dropped.

Every anchor operation crosses to the scheduler through `SchedulerRpc`: SGLang's RPC
socket (`RpcReqInput` → `Scheduler.handle_rpc_request` → `scheduler.tree_cache(...)`),
one call at a time; the reply data comes back on our own PULL socket.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import zmq
import zmq.asyncio

from anchorcache.wire import GenerateRequest, SamplingParams, WireError, parse_generate

log = logging.getLogger("anchorcache.sglang")

RPC_TIMEOUT_S = 120.0
OUR_ROUTES = ("/generate", "/health", "/model_info", "/flush_cache", "/abort_request")


class SchedulerError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class SchedulerRpc:
    """Calls `AnchorRadixCache.__call__` on the scheduler's loop; one call at a time."""

    def __init__(self, rpc_ipc_name: str) -> None:
        self.rpc_ipc_name = rpc_ipc_name
        self.reply_to = f"ipc://{tempfile.mktemp(prefix='anchorcache-reply-')}"
        self._ctx: zmq.asyncio.Context | None = None
        self._dealer: Any = None
        self._pull: Any = None
        self._lock: asyncio.Lock | None = None
        self._calls = 0

    def _open(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.bind(self.rpc_ipc_name)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.reply_to)
        self._lock = asyncio.Lock()

    async def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        from sglang.srt.managers.io_struct import RpcReqInput, async_sock_recv, async_sock_send

        if self._ctx is None:
            self._open()
        assert self._lock is not None
        async with self._lock:
            self._calls += 1
            call_id = self._calls
            params = {"op": op, "payload": orjson.dumps(body).decode(),
                      "reply_to": self.reply_to, "call_id": call_id}
            await async_sock_send(self._dealer, RpcReqInput(method="tree_cache", parameters=params))
            done = await asyncio.wait_for(async_sock_recv(self._dealer), RPC_TIMEOUT_S)
            if not done.success:
                raise SchedulerError(500, f"scheduler RPC {op} failed: {done.message}")
            while True:
                reply = orjson.loads(await asyncio.wait_for(self._pull.recv(), RPC_TIMEOUT_S))
                if reply.get("call_id") == call_id:
                    break
        if not reply.pop("ok"):
            raise SchedulerError(int(reply.get("status", 500)), str(reply.get("message")))
        reply.pop("call_id", None)
        return reply


class SGLangWorker:
    """What the contract routes need in SGLang's HTTP process."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.model_id = Path(model_path).name
        self.rpc: SchedulerRpc | None = None
        self.epoch: str | None = None

    def init_tokenizer_manager(self, server_args: Any, port_args: Any, *args: Any) -> Any:
        """`launch_server`'s tokenizer-manager factory: SGLang's own, plus the RPC socket name."""
        from sglang.srt.entrypoints.engine import init_tokenizer_manager

        self.rpc = SchedulerRpc(port_args.rpc_ipc_name)
        return init_tokenizer_manager(server_args, port_args, *args)

    @property
    def tm(self) -> Any:
        from sglang.srt.entrypoints.http_server import get_global_state

        return get_global_state().tokenizer_manager

    async def call(self, op: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.rpc is None:
            raise SchedulerError(503, "the scheduler RPC channel is not set up")
        reply = await self.rpc.call(op, body or {})
        self.epoch = reply.pop("epoch", self.epoch)
        return reply

    async def ready(self) -> bool:
        if self.epoch is None:
            try:
                await self.call("hello")
            except (SchedulerError, asyncio.TimeoutError):
                return False
        return self.epoch is not None


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
    return orjson.loads(await request.body())


# ---- /generate ---------------------------------------------------------------------------

def _sglang_sampling(p: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature,
                           "top_p": p.top_p, "top_k": p.top_k,
                           "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos}
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


def _finish(meta: dict[str, Any], output_ids: list[int]) -> dict[str, Any]:
    reason = meta.get("finish_reason") or {"type": "abort"}
    kind = reason.get("type")
    if kind == "stop":
        matched = reason.get("matched")
        return {"type": "stop", "matched": matched if isinstance(matched, int) else None}
    if kind == "length":
        return {"type": "length", "length": len(output_ids)}
    return {"type": "abort"}


async def generate(request: Any, worker: SGLangWorker) -> Any:
    from fastapi import HTTPException
    from fastapi.responses import StreamingResponse
    from sglang.srt.managers.io_struct import GenerateReqInput

    req = parse_generate(await _body(request))
    tm = worker.tm
    limit = max_request_tokens(tm)
    if len(req.input_ids) + req.sampling.max_new_tokens > limit:
        raise WireError(f"prompt ({len(req.input_ids)} tokens) + max_new_tokens "
                        f"({req.sampling.max_new_tokens}) exceeds the context of {limit} "
                        f"tokens (the model's context or what SGLang's KV pool holds for "
                        f"one request, whichever is smaller)")
    vocab = int(tm.model_config.hf_config.vocab_size)
    if min(req.input_ids) < 0 or max(req.input_ids) >= vocab:
        raise WireError(f"input_ids must lie in [0, {vocab}) (the model's vocabulary)")
    rid = req.rid or uuid.uuid4().hex
    if rid in tm.rid_to_state:
        raise WireError(f"request id {rid!r} is already running")
    await worker.ready()
    t0 = time.perf_counter()
    prep = None
    if req.anchor is not None:
        prep = await worker.call("prepare", {"rid": rid, "input_ids": list(req.input_ids),
                                             "anchor": req.anchor.to_json()})
    restore_ms = (time.perf_counter() - t0) * 1e3
    obj = GenerateReqInput(rid=rid, input_ids=list(req.input_ids),
                           sampling_params=_sglang_sampling(req.sampling), stream=req.stream)
    run = _Run(worker, req, rid, prep, restore_ms)
    if not req.stream:
        ok = False
        try:
            out = await tm.generate_request(obj, request).__anext__()
            run.add(out)
            ok = run.finish_reason.get("type") != "abort"
        except ValueError as e:  # SGLang's way of refusing a request (its 400)
            raise WireError(str(e)) from None
        except HTTPException as e:
            raise SchedulerError(e.status_code, str(e.detail)) from None
        finally:
            meta = await asyncio.shield(run.meta(ok))
        if not ok:
            return _abort_error(run)
        return _json({"rid": rid, "output_ids": run.output_ids, "meta_info": meta})

    async def events() -> AsyncIterator[bytes]:
        ok = False
        try:
            async for out in tm.generate_request(obj, request):
                new = run.add(out)
                if new:
                    yield b"data: " + orjson.dumps({"rid": rid, "output_ids": new}) + b"\n\n"
            ok = run.finish_reason.get("type") != "abort"
            if not ok:
                await asyncio.shield(run.meta(False))
                err = orjson.loads(_abort_error(run).body)
                yield b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"
                return
        except (asyncio.CancelledError, GeneratorExit):
            await asyncio.shield(run.meta(False))
            raise
        except Exception as e:
            log.exception("streamed generate failed")
            await asyncio.shield(run.meta(False))
            err = {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                             "code": "worker_error"}}
            yield b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"
            return
        meta = await asyncio.shield(run.meta(ok))
        yield b"data: " + orjson.dumps({"rid": rid, "output_ids": [], "meta_info": meta}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def max_request_tokens(tm: Any) -> int:
    """Prompt + completion tokens one request may have: the model's context, or less when
    SGLang's KV pool is smaller (SGLang refuses prompts of `max_req_input_len` tokens)."""
    limit = int(tm.context_len)
    pool = getattr(tm, "max_req_input_len", None)
    return min(limit, int(pool)) if pool else limit


def _abort_error(run: _Run) -> Any:
    """The error reply for a request SGLang aborted: never a completion (its status when
    SGLang gave one, e.g. 400 for a prompt over the pool; else a 502)."""
    reason = run.sglang_meta.get("finish_reason") or {}
    status = reason.get("status_code") if isinstance(reason, dict) else None
    message = reason.get("message") if isinstance(reason, dict) else None
    status = int(status) if isinstance(status, int) and 400 <= status < 600 else 502
    text = f"SGLang aborted the request: {message or 'no reason given'}"
    if status == 400 and "length" in text:
        text += " (over the context SGLang's KV pool holds for one request)"
    return _error(text, status)


class _Run:
    """One contract request over SGLang's output chunks."""

    def __init__(self, worker: SGLangWorker, req: GenerateRequest, rid: str,
                 prep: dict[str, Any] | None, restore_ms: float) -> None:
        self.worker, self.req, self.rid, self.prep = worker, req, rid, prep
        self.restore_ms = restore_ms
        self.output_ids: list[int] = []
        self.sglang_meta: dict[str, Any] = {}
        self.finish_reason: dict[str, Any] = {"type": "abort"}
        self._done: dict[str, Any] | None = None
        self.t0 = time.perf_counter()

    def add(self, out: dict[str, Any]) -> list[int]:
        ids = list(out.get("output_ids") or [])
        if getattr(self.worker.tm, "incremental_streaming_output", False) and self.req.stream:
            new = ids
        else:
            new = ids[len(self.output_ids):]
        self.output_ids.extend(new)
        self.sglang_meta = out.get("meta_info") or {}
        if self.sglang_meta.get("finish_reason") is not None:
            self.finish_reason = _finish(self.sglang_meta, self.output_ids)
        return new

    async def meta(self, ok: bool) -> dict[str, Any]:
        if self._done is not None:
            return self._done
        anchors: dict[str, Any] = {"restored": [], "restore_miss": [], "written": [],
                                   "held": []}
        if self.prep is not None:
            anchors.update(self.prep["anchors"])
            fin = await self.worker.call("finish", {"rid": self.rid, "ok": ok})
            anchors["written"] = fin["written"]
            anchors["held"] = [*anchors.get("held", []), *fin["held"]]
            anchors["restored_tokens"] = self.prep["restored_tokens"]
        m = self.sglang_meta
        n = len(self.req.input_ids)
        cached = int(m.get("cached_tokens") or 0)
        self._done = {
            "id": self.rid, "prompt_tokens": n, "completion_tokens": len(self.output_ids),
            "cached_tokens": cached, "prefill_tokens": n - cached,
            "restore_ms": round(self.restore_ms, 3),
            "prefill_ms": 0.0, "decode_ms": round((time.perf_counter() - self.t0) * 1e3, 3),
            "finish_reason": self.finish_reason, "anchors": anchors,
            "epoch": self.worker.epoch,
        }
        return self._done


# ---- other contract routes ---------------------------------------------------------------

async def health(request: Any, worker: SGLangWorker) -> Any:
    if not await worker.ready():
        return _error("the scheduler is not ready", 503)
    rids = [r for r in worker.tm.rid_to_state if not str(r).startswith("HEALTH_CHECK")]
    return _json({"status": "ok", "epoch": worker.epoch, "running_requests": rids,
                  "queued_requests": []})


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
    return _json({"model_id": worker.model_id, "model_path": worker.model_path,
                  "tokenizer_path": worker.model_path, "is_generation": True,
                  "architecture": archs[0], "max_context_tokens": max_request_tokens(tm),
                  "eos_token_ids": sorted(eos), "hybrid": False,
                  "vocab_size": int(getattr(hf, "vocab_size", 0)), "backend": "sglang",
                  "epoch": worker.epoch})


async def flush_cache(request: Any, worker: SGLangWorker) -> Any:
    """SGLang's own flush of its device tree; the host anchors survive it (see the docs)."""
    ret = await worker.tm.flush_cache()
    if not ret.success:
        return _error(ret.message or "SGLang refused to flush: requests are running", 409)
    await worker.ready()
    return _json({"flushed_anchors": 0, "flushed_device": True, "epoch": worker.epoch})


async def abort_request(request: Any, worker: SGLangWorker) -> Any:
    body = await _body(request)
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise WireError("'rid' must be a string")
    running = rid in worker.tm.rid_to_state
    if running:
        worker.tm.abort_request(rid=rid)
    dropped = (await worker.call("abort_request", {"rid": rid}))["dropped"]
    return _json({"rid": rid, "aborted": running or bool(dropped), "epoch": worker.epoch})


def _anchor_route(op: str, has_body: bool) -> Callable[[Any, SGLangWorker], Awaitable[Any]]:
    async def route(request: Any, worker: SGLangWorker) -> Any:
        body = await _body(request) if has_body else {}
        if not isinstance(body, dict):
            raise WireError("body must be an object")
        reply = await worker.call(op, body)
        return _json({**reply, "epoch": worker.epoch})

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
                             ("/anchor/flush", "flush_anchors", "POST")]:
        add(path, _anchor_route(op, method == "POST"), method)
