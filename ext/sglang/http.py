"""HTTP side of the SGLang worker: the worker contract served by SGLang's own HTTP process.

`install(app, worker)` replaces SGLang's native `/generate`, `/health`, `/model_info`,
`/flush_cache` and `/abort_request` routes on SGLang's FastAPI app with the contract's
(docs/worker-protocol.md) and adds `/anchor/*`. A contract `/generate` runs as:

1. `prepare` (RPC to the scheduler): verify and restore the anchor chain into SGLang's
   pool and tree, lock it, register the snapshot cuts;
2. SGLang's own `TokenizerManager.generate_request`, as its `/generate` route calls it, so
   requests are batched by SGLang as usual; sampling parameters (constraints, seed,
   logprobs) pass through under SGLang's names. With `n > 1` the prompt is prefilled once,
   then the samples run as `n` SGLang requests (`_Run`);
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import zmq
import zmq.asyncio

from anchorcache.wire import GenerateRequest, SamplingParams, WireError, parse_generate

from .config import SGLangAnchorConfig

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
        self.pin_budget_tokens = 0  # the scheduler's (hello): kept out of every request
        self.samples: dict[str, list[str]] = {}  # running request → its SGLang requests

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
                hello = await self.call("hello")
            except (SchedulerError, asyncio.TimeoutError):
                return False
            self.pin_budget_tokens = int(hello.get("pin_budget_tokens", 0))
        return self.epoch is not None

    def max_request_tokens(self) -> int:
        """Prompt + completion tokens one request may have: the model's context, or less
        when SGLang's KV pool is smaller (SGLang refuses prompts of `max_req_input_len`
        tokens), less the share of the pool pinned anchors may lock (so a request that is
        admitted always fits beside them)."""
        tm = self.tm
        limit = int(tm.context_len)
        pool = getattr(tm, "max_req_input_len", None)
        if pool:
            limit = min(limit, int(pool) - self.pin_budget_tokens)
        return limit


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

def _sglang_sampling(p: SamplingParams, index: int) -> dict[str, Any]:
    """SGLang's sampling parameters for sample `index` (its seed is `seed + index`); the
    constraint passes through under SGLang's own name, compiled by SGLang's grammar backend."""
    out: dict[str, Any] = {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature,
                           "top_p": p.top_p, "top_k": p.top_k,
                           "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos}
    if p.seed is not None:
        out["sampling_seed"] = p.seed + index
    if p.constraint is not None:
        kind, value = p.constraint
        out[kind] = value
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


class Aborted(Exception):
    """SGLang aborted a request: an error reply, never a completion."""

    def __init__(self, meta: dict[str, Any]) -> None:
        reason = meta.get("finish_reason") or {}
        status = reason.get("status_code") if isinstance(reason, dict) else None
        message = reason.get("message") if isinstance(reason, dict) else None
        self.status = int(status) if isinstance(status, int) and 400 <= status < 600 else 502
        text = f"SGLang aborted the request: {message or 'no reason given'}"
        if self.status == 400 and "length" in text:
            text += " (over the context SGLang's KV pool holds for one request)"
        super().__init__(text)


async def generate(request: Any, worker: SGLangWorker) -> Any:
    from fastapi.responses import StreamingResponse

    req = parse_generate(await _body(request))
    tm = worker.tm
    await worker.ready()
    limit = worker.max_request_tokens()
    if len(req.input_ids) + req.sampling.max_new_tokens > limit:
        raise WireError(f"prompt ({len(req.input_ids)} tokens) + max_new_tokens "
                        f"({req.sampling.max_new_tokens}) exceeds the context of {limit} "
                        f"tokens (the model's context or what SGLang's KV pool holds for "
                        f"one request, whichever is smaller)")
    vocab = int(tm.model_config.hf_config.vocab_size)
    if min(req.input_ids) < 0 or max(req.input_ids) >= vocab:
        raise WireError(f"input_ids must lie in [0, {vocab}) (the model's vocabulary)")
    rid = req.rid or uuid.uuid4().hex
    run = _Run(worker, req, rid, request)
    if rid in worker.samples or any(r in tm.rid_to_state for r in run.sglang_rids()):
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


class _Sample:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.output_ids: list[int] = []
        self.finish_reason: dict[str, Any] = {"type": "abort"}
        self.sglang_meta: dict[str, Any] = {}
        self.t_first: float | None = None


class _Run:
    """One contract request: the anchor `prepare`, SGLang's own generation of each sample
    (`TokenizerManager.generate_request`, streamed internally so the first token's time is
    known), and the anchor `finish`.

    With `n > 1` the prompt is prefilled once first, under the request's own id (so its
    snapshots are taken then); the samples, each its own SGLang request `rid-i` with seed
    `seed + i`, then find the whole prompt in SGLang's tree but its last token, whose
    logits each needs. SGLang batches them as it does any requests."""

    def __init__(self, worker: SGLangWorker, req: GenerateRequest, rid: str,
                 request: Any) -> None:
        self.worker, self.req, self.rid, self.request = worker, req, rid, request
        n = req.sampling.n
        self.samples = [_Sample(rid if n == 1 else f"{rid}-{i}") for i in range(n)]
        self.anchors: dict[str, Any] = {"restored": [], "restore_miss": [], "written": [],
                                        "held": []}
        self.cached_tokens: int | None = None  # of the prompt prefill (n > 1)
        self.restore_ms = 0.0
        self.t0 = time.perf_counter()
        self.prepared = False
        self.finished = False

    def sglang_rids(self) -> list[str]:
        """The ids this run gives SGLang: its own (the prefill when n > 1) and the samples'."""
        return list(dict.fromkeys([self.rid, *(s.rid for s in self.samples)]))

    def _obj(self, rid: str, sampling: dict[str, Any]) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        req = self.req
        return GenerateReqInput(rid=rid, input_ids=list(req.input_ids),
                                sampling_params=sampling, stream=True,
                                return_logprob=req.return_logprob,
                                top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0)

    async def _stream(self, obj: Any) -> AsyncIterator[dict[str, Any]]:
        """SGLang's outputs for one request; `Aborted` (or WireError: SGLang's way of refusing
        a request is a ValueError) instead of an abort finish."""
        from fastapi import HTTPException

        try:
            async for out in self.worker.tm.generate_request(obj, self.request):
                meta = out.get("meta_info") or {}
                reason = meta.get("finish_reason")
                if isinstance(reason, dict) and reason.get("type") not in ("stop", "length"):
                    raise Aborted(meta)
                yield out
        except ValueError as e:
            raise WireError(str(e)) from None
        except HTTPException as e:
            raise SchedulerError(e.status_code, str(e.detail)) from None

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Contract events: new ids (and logprobs) per sample, then each sample's meta."""
        self.worker.samples[self.rid] = [s.rid for s in self.samples]
        ok = False
        try:
            req = self.req
            if req.anchor is not None:
                anchor = req.anchor
                if len(self.samples) > 1:  # the samples' responses differ: none is saved
                    anchor = replace(anchor, snapshot_response=False)
                prep = await self.worker.call("prepare", {
                    "rid": self.rid, "input_ids": list(req.input_ids),
                    "anchor": anchor.to_json()})
                self.prepared = True
                self.anchors.update(prep["anchors"])
                self.anchors["restored_tokens"] = prep["restored_tokens"]
            self.restore_ms = (time.perf_counter() - self.t0) * 1e3
            if len(self.samples) == 1:
                sample = self.samples[0]
                obj = self._obj(sample.rid, _sglang_sampling(req.sampling, 0))
                async for out in self._stream(obj):
                    event = self._add(sample, out)
                    if event is not None:
                        yield event
                ok = True
                await self._finish(True)
                yield self._meta(0)
            else:
                await self._prefill()
                await self._finish(True)
                async for event in self._merged():
                    yield event
                ok = True
        except BaseException:  # an error, or the client went away (cancelled, closed)
            self._abort_samples()
            raise
        finally:
            self.worker.samples.pop(self.rid, None)
            if not self.finished:
                await asyncio.shield(self._finish(ok))

    async def _prefill(self) -> None:
        """The prompt once (no token sampled), under the request's own id."""
        obj = self._obj(self.rid, {"max_new_tokens": 0})
        obj.return_logprob = False
        obj.top_logprobs_num = 0
        async for out in self._stream(obj):
            meta = out.get("meta_info") or {}
            if meta.get("finish_reason") is not None:
                self.cached_tokens = int(meta.get("cached_tokens") or 0)

    async def _merged(self) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = \
            asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                obj = self._obj(self.samples[i].rid, _sglang_sampling(self.req.sampling, i))
                async for out in self._stream(obj):
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.samples))]
        try:
            live = len(tasks)
            while live:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    live -= 1
                    yield self._meta(i)
                    continue
                event = self._add(self.samples[i], item)
                if event is not None:
                    yield event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _add(self, sample: _Sample, out: dict[str, Any]) -> dict[str, Any] | None:
        """Fold one SGLang output into `sample`; the contract event for its new ids."""
        if sample.t_first is None:
            sample.t_first = time.perf_counter()
        incremental = getattr(self.worker.tm, "incremental_streaming_output", False)
        ids = list(out.get("output_ids") or [])
        sent = len(sample.output_ids)  # SGLang's ids and logprob rows are cumulative
        new = ids if incremental else ids[sent:]
        sample.output_ids.extend(new)
        meta = out.get("meta_info") or {}
        sample.sglang_meta = meta
        if meta.get("finish_reason") is not None:
            sample.finish_reason = _finish(meta, sample.output_ids)
        if not new:
            return None
        event: dict[str, Any] = {"rid": self.rid, "output_ids": new}
        if len(self.samples) > 1:
            event["index"] = self.samples.index(sample)
        if self.req.return_logprob:
            rows = meta.get("output_token_logprobs") or []
            tops = meta.get("output_top_logprobs") or []
            start = 0 if incremental else sent
            take = slice(start, start + len(new))
            event["output_token_logprobs"] = [[lp, t, None] for lp, t, *_ in rows[take]]
            if self.req.top_logprobs_num:
                event["output_top_logprobs"] = [[[lp, t, None] for lp, t, *_ in top or []]
                                                for top in tops[take]]
        return event

    async def _finish(self, ok: bool) -> None:
        """Drop the restore lock; learn what the prefill saved."""
        self.finished = True
        if self.prepared:
            fin = await self.worker.call("finish", {"rid": self.rid, "ok": ok})
            self.anchors["written"] = fin["written"]
            self.anchors["held"] = [*self.anchors.get("held", []), *fin["held"]]

    def _abort_samples(self) -> None:
        tm = self.worker.tm
        for rid in self.sglang_rids():
            if rid in tm.rid_to_state:
                tm.abort_request(rid=rid)

    def _meta(self, index: int) -> dict[str, Any]:
        sample = self.samples[index]
        n = len(self.req.input_ids)
        cached = self.cached_tokens
        if cached is None:
            cached = int(sample.sglang_meta.get("cached_tokens") or 0)
        now = time.perf_counter()
        first = sample.t_first or now
        meta = {
            "id": self.rid, "prompt_tokens": n, "completion_tokens": len(sample.output_ids),
            "cached_tokens": cached, "prefill_tokens": n - cached,
            "restore_ms": round(self.restore_ms, 3),
            # SGLang does not split a request's time: prefill is until its first output
            # (queueing included), decode the rest
            "prefill_ms": round((first - self.t0) * 1e3 - self.restore_ms, 3),
            "decode_ms": round((now - first) * 1e3, 3),
            "finish_reason": sample.finish_reason, "anchors": dict(self.anchors),
            "epoch": self.worker.epoch,
        }
        event: dict[str, Any] = {"rid": self.rid, "output_ids": [], "meta_info": meta}
        if len(self.samples) > 1:
            meta["index"] = index
            event["index"] = index
        return event


# ---- other contract routes ---------------------------------------------------------------

async def health(request: Any, worker: SGLangWorker) -> Any:
    if not await worker.ready():
        return _error("the scheduler is not ready", 503)
    samples = {r for rids in worker.samples.values() for r in rids}
    rids = [r for r in worker.tm.rid_to_state
            if not str(r).startswith("HEALTH_CHECK") and r not in samples]
    rids += [r for r in worker.samples if r not in rids]
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
                  "architecture": archs[0], "max_context_tokens": worker.max_request_tokens(),
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
    running = False
    for r in {rid, *worker.samples.get(rid, ())}:
        if r in worker.tm.rid_to_state:
            worker.tm.abort_request(rid=r)
            running = True
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
                             ("/anchor/flush", "flush_anchors", "POST"),
                             ("/anchor/verify", "verify", "POST")]:
        add(path, _anchor_route(op, method == "POST"), method)
    if SGLangAnchorConfig.from_env().fault_injection:
        add("/debug/fault", _anchor_route("fault", True), "POST")
