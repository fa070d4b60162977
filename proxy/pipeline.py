"""The protocol-neutral request pipeline: split → plan anchors → generate → settle → usage.

Every API layer (OpenAI chat completions, Anthropic messages) parses its body into one
`Generation`, runs it through a `Completion`, and formats what comes out: a stream of
`OutputDelta`s (text and tool-call pieces) and, at the end, the `Outcome` and `Usage`.
Nothing here knows a wire format.

One generator (`Completion.deltas`) drives the worker; streaming and non-streaming replies
are two consumers of it, so both see the same tokens. Whatever ends the request early
(client gone, stop sequence, worker failure), its `finally` aborts the worker request, and
the worker drops every anchor it staged for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from anchorcache.wire import AnchorKind, GenerateMeta, GenerateRequest, SamplingParams

from .cut_hints import with_hint_cuts
from .detokenizer import IncrementalDetokenizer
from .errors import ApiError
from .lifecycle import Caller, Flight
from .planner import Plan
from .schema import ToolChoice, rendered_chars
from .splitter.types import OutputDelta, SplitResult, ToolCall
from .state import ProxyState
from .tenants import TenantContext

log = logging.getLogger("anchorcache.proxy")

NO_TOOLS = ToolChoice("none")


@dataclass(frozen=True)
class Generation:
    """A chat to complete, in the splitter's terms (OpenAI-form messages and tools)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = NO_TOOLS
    max_tokens: int | None = None  # None: the proxy's default, bounded by the context left
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop sequences (text)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # anchor hints from the client (Anthropic cache_control): also cut after this many
    # messages where that boundary verifies (cut_hints.py)
    cut_after: tuple[int, ...] = ()
    cache_salt: str | None = None  # narrows anchor sharing inside the tenant (never widens)
    anchors: bool = True  # False: restore and save nothing for this request (a baseline)


class FinishReason(str, Enum):
    STOP = "stop"  # an EOS / stop token
    LENGTH = "length"  # max_tokens or the context ran out
    TOOL_CALLS = "tool_calls"  # the output parsed into tool calls
    STOP_SEQUENCE = "stop_sequence"  # one of `Generation.stop` appeared in the text


@dataclass
class Outcome:
    """What one completion produced, filled in as `Completion.deltas` goes."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.STOP
    stop_sequence: str | None = None  # which of `Generation.stop` ended the text
    completion_tokens: int = 0
    meta: GenerateMeta | None = None  # the worker's final meta_info


@dataclass(frozen=True)
class AnchorHit:
    kind: str | None
    depth: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the worker did not prefill (device cache + restored)
    prefill_tokens: int
    snapshot_tokens: int  # prompt tokens newly saved as anchors by this request
    restore_ms: float
    prefill_ms: float
    decode_ms: float
    anchor_hits: tuple[AnchorHit, ...]


def check_model(state: ProxyState, model: str) -> None:
    if model not in (state.info.model_id, "default"):
        raise ApiError("model_not_found", f"the model {model!r} does not exist; this proxy "
                       f"serves {state.info.model_id!r}", param="model")


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The earliest stop sequence in `text` that ends past `start` (where new text began)."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a stop sequence may still complete: held
    back, so that a sequence spanning tokens or chunks never reaches the client in part."""
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


class Completion:
    """One request's run through the pipeline. Build it with `Completion.create`, consume
    `deltas()` once (inside `contextlib.aclosing`), then read `outcome` and `usage()`."""

    def __init__(self, state: ProxyState, gen: Generation, split: SplitResult, *,
                 caller: Caller, started: float | None = None) -> None:
        self.state = state
        self.gen = gen
        self.split = split
        self.caller = caller
        self.rid = uuid.uuid4().hex
        self.outcome = Outcome()
        self.started = time.perf_counter() if started is None else started
        self.ttft_s: float | None = None  # pipeline start → first generated token

    @classmethod
    async def create(cls, state: ProxyState, gen: Generation, *,
                     tenant: TenantContext) -> Completion:
        """Render and split the chat (a bad chat raises a 400 `ApiError`, one that cannot
        fit the context `context_length_exceeded` before anything is rendered). `tenant`:
        what the tenant middleware put on the request (`request[TENANT]`).

        The split runs on the split thread (split_pool.py), never on the event loop."""
        started = time.perf_counter()
        caller = tenant.caller(gen.cache_salt)
        state.budget.check(rendered_chars(gen.messages), gen.max_tokens)
        messages, tools = [dict(m) for m in gen.messages], [dict(t) for t in gen.tools] or None
        split = await state.splits.split(messages, tools, gen.template_kwargs or None)
        if gen.cut_after:
            split = await with_hint_cuts(state.splits.split, split, messages, tools,
                                         gen.template_kwargs or None, gen.cut_after)
        return cls(state, gen, split, caller=caller, started=started)

    def _sampling(self, prompt_ids: tuple[int, ...]) -> SamplingParams:
        gen, state = self.gen, self.state
        room = state.info.max_context_tokens - len(prompt_ids)
        if room < 1 or (gen.max_tokens is not None and gen.max_tokens > room):
            raise ApiError("context_length_exceeded",
                           f"the prompt has {len(prompt_ids)} tokens; with max_tokens="
                           f"{gen.max_tokens} it exceeds the model's context of "
                           f"{state.info.max_context_tokens} tokens", param="messages")
        return SamplingParams(
            max_new_tokens=min(gen.max_tokens or state.config.default_max_tokens, room),
            temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
            stop_token_ids=tuple(state.adapter.stop_token_ids), seed=gen.seed)

    async def deltas(self) -> AsyncGenerator[OutputDelta, None]:
        """Yield text / tool-call deltas as the worker produces them; fill `outcome`.

        Raises `ApiError` before the first delta for a request the worker refuses (so a
        streaming layer can still answer with a status code) and after it for a failure
        mid-generation. Cleans up the worker side on any exit.
        """
        state, gen, outcome = self.state, self.gen, self.outcome
        choice = gen.tool_choice.openai()
        parse_tools = bool(gen.tools) and gen.tool_choice.mode != "none"
        forced = state.adapter.forced_prefix_ids(choice) if parse_tools else ()
        prompt_ids = self.split.input_ids + forced
        sampling = self._sampling(prompt_ids)
        flight: Flight | None = None
        if state.anchors_on and gen.anchors:  # opens the reservation: the `finally` closes it
            flight = await state.lifecycle.begin(self.rid, self.caller, self.split)
        finished = settled = False
        emitted = 0  # characters of detok.text already passed on
        reason = "cancelled"  # why the reservation is aborted, if it is
        plan: Plan | None = None
        try:
            plan = flight.plan if flight is not None else state.planner.chunk_only(self.split)
            req = GenerateRequest(input_ids=prompt_ids, sampling=sampling, rid=self.rid,
                                  stream=True, anchor=plan.request)
            stop_ids = set(req.sampling.stop_token_ids) | set(state.info.eos_token_ids)
            detok = IncrementalDetokenizer(state.tokenizer, skip_token_ids=stop_ids)
            # Always parse: besides tool calls, some formats (harmony) carry channels that
            # must not reach the client as content; with tool_choice "none" the parser only
            # splits those.
            parser = state.adapter.output_parser(list(gen.tools) or None, tool_choice=choice)
            async for chunk in state.worker.generate(req):
                if self.ttft_s is None and chunk.output_ids:
                    self.ttft_s = time.perf_counter() - self.started
                outcome.completion_tokens += len(chunk.output_ids)
                detok.add(chunk.output_ids)
                if chunk.meta is not None:
                    detok.flush()
                text = detok.text
                stop = _find_stop(text, gen.stop, emitted) if gen.stop else None
                if stop is not None:
                    text = text[:stop[0]]
                elif gen.stop and chunk.meta is None:
                    text = text[:max(emitted, len(text) - _stop_prefix(text, gen.stop))]
                new, emitted = text[emitted:], len(text)
                for delta in parser.feed(new) if new else ():
                    yield self._record(delta)
                if stop is not None:
                    outcome.finish_reason = FinishReason.STOP_SEQUENCE
                    outcome.stop_sequence = stop[1]
                    reason = "stop_sequence"
                    break
                if chunk.meta is not None:
                    outcome.meta = chunk.meta
                    outcome.finish_reason = FinishReason.LENGTH \
                        if chunk.meta.finish_type == "length" else FinishReason.STOP
                    finished = True
            for delta in parser.flush():
                yield self._record(delta)
            parsed = parser.finish()
            outcome.text = parsed.content or ""
            outcome.tool_calls = list(parsed.tool_calls)
            if outcome.tool_calls:
                outcome.finish_reason = FinishReason.TOOL_CALLS
            if finished and outcome.meta is not None:
                if flight is not None:
                    await asyncio.shield(state.lifecycle.settle(flight, outcome.meta))
                settled = True
        except ApiError as e:
            reason = e.kind
            raise
        except Exception:
            reason = "error"
            raise
        finally:
            try:
                if not settled:
                    # client gone, stop sequence, or worker failure: nothing may linger
                    if flight is not None:
                        state.lifecycle.fail(flight, reason)
                    await asyncio.shield(self._abort())
            finally:
                self._observe(plan, flight is not None, None if settled else reason)

    def _observe(self, plan: Plan | None, reserved: bool, aborted: str | None) -> None:
        """The one place the pipeline feeds the metrics (`aborted`: why it was not settled).
        Never raises: a metrics bug must not turn a served request into an error."""
        metrics, tenant = self.state.metrics, self.caller.tenant
        try:
            if self.ttft_s is not None:
                metrics.record_ttft(tenant, self.ttft_s)
            if self.outcome.meta is not None and plan is not None:
                metrics.record_generation(tenant, plan, self.outcome.meta)
            if reserved:  # anchors on: the request held a reservation
                metrics.record_reservations(tenant, "aborted" if aborted else "confirmed",
                                            aborted or "ok")
        except Exception:
            log.exception("recording metrics of request %s failed", self.rid)

    def _record(self, delta: OutputDelta) -> OutputDelta:
        if delta.tool_call is None:
            self.outcome.text += delta.content or ""
        return delta

    async def _abort(self) -> None:
        """Abort the worker request; the worker then drops every snapshot it staged for it."""
        try:
            await self.state.worker.abort(self.rid)
        except ApiError:
            pass

    def usage(self) -> Usage:
        meta = self.outcome.meta
        if meta is None:
            n = len(self.split.input_ids)
            return Usage(n, self.outcome.completion_tokens, 0, n, 0, 0.0, 0.0, 0.0, ())
        saved = [w.depth for w in meta.anchors.written if w.kind != AnchorKind.RESPONSE]
        return Usage(
            prompt_tokens=meta.prompt_tokens,
            completion_tokens=self.outcome.completion_tokens,
            cached_tokens=meta.cached_tokens,
            prefill_tokens=meta.prefill_tokens,
            snapshot_tokens=max(0, min(max(saved, default=0), meta.prompt_tokens) - meta.cached_tokens),
            restore_ms=meta.restore_ms,
            prefill_ms=meta.prefill_ms,
            decode_ms=meta.decode_ms,
            anchor_hits=tuple(AnchorHit(h.kind.value, h.depth) for h in meta.anchors.restored),
        )
