"""The embedded worker's side of the contract (`anchorcache.ext.contract.Backend`).

The engine thread owns the model and the anchor store: every call that reads or changes
the store is queued onto it (`Engine.call`) and runs between requests, or between a
running request's prefill chunks and decode steps (llama.cpp's slots API: snapshot state
has one owner). The asyncio side only admits requests, reads their events, and answers
`/health` and `/model_info` from what it holds itself, so a busy or wedged engine never
delays them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from msgspec.structs import replace

from anchorcache.ext.contract import Backend, ContractError, Event, Tokens, export_from, import_into
from anchorcache.wire import (
    AbortReply,
    ConfirmReply,
    EvictReply,
    FlushReply,
    GenerateRequest,
    ImportReply,
    LookupReply,
    ModelInfo,
    PinReply,
    SlotsAborted,
    SlotsReply,
    StatsReply,
    StopReply,
    UnpinReply,
    WireError,
    WorkerHealth,
)

from .anchors import EmbeddedAnchors
from .engine import Engine, ErrorEvent, FinishEvent, Job

T = TypeVar("T")


class EmbeddedBackend(Backend):
    def __init__(self, engine: Engine, info: ModelInfo, epoch: str) -> None:
        self.engine = engine
        self.info = info
        self._epoch = epoch

    @property
    def epoch(self) -> str:
        return self._epoch

    def _on_engine(self, fn: Callable[[EmbeddedAnchors], T]) -> asyncio.Future[T]:
        store = self.engine.anchors
        if store is None:
            raise ContractError(404, "this worker runs without an anchor store")
        return self.engine.call(lambda: fn(store))

    # ---- generate ---------------------------------------------------------------------
    async def prepare(self, req: GenerateRequest, context: Any) -> Job:
        info = self.info
        lo, hi = min(req.input_ids), max(req.input_ids)
        if lo < 0 or hi >= info.vocab_size:
            bad = lo if lo < 0 else hi
            raise WireError(f"'input_ids' holds {bad}, outside the vocabulary [0, {info.vocab_size})")
        n_prompt, max_new = len(req.input_ids), req.sampling.max_new_tokens
        if n_prompt + max_new > info.max_context_tokens:
            raise WireError(f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new}) exceeds "
                            f"the model's context of {info.max_context_tokens} tokens")
        grammar = None
        if req.sampling.constraint is not None:
            grammars = self.engine.grammars
            if grammars is None:
                raise WireError("this worker does not support constrained decoding")
            # compiling a large schema takes a while: off the event loop (a cache of its
            # own, never the store)
            grammar = await asyncio.get_running_loop().run_in_executor(
                None, grammars.compile, *req.sampling.constraint)
        try:
            return self.engine.submit(req, grammar=grammar)
        except ValueError as e:
            raise WireError(str(e)) from None

    async def generate(self, job: Job) -> AsyncGenerator[Event, None]:
        top = job.req.top_logprobs_num
        while True:
            event = await job.events.get()
            if isinstance(event, ErrorEvent):
                raise event.error
            if isinstance(event, FinishEvent):
                yield replace(event.meta, epoch=self._epoch)
                if event.last:
                    return
                continue
            picks = event.picks
            yield Tokens(event.output_ids, event.index,
                         None if picks is None else tuple((p.logprob, p.token) for p in picks),
                         None if picks is None or not top
                         else tuple(tuple((lp, t) for t, lp in p.top) for p in picks))

    async def finish(self, job: Job, ok: bool) -> None:
        # the engine thread releases the request itself (staged anchors kept only when it
        # ran to its end uncancelled); a consumer that went away cancels it
        if not ok:
            await self.abort(job.rid)

    async def abort(self, rid: str) -> AbortReply:
        running = self.engine.cancel(rid)
        if self.engine.anchors is None:
            return AbortReply(rid, running, self._epoch)
        drop = self._on_engine(lambda store: store.abort_request(rid))
        if running:  # dropped at the engine's next step; a wedged one must not hold us
            return AbortReply(rid, True, self._epoch)
        return AbortReply(rid, bool(await drop), self._epoch)

    async def stop(self, rid: str, output_tokens: int | None) -> StopReply:
        return StopReply(rid, self.engine.stop_request(rid, output_tokens), self._epoch)

    # ---- anchors (engine thread) --------------------------------------------------------
    async def confirm(self, slots: list[int], rid: str | None) -> ConfirmReply:
        confirmed, evicted = await self._on_engine(lambda store: store.confirm(slots, rid))
        return ConfirmReply(tuple(confirmed), tuple(evicted), self._epoch)

    async def abort_slots(self, slots: list[int]) -> SlotsAborted:
        return SlotsAborted(tuple(await self._on_engine(lambda store: store.abort(slots))),
                            self._epoch)

    async def lookup(self, namespace: bytes, ids: tuple[int, ...],
                     depths: tuple[int, ...]) -> LookupReply:
        return await self._on_engine(lambda store: store.lookup(namespace, list(ids),
                                                                list(depths), self._epoch))

    async def pin(self, key: bytes, cache_key: str | None, device: bool) -> PinReply:
        # no device tier (and no engine cache to key): nothing is locked beyond the host
        # slot table
        return PinReply(await self._on_engine(lambda store: store.pin(key)), self._epoch, "none")

    async def unpin(self, key: bytes) -> UnpinReply:
        return UnpinReply(await self._on_engine(lambda s: s.unpin(key)), self._epoch)

    async def evict(self, key: bytes) -> EvictReply:
        return EvictReply(await self._on_engine(lambda s: s.evict(key)), self._epoch)

    # the disk tier takes its own lock: files are read and written off the engine thread
    @property
    def _disk(self) -> Any:
        return self.engine.anchors.disk if self.engine.anchors is not None else None

    async def import_slab(self, data: bytes) -> ImportReply:
        return await asyncio.to_thread(import_into, self._disk, data, self._epoch)

    async def export_slab(self, key: bytes) -> bytes:
        return await asyncio.to_thread(export_from, self._disk, key)

    async def flush(self, device: bool) -> FlushReply:
        # no device cache of its own: /flush_cache drops the anchors too
        if device and self.engine.anchors is None:
            return FlushReply(0, self._epoch)
        return FlushReply(await self._on_engine(lambda store: store.flush()), self._epoch)

    async def slots(self) -> SlotsReply:
        return await self._on_engine(lambda store: store.slots(self._epoch))

    async def stats(self) -> StatsReply:
        return await self._on_engine(lambda store: store.stats(self._epoch))

    # ---- answered by the asyncio side ---------------------------------------------------
    async def model_info(self) -> ModelInfo:
        return replace(self.info, epoch=self._epoch)

    async def health(self) -> WorkerHealth:
        jobs = self.engine.jobs()
        return WorkerHealth("ok", self._epoch, tuple(j.rid for j in jobs if j.started),
                            tuple(j.rid for j in jobs if not j.started))

    async def fault(self, body: dict[str, Any]) -> dict[str, Any]:
        """Arm one fault: the next time the engine passes `where` it raises, or with
        `"hang": true` its thread blocks there for good, while the HTTP side keeps
        answering (a wedged engine: what `serve`'s supervisor must notice). Tests only."""
        where = body.get("where")
        if where not in ("start", "prefill", "decode", "snapshot", "restore", "confirm"):
            raise WireError("'where' must be start, prefill, decode, snapshot, restore or "
                            "confirm")
        hang = body.get("hang", False)
        if not isinstance(hang, bool):
            raise WireError("'hang' must be a boolean")
        engine = self.engine

        def hook(at: str) -> None:
            if at == where:
                engine.fault_hook = None
                if hang:
                    threading.Event().wait()  # never set: only the process's end frees it
                raise RuntimeError(f"injected fault at {at}")

        engine.fault_hook = hook
        return {"armed": where, "hang": hang}
