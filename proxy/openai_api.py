"""`POST /v1/chat/completions`: the OpenAI layer over the request pipeline (`pipeline.py`).

Parses the body into a `Generation`, runs a `Completion`, and frames its deltas as a
`chat.completion` object or `chat.completion.chunk` server-sent events. Reasoning (a think
block, harmony's analysis channel) is `message.reasoning_content` (only when there is some)
and streams as `delta.reasoning_content`, as vLLM, SGLang and DeepSeek frame it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from .errors import ApiError, EventStream, json_response
from .pipeline import (
    ChoiceDelta,
    Completion,
    FinishReason,
    Generation,
    Outcome,
    TokenLogprob,
    Usage,
    check_model,
)
from .running import STATE
from .schema import BODY_BYTES, ChatRequest, parse_chat_request, read_items
from .splitter.types import OutputDelta
from .tenants import TENANT

# stop sequences are OpenAI's "stop" too
FINISH = {FinishReason.STOP: "stop", FinishReason.STOP_SEQUENCE: "stop",
           FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls"}


# `X-Anchorcache-Anchors: off` runs one request without anchors (a baseline for comparisons,
# e.g. `anchorcache bench`); it can only make the request slower, never share anything.
ANCHORS_HEADER = "X-Anchorcache-Anchors"


def anchors_wanted(request: web.Request) -> bool:
    value = request.headers.get(ANCHORS_HEADER, "on").strip().lower()
    if value not in ("on", "off"):
        raise ApiError("invalid_request", f"{ANCHORS_HEADER} must be 'on' or 'off', not {value!r}")
    return value == "on"


def generation(req: ChatRequest, cache_salt: str | None = None,
               messages_head: bytes | None = None) -> Generation:
    return Generation(messages=req.messages, messages_head=messages_head, tools=req.tools, tool_choice=req.tool_choice,
                      max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, seed=req.seed, stop=req.stop,
                      template_kwargs=req.template_kwargs, cache_salt=cache_salt, n=req.n,
                      logprobs=req.logprobs, top_logprobs=req.top_logprobs,
                      response_format=req.response_format, grammar=req.grammar,
                      parallel_tool_calls=req.parallel_tool_calls,
                      reasoning_effort=req.reasoning_effort)


def delta_json(delta: OutputDelta) -> dict[str, Any]:
    if delta.reasoning is not None:
        return {"reasoning_content": delta.reasoning}
    if delta.tool_call is None:
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


def _token_json(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def logprobs_json(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{**_token_json(e.token, e.logprob),
                         "top_logprobs": [_token_json(t, lp) for t, lp in e.top]}
                        for e in entries],
            "refusal": None}


def _message(outcome: Outcome) -> dict[str, Any]:
    # no text: null next to tool calls or a call that failed, else "" (a plain empty answer)
    content = outcome.text or (None if outcome.tool_calls or outcome.tool_call_error else "")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if outcome.reasoning:
        message["reasoning_content"] = outcome.reasoning
    if outcome.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in outcome.tool_calls]
    return message


def _choice_extra(outcome: Outcome) -> dict[str, Any]:
    # not an OpenAI field: why a started tool call is missing (SDKs ignore unknown fields)
    return {"tool_call_error": outcome.tool_call_error} if outcome.tool_call_error else {}


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "timings": {
            "restore_ms": u.restore_ms,
            "prefill_ms": u.prefill_ms,
            "decode_ms": u.decode_ms,
            "prefill_tokens": u.prefill_tokens,
            # (the kind a str enum: its value in JSON)
            "anchor_hits": [{"kind": h.kind, "depth": h.depth} for h in u.anchor_hits],
        },
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    # looked up in the caller's namespace without a salt (a salted caller may see what the
    # unsalted ones sent, as by leaving its salt out; only unsalted bodies are kept)
    read = await read_items(request, state.messages, request[TENANT].caller().namespace,
                            "messages")
    body = read.body
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    # a max_tokens beyond the room: the pipeline's to clamp
    req = parse_chat_request(read, memo=state.messages,
                             scope=request[TENANT].caller(salt).namespace)
    check_model(state, req.model)
    gen = generation(req, salt, read.head)
    if not anchors_wanted(request):
        gen = dataclasses.replace(gen, anchors=False)
    completion = await Completion.create(state, gen, tenant=request[TENANT],
                                         body_bytes=request[BODY_BYTES])
    cid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    if not req.stream:
        async with contextlib.aclosing(completion.choice_deltas()) as pieces:
            async for _ in pieces:
                pass
        return json_response({
            "id": cid, "object": "chat.completion", "created": created,
            "model": state.info.model_id,
            "choices": [{"index": i, "message": _message(o),
                         "finish_reason": FINISH[o.finish_reason],
                         "logprobs": logprobs_json(o.logprobs) if req.logprobs else None,
                         **_choice_extra(o)}
                        for i, o in enumerate(completion.outcomes)],
            "usage": usage_json(completion.usage()),
        }, headers=completion.headers())

    def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": state.info.model_id, "choices": choices, **extra}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def piece_frame(piece: ChoiceDelta) -> bytes:
        choice: dict[str, Any] = {"index": piece.index,
                                  "delta": delta_json(piece.delta) if piece.delta else {},
                                  "finish_reason": None}
        if req.logprobs:
            choice["logprobs"] = logprobs_json(piece.logprobs)
        return frame([choice])

    def opening() -> list[bytes]:
        return [frame([{"index": i, "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None}]) for i in range(req.n)]

    def closing() -> list[bytes]:
        out = [frame([{"index": i, "delta": {}, "finish_reason": FINISH[o.finish_reason],
                       **_choice_extra(o)}]) for i, o in enumerate(completion.outcomes)]
        if req.include_usage:
            out.append(frame([], usage=usage_json(completion.usage())))
        return out

    return await stream_events(request, completion, piece_frame, opening, closing)


async def stream_events(request: web.Request, completion: Completion,
                        piece_frame: Callable[[ChoiceDelta], bytes],
                        opening: Callable[[], list[bytes]],
                        closing: Callable[[], list[bytes]]) -> web.StreamResponse:
    """An OpenAI-style event stream (`data: JSON` events, then `data: [DONE]`) of a
    completion's pieces: `opening()`'s events, a `piece_frame` per piece, `closing()`'s.
    The headers wait for the first piece, so that a worker that is down or rejects the
    request still gets a proper status code rather than a 200 stream; an error after that
    is reported in-band and ends the stream."""
    async with contextlib.aclosing(completion.choice_deltas()) as pieces:
        first = await anext(pieces, None)
        resp = EventStream(completion.headers())
        await resp.prepare(request)
        unsent = opening()
        try:  # (the opening events go out with the first piece)
            await resp.send([*unsent, *([] if first is None else [piece_frame(first)])])
            unsent = []
            async for piece in pieces:
                await resp.write(piece_frame(piece))
        except ApiError as e:
            await resp.end([*unsent, b"data: " + orjson.dumps(e.body()) + b"\n\n",
                            b"data: [DONE]\n\n"])
            return resp
    await resp.end([*closing(), b"data: [DONE]\n\n"])
    return resp
