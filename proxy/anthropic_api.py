"""`POST /v1/messages`: Anthropic's Messages API, a thin layer over the request pipeline.

The request is parsed into the pipeline's `Generation` (`anthropic_schema`; the client's
`cache_control` marks become `cut_after` hints), run by the same `Completion` as chat
completions (same splitter, planner, anchors and worker), and the deltas are
framed as Anthropic content blocks: one `thinking` block per run of reasoning (reasoning
templates), one `text` block per run of text, one `tool_use` block per tool call (a call cut
short by max_tokens: its input as far as it was written, with stop reason `max_tokens`).
Errors are Anthropic error objects with the status of the error table (`errors.py`: the one
error middleware formats them for these routes).
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import web

from .anthropic_messages import fold_system_messages
from .anthropic_schema import MessagesRequest, parse_messages_request
from .errors import ApiError, EventStream, json_response
from .pipeline import Completion, FinishReason, Outcome, Usage, check_model
from .running import STATE, ProxyState
from .schema import BODY_BYTES, read_items, read_json
from .splitter.partial_json import close_json
from .splitter.reasoning import effort_template_kwargs
from .splitter.types import OutputDelta
from .tenants import TENANT, TenantContext

STOP_REASONS = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens",
                FinishReason.TOOL_CALLS: "tool_use", FinishReason.STOP_SEQUENCE: "stop_sequence"}
# set to "unsupported" when a request asks for thinking from a model whose template has no
# reasoning switch: the request runs, without thinking
THINKING_HEADER = "X-Anchorcache-Thinking"


def tool_use_id(call_id: str) -> str:
    """The parser's call id in Anthropic's form (`toolu_…`)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments as an object: JSON text of one (checked by the parser) or,
    for a call cut short by max_tokens, the object its text so far describes."""
    value = close_json(arguments) if arguments.strip() else {}
    return value if isinstance(value, dict) else {}


def usage_json(u: Usage) -> dict[str, int]:
    """Anthropic usage: `cache_read_input_tokens` the worker did not prefill (restored
    anchors), `cache_creation_input_tokens` the prompt tokens this request newly saved as
    anchors, `input_tokens` the rest; the three add up to the prompt."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens - u.snapshot_tokens,
            "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": u.snapshot_tokens,
            "cache_read_input_tokens": u.cached_tokens}


def sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def signature(thinking: str) -> str:
    """A thinking block's `signature`: clients send it back with the block; the proxy
    verifies nothing (the text only renders as the template renders reasoning)."""
    return hashlib.blake2b(thinking.encode(), digest_size=16).hexdigest()


class BlockFramer:
    """Turns the pipeline's output deltas into Anthropic content-block events.

    Reasoning deltas go to an open `thinking` block (`thinking_delta`; closed with its
    `signature_delta`), text deltas to an open text block (a new one after a tool call or
    a thinking block); each tool call starts a `tool_use` block whose input streams as
    `input_json_delta`. `single_tool_use` (`disable_parallel_tool_use`) drops calls after
    the first (the grammar already stops there). `omit_thinking` (`display: "omitted"`):
    thinking blocks carry their signature only.
    """

    def __init__(self, *, single_tool_use: bool = False, omit_thinking: bool = False) -> None:
        self.single_tool_use = single_tool_use
        self.omit_thinking = omit_thinking
        self.blocks: list[dict[str, Any]] = []  # the finished content, for the whole reply
        self._open: str | None = None  # "thinking" | "text" | "tool_use"
        self._call_index: int | None = None  # the parser's index of the open tool call
        self._args: list[str] = []
        self._dropped: set[int] = set()

    def feed(self, delta: OutputDelta) -> Iterator[bytes]:
        if delta.reasoning:
            yield from self._thinking(delta.reasoning)
        tc = delta.tool_call
        if tc is None:
            if not delta.content:
                return
            if self._open != "text":
                yield from self.close()
                yield from self._start({"type": "text", "text": ""})
                self._open = "text"
            self.blocks[-1]["text"] += delta.content
            yield sse("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": "text_delta", "text": delta.content}})
            return
        if tc.index in self._dropped:
            return
        if self._open != "tool_use" or tc.index != self._call_index:
            if self.single_tool_use and any(b["type"] == "tool_use" for b in self.blocks):
                self._dropped.add(tc.index)
                return
            yield from self.close()
            assert tc.id is not None and tc.name is not None, "a call's first delta names it"
            yield from self._start({"type": "tool_use", "id": tool_use_id(tc.id),
                                    "name": tc.name, "input": {}})
            self._open, self._call_index = "tool_use", tc.index
        args = tc.arguments_delta
        if tc.partial:  # cut by max_tokens: stream the object it parsed to, as valid JSON
            args = orjson.dumps(tool_input(args)).decode()
        if args:
            self._args.append(args)
            yield sse("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": "input_json_delta", "partial_json": args}})

    def _thinking(self, text: str) -> Iterator[bytes]:
        if self._open != "thinking":
            yield from self.close()
            yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
            self._open = "thinking"
        self.blocks[-1]["thinking"] += text  # emptied at the end if omitted
        if self.omit_thinking:
            return
        yield sse("content_block_delta", {
            "type": "content_block_delta", "index": len(self.blocks) - 1,
            "delta": {"type": "thinking_delta", "thinking": text}})

    def close(self) -> Iterator[bytes]:
        """End the open block, if any."""
        if self._open is None:
            return
        if self._open == "tool_use":
            self.blocks[-1]["input"] = tool_input("".join(self._args))
            self._args = []
        elif self._open == "thinking":
            block = self.blocks[-1]
            block["signature"] = signature(block["thinking"])
            if self.omit_thinking:
                block["thinking"] = ""
            yield sse("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": "signature_delta", "signature": self.blocks[-1]["signature"]}})
        self._open = self._call_index = None
        yield sse("content_block_stop", {"type": "content_block_stop",
                                         "index": len(self.blocks) - 1})

    def _start(self, block: dict[str, Any]) -> Iterator[bytes]:
        self.blocks.append(block)
        yield sse("content_block_start", {"type": "content_block_start",
                                          "index": len(self.blocks) - 1,
                                          "content_block": dict(block)})


def _stop(outcome: Outcome) -> dict[str, Any]:
    reason = STOP_REASONS[outcome.finish_reason]
    return {"stop_reason": reason,
            "stop_sequence": outcome.stop_sequence if reason == "stop_sequence" else None}


async def _completion(state: ProxyState, req: MessagesRequest, tenant: TenantContext,
                      body_bytes: int) -> Completion:
    """The request rendered and split (`Completion.create`; `body_bytes`: the decoded
    body's length, which holds every text of the conversation). A template that refuses the
    conversation as a whole gets it again with its system messages after the first folded
    into user messages (`fold_system_messages`), if it has any."""
    try:
        return await Completion.create(state, req.generation, tenant=tenant,
                                       body_bytes=body_bytes)
    except ApiError as e:
        folded = fold_system_messages(req.generation)
        if e.kind != "invalid_request" or e.param != "messages" or folded is None:
            raise
        return await Completion.create(state, folded, tenant=tenant, body_bytes=body_bytes)


def _headers(state: ProxyState, req: MessagesRequest, completion: Completion) -> dict[str, str]:
    headers = completion.headers()
    if req.thinking and not effort_template_kwargs(state.adapter, "none"):
        headers[THINKING_HEADER] = "unsupported"  # the template has no reasoning to switch
    return headers


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """`POST /v1/messages/count_tokens`: the prompt's tokens as `/v1/messages` would send
    them to the worker (rendered and split the same way, nothing generated)."""
    state = request.app[STATE]
    req = parse_messages_request(await read_json(request), count_only=True,
                                 memos=state.anthropic, scope=request[TENANT].caller().namespace)
    check_model(state, req.model)
    completion = await _completion(state, req, request[TENANT], request[BODY_BYTES])
    return json_response({"input_tokens": len(completion.split.input_ids)})


async def messages(request: web.Request) -> web.StreamResponse:
    """`POST /v1/messages`."""
    state = request.app[STATE]
    scope = request[TENANT].caller().namespace
    req = parse_messages_request(
        await read_items(request, state.anthropic.shapes, scope, "messages"),
        memos=state.anthropic, scope=scope)
    check_model(state, req.model)
    completion = await _completion(state, req, request[TENANT], request[BODY_BYTES])
    framer = BlockFramer(single_tool_use=req.single_tool_use, omit_thinking=req.omit_thinking)
    message: dict[str, Any] = {"id": "msg_" + uuid.uuid4().hex, "type": "message",
                               "role": "assistant", "model": state.info.model_id}
    if not req.stream:
        async with contextlib.aclosing(completion.deltas()) as deltas:
            async for delta in deltas:
                for _ in framer.feed(delta):
                    pass
        for _ in framer.close():
            pass
        return json_response({**message, "content": framer.blocks,
                              **_stop(completion.outcome),
                              "usage": usage_json(completion.usage())},
                             headers=_headers(state, req, completion))

    # Wait for the first delta before sending headers, so that a worker that is down or
    # rejects the request still gets a proper status code rather than a 200 stream.
    async with contextlib.aclosing(completion.deltas()) as deltas:
        first = await anext(deltas, None)
        resp = EventStream(_headers(state, req, completion))
        await resp.prepare(request)
        # the prompt's split into cached and new tokens is known at the end (message_delta)
        start_usage = {"input_tokens": len(completion.split.input_ids), "output_tokens": 0,
                       "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        unsent = [sse("message_start", {"type": "message_start", "message": {
                      **message, "content": [], "stop_reason": None, "stop_sequence": None,
                      "usage": start_usage}}),
                  sse("ping", {"type": "ping"})]
        try:  # (the opening events go out with the first delta's)
            await resp.send([*unsent, *(() if first is None else framer.feed(first))])
            unsent = []
            async for delta in deltas:
                await resp.send(framer.feed(delta))
        except ApiError as e:  # the stream has started: report in-band, then end it
            await resp.end([*unsent, sse("error", e.anthropic_body())])
            return resp
    await resp.end([*framer.close(),
                    sse("message_delta", {"type": "message_delta",
                                          "delta": _stop(completion.outcome),
                                          "usage": usage_json(completion.usage())}),
                    sse("message_stop", {"type": "message_stop"})])
    return resp
