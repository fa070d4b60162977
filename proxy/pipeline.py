"""The protocol-neutral request pipeline: split → plan anchors → generate → settle → usage.

Every API layer (OpenAI chat completions, Anthropic messages) parses its body into one
`Generation`, runs it through a `Completion`, and formats what comes out: a stream of
`OutputDelta`s (text, tool-call and reasoning pieces) and, at the end, the `Outcome` and
`Usage`.
Nothing here knows a wire format.

One generator (`Completion.choice_deltas`) drives the worker; streaming and non-streaming
replies are two consumers of it, so both see the same tokens. Whatever ends the request
early (client gone, worker failure), its `finally` aborts the worker request, and the worker
drops every anchor it staged for it. A stop sequence instead stops the worker request
(`/stop_request`): it ends as a finished one, so its prompt anchors, and its response
anchor up to the stop, are settled as usual and the next turn restores them.

Structured output (`structured.py`): the request's constraint goes to the worker as an
SGLang sampling parameter; a tool grammar replaces the adapter's forced prefix. `n > 1`
choices come from one worker request (one prefill); each has its own text path
(`choice.py`: detokenizer, stop sequences, output parser) and `Outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgspec

from anchorcache.wire import (
    AnchorKind,
    GenerateMeta,
    GenerateRequest,
    SamplingParams,
    TokenIds,
    engine_cache_key,
)

from .choice import (
    CALL_MARKERS,
    Choice,
    ChoiceDelta,
    FinishReason,
    Outcome,
    TokenLogprob,
)
from .cut_hints import add_hint_cuts, hint_positions
from .errors import ApiError
from .lifecycle import AnchoredRequest, Caller
from .planner import Plan
from .running import ProxyState
from .schema import ToolChoice, rendered_chars
from .splitter.parsers import OutputParser
from .splitter.reasoning import effort_template_kwargs, response_parser
from .splitter.types import RAW_ADAPTER, OutputDelta, SplitResult
from .structured import FAMILY, Constraint, ResponseFormat, build_constraint
from .targets import Target
from .tenants import TenantContext
from .worker_client import Chunk

# the API layers import the choice's records from here, with the rest of the pipeline
__all__ = ["AnchorHit", "ChoiceDelta", "Completion", "FinishReason", "Generation", "Outcome",
           "TokenLogprob", "Usage", "check_model"]

log = logging.getLogger("anchorcache.proxy")

NO_TOOLS = ToolChoice("none")
STOP_WAIT_S = 30.0  # a stopped worker request's last replies: then it is aborted instead
# the max_tokens a request ran with, where its own was clamped to the room the prompt left
MAX_TOKENS_HEADER = "X-Anchorcache-Max-Tokens"


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
    # OpenAI's `reasoning_effort` (splitter/reasoning.py REASONING_EFFORTS): becomes the
    # template's own kwargs in `Completion.create`; `template_kwargs` win over it
    reasoning_effort: str | None = None
    # anchor hints from the client (Anthropic cache_control): also cut after this many
    # messages where that boundary verifies (cut_hints.py; 0: the instruction prefix)
    cut_after: tuple[int, ...] = ()
    # hint k (of `cut_after`) → seconds its anchor is kept at least after this request (a
    # lease within the tenant's budget, leases.py); a hint not named here gets no lease
    cut_ttl_s: dict[int, float] = field(default_factory=dict)
    cache_salt: str | None = None  # narrows anchor sharing inside the tenant (never widens)
    n: int = 1  # choices, sampled from one prefill
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: ResponseFormat | None = None
    grammar: Constraint | None = None  # a regex / ebnf for the content (SGLang's extras)
    parallel_tool_calls: bool = True
    anchors: bool = True  # False: restore and save nothing for this request (a baseline)
    # what stands for `messages` in the splitter's memos, where the edge has it (a chat
    # body's bytes up to the end of its messages, or orjson's of converted messages that the
    # edge kept: `TextAdapter.split`'s `head`); a key, not part of the request's meaning
    messages_head: bytes | None = field(default=None, compare=False, repr=False)


class AnchorHit(Protocol):
    """A link a request restored, as its usage reports it: the planner's record, or a late
    chain's link as the worker listed it (made per anchor, not per request: a long
    conversation restores hundreds)."""

    @property
    def kind(self) -> AnchorKind: ...
    @property
    def depth(self) -> int: ...


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
    anchor_hits: Sequence[AnchorHit]  # root→leaf


def max_new_tokens(max_tokens: int | None, *, default: int, prompt_tokens: int,
                   context_tokens: int, policy: str) -> int:
    """How many tokens a request may generate: its `max_tokens` (`default` without one),
    clamped to the room the prompt leaves in the context. A prompt that leaves no room, or
    (`policy` "refuse", `ProxyConfig.max_tokens_policy`) a max_tokens beyond the room, is a
    400 `context_length_exceeded`."""
    room = context_tokens - prompt_tokens
    if room < 1 or (policy == "refuse" and max_tokens is not None and max_tokens > room):
        raise ApiError("context_length_exceeded",
                       f"the prompt has {prompt_tokens} tokens; with max_tokens={max_tokens} "
                       f"it exceeds the model's context of {context_tokens} tokens",
                       param="messages")
    return min(max_tokens or default, room)


def check_model(state: ProxyState, model: str) -> None:
    """`model` names the served model: its id, "default", or one of the configured
    `served_model_names` ("*": any name)."""
    names = state.config.served_model_names
    if model not in (state.info.model_id, "default") and model not in names and "*" not in names:
        raise ApiError("model_not_found", f"the model {model!r} does not exist; this proxy "
                       f"serves {state.info.model_id!r}", param="model")


async def _prepend(first: Chunk, rest: AsyncGenerator[Chunk, None]
                   ) -> AsyncGenerator[Chunk, None]:
    """`first`, then the rest of the stream; closing this closes the stream."""
    async with contextlib.aclosing(rest):
        yield first
        async for chunk in rest:
            yield chunk


class Completion:
    """One request's run through the pipeline. Build it with `Completion.create`, consume
    `deltas()` once (inside `contextlib.aclosing`), then read `outcome` and `usage()`."""

    def __init__(self, state: ProxyState, gen: Generation, split: SplitResult, *,
                 caller: Caller, started: float | None = None,
                 leases: dict[int, float] | None = None) -> None:
        self.state = state
        self.gen = gen
        self.split = split
        # prompt depth → seconds the anchor there is leased for (`gen.cut_ttl_s`, resolved)
        self.leases = leases or {}
        self.caller = caller
        self.rid = uuid.uuid4().hex
        self.outcomes = [Outcome() for _ in range(gen.n)]
        self.outcome = self.outcomes[0]
        self.meta: GenerateMeta | None = None  # the worker's last meta_info (prefill, anchors)
        self.started = time.perf_counter() if started is None else started
        self.ttft_s: float | None = None  # pipeline start → first generated token
        self.constraint = self._constraint()
        self.target: Target | None = None  # the worker serving it, once routed
        self.plan: Plan | None = None  # its anchor plan there, once routed
        self.max_new_tokens: int | None = None  # what the worker may generate, once known

    @classmethod
    async def create(cls, state: ProxyState, gen: Generation, *,
                     tenant: TenantContext, body_bytes: int | None = None) -> Completion:
        """Render and split the chat (a bad chat raises a 400 `ApiError`, one that cannot
        fit the context `context_length_exceeded` before anything is rendered). `tenant`:
        what the tenant middleware put on the request (`request[TENANT]`); `body_bytes`:
        the decoded body's length where every text of `gen` is in it (each character is at
        least a byte of its JSON), which spares the early budget check's pass over the
        messages for a body that cannot reach the budget.

        The split runs on the split thread (split_pool.py), never on the event loop."""
        started = time.perf_counter()
        caller = tenant.caller(gen.cache_salt)
        if gen.reasoning_effort is not None:
            gen = dataclasses.replace(gen, reasoning_effort=None, template_kwargs={
                **effort_template_kwargs(state.adapter, gen.reasoning_effort),
                **gen.template_kwargs})
        # a max_tokens beyond the room is clamped: only a refused one counts against the text
        asked = gen.max_tokens if state.config.max_tokens_policy == "refuse" else None
        if body_bytes is None or not state.budget.fits(body_bytes, asked):
            state.budget.check(rendered_chars(gen.messages, gen.tools), asked)
        # the adapters copy what they change: the messages are passed as they are (a copy of
        # each was a pass over the conversation on the loop)
        messages, tools = list(gen.messages), [dict(t) for t in gen.tools] or None
        # in the tenant's turn on the split threads, with memos of the caller's own
        splitter = functools.partial(state.splits.split, tenant=caller.tenant,
                                     scope=caller.namespace)
        split = await splitter(messages, tools, gen.template_kwargs or None,
                               head=gen.messages_head)
        leases: dict[int, float] = {}
        if gen.cut_after:
            found = await hint_positions(splitter, split, messages, tools,
                                         gen.template_kwargs or None, gen.cut_after)
            split = add_hint_cuts(split, found.values())
            for k, depth in found.items():
                if k in gen.cut_ttl_s:
                    leases[depth] = max(gen.cut_ttl_s[k], leases.get(depth, 0.0))
        return cls(state, gen, split, caller=caller, started=started, leases=leases)

    def _constraint(self) -> Constraint | None:
        """The grammar for this request (a 400 `ApiError` for a bad schema)."""
        gen, adapter = self.gen, self.state.adapter
        return build_constraint(
            adapter=adapter.name, tools=gen.tools, mode=gen.tool_choice.mode,
            function=gen.tool_choice.function, response_format=gen.response_format,
            grammar=gen.grammar, parallel_tool_calls=gen.parallel_tool_calls,
            thinking=adapter.name == "qwen3"
            and gen.template_kwargs.get("enable_thinking", True) is not False,
            memo=self.state.constraints, scope=self.caller.namespace)

    @property
    def tool_grammar(self) -> bool:
        """Whether the grammar writes the tool-call markup (no forced prefix then)."""
        return self.constraint is not None and self.constraint.kind == "structural_tag" \
            and bool(self.gen.tools) and self.gen.tool_choice.mode != "none"

    def _sampling(self, prompt_ids: tuple[int, ...] | TokenIds) -> SamplingParams:
        gen, state = self.gen, self.state
        self.max_new_tokens = max_new_tokens(
            gen.max_tokens, default=state.config.default_max_tokens,
            prompt_tokens=len(prompt_ids), context_tokens=state.info.max_context_tokens,
            policy=state.config.max_tokens_policy)
        params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
            stop_token_ids=tuple(state.adapter.stop_token_ids), seed=gen.seed, n=gen.n)
        if self.constraint is not None:
            params = msgspec.structs.replace(params, **self.constraint.sampling_fields())
        return params

    async def deltas(self) -> AsyncGenerator[OutputDelta, None]:
        """The deltas of choice 0 (a layer that serves one choice): see `choice_deltas`."""
        async with contextlib.aclosing(self.choice_deltas()) as pieces:
            async for piece in pieces:
                if piece.delta is not None and piece.index == 0:
                    yield piece.delta

    async def choice_deltas(self) -> AsyncGenerator[ChoiceDelta, None]:
        """Yield every choice's text / tool-call deltas as the worker produces them; fill
        `outcomes`.

        Raises `ApiError` before the first delta for a request the worker refuses (so a
        streaming layer can still answer with a status code) and after it for a failure
        mid-generation. Cleans up the worker side on any exit.
        """
        state, gen = self.state, self.gen
        choice = gen.tool_choice.openai()
        parse_tools = bool(gen.tools) and gen.tool_choice.mode != "none"
        forced = state.adapter.forced_prefix_ids(choice) \
            if parse_tools and not self.tool_grammar else ()
        prompt_ids = self.split.input_ids + forced
        sampling = self._sampling(prompt_ids)
        stop_ids = set(sampling.stop_token_ids) | set(state.info.eos_token_ids)
        # Always parse: besides tool calls, some formats carry reasoning (harmony's channels,
        # think blocks: splitter/reasoning.py) that must not reach the client as content;
        # with tool_choice "none" the parser only splits those.
        # Under a tool grammar the calls are the model's own output: parsed as under "auto".
        parser_choice = "auto" if self.tool_grammar else choice
        markers = CALL_MARKERS.get(FAMILY.get(state.adapter.name, ""), ()) if parse_tools else ()
        def parser() -> OutputParser:  # a raw prompt's output is text, as the model wrote it
            if self.split.adapter == RAW_ADAPTER:
                return OutputParser(tool_choice="none")
            return response_parser(state.adapter, list(gen.tools) or None,
                                   tool_choice=parser_choice, prompt_ids=prompt_ids)

        choices = [Choice(i, self.outcomes[i], tokenizer=state.tokenizer, parser=parser(),
                          stop=gen.stop, stop_ids=stop_ids, markers=markers)
                   for i in range(gen.n)]
        settled = False
        samples_done = 0  # samples the worker has finished
        reason = "cancelled"  # why the reservation is aborted, if it is
        anchoring: AnchoredRequest | None = None
        plan: Plan | None = None
        try:
            target, anchoring, plan, chunks = await self._start(prompt_ids, sampling)
            self.plan = plan
            async with contextlib.aclosing(chunks) as stream:
                async for chunk in stream:
                    if not 0 <= chunk.index < len(choices):
                        raise ApiError("worker_error",
                                       f"worker sent choice {chunk.index} of {gen.n}")
                    if self.ttft_s is None and chunk.output_ids:
                        self.ttft_s = time.perf_counter() - self.started
                    samples_done += chunk.meta is not None
                    if chunk.meta is not None:
                        self.meta = chunk.meta
                    c = choices[chunk.index]
                    if not c.closed:
                        for piece in c.feed(chunk):
                            yield piece
                    if all(c.closed for c in choices) and samples_done < len(choices):
                        # stop sequences ended what the worker still generates: with
                        # anchors to keep it is stopped, else aborted (`finally`)
                        reason = "stop_sequence"
                        if anchoring is not None:
                            samples_done += await self._stop(target, stream, choices)
                        break
            for c in choices:  # a worker that ended without a choice's finish
                if not c.closed:
                    for d in c.close():
                        yield ChoiceDelta(c.index, d)
            if samples_done == len(choices) and self.meta is not None:
                if anchoring is not None:
                    await asyncio.shield(target.lifecycle.settle(
                        anchoring, self.meta, reason if reason == "stop_sequence" else None,
                        leases=self.leases))
                settled = True
        except ApiError as e:
            reason = e.kind
            raise
        except Exception:
            reason = "error"
            raise
        finally:
            try:
                if not settled and self.target is not None:
                    # client gone, stop sequence, or worker failure: nothing may linger
                    if anchoring is not None:
                        self.target.lifecycle.fail(anchoring, reason)
                    await asyncio.shield(self._abort(self.target))
            finally:
                if self.target is not None:
                    self.target.leave()
                self._observe(plan, anchoring is not None,
                              "ok" if settled and reason != "stop_sequence" else reason, settled)

    async def _stop(self, target: Target, stream: AsyncGenerator[Chunk, None],
                    choices: list[Choice]) -> int:
        """Stop the worker request (a stop sequence closed every choice) and read its stream
        to the end, ignoring the ids past the stops; returns how many samples finished. The
        worker keeps what the request saved: prompt anchors, and the response anchor up to
        the stop (one choice). Any failure, or no end within `STOP_WAIT_S`, leaves samples
        unfinished: the caller then aborts the request."""
        done = 0
        try:
            async with asyncio.timeout(STOP_WAIT_S):
                keep = choices[0].kept_tokens if len(choices) == 1 else None
                await target.worker.stop(self.rid, keep)  # not running: its end is on its way
                async for chunk in stream:
                    if chunk.meta is not None:
                        done += 1
                        self.meta = chunk.meta
        except (ApiError, TimeoutError) as e:
            log.warning("request %s: stopping it on the worker failed (%s); aborting it",
                        self.rid, e.message if isinstance(e, ApiError) else "timed out")
        return done

    async def _start(self, prompt_ids: tuple[int, ...] | TokenIds, sampling: SamplingParams
                     ) -> tuple[Target, AnchoredRequest | None, Plan, AsyncGenerator[Chunk, None]]:
        """Route the request (targets.py), open its reservation there and start it, up to
        the worker's first chunk. A worker that cannot be reached before then is taken out
        and the request goes to the next one: nothing has reached the client yet. Sets
        `self.target` (counted in flight there until the request ends)."""
        state, gen = self.state, self.gen
        tried: set[str] = set()
        anchored = state.anchors_on and gen.anchors
        while True:
            target, routed = state.targets.route(self.split, self.caller if anchored else None,
                                                 frozenset(tried))
            self.target, anchoring = target, None
            target.enter()
            if anchored:  # opens the reservation: `choice_deltas` closes it
                anchoring = await target.lifecycle.begin(self.rid, self.caller, self.split, routed)
            plan = anchoring.plan if anchoring is not None else target.lifecycle.chunk_only(self.split)
            # (a `TokenIds` is written as the tuple it equals: the wire codec)
            req = GenerateRequest(input_ids=cast("tuple[int, ...]", prompt_ids),
                                  sampling=sampling, rid=self.rid,
                                  stream=True, anchor=plan.request,
                                  cache_key=engine_cache_key(self.caller.namespace),
                                  return_logprob=gen.logprobs, top_logprobs_num=gen.top_logprobs)
            # held open until the anchors are kept: a dropped stream aborts the worker request
            chunks = cast(AsyncGenerator[Chunk, None], target.worker.generate(req))
            try:
                first = await anext(chunks)
            except BaseException as e:
                await asyncio.shield(chunks.aclose())
                if anchoring is not None:  # (closed here: `choice_deltas` never sees it)
                    reason = e.kind if isinstance(e, ApiError) else "error"
                    target.lifecycle.fail(anchoring, reason)
                    self._observe_reservation(reason, confirmed=False)
                if not isinstance(e, ApiError) or e.kind not in ("worker_unavailable",
                                                                 "worker_error"):
                    raise  # `choice_deltas` aborts it on the worker
                if e.kind == "worker_error":  # it failed this request: dead, or alive?
                    await state.targets.check(target)
                    if target.healthy:
                        raise
                self.target = None
                target.leave()
                state.targets.down(target, e.message)
                tried.add(target.id)
                log.warning("request %s: worker %s failed before replying (%s); retrying "
                            "elsewhere", self.rid, target.id, e.message)
                self.rid = uuid.uuid4().hex  # a new reservation: the failed one stays closed
                continue
            return target, anchoring, plan, _prepend(first, chunks)

    def _observe(self, plan: Plan | None, reserved: bool, reason: str, confirmed: bool) -> None:
        """Where the pipeline feeds the metrics when a request ends (`reason`: why the
        reservation ended, `confirmed`: whether it kept anything; one closed before the
        worker's first chunk was counted where it closed). Never raises: a metrics bug must
        not turn a served request into an error."""
        metrics, tenant = self.state.metrics, self.caller.tenant
        try:
            if self.ttft_s is not None:
                metrics.record_ttft(tenant, self.ttft_s)
            metrics.record_completion_tokens(tenant, sum(o.completion_tokens for o in self.outcomes))
            if self.meta is not None and plan is not None:
                metrics.record_generation(tenant, plan, self.meta)
        except Exception:
            log.exception("recording metrics of request %s failed", self.rid)
        if reserved:  # anchors on: the request held a reservation
            self._observe_reservation(reason, confirmed)

    def _observe_reservation(self, reason: str, confirmed: bool) -> None:
        """Count how a reservation of this request ended (never raises)."""
        try:
            self.state.metrics.record_reservations(
                self.caller.tenant, "confirmed" if confirmed else "aborted", reason)
        except Exception:
            log.exception("recording metrics of request %s failed", self.rid)

    async def _abort(self, target: Target) -> None:
        """Abort the worker request; the worker then drops every snapshot it staged for it."""
        if not target.healthy:
            return  # out of reach: its requests and staged snapshots are gone or reconciled
        try:
            await target.worker.abort(self.rid)
        except ApiError:
            pass

    def headers(self) -> dict[str, str]:
        """Response headers: which worker served the request (for operators and tests), and
        the max_tokens the request ran with where it was clamped."""
        out = {"X-Anchorcache-Worker": self.target.name} if self.target is not None else {}
        asked = self.gen.max_tokens
        if asked is not None and self.max_new_tokens is not None and asked > self.max_new_tokens:
            out[MAX_TOKENS_HEADER] = str(self.max_new_tokens)
        return out

    def usage(self) -> Usage:
        """The request's usage: one prompt (prefilled once), every choice's completion."""
        meta = self.meta
        completion_tokens = sum(o.completion_tokens for o in self.outcomes)
        if meta is None:
            n = len(self.split.input_ids)
            return Usage(n, completion_tokens, 0, n, 0, 0.0, 0.0, 0.0, ())
        saved = [w.depth for w in meta.anchors.written if w.kind != AnchorKind.RESPONSE]
        return Usage(
            prompt_tokens=meta.prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=meta.cached_tokens,
            prefill_tokens=meta.prefill_tokens,
            snapshot_tokens=max(0, min(max(saved, default=0), meta.prompt_tokens) - meta.cached_tokens),
            restore_ms=meta.restore_ms,
            prefill_ms=meta.prefill_ms,
            decode_ms=round(sum(o.meta.decode_ms for o in self.outcomes if o.meta is not None), 3),
            anchor_hits=self.plan.restored(meta.anchors) if self.plan is not None
            else meta.anchors.restored,
        )
