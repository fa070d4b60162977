"""HTTP side of the SGLang worker: the contract (`anchorcache.ext.contract`) served by
SGLang's own HTTP process.

`SGLangBackend` implements the contract's `Backend`: a `/generate` is a `Run` (`run.py`);
every anchor operation crosses to the scheduler's loop through the scheduler RPC
(`rpc.py`), whose replies are parsed into their wire records here; the worker's state and
limits are `SGLangWorker` (`worker.py`). `install(app, workers)` replaces SGLang's native
`/generate`, `/health`, `/model_info`, `/flush_cache` and `/abort_request` routes on its
FastAPI app with the contract's and adds `/anchor/*`.

Data parallelism (`--dp-size N`): each rank is a worker of its own, its contract served under
`/dp/K` (`/dp/0/generate`, `/dp/0/anchor/confirm`, ...): its own anchors and epoch, requests
sent to that rank (SGLang's `routed_dp_rank`). At the root, `/model_info` lists the ranks
(`ranks`: the paths under which each is served) and `/health` answers for the whole server;
every other contract route there is a 409 that names the ranks, since no call may leave the
rank it is meant for.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from msgspec.structs import replace

from anchorcache import wire
from anchorcache.ext import contract
from anchorcache.ext.contract import Backend, ContractError, Event
from anchorcache.wire import GenerateRequest, WireError, encode, from_json

from .config import SGLangAnchorConfig
from .cpu_kernels import is_hybrid
from .run import Run
from .worker import SGLangWorker

T = TypeVar("T")


class SGLangBackend(Backend):
    def __init__(self, worker: SGLangWorker) -> None:
        self.worker = worker

    @property
    def epoch(self) -> str:
        return self.worker.epoch or ""

    async def _call(self, op: str, body: dict[str, Any], record: type[T]) -> T:
        """One anchor operation on the scheduler's loop, its reply read into its `record`
        (a reply that does not fit is a 500, never passed on)."""
        reply = {**await self.worker.call(op, body), "epoch": self.epoch}
        try:
            return from_json(record, reply)
        except WireError as e:
            raise RuntimeError(f"malformed scheduler reply to {op}: {e}") from None

    # ---- generate ---------------------------------------------------------------------
    async def prepare(self, req: GenerateRequest, context: Any) -> Run:
        worker = self.worker
        await worker.ready()
        worker.check_input(req)
        assert req.rid is not None
        run = Run(worker, req, req.rid, context)
        if req.rid in worker.runs or any(r in worker.tm.rid_to_state
                                            for r in run.sglang_rids()):
            raise WireError(f"request id {req.rid!r} (or one of its samples' ids) is already "
                            f"running")
        return run

    def generate(self, run: Run) -> AsyncGenerator[Event, None]:
        return run.events()

    async def finish(self, run: Run, ok: bool) -> None:
        await run.finish(ok)

    async def abort(self, rid: str) -> wire.AbortReply:
        worker = self.worker
        running = False
        run = worker.runs.get(rid)
        for r in run.sglang_rids() if run is not None else [rid]:
            if r in worker.tm.rid_to_state:
                worker.tm.abort_request(rid=r)
                running = True
        dropped = (await worker.call("abort_request", {"rid": rid}))["dropped"]
        return wire.AbortReply(rid, running or bool(dropped), self.epoch)

    async def stop(self, rid: str, output_tokens: int | None) -> wire.StopReply:
        run = self.worker.runs.get(rid)
        stopped = run is not None and await run.stop(output_tokens)
        return wire.StopReply(rid, stopped, self.epoch)

    # ---- anchors (scheduler loop) -------------------------------------------------------
    async def confirm(self, slots: list[int], rid: str | None) -> wire.ConfirmReply:
        return await self._call("confirm", {"slots": slots, "rid": rid}, wire.ConfirmReply)

    async def abort_slots(self, slots: list[int]) -> wire.SlotsAborted:
        return await self._call("abort", {"slots": slots}, wire.SlotsAborted)

    async def lookup(self, namespace: bytes, ids: tuple[int, ...],
                     depths: tuple[int, ...]) -> wire.LookupReply:
        return await self._call("lookup", {"namespace": namespace.hex(), "input_ids": list(ids),
                                           "depths": list(depths)}, wire.LookupReply)

    async def pin(self, key: bytes, cache_key: str | None, device: bool) -> wire.PinReply:
        return await self._call("pin", {"key": key.hex(), "cache_key": cache_key,
                                        "device": device}, wire.PinReply)

    async def unpin(self, key: bytes) -> wire.UnpinReply:
        return await self._call("unpin", {"key": key.hex()}, wire.UnpinReply)

    async def evict(self, key: bytes) -> wire.EvictReply:
        return await self._call("evict", {"key": key.hex()}, wire.EvictReply)

    # the file's bytes ride the RPC as base64 (an operator's call, not a request's)
    async def import_slab(self, data: bytes) -> wire.ImportReply:
        return await self._call("import_slab", {"data": base64.b64encode(data).decode()},
                                wire.ImportReply)

    async def export_slab(self, key: bytes) -> bytes:
        reply = await self.worker.call("export_slab", {"key": key.hex()})
        return base64.b64decode(reply["data"])

    async def flush(self, device: bool) -> wire.FlushReply:
        if not device:
            return await self._call("flush_anchors", {}, wire.FlushReply)
        # SGLang's own flush of its device tree; the host anchors survive it (see the docs)
        ret = await self.worker.tm.flush_cache()
        if not ret.success:
            raise ContractError(409, ret.message or "SGLang refused to flush: requests are running")
        await self.worker.ready()
        return wire.FlushReply(0, self.epoch, flushed_device=True)

    async def slots(self) -> wire.SlotsReply:
        return await self._call("slots", {}, wire.SlotsReply)

    async def stats(self) -> wire.StatsReply:
        return await self._call("stats", {}, wire.StatsReply)

    async def verify(self, key: bytes, cache_key: str | None) -> wire.VerifyReply:
        return await self._call("verify", {"key": key.hex(), "cache_key": cache_key},
                                wire.VerifyReply)

    async def fault(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**await self.worker.call("fault", body), "epoch": self.epoch}

    # ---- answered by the HTTP process -----------------------------------------------------
    async def model_info(self) -> wire.ModelInfo:
        worker = self.worker
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
        return wire.ModelInfo(model_id=worker.model_id, model_path=worker.model_path,
                         tokenizer_path=worker.model_path, architecture=archs[0],
                         max_context_tokens=worker.max_request_tokens(),
                         eos_token_ids=tuple(sorted(eos)), hybrid=is_hybrid(hf.to_dict()),
                         vocab_size=int(getattr(hf, "vocab_size", 0)), backend="sglang",
                         epoch=self.epoch)

    async def health(self) -> wire.WorkerHealth:
        from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

        worker = self.worker
        if not await worker.ready():
            raise ContractError(503, "the scheduler is not ready")
        # requests that are no contract run's (SGLang's own routes) count on every rank: SGLang
        # does not say which rank runs them
        ours = {r for peer in worker.peers for run in peer.runs.values()
                for r in run.sglang_rids()}
        rids = [r for r in worker.tm.rid_to_state
                if not str(r).startswith(HEALTH_CHECK_RID_PREFIX) and r not in ours]
        rids += [r for r in worker.runs if r not in rids]
        return wire.WorkerHealth("ok", self.epoch, tuple(rids))


class RankedServer:
    """The root of a server with data-parallel ranks: `/model_info` lists the ranks and
    `/health` answers for all of them; every other contract call there is refused (a 409
    that names the ranks), since no call may leave the rank it is meant for."""

    def __init__(self, ranks: list[SGLangBackend]) -> None:
        self.ranks = ranks

    @property
    def epoch(self) -> str:
        return ",".join(b.epoch for b in self.ranks)

    async def model_info(self) -> wire.ModelInfo:
        infos = [await b.model_info() for b in self.ranks]  # every rank ready: its epoch
        return replace(infos[0], epoch=self.epoch,
                       ranks=tuple(rank_path(b.worker.dp_rank) for b in self.ranks))

    async def health(self) -> wire.WorkerHealth:
        replies = [await b.health() for b in self.ranks]  # 503 while any rank is not ready
        rids = dict.fromkeys(r for h in replies for r in h.running_requests)
        return wire.WorkerHealth("ok", self.epoch, tuple(rids))

    def refusal(self) -> ContractError:
        paths = ", ".join(f"/{rank_path(b.worker.dp_rank)}" for b in self.ranks)
        return ContractError(409, f"this SGLang server runs {len(self.ranks)} data-parallel "
                                  f"ranks, each with its own anchors: call one of {paths} "
                                  f"(/model_info lists them as `ranks`)")

    def handler(self, path: str) -> Callable[[Any], Awaitable[Any]]:
        calls: dict[str, Callable[[], Awaitable[Any]]] = {"/model_info": self.model_info,
                                                           "/health": self.health}

        async def handler(request: Any) -> Any:
            try:
                call = calls.get(path)
                if call is None:
                    raise self.refusal()
                return _response(contract.Reply(200, encode(await call())))
            except ContractError as e:
                return _response(contract.error_reply(e))

        handler.__name__ = "server_" + path.strip("/").replace("/", "_")
        return handler


def rank_path(dp_rank: int | None) -> str:
    """The path under which data-parallel rank `dp_rank`'s contract is served."""
    return f"dp/{dp_rank}"


# ---- Starlette adapter ---------------------------------------------------------------------

def _response(reply: contract.Reply) -> Any:
    from fastapi.responses import Response

    return Response(content=reply.body, status_code=reply.status, media_type=reply.content_type)


def _route(backend: Backend, route: contract.Route) -> Callable[[Any], Awaitable[Any]]:
    async def handler(request: Any) -> Any:
        return _response(await contract.handle(backend, route, await request.body()))

    handler.__name__ = route.path.strip("/").replace("/", "_")
    return handler


def _generate(backend: Backend) -> Callable[[Any], Awaitable[Any]]:
    async def generate(request: Any) -> Any:
        from fastapi.responses import StreamingResponse

        out = await contract.generate(backend, await request.body(), request)
        if isinstance(out, contract.Reply):
            return _response(out)
        return StreamingResponse(out, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return generate


def install(app: Any, workers: list[SGLangWorker]) -> None:
    """Put the contract's routes on SGLang's FastAPI `app` (before it starts serving): at the
    root for one worker; under `/dp/K` for each data-parallel rank's, with the rank list
    (`RankedServer`) at the root."""
    routes = contract.routes(SGLangAnchorConfig.from_env().fault_injection)
    ours = {"/generate", *(r.path for r in routes)}
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in ours]
    ranks = [SGLangBackend(w) for w in workers]
    if len(ranks) > 1:
        server = RankedServer(ranks)
        for path, method in (*((r.path, r.method) for r in routes), ("/generate", "POST")):
            app.add_route(path, server.handler(path), methods=[method])
    # plain Starlette routes: the handler gets the Request itself, no FastAPI injection
    for backend in ranks:
        prefix = "" if len(ranks) == 1 else f"/{rank_path(backend.worker.dp_rank)}"
        for route in routes:
            app.add_route(prefix + route.path, _route(backend, route), methods=[route.method])
        app.add_route(prefix + "/generate", _generate(backend), methods=["POST"])
