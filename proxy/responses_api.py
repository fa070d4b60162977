"""`/v1/responses`: OpenAI's Responses API, a thin layer over the request pipeline.

The body is parsed into the pipeline's `Generation` (`responses_schema`), run by the same
`Completion` as chat completions (same splitter, planner, anchors and worker), and the
deltas are framed as output items: a `reasoning` item per run of reasoning text, a
`message` item (one `output_text` part) per run of text, a `function_call` item per tool
call; streamed, as the documented `response.*` events.

Stored responses (`store`, on unless false, as in OpenAI's API) keep their whole
conversation (the input items as resolved, then the output items) in the ledger, per
tenant, for `ProxyConfig.response_ttl_s`; `previous_response_id` continues one, and renders
the same prompt as the same conversation sent whole, so the previous turn's anchors
restore. Hosted tools (web search, ...) are left out of the prompt and named in the
`X-Anchorcache-Ignored-Tools` header. `prompt_cache_key` is accepted and ignored: routing
already follows the deepest anchor chain (targets.py), and the key must never narrow
sharing the way `cache_salt` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sqlite3
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import orjson
from aiohttp import web

from .errors import ApiError, EventStream, json_response
from .openai_api import anchors_wanted, usage_json
from .pipeline import Completion, FinishReason, Usage, check_model
from .responses_items import Item, encrypt_reasoning, parse_items
from .responses_schema import ResponsesRequest, parse_responses_request
from .running import STATE, ProxyState
from .schema import BODY_BYTES, read_items
from .splitter.types import OutputDelta
from .tenants import TENANT

IGNORED_TOOLS_HEADER = "X-Anchorcache-Ignored-Tools"

log = logging.getLogger("anchorcache.proxy")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(u: Usage) -> dict[str, Any]:
    """OpenAI's usage: `cached_tokens` the worker did not prefill (restored anchors and its
    own cache), `cache_write_tokens` the prompt tokens this request newly saved as anchors."""
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": u.snapshot_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "timings": usage_json(u)["timings"]}


class ItemFramer:
    """Turns the pipeline's output deltas into Responses output items and their stream
    events (dicts with a `type`; the writer numbers them).

    Reasoning deltas go to an open `reasoning` item, text deltas to an open `message`
    item; each tool call is a `function_call` item. A new kind of delta closes the open
    item (`completed`); `close` ends the last one with the response's status.
    """

    def __init__(self, *, namespaces: dict[str, str] | None = None,
                 encrypted_reasoning: bool = False) -> None:
        self.namespaces = namespaces or {}
        self.encrypted_reasoning = encrypted_reasoning
        self.items: list[dict[str, Any]] = []  # the output, items final once closed
        self._open: str | None = None  # the open item's type
        self._call_index: int | None = None  # the parser's index of the open call
        self._parts: list[str] = []  # the open item's text or arguments so far

    def feed(self, delta: OutputDelta) -> Iterator[dict[str, Any]]:
        if delta.reasoning:
            yield from self._text("reasoning", delta.reasoning)
        if delta.content:
            yield from self._text("message", delta.content)
        tc = delta.tool_call
        if tc is None:
            return
        if self._open != "function_call" or tc.index != self._call_index:
            yield from self.close()
            assert tc.id is not None and tc.name is not None, "a call's first delta names it"
            item = {"id": "fc_" + tc.id.removeprefix("call_"), "type": "function_call",
                    "status": "in_progress", "arguments": "", "call_id": tc.id,
                    "name": tc.name}
            if tc.name in self.namespaces:
                item["namespace"] = self.namespaces[tc.name]
            yield from self._start(item)
            self._call_index = tc.index
        if tc.partial:
            self.items[-1]["partial"] = True
        if tc.arguments_delta:
            self._parts.append(tc.arguments_delta)
            yield {"type": "response.function_call_arguments.delta", **self._where(),
                   "delta": tc.arguments_delta}

    def close(self, status: str = "completed") -> Iterator[dict[str, Any]]:
        """End the open item, if any, with `status` (`incomplete`: cut by max tokens)."""
        if self._open is None:
            return
        item, text = self.items[-1], "".join(self._parts)
        where = self._where()
        if self._open == "function_call":
            item["arguments"] = text
            if item.pop("partial", False):
                status = "incomplete"
            yield {"type": "response.function_call_arguments.done", **where,
                   "arguments": text, "name": item["name"]}
        else:
            kind = "output_text" if self._open == "message" else "reasoning_text"
            part: dict[str, Any] = {"type": kind, "text": text}
            if kind == "output_text":
                part.update(annotations=[], logprobs=[])
            event = "response.output_text.done" if kind == "output_text" \
                else "response.reasoning_text.done"
            yield {"type": event, **where, "content_index": 0, "text": text,
                   **({"logprobs": []} if kind == "output_text" else {})}
            yield {"type": "response.content_part.done", **where, "content_index": 0,
                   "part": part}
            item["content"] = [part]
            if self._open == "reasoning" and self.encrypted_reasoning:
                item["encrypted_content"] = encrypt_reasoning(text)
        if self._open != "reasoning":
            item["status"] = status
        self._open, self._call_index, self._parts = None, None, []
        yield {"type": "response.output_item.done", "output_index": len(self.items) - 1,
               "item": item}

    def _text(self, kind: str, text: str) -> Iterator[dict[str, Any]]:
        if self._open != kind:
            yield from self.close()
            if kind == "message":
                yield from self._start({"id": _id("msg"), "type": "message",
                                        "status": "in_progress", "role": "assistant",
                                        "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                yield from self._start({"id": _id("rs"), "type": "reasoning", "summary": [],
                                        "content": []})
                part = {"type": "reasoning_text", "text": ""}
            yield {"type": "response.content_part.added", **self._where(), "content_index": 0,
                   "part": part}
        self._parts.append(text)
        event = "response.output_text.delta" if kind == "message" \
            else "response.reasoning_text.delta"
        yield {"type": event, **self._where(), "content_index": 0, "delta": text,
               **({"logprobs": []} if kind == "message" else {})}

    def _start(self, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.items.append(item)
        self._open = item["type"]
        yield {"type": "response.output_item.added", "output_index": len(self.items) - 1,
               "item": dict(item)}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}


# ---- stored responses ------------------------------------------------------------------------

def _not_found(response_id: str, kind: str = "not_found",
               param: str | None = None) -> ApiError:
    return ApiError(kind, f"Response with id '{response_id}' not found.", param=param)


def _stored(state: ProxyState, tenant: str, response_id: str) -> dict[str, Any] | None:
    blob = state.ledger.response(response_id, tenant)
    return orjson.loads(blob) if blob is not None else None


def _history(state: ProxyState, tenant: str, req: ResponsesRequest) -> tuple[Item, ...]:
    """The stored conversation `previous_response_id` continues (a 404 for one this tenant
    did not store, or that expired)."""
    if req.previous_response_id is None:
        return ()
    stored = _stored(state, tenant, req.previous_response_id)
    if stored is None:
        raise _not_found(req.previous_response_id, "previous_response_not_found",
                         "previous_response_id")
    return parse_items(stored["items"], "previous_response_id")


def _store(state: ProxyState, tenant: str, response: dict[str, Any],
           conversation: tuple[Item, ...], output: list[dict[str, Any]]) -> None:
    """Keep `response` and its conversation: the input as resolved, then the output."""
    try:
        items = conversation + parse_items(output, "output")
    except ApiError as e:  # output this proxy cannot read back: served, not stored
        log.warning("response %s is not stored: %s", response["id"], e.message)
        return
    try:
        state.ledger.put_response(response["id"], tenant,
                                  orjson.dumps({"response": response, "items": items}),
                                  ttl_s=state.config.response_ttl_s,
                                  max_tenant_bytes=state.config.response_store_bytes)
    except sqlite3.Error:  # a full or failing disk: the reply is served all the same
        log.exception("storing response %s failed", response["id"])


def _check_storable(state: ProxyState, conversation: tuple[Item, ...]) -> None:
    """A stored conversation is held to the body limit: one sent whole could not be larger."""
    if len(orjson.dumps(conversation)) > state.config.max_body_bytes:
        raise ApiError("invalid_request", "the conversation is too large to store (over "
                       f"{state.config.max_body_bytes} bytes); send it with store: false",
                       param="store")


# ---- the routes ------------------------------------------------------------------------------

def _response(req: ResponsesRequest, model: str, rid: str, created: int, *,
              status: str = "in_progress", output: list[dict[str, Any]] | None = None,
              usage: Usage | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "model": model, "output": output or [], "max_tool_calls": None,
            "service_tier": "default", **req.echo,
            "usage": responses_usage(usage) if usage is not None else None}


def _failure(e: ApiError) -> dict[str, Any]:
    """A failed response's `error`: OpenAI's codes are few (a worker failure is a
    `server_error`, a quota a `rate_limit_exceeded`), our kind goes in `type`."""
    code = "server_error" if e.status >= 500 else \
        "rate_limit_exceeded" if e.status == 429 else "invalid_prompt"
    return {"code": code, "message": e.message, "param": e.param, "type": e.kind}


def _sse(event: dict[str, Any], seq: int) -> bytes:
    return (b"event: " + event["type"].encode() + b"\ndata: "
            + orjson.dumps({**event, "sequence_number": seq}) + b"\n\n")


async def create_response(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`."""
    state = request.app[STATE]
    # a max_output_tokens beyond the room: the pipeline's to clamp
    # read as the chat edge reads (openai_api.py): unsalted bodies kept, looked up unsalted
    read = await read_items(request, state.responses, request[TENANT].caller().namespace,
                            "input")
    salt = read.body.get("cache_salt") if isinstance(read.body, dict) else None
    scope = request[TENANT].caller(salt).namespace
    req = parse_responses_request(read, memo=state.responses, scope=scope)
    check_model(state, req.model)
    tenant = request[TENANT]
    previous = _history(state, tenant.tenant.name, req)
    conversation = previous + req.input_items
    if req.store:
        _check_storable(state, conversation)
    gen = req.generation(previous, memo=state.responses_messages, scope=scope)
    if not anchors_wanted(request):
        gen = dataclasses.replace(gen, anchors=False)
    # the body holds every text of a conversation without stored history (the early budget)
    completion = await Completion.create(state, gen, tenant=tenant,
                                         body_bytes=None if previous else request[BODY_BYTES])
    framer = ItemFramer(namespaces=req.namespaces, encrypted_reasoning=req.encrypted_reasoning)
    rid, created, model = _id("resp"), int(time.time()), state.info.model_id

    def headers() -> dict[str, str]:  # once routed: the worker's name is known then
        ignored = {IGNORED_TOOLS_HEADER: ",".join(req.ignored_tools)} if req.ignored_tools else {}
        return {**completion.headers(), **ignored}

    def finish() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The final response (stored if asked), and the events that close the output."""
        length = completion.outcome.finish_reason is FinishReason.LENGTH
        status = "incomplete" if length else "completed"
        events = list(framer.close(status))
        response = _response(req, model, rid, created, status=status, output=framer.items,
                             usage=completion.usage())
        if completion.outcome.tool_call_error:  # not OpenAI's: why a started call is missing
            response["tool_call_error"] = completion.outcome.tool_call_error
        if req.store:
            _store(state, tenant.tenant.name, response, conversation, framer.items)
        return response, events

    if not req.stream:
        async with contextlib.aclosing(completion.deltas()) as deltas:
            async for delta in deltas:
                for _ in framer.feed(delta):
                    pass
        return json_response(finish()[0], headers=headers())

    seq = 0

    def frames(events: Iterable[dict[str, Any]]) -> list[bytes]:
        """`events` as SSE frames, numbered on from the last one."""
        nonlocal seq
        out = [_sse(event, n) for n, event in enumerate(events, seq)]
        seq += len(out)
        return out

    # Wait for the first delta before sending headers, so that a worker that is down or
    # rejects the request still gets a proper status code rather than a 200 stream.
    async with contextlib.aclosing(completion.deltas()) as deltas:
        first = await anext(deltas, None)
        resp = EventStream(headers())
        await resp.prepare(request)
        started = _response(req, model, rid, created)
        unsent = frames([{"type": "response.created", "response": started},
                         {"type": "response.in_progress", "response": started}])
        try:  # (the opening events go out with the first delta's)
            await resp.send([*unsent, *frames(() if first is None else framer.feed(first))])
            unsent = []
            async for delta in deltas:
                await resp.send(frames(framer.feed(delta)))
        except ApiError as e:  # the stream has started: the response failed, in-band
            closed = frames(framer.close("incomplete"))  # the item it was writing, so far
            failed = _response(req, model, rid, created, status="failed", output=framer.items)
            failed["error"] = _failure(e)
            await resp.end([*unsent, *closed,
                            *frames([{"type": "response.failed", "response": failed}])])
            return resp
    response, events = finish()
    await resp.end(frames([*events, {"type": f"response.{response['status']}",
                                     "response": response}]))
    return resp


async def get_response(request: web.Request) -> web.StreamResponse:
    """`GET /v1/responses/{id}`: a response this tenant stored."""
    state, response_id = request.app[STATE], request.match_info["response_id"]
    stored = _stored(state, request[TENANT].tenant.name, response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored["response"])


async def delete_response(request: web.Request) -> web.StreamResponse:
    """`DELETE /v1/responses/{id}`."""
    state, response_id = request.app[STATE], request.match_info["response_id"]
    if not state.ledger.delete_response(response_id, request[TENANT].tenant.name):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
