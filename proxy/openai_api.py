"""`POST /v1/chat/completions`: the OpenAI layer over the request pipeline (`pipeline.py`).

Parses the body into a `Generation`, runs a `Completion`, and frames its deltas as a
`chat.completion` object or `chat.completion.chunk` server-sent events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from .errors import ApiError, json_response
from .pipeline import Completion, FinishReason, Generation, Usage, check_model
from .schema import ChatRequest, parse_chat_request, read_json
from .splitter.types import OutputDelta
from .state import STATE
from .tenants import TENANT

# stop sequences are OpenAI's "stop" too
_FINISH = {FinishReason.STOP: "stop", FinishReason.STOP_SEQUENCE: "stop",
           FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls"}


# `X-Anchorcache-Anchors: off` runs one request without anchors (a baseline for comparisons,
# e.g. `anchorcache bench`); it can only make the request slower, never share anything.
ANCHORS_HEADER = "X-Anchorcache-Anchors"


def anchors_wanted(request: web.Request) -> bool:
    value = request.headers.get(ANCHORS_HEADER, "on").strip().lower()
    if value not in ("on", "off"):
        raise ApiError("invalid_request", f"{ANCHORS_HEADER} must be 'on' or 'off', not {value!r}")
    return value == "on"


def generation(req: ChatRequest, cache_salt: str | None = None) -> Generation:
    return Generation(messages=req.messages, tools=req.tools, tool_choice=req.tool_choice,
                      max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, seed=req.seed, stop=req.stop,
                      template_kwargs=req.template_kwargs, cache_salt=cache_salt)


def delta_json(delta: OutputDelta) -> dict[str, Any]:
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
            "anchor_hits": [{"kind": h.kind, "depth": h.depth} for h in u.anchor_hits],
        },
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_chat_request(body, max_tokens_limit=state.info.max_context_tokens)
    check_model(state, req.model)
    gen = generation(req, body.get("cache_salt"))
    if not anchors_wanted(request):
        gen = dataclasses.replace(gen, anchors=False)
    completion = await Completion.create(state, gen, tenant=request[TENANT])
    cid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    outcome = completion.outcome
    if not req.stream:
        async with contextlib.aclosing(completion.deltas()) as deltas:
            async for _ in deltas:
                pass
        message: dict[str, Any] = {"role": "assistant",
                                   "content": outcome.text if outcome.text or not outcome.tool_calls else None}
        if outcome.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in outcome.tool_calls]
        return json_response({
            "id": cid, "object": "chat.completion", "created": created,
            "model": state.info.model_id,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": _FINISH[outcome.finish_reason], "logprobs": None}],
            "usage": usage_json(completion.usage()),
        })

    def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": state.info.model_id, "choices": choices, **extra}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    # Wait for the first delta before sending headers, so that a worker that is down or
    # rejects the request still gets a proper status code rather than a 200 stream.
    async with contextlib.aclosing(completion.deltas()) as deltas:
        first = await anext(deltas, None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(frame([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None}]))
        try:
            if first is not None:
                await resp.write(frame([{"index": 0, "delta": delta_json(first),
                                         "finish_reason": None}]))
            async for delta in deltas:
                await resp.write(frame([{"index": 0, "delta": delta_json(delta),
                                         "finish_reason": None}]))
        except ApiError as e:  # the stream has started: report in-band, then end it
            await resp.write(b"data: " + orjson.dumps(e.body()) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
    await resp.write(frame([{"index": 0, "delta": {},
                             "finish_reason": _FINISH[outcome.finish_reason]}]))
    if req.include_usage:
        await resp.write(frame([], usage=usage_json(completion.usage())))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
