"""The embedded worker's engine: one thread owns the model and runs requests one at a time.

Requests are queued to that thread (llama.cpp's slots API: snapshot state has one owner),
and so is every other use of the anchor store (`call`: confirm, pin, list, ...), which the
thread runs between requests or between a running request's prefill chunks and decode
steps; so the model, its cache, the anchor slabs and the slot table have one owner and
need no lock. Results flow back to the asyncio side through `loop.call_soon_threadsafe`.
An abort sets a flag that the thread checks at those same points; so does a stop (the
proxy found a stop sequence), which ends the request as finished, keeping its anchors.

A request for n > 1 samples prefills its prompt once; every sample then decodes from that
state (the first n - 1 from a copy of the cache, the last from the cache itself), one
after the other, each with its own seeded generator and grammar mask.

On recurrent models prefill is split so a chunk ends exactly at every anchor cut
(`chunk_at` and snapshot depths), whether or not anchoring is on: recurrent state exists
only at chunk ends. Dense models slice their K/V rows at the cuts after the prefill.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from msgspec.structs import replace

from anchorcache.wire import (
    AnchorHeld,
    AnchorReport,
    AnchorWritten,
    FinishAbort,
    FinishLength,
    FinishReason,
    FinishStop,
    GenerateMeta,
    GenerateRequest,
    to_json,
)

from . import cache_io
from .sampling import Pick, Sampler


@dataclass(frozen=True)
class TokenEvent:
    output_ids: tuple[int, ...]
    index: int = 0  # the sample (choice) these tokens belong to
    picks: tuple[Pick, ...] | None = None  # with logprobs, when the request asks for them


@dataclass(frozen=True)
class FinishEvent:
    meta: GenerateMeta  # its epoch is the HTTP side's to fill in
    index: int = 0
    last: bool = True  # the request's last event: every sample has finished

    @property
    def finish_reason(self) -> dict[str, Any]:
        return to_json(self.meta.finish_reason)


@dataclass(frozen=True)
class ErrorEvent:
    error: BaseException


Event = TokenEvent | FinishEvent | ErrorEvent


@dataclass
class Job:
    req: GenerateRequest
    rid: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)  # end as a stop
    stop_at: int | None = None  # with `stopping`: output tokens the response anchor keeps
    started: bool = False
    grammar: Any = None  # the request's compiled constraint (grammar.Grammars.compile)

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Aborted(Exception):
    pass


T = TypeVar("T")


@dataclass
class _Call:
    """A function to run on the engine thread, and the asyncio future of its result."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def run(self) -> None:
        try:
            result = self.fn()
        except BaseException as e:
            self.loop.call_soon_threadsafe(_settle, self.future, None, e)
        else:
            self.loop.call_soon_threadsafe(_settle, self.future, result, None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_WAKE = object()  # queued after a call, so that an idle thread wakes to run it


class Engine:
    def __init__(self, model: torch.nn.Module, *, eos_token_ids: tuple[int, ...],
                 recurrent: bool, anchors: Any | None = None,
                 prefill_chunk_tokens: int | None = None, grammars: Any | None = None,
                 spec: cache_io.CacheSpec | None = None) -> None:
        self.model = model
        self.grammars = grammars  # grammar.Grammars: masks for constrained requests
        self.recurrent = recurrent  # state only at chunk ends (hybrid / SSM models)
        self.prefill_chunk_tokens = prefill_chunk_tokens  # bounds how late an abort is seen
        self.eos_token_ids = eos_token_ids
        self.anchors = anchors  # EmbeddedAnchors or None (see anchors.py)
        if anchors is not None:
            anchors.fault = self._fault
        self._queue: queue.Queue[Job | object | None] = queue.Queue()
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()  # the job registry only: `jobs()` answers /health
        self._thread = threading.Thread(target=self._run, name="anchorcache-engine", daemon=True)
        self.fault_hook: Callable[[str], None] | None = None  # tests inject faults here
        self._spec = spec  # the model's cache layout (measured on the first copy if None)

    # ---- asyncio side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        for job in self.jobs():
            job.cancelled.set()
        self._queue.put(None)
        self._thread.join(timeout=30)

    def submit(self, req: GenerateRequest, *, grammar: Any = None) -> Job:
        """Queue `req`; `grammar` is its compiled constraint (required when it has one)."""
        if req.sampling.constraint is not None and (grammar is None or self.grammars is None):
            raise ValueError("a constrained request needs its compiled grammar")
        rid = req.rid or uuid.uuid4().hex
        job = Job(req=req, rid=rid, loop=asyncio.get_running_loop(), grammar=grammar)
        with self._lock:
            if rid in self._jobs:
                raise ValueError(f"request id {rid!r} is already running")
            self._jobs[rid] = job
        self._queue.put(job)
        return job

    def cancel(self, rid: str) -> bool:
        """Cancel request `rid` (queued or running): it ends at its next check, and its
        staged anchors are dropped. False when no such request is queued or running."""
        with self._lock:
            job = self._jobs.get(rid)
        if job is not None:
            job.cancelled.set()
        return job is not None

    def stop_request(self, rid: str, output_tokens: int | None) -> bool:
        """End request `rid` at its next decode step as a stop, its anchors kept (the
        response anchor: prompt + `output_tokens` output ids). False when it is not running."""
        with self._lock:
            job = self._jobs.get(rid)
        if job is None or job.cancelled.is_set():
            return False
        job.stop_at = output_tokens
        job.stopping.set()
        return True

    def call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn()` on the engine thread, between requests or between a running request's
        prefill chunks and decode steps; its result (or exception) in the future. A wedged
        engine never runs it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put(_Call(fn, loop, future))
        self._queue.put(_WAKE)
        return future

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while (job := self._queue.get()) is not None:
            self._run_calls()
            if not isinstance(job, Job):
                continue
            ok = False
            try:
                job.started = True
                self._generate(job)
                ok = not job.cancelled.is_set()
            except Aborted:
                n = len(job.req.input_ids)
                job.emit(FinishEvent(GenerateMeta(
                    "", n, 0, 0, n, FinishAbort(), AnchorReport(), 0.0, 0.0, 0.0, rid=job.rid)))
            except BaseException as e:  # reported to the request, the thread lives on
                job.emit(ErrorEvent(e))
            finally:
                if self.anchors is not None:
                    self.anchors.release_request(job.rid, ok=ok)
                with self._lock:
                    self._jobs.pop(job.rid, None)
        self._run_calls()

    def _run_calls(self) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            call.run()

    def _fault(self, where: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(where)

    def _check(self, job: Job, where: str) -> None:
        self._run_calls()
        if job.cancelled.is_set():
            raise Aborted
        self._fault(where)

    def _generate(self, job: Job) -> None:
        req, p = job.req, job.req.sampling
        ids = req.input_ids
        n = len(ids)
        plan = req.anchor
        self._check(job, "start")

        t0 = time.perf_counter()
        cache, restored, report = None, 0, AnchorReport()
        if self.anchors is not None and plan is not None and (plan.restore or plan.snapshot):
            cache, restored, report = self.anchors.restore(self.model, job.rid, ids, plan)
        if cache is None:
            cache, restored = cache_io.new_cache(self.model), 0
        t_restore = time.perf_counter()

        snapshots = {s.depth: s for s in (plan.snapshot if plan else ()) if restored < s.depth <= n}
        # Recurrent state exists only at a chunk end, so a recurrent model's prefill ends a
        # chunk at every cut (anchors on or off alike). Attention K/V rows can be sliced at any
        # depth afterwards, so a dense model prefills the delta in as few forwards as it can.
        boundaries = sorted({d for d in (plan.chunk_at if plan else ()) if restored < d < n}
                            | {d for d in snapshots if d < n}) if self.recurrent else []
        written: list[AnchorWritten] = []
        snapshot_s = 0.0  # counted in prefill_ms too, except the response anchor's

        def save(depth: int, cache: Any) -> None:
            nonlocal snapshot_s
            spec = snapshots.get(depth)
            if spec is not None and self.anchors is not None and plan is not None:
                t = time.perf_counter()
                w = self.anchors.snapshot(job.rid, cache, ids, depth, spec, plan)
                snapshot_s += time.perf_counter() - t
                if w is not None:
                    written.append(w)

        def on_boundary(depth: int, cache: Any) -> None:
            self._check(job, "prefill")
            if self.recurrent:
                save(depth, cache)

        input_t = torch.tensor([ids], dtype=torch.long)
        logits = cache_io.prefill(self.model, cache, input_t, restored, boundaries,
                                  on_boundary=on_boundary,
                                  max_chunk_tokens=self.prefill_chunk_tokens)
        if not self.recurrent:
            for depth in sorted(snapshots):
                save(depth, cache)
        t_prefill = time.perf_counter()

        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        for index in range(p.n):
            last = index == p.n - 1
            # every sample starts from the prompt's state; the last one may consume it
            sample_cache = cache if last else self._copy(cache, n)
            t_start = time.perf_counter()
            out, finish = self._decode(job, sample_cache, logits, n, index, stops)
            t_decode = time.perf_counter()
            if (self.anchors is not None and plan is not None and plan.snapshot_response
                    and p.n == 1 and out and isinstance(finish, FinishStop)):
                t = time.perf_counter()
                w = self._snapshot_response(job, sample_cache, ids + tuple(out), n, plan)
                snapshot_s += time.perf_counter() - t
                if w is not None:
                    written.append(w)
            anchors = replace(
                report, restored_tokens=restored,  # every restored row came from a slab
                written=tuple(w for w in written if not isinstance(w, AnchorHeld)),
                # held: committed prefixes it restored unasked (late lookup) or did not
                # write again because it holds them
                held=(*report.held, *(w for w in written if isinstance(w, AnchorHeld))))
            meta = GenerateMeta(
                epoch="", rid=job.rid, prompt_tokens=n, completion_tokens=len(out),
                cached_tokens=restored, prefill_tokens=n - restored,
                restore_ms=round((t_restore - t0) * 1e3, 3),
                prefill_ms=round((t_prefill - t_restore) * 1e3, 3),
                decode_ms=round((t_decode - t_start) * 1e3, 3),
                snapshot_ms=round(snapshot_s * 1e3, 3), finish_reason=finish,
                anchors=anchors,
                index=index if p.n > 1 else None)
            job.emit(FinishEvent(meta, index=index, last=last))

    def _snapshot_response(self, job: Job, cache: Any, full: tuple[int, ...], n: int,
                           plan: Any) -> AnchorWritten | AnchorHeld | None:
        """The response anchor: prompt + output, or prompt + the `stop_at` output ids a stop
        sequence left (a prefix of the next turn). The cache holds every token but the last
        sampled one; a recurrent model's state exists only at the cache's end, so it keeps
        one only when the kept ids end there (or one past, fed first)."""
        assert self.anchors is not None
        keep = len(full) - n if job.stop_at is None else min(job.stop_at, len(full) - n)
        depth, held = n + keep, len(full) - 1
        if depth <= n:
            return None
        if depth == held + 1:  # feed the last token so the state covers it
            cache_io.decode_step(self.model, cache, full[-1], held)
            held += 1
        if self.recurrent and depth != held:
            return None
        return self.anchors.snapshot_response(job.rid, cache, full[:depth], plan)

    def _copy(self, cache: Any, depth: int) -> Any:
        """An independent cache holding the same `depth` tokens (and state) as `cache`."""
        if self._spec is None:
            self._spec = cache_io.CacheSpec.from_model(self.model)
        t = cache_io.snapshot(cache, 0, depth)
        return cache_io.cache_from_tensors(self.model, t.keys, t.values, t.states,
                                           spec=self._spec, adopt=True)

    def _decode(self, job: Job, cache: Any, logits: torch.Tensor, position: int, index: int,
                stops: set[int]) -> tuple[list[int], FinishReason]:
        """Sample one continuation from `logits` (the prompt's last position) on `cache`."""
        p = job.req.sampling
        mask = None
        if job.grammar is not None:
            assert self.grammars is not None
            # the grammar ends generation with any stop token, EOS included
            mask = self.grammars.mask(job.grammar, set(p.stop_token_ids) | set(self.eos_token_ids))
        sampler = Sampler(p, index=index, mask=mask, logprobs=job.req.return_logprob,
                          top_logprobs=job.req.top_logprobs_num)
        out: list[int] = []
        finish: FinishReason | None = None
        while len(out) < p.max_new_tokens:
            if job.stopping.is_set():  # the proxy found a stop sequence
                finish = FinishStop(None)
                break
            pick = sampler(logits[0, -1])
            out.append(pick.token)
            job.emit(TokenEvent((pick.token,), index,
                                (pick,) if job.req.return_logprob else None))
            if pick.token in stops or (mask is not None and mask.terminated):
                finish = FinishStop(pick.token)
                break
            if len(out) >= p.max_new_tokens:
                break
            self._check(job, "decode")
            logits = cache_io.decode_step(self.model, cache, pick.token, position)
            position += 1
        return out, finish if finish is not None else FinishLength(len(out))

