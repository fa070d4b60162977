"""One contract `/generate` on SGLang (`Run`): SGLang's own generation of each sample
(`TokenizerManager.generate_request`, as its `/generate` route calls it, so requests are
batched by SGLang as usual), the anchor plan riding in the request's sampling parameters,
and the report the scheduler pushes when it releases the request (ext/sglang/rpc.py).
Sampling parameters (constraints, seed, logprobs) pass through under SGLang's names."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson
from msgspec.structs import replace

from anchorcache.ext.contract import Event, Tokens
from anchorcache.wire import (
    AnchorReport,
    FinishAbort,
    FinishLength,
    FinishReason,
    FinishStop,
    GenerateMeta,
    GenerateRequest,
    SamplingParams,
    WireError,
)

from .rpc import PLAN_PARAM, SchedulerError
from .worker import SGLangWorker

PUSH_WAIT_S = 10.0  # for a finished request's pushed report, then the `finish` call


def sglang_sampling(p: SamplingParams, index: int) -> dict[str, Any]:
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


def finish_reason(meta: dict[str, Any], output_ids: list[int]) -> FinishReason:
    """The contract's finish of SGLang's `finish_reason` (a stop string matches no token)."""
    reason = meta.get("finish_reason") or {"type": "abort"}
    kind = reason.get("type")
    if kind == "stop":
        matched = reason.get("matched")
        return FinishStop(matched if isinstance(matched, int) and matched >= 0 else None)
    if kind == "length":
        return FinishLength(len(output_ids))
    return FinishAbort()


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



class Sample:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason = FinishAbort()
        self.sglang_meta: dict[str, Any] = {}
        self.t_first: float | None = None


class Run:
    """One contract request: SGLang's own generation of each sample
    (`TokenizerManager.generate_request`, streamed internally so the first token's time is
    known), with the anchor plan in the sampling parameters of the request that prefills
    the prompt, and the scheduler's report of what it restored and saved (`finish`).

    With `n > 1` the prompt is prefilled once first, under the request's own id (so its
    snapshots are taken then); the samples, each its own SGLang request `rid-i` with seed
    `seed + i`, then find the whole prompt in SGLang's tree but its last token, whose
    logits each needs. SGLang batches them as it does any requests."""

    def __init__(self, worker: SGLangWorker, req: GenerateRequest, rid: str,
                 request: Any) -> None:
        self.worker, self.req, self.rid, self.request = worker, req, rid, request
        n = req.sampling.n
        self.samples = [Sample(rid if n == 1 else f"{rid}-{i}") for i in range(n)]
        self.anchors = AnchorReport()  # finish's: restored, missed, written, held
        self.snapshot_ms = 0.0
        self.cached_tokens: int | None = None  # of the prompt prefill (n > 1)
        self.restore_ms = 0.0
        self.t0 = time.perf_counter()
        self.token = uuid.uuid4().hex  # this run's id on the scheduler (a rid may be reused)
        self.plan: str | None = None  # the anchor plan, as the prompt's request carries it
        self.report: asyncio.Future[dict[str, Any]] | None = None  # pushed at its release
        self.finished = False
        self.stopping = False  # `stop`: SGLang's abort of its samples ends them as stops

    def sglang_rids(self) -> list[str]:
        """The ids this run gives SGLang: its own (the prefill when n > 1) and the samples'."""
        return list(dict.fromkeys([self.rid, *(s.rid for s in self.samples)]))

    def _obj(self, rid: str, sampling: dict[str, Any]) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        req = self.req
        if rid == self.rid and self.plan is not None:
            sampling = {**sampling, "custom_params": {PLAN_PARAM: self.plan}}
        return GenerateReqInput(rid=rid, input_ids=list(req.input_ids),
                                sampling_params=sampling, stream=True,
                                return_logprob=req.return_logprob,
                                top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                                # SGLang's tree is keyed by it: a request matches only what
                                # requests of its namespace left there (anchorcache.wire)
                                extra_key=req.cache_key,
                                # data parallelism: the rank this worker addresses (SGLang's own
                                # field; its DP controller sends the request there)
                                routed_dp_rank=self.worker.dp_rank)

    async def _stream(self, obj: Any) -> AsyncIterator[dict[str, Any]]:
        """SGLang's outputs for one request; `Aborted` (or WireError: SGLang's way of refusing
        a request is a ValueError) instead of an abort finish."""
        from fastapi import HTTPException

        try:
            async for out in self.worker.tm.generate_request(obj, self.request):
                meta = out.get("meta_info") or {}
                reason = meta.get("finish_reason")
                if isinstance(reason, dict) and reason.get("type") not in ("stop", "length"):
                    if not self.stopping:
                        raise Aborted(meta)
                    out = {**out, "meta_info": {**meta, "finish_reason": {"type": "stop"}}}
                yield out
        except ValueError as e:
            raise WireError(str(e)) from None
        except HTTPException as e:
            raise SchedulerError(e.status_code, str(e.detail)) from None

    async def events(self) -> AsyncGenerator[Event, None]:
        """Contract events: new ids (and logprobs) per sample, then each sample's meta.
        `finish` follows, also when this fails or is closed early."""
        self.worker.started(self.rid, self)
        try:
            req = self.req
            if req.anchor is not None:
                anchor = req.anchor
                if len(self.samples) > 1:  # the samples' responses differ: none is saved
                    anchor = replace(anchor, snapshot_response=False)
                self.plan = orjson.dumps({"token": self.token,
                                          "anchor": anchor.to_json()}).decode()
                self.report = self.worker.expect(self.token)
            if len(self.samples) == 1:
                sample = self.samples[0]
                obj = self._obj(sample.rid, sglang_sampling(req.sampling, 0))
                async for out in self._stream(obj):
                    event = self._add(sample, out)
                    if event is not None:
                        yield event
                await self.finish(True)
                yield self._meta(0)
            else:
                await self._prefill()
                await self.finish(True)
                async for event in self._merged():
                    yield event
        except BaseException:  # an error, or the client went away (cancelled, closed)
            self._abort_samples()
            raise
        finally:
            self.worker.ended(self.rid)

    async def _prefill(self) -> None:
        """The prompt once (no token sampled), under the request's own id."""
        obj = self._obj(self.rid, {"max_new_tokens": 0})
        obj.return_logprob = False
        obj.top_logprobs_num = 0
        async for out in self._stream(obj):
            meta = out.get("meta_info") or {}
            if meta.get("finish_reason") is not None:
                self.cached_tokens = int(meta.get("cached_tokens") or 0)

    async def _merged(self) -> AsyncIterator[Event]:
        queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = \
            asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                obj = self._obj(self.samples[i].rid, sglang_sampling(self.req.sampling, i))
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

    def _add(self, sample: Sample, out: dict[str, Any]) -> Tokens | None:
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
            sample.finish_reason = finish_reason(meta, sample.output_ids)
        if not new:
            return None
        index = self.samples.index(sample)
        if not self.req.return_logprob:
            return Tokens(tuple(new), index)
        rows = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        start = 0 if incremental else sent
        take = slice(start, start + len(new))
        return Tokens(tuple(new), index, tuple((lp, t) for lp, t, *_ in rows[take]),
                      tuple(tuple((lp, t) for lp, t, *_ in top or []) for top in tops[take])
                      if self.req.top_logprobs_num else None)

    async def finish(self, ok: bool) -> None:
        """Learn what the request restored (at its admission) and saved: the report the
        scheduler pushed at its release, or (the request failed, or no report came) the
        `finish` call, which unless `ok` drops what the request staged. Once: a later call
        (the contract's, after the events) does nothing."""
        if self.finished:
            return
        self.finished = True
        if self.report is not None:
            fin = None
            if ok:
                try:
                    fin = await asyncio.wait_for(asyncio.shield(self.report), PUSH_WAIT_S)
                except asyncio.TimeoutError:
                    pass
            self.worker.forget(self.token)
            if fin is None:
                fin = await self.worker.call("finish", {"rid": self.rid, "token": self.token,
                                                        "ok": ok})
            else:
                self.worker.learn_epoch(fin)
            restore = AnchorReport.from_json(fin["anchors"])
            saved = AnchorReport.from_json({"written": fin["written"], "held": fin["held"]})
            self.anchors = replace(restore, written=saved.written,
                                   held=restore.held + saved.held,
                                   restored_tokens=int(fin["restored_tokens"]))
            self.restore_ms = float(fin["restore_ms"])
            self.snapshot_ms = float(fin["snapshot_ms"])

    async def stop(self, output_tokens: int | None) -> bool:
        """End the run as a stop (a stop sequence the proxy found): its response anchor is
        cut at prompt + `output_tokens` (the scheduler's `cut`, answered before the abort
        is sent), then SGLang aborts its samples, whose abort finishes `_stream` turns into
        stops. False when it has already ended."""
        if self.stopping or all(r not in self.worker.tm.rid_to_state for r in self.sglang_rids()):
            return False
        self.stopping = True
        if self.report is not None and not self.finished and output_tokens is not None \
                and len(self.samples) == 1:
            await self.worker.call("cut", {"rid": self.rid,
                                           "depth": len(self.req.input_ids) + output_tokens})
        self._abort_samples()
        return True

    def _abort_samples(self) -> None:
        tm = self.worker.tm
        for rid in self.sglang_rids():
            if rid in tm.rid_to_state:
                tm.abort_request(rid=rid)

    def _meta(self, index: int) -> GenerateMeta:
        sample = self.samples[index]
        n = len(self.req.input_ids)
        cached = self.cached_tokens
        if cached is None:
            cached = int(sample.sglang_meta.get("cached_tokens") or 0)
        now = time.perf_counter()
        first = sample.t_first or now
        return GenerateMeta(
            epoch=self.worker.epoch or "", rid=self.rid, prompt_tokens=n,
            completion_tokens=len(sample.output_ids), cached_tokens=cached,
            prefill_tokens=n - cached, restore_ms=round(self.restore_ms, 3),
            # SGLang does not split a request's time: prefill is until its first output
            # (queueing included), decode the rest
            prefill_ms=round((first - self.t0) * 1e3 - self.restore_ms, 3),
            decode_ms=round((now - first) * 1e3, 3), snapshot_ms=self.snapshot_ms,
            finish_reason=sample.finish_reason, anchors=self.anchors,
            index=index if len(self.samples) > 1 else None)
