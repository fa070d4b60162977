"""`POST /v1/completions`: OpenAI's legacy completions, a thin layer over the request pipeline.

The prompt is raw: text tokenized as it is (no chat template; special-token strings in it
are the model's special tokens, as in the model's own tokenizer), or the client's token ids.
Its split (`raw_split`, on the split threads) has one cut besides the prompt's end, which
the planner always anchors: the prompt without its last word. A request whose prompt extends
an earlier one (few-shot prompts, a client that keeps its own transcript) restores the
earlier prompt from the end anchor, or, where the tokenizer merges that end with what
follows (trailing whitespace, a word continued), from the cut. Token-id prompts are the
client's own tokens: the end anchor is an exact prefix of any extension.

One prompt per request (a list of several is refused: send them as separate requests, they
run side by side); `echo` is supported, prompt logprobs (`echo` with `logprobs`) are not:
the worker computes none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .errors import ApiError, json_response
from .openai_api import FINISH, anchors_wanted, stream_events, usage_json
from .pipeline import ChoiceDelta, Completion, Generation, TokenLogprob, check_model
from .running import STATE
from .schema import (
    DEFAULT_LIMITS,
    MAX_CHOICES,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    bad,
    model_body,
    number,
    optional_int,
    read_json,
    stop_sequences,
    stream_flags,
    temperature,
)
from .splitter.types import RAW_ADAPTER, Cut, CutKind, SplitResult
from .tenants import TENANT

# OpenAI's documented default for this API (chat completions have none)
DEFAULT_MAX_TOKENS = 16
MAX_TOKEN_ID = (1 << 31) - 1  # the worker refuses ids outside its vocabulary (a 400)
_LAST_WORD = re.compile(r"(\s+)\S+\s*\Z")


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    n: int
    logprobs: int | None  # top-k per token (0: the sampled token's only); None: none
    echo: bool
    stream: bool
    include_usage: bool

    def generation(self, cache_salt: Any) -> Generation:
        return Generation(messages=(), max_tokens=self.max_tokens, temperature=self.temperature,
                          top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop,
                          cache_salt=cache_salt, n=self.n, logprobs=self.logprobs is not None,
                          top_logprobs=self.logprobs or 0)


def _prompt(value: Any) -> str | tuple[int, ...]:
    """A string, a list of one string, token ids, or a list of one list of token ids."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    elif isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise bad(f"one prompt per request, not a batch of {len(value)}: send each prompt "
                  "as a request of its own (they run side by side)", "prompt")
    if isinstance(value, str):
        if not value:
            raise bad("'prompt' must not be empty", "prompt")
        return value
    if not isinstance(value, list) or not value:
        raise bad("'prompt' must be a non-empty string or a non-empty list of token ids",
                  "prompt")
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise bad(f"token ids in 'prompt' must be integers in [0, {MAX_TOKEN_ID}]", "prompt")
    return tuple(value)


def parse_completion_request(body: Any) -> CompletionRequest:
    body, model = model_body(body)
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    prompt = _prompt(body["prompt"])
    if body.get("suffix") is not None:
        raise bad("'suffix' (insertion) is not supported", "suffix")
    n = optional_int(body, "n", 1, MAX_CHOICES) or 1
    best_of = optional_int(body, "best_of", 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise bad("'best_of' other than n is not supported", "best_of")
    logprobs = optional_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad("'echo' must be a boolean", "echo")
    if echo and logprobs is not None:
        raise bad("'echo' with 'logprobs' asks for the prompt's logprobs, which this proxy "
                  "does not compute", "logprobs")
    stream, include_usage = stream_flags(body)
    max_tokens = optional_int(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    top_k = optional_int(body, "top_k", -1, 1 << 20)
    return CompletionRequest(
        model=model, prompt=prompt,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=temperature(body), top_p=number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=optional_int(body, "seed", -(1 << 63), (1 << 63) - 1),
        stop=stop_sequences(body, DEFAULT_LIMITS), n=n, logprobs=logprobs, echo=echo,
        stream=stream, include_usage=include_usage)


def raw_split(tokenizer: Any, prompt: str | tuple[int, ...]) -> SplitResult:
    """The split of a raw prompt: its ids, and for text a cut before its last word where
    that prefix tokenizes to a prefix of the ids (a verified cut). Pure; runs on a split
    thread (it tokenizes the text twice)."""
    if isinstance(prompt, tuple):
        return SplitResult(RAW_ADAPTER, prompt, ())
    ids = tuple(tokenizer.encode(prompt))
    if not ids:
        raise ApiError("invalid_request", "the prompt tokenizes to no tokens", param="prompt")
    cuts: tuple[Cut, ...] = ()
    m = _LAST_WORD.search(prompt)
    if m is not None and m.start(1) > 0:
        head = tuple(tokenizer.encode(prompt[:m.start(1)]))
        if 0 < len(head) < len(ids) and ids[:len(head)] == head:
            cuts = (Cut(CutKind.CONVERSATION, len(head)),)
    return SplitResult(RAW_ADAPTER, ids, cuts)


def logprobs_json(entries: list[TokenLogprob] | tuple[TokenLogprob, ...], offset: int
                  ) -> dict[str, Any]:
    """OpenAI's completions logprobs: per token its text, logprob, the top tokens there (and
    the sampled one) and its offset in the choice's text, `offset` for the first."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**dict(e.top), e.token: e.logprob} for e in entries],
            "text_offset": offsets}


def _text(piece: ChoiceDelta) -> str:
    # a raw prompt's output is parsed as text alone (pipeline: RAW_ADAPTER)
    d = piece.delta
    return "" if d is None else (d.content or "")


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_completion_request(body)
    check_model(state, req.model)
    gen = req.generation(body.get("cache_salt"))
    if not anchors_wanted(request):
        gen = dataclasses.replace(gen, anchors=False)
    started = time.perf_counter()
    caller = request[TENANT].caller(gen.cache_salt)
    if isinstance(req.prompt, str):  # as Completion.create: refused before tokenizing
        state.budget.check(len(req.prompt), gen.max_tokens
                           if state.config.max_tokens_policy == "refuse" else None)
        split = await state.splits.run(functools.partial(raw_split, state.tokenizer, req.prompt),
                                       tenant=caller.tenant)
    else:
        split = raw_split(state.tokenizer, req.prompt)
    completion = Completion(state, gen, split, caller=caller, started=started)

    def echoed() -> str:  # called once the worker took the ids (it checks the vocabulary)
        if not req.echo:
            return ""
        return req.prompt if isinstance(req.prompt, str) \
            else state.tokenizer.decode(list(req.prompt))

    cid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    if not req.stream:
        async with contextlib.aclosing(completion.choice_deltas()) as pieces:
            texts = [""] * req.n
            async for piece in pieces:
                texts[piece.index] += _text(piece)
        echo = echoed()
        return json_response({
            "id": cid, "object": "text_completion", "created": created,
            "model": state.info.model_id,
            "choices": [{"text": echo + texts[i], "index": i,
                         "finish_reason": FINISH[o.finish_reason],
                         "logprobs": logprobs_json(o.logprobs, len(echo))
                         if req.logprobs is not None else None}
                        for i, o in enumerate(completion.outcomes)],
            "usage": usage_json(completion.usage()),
        }, headers=completion.headers())

    def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": cid, "object": "text_completion", "created": created,
                "model": state.info.model_id, "choices": choices, **extra}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def piece_frame(piece: ChoiceDelta) -> bytes:
        logprobs = None
        if req.logprobs is not None:
            logprobs = logprobs_json(piece.logprobs, offsets[piece.index])
            offsets[piece.index] += sum(len(e.token) for e in piece.logprobs)
        return frame([{"text": _text(piece), "index": piece.index, "logprobs": logprobs,
                       "finish_reason": None}])

    echo = ""
    offsets: list[int] = []  # each choice's text so far (its logprobs' text_offset)

    def opening() -> list[bytes]:  # after the first piece: the worker took the ids
        nonlocal echo
        echo = echoed()
        offsets.extend([len(echo)] * req.n)
        return [frame([{"text": echo, "index": i, "logprobs": None, "finish_reason": None}])
                for i in range(req.n)] if echo else []

    def closing() -> list[bytes]:
        out = [frame([{"text": "", "index": i, "logprobs": None,
                       "finish_reason": FINISH[o.finish_reason]}])
               for i, o in enumerate(completion.outcomes)]
        if req.include_usage:
            out.append(frame([], usage=usage_json(completion.usage())))
        return out

    return await stream_events(request, completion, piece_frame, opening, closing)
