"""`POST /v1/chat/completions`: split → plan anchors → generate on the worker → OpenAI reply.

One generator (`_run`) drives the worker and yields text/tool-call deltas; the streaming
and non-streaming replies are two consumers of it, so both see the same tokens. Whatever
ends the request early (client gone, stop string, worker failure), the `finally` aborts the
worker request and every anchor reservation it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from anchorcache.wire import GenerateMeta, GenerateRequest, SamplingParams

from .detokenizer import IncrementalDetokenizer
from .errors import ApiError, json_response
from .lifecycle import Caller, Flight
from .schema import ChatRequest, parse_chat_request
from .splitter.types import SplitError, SplitResult
from .state import STATE, ProxyState
from .tenants import TENANT


@dataclass
class Outcome:
    """What one completion produced, filled in as `_run` goes."""

    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    completion_tokens: int = 0
    meta: GenerateMeta | None = None


def _sampling(req: ChatRequest, prompt_ids: tuple[int, ...], state: ProxyState) -> SamplingParams:
    room = state.info.max_context_tokens - len(prompt_ids)
    if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
        raise ApiError("context_length_exceeded",
                       f"the prompt has {len(prompt_ids)} tokens; with max_tokens="
                       f"{req.max_tokens} it exceeds the model's context of "
                       f"{state.info.max_context_tokens} tokens", param="messages")
    return SamplingParams(
        max_new_tokens=min(req.max_tokens or state.config.default_max_tokens, room),
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        stop_token_ids=tuple(state.adapter.stop_token_ids), seed=req.seed)


def _split(state: ProxyState, req: ChatRequest) -> SplitResult:
    # On the event loop: the splitter's prefix cache is single-threaded, and an incremental
    # split of an agent prompt takes well under a millisecond.
    try:
        return state.adapter.split([dict(m) for m in req.messages],
                                   [dict(t) for t in req.tools] or None,
                                   template_kwargs=req.template_kwargs or None)
    except SplitError as e:
        raise ApiError("invalid_request", str(e), param=getattr(e, "param", None)) from None


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    hits = [i for s in stops if (i := text.find(s, max(0, start - len(s)))) >= 0]
    return min(hits) if hits else None


async def _run(state: ProxyState, req: ChatRequest, split: SplitResult, caller: Caller,
               outcome: Outcome) -> AsyncGenerator[dict[str, Any], None]:
    """Yield OpenAI `delta` dicts; fill `outcome`. Cleans up the worker side on any exit."""
    rid = uuid.uuid4().hex
    choice = req.tool_choice.openai()
    parse_tools = bool(req.tools) and req.tool_choice.mode != "none"
    forced = state.adapter.forced_prefix(choice) if parse_tools else None
    prompt_ids = split.input_ids + (tuple(state.tokenizer.encode(forced)) if forced else ())
    sampling = _sampling(req, prompt_ids, state)
    flight: Flight | None = None
    if state.anchors_on:
        flight = await state.lifecycle.begin(rid, caller, split)
    finished = settled = False
    emitted = 0  # characters of detok.text already passed on
    reason = "cancelled"
    try:  # from here on, any exit closes the reservation (the `finally`)
        plan = flight.plan if flight is not None else state.planner.chunk_only(split)
        gen = GenerateRequest(input_ids=prompt_ids, sampling=sampling, rid=rid, stream=True,
                              anchor=plan.request)
        stop_ids = set(gen.sampling.stop_token_ids) | set(state.info.eos_token_ids)
        detok = IncrementalDetokenizer(state.tokenizer, skip_token_ids=stop_ids)
        # Always parse: besides tool calls, some formats (harmony) carry channels that must
        # not reach the client as content; with tool_choice "none" the parser only splits those.
        parser = state.adapter.output_parser(list(req.tools) or None, tool_choice=choice)
        async for chunk in state.worker.generate(gen):
            outcome.completion_tokens += len(chunk.output_ids)
            detok.add(chunk.output_ids)
            if chunk.meta is not None:
                detok.flush()
            text = detok.text
            cut = _find_stop(text, req.stop, emitted) if req.stop else None
            if cut is not None:
                text = text[:cut]
            new, emitted = text[emitted:], len(text)
            for delta in parser.feed(new) if new else ():
                yield _delta_json(delta, outcome)
            if cut is not None:
                outcome.finish_reason = "stop"
                reason = "stop_string"
                break
            if chunk.meta is not None:
                outcome.meta = chunk.meta
                outcome.finish_reason = "length" if chunk.meta.finish_type == "length" else "stop"
                finished = True
        for delta in parser.flush():
            yield _delta_json(delta, outcome)
        parsed = parser.finish()
        outcome.text = parsed.content or ""
        outcome.tool_calls = [c.to_openai() for c in parsed.tool_calls]
        if outcome.tool_calls:
            outcome.finish_reason = "tool_calls"
        if finished and outcome.meta is not None:
            if flight is not None:
                await asyncio.shield(state.lifecycle.settle(flight, outcome.meta))
            settled = True
    except ApiError as e:
        reason = e.kind
        raise
    finally:
        if not settled:
            # client gone, stop string, or worker failure: nothing of this request may linger
            if flight is not None:
                state.lifecycle.fail(flight, reason)
            await asyncio.shield(_cleanup(state, rid))


async def _cleanup(state: ProxyState, rid: str) -> None:
    """Abort the worker request; the worker then drops every snapshot it staged for it."""
    try:
        await state.worker.abort(rid)
    except ApiError:
        pass


def _delta_json(delta: Any, outcome: Outcome) -> dict[str, Any]:
    if delta.tool_call is None:
        outcome.text += delta.content or ""
        return {"content": delta.content}
    tc = delta.tool_call
    call: dict[str, Any] = {"index": tc.index}
    if tc.id is not None:
        call.update(id=tc.id, type="function")
    fn: dict[str, Any] = {}
    if tc.name is not None:
        fn["name"] = tc.name
    if tc.arguments_delta:
        fn["arguments"] = tc.arguments_delta
    call["function"] = fn
    return {"tool_calls": [call]}


def _usage(split: SplitResult, outcome: Outcome) -> dict[str, Any]:
    meta = outcome.meta
    prompt_tokens = meta.prompt_tokens if meta else len(split.input_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": meta.cached_tokens if meta else 0},
        "timings": {
            "restore_ms": meta.restore_ms if meta else 0.0,
            "prefill_ms": meta.prefill_ms if meta else 0.0,
            "decode_ms": meta.decode_ms if meta else 0.0,
            "prefill_tokens": meta.prefill_tokens if meta else prompt_tokens,
            "anchor_hits": [{"kind": h.kind.value, "depth": h.depth}
                            for h in (meta.anchors.restored if meta else ())],
        },
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise ApiError("invalid_json", f"the request body is not valid JSON: {e}") from None
    req = parse_chat_request(body, max_tokens_limit=state.info.max_context_tokens)
    caller = request[TENANT].caller(body.get("cache_salt") if isinstance(body, dict) else None)
    if req.model not in (state.info.model_id, "default"):
        raise ApiError("model_not_found", f"the model {req.model!r} does not exist; this proxy "
                       f"serves {state.info.model_id!r}", param="model")
    split = _split(state, req)
    cid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    outcome = Outcome()
    if not req.stream:
        async with contextlib.aclosing(_run(state, req, split, caller, outcome)) as deltas:
            async for _ in deltas:
                pass
        message: dict[str, Any] = {"role": "assistant",
                                   "content": outcome.text if outcome.text or not outcome.tool_calls else None}
        if outcome.tool_calls:
            message["tool_calls"] = outcome.tool_calls
        return json_response({
            "id": cid, "object": "chat.completion", "created": created,
            "model": state.info.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": outcome.finish_reason,
                         "logprobs": None}],
            "usage": _usage(split, outcome),
        })

    def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": state.info.model_id, "choices": choices, **extra}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    # Wait for the first delta before sending headers, so that a worker that is down or
    # rejects the request still gets a proper status code rather than a 200 stream.
    async with contextlib.aclosing(_run(state, req, split, caller, outcome)) as deltas:
        first = await anext(deltas, None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(frame([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None}]))
        try:
            if first is not None:
                await resp.write(frame([{"index": 0, "delta": first, "finish_reason": None}]))
            async for delta in deltas:
                await resp.write(frame([{"index": 0, "delta": delta, "finish_reason": None}]))
        except ApiError as e:  # the stream has started: report in-band, then end it
            await resp.write(b"data: " + orjson.dumps(e.body()) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
    await resp.write(frame([{"index": 0, "delta": {}, "finish_reason": outcome.finish_reason}]))
    if req.include_usage:
        await resp.write(frame([], usage=_usage(split, outcome)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
