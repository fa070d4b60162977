"""Rendering and tokenizing off the event loop, behind an early token budget.

A 16 MiB message used to be rendered and tokenized on the event loop: `/health` and every
other request waited for it (13–19 s) before it was refused as over the context. Now:

1. `TokenBudget.check` refuses, before any rendering, a request whose text alone must exceed
   the context: a token covers at most `max_chars_per_token` characters (the longest
   vocabulary entry, times what the tokenizer's normalizer can shrink), so
   `rendered_chars / max_chars_per_token` is a lower bound of the prompt's tokens. For a
   tokenizer whose pipeline could drop characters (no byte-level model, an unknown
   normalizer) there is no bound and no early refusal; step 2 still applies.
2. `SplitPool.split` runs the adapter's `split` on one dedicated thread. One, because the
   adapter's prefix cache is single-threaded (proxy/splitter/prefix_cache.py) and requests
   then tokenize in arrival order; the tokenizer releases the GIL while it encodes, so the
   loop keeps serving. At most `max_pending` splits wait; more are refused with 503
   `overloaded` rather than queued without bound.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .errors import ApiError
from .splitter import Adapter
from .splitter.types import SplitError, SplitResult

# normalizers that can only shrink text by composing characters (at most 3 code points into 1)
_SHRINK = {"NFC": 3, "NFKC": 3, "Prepend": 1, "Strip": 1}


def _max_chars_per_token(tokenizer: Any) -> int | None:
    """Most characters of input one token can stand for; None when no bound is known."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:  # mistral / harmony handles: no early bound
        return None
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, json.dumps(spec.get("pre_tokenizer"))
    byte_level = '"ByteLevel"' in pre or json.dumps(spec.get("decoder")).count('"ByteLevel"') > 0
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None  # an unknown character could become one token covering any length
    shrink = 1
    norm = spec.get("normalizer")
    for step in (norm.get("normalizers", [norm]) if norm else []):
        factor = _SHRINK.get(step.get("type"))
        if factor is None:
            return None
        shrink = max(shrink, factor)
    longest = max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    return longest * shrink


@dataclass(frozen=True)
class TokenBudget:
    context_tokens: int
    max_chars_per_token: int | None  # None: no early check for this tokenizer

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, context_tokens: int) -> TokenBudget:
        return cls(context_tokens, _max_chars_per_token(tokenizer))

    def min_tokens(self, rendered_chars: int) -> int:
        if self.max_chars_per_token is None:
            return 0
        return -(-rendered_chars // self.max_chars_per_token)

    def check(self, rendered_chars: int, max_tokens: int | None) -> None:
        """Raise `context_length_exceeded` if a prompt with at least `rendered_chars`
        characters of text cannot leave room for `max_tokens` (at least 1) new tokens."""
        least = self.min_tokens(rendered_chars)
        if least + (max_tokens or 1) > self.context_tokens:
            raise ApiError("context_length_exceeded",
                           f"the messages hold {rendered_chars} characters, at least {least} "
                           f"tokens; with max_tokens={max_tokens} that exceeds the model's "
                           f"context of {self.context_tokens} tokens", param="messages")


class SplitPool:
    def __init__(self, adapter: Adapter, *, max_pending: int = 64) -> None:
        self.adapter = adapter
        self.max_pending = max_pending
        self._pending = 0
        self.runs = 0  # splits started on the thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="anchorcache-split")

    @property
    def pending(self) -> int:
        return self._pending

    async def split(self, messages: list[dict], tools: list[dict] | None,
                    template_kwargs: dict | None) -> SplitResult:
        """The adapter's split, on the split thread; a bad chat raises a 400 `ApiError`."""
        if self._pending >= self.max_pending:
            raise ApiError("overloaded", f"{self._pending} requests are waiting to be "
                           "tokenized; try again shortly")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._split, messages, tools,
                                      template_kwargs)
        self._pending += 1
        future.add_done_callback(self._done)
        # a cancelled request does not cancel its split: the thread finishes it either way
        return await asyncio.shield(future)

    def _done(self, future: asyncio.Future[SplitResult]) -> None:
        self._pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: its request may be gone

    def _split(self, messages: list[dict], tools: list[dict] | None,
               template_kwargs: dict | None) -> SplitResult:
        self.runs += 1
        try:
            return self.adapter.split(messages, tools, template_kwargs=template_kwargs)
        except SplitError as e:
            raise ApiError("invalid_request", str(e), param=e.param) from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
