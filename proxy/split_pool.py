"""Rendering and tokenizing off the event loop, behind an early token budget.

Rendered and tokenized on the event loop, a 16 MiB message would hold `/health` and every
other request for 13–19 s before being refused as over the context. So:

1. `TokenBudget.check` refuses, before any rendering, a request whose text alone must exceed
   the context: a token covers at most `max_chars_per_token` characters (the longest
   vocabulary entry, times what the tokenizer's normalizer can shrink), so
   `rendered_chars / max_chars_per_token` is a lower bound of the prompt's tokens. For a
   tokenizer whose pipeline could drop characters (no byte-level model, an unknown
   normalizer) there is no bound and no early refusal; step 2 still applies.
2. `SplitPool.split` runs the adapter's `split` on a few dedicated threads (the adapter's
   memos are locked; the tokenizer releases the GIL while it encodes, so the loop keeps
   serving), in turns per tenant (`SplitPool`): a tenant's long split delays its own
   requests, not another tenant's. Waiting splits are bounded in all and per tenant; more
   are refused with 503 `overloaded` rather than queued without bound.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import deque
from collections.abc import Callable
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

    def fits(self, chars: int, max_tokens: int | None) -> bool:
        """Whether `check` passes every prompt of at most `chars` characters of text."""
        return self.min_tokens(chars) + (max_tokens or 1) <= self.context_tokens

    def check(self, rendered_chars: int, max_tokens: int | None) -> None:
        """Raise `context_length_exceeded` if a prompt with at least `rendered_chars`
        characters of text cannot leave room for `max_tokens` (at least 1) new tokens."""
        least = self.min_tokens(rendered_chars)
        if least + (max_tokens or 1) > self.context_tokens:
            raise ApiError("context_length_exceeded",
                           f"the messages hold {rendered_chars} characters, at least {least} "
                           f"tokens; with max_tokens={max_tokens} that exceeds the model's "
                           f"context of {self.context_tokens} tokens", param="messages")


@dataclass
class _Job:
    work: Callable[[], SplitResult]  # runs on a split thread
    future: asyncio.Future[SplitResult]


class SplitPool:
    """The adapter's splits on `threads` threads, fairly: each tenant's requests wait in a
    queue of their own, and a free thread takes the next tenant's oldest request in turn, so
    one tenant's long or many splits delay its own requests, not the others'. At most
    `max_pending` requests wait in all and `max_pending_per_tenant` per tenant (more are
    refused with 503 `overloaded`): one tenant's flood cannot fill the queue for everyone.
    Each split is bounded by the request's size (tool cuts: tool_cuts.py)."""

    def __init__(self, adapter: Adapter, *, max_pending: int = 64, threads: int = 2,
                 max_pending_per_tenant: int | None = None) -> None:
        self.adapter = adapter
        self.max_pending = max_pending
        self.max_pending_per_tenant = max_pending_per_tenant or max(1, max_pending // 2)
        self.threads = threads
        self._queues: dict[str, deque[_Job]] = {}  # tenant → its waiting splits, oldest first
        self._turns: deque[str] = deque()  # tenants with waiting splits, next first
        self._waiting = 0
        self._running = 0
        self.runs = 0  # splits started on the threads
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=threads,
                                            thread_name_prefix="anchorcache-split")

    @property
    def pending(self) -> int:
        return self._waiting + self._running

    async def split(self, messages: list[dict], tools: list[dict] | None,
                    template_kwargs: dict | None, *, tenant: str = "",
                    scope: bytes = b"", head: bytes | None = None) -> SplitResult:
        """The adapter's split, on a split thread, in `tenant`'s turn; `scope` keys the
        adapter's memos (the caller's namespace; `head`: what stands for the messages in
        them, `TextAdapter.split`). A bad chat raises a 400 `ApiError`."""
        return await self.run(functools.partial(self._split_chat, messages, tools,
                                                template_kwargs, scope, head), tenant=tenant)

    def _split_chat(self, messages: list[dict], tools: list[dict] | None,
                    template_kwargs: dict | None, scope: bytes,
                    head: bytes | None) -> SplitResult:
        return self.adapter.split(messages, tools, template_kwargs=template_kwargs, scope=scope,
                                  messages_head=head)

    async def run(self, work: Callable[[], SplitResult], *, tenant: str = "") -> SplitResult:
        """`work()` (a split of any kind: the chat's, a raw prompt's) on a split thread, in
        `tenant`'s turn, under the same bounds; a `SplitError` it raises is a 400."""
        if self.pending >= self.max_pending:
            raise ApiError("overloaded", f"{self.pending} requests are waiting to be "
                           "tokenized; try again shortly")
        queue = self._queues.get(tenant)
        if queue is not None and len(queue) >= self.max_pending_per_tenant:
            raise ApiError("overloaded", f"{len(queue)} of this tenant's requests are waiting "
                           "to be tokenized; try again shortly")
        future: asyncio.Future[SplitResult] = asyncio.get_running_loop().create_future()
        if queue is None:
            queue = self._queues[tenant] = deque()
            self._turns.append(tenant)
        queue.append(_Job(work, future))
        self._waiting += 1
        self._dispatch()
        # a cancelled request does not cancel its split: the thread finishes it either way
        return await asyncio.shield(future)

    def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._running < self.threads and self._turns:
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            job = queue.popleft()
            if queue:
                self._turns.append(tenant)  # its next split waits for the others' turns
            else:
                del self._queues[tenant]
            self._waiting -= 1
            self._running += 1
            done = loop.run_in_executor(self._executor, self._split, job)
            done.add_done_callback(functools.partial(self._done, job=job))

    def _done(self, done: asyncio.Future[SplitResult], job: _Job) -> None:
        self._running -= 1
        if not job.future.done():
            if done.cancelled():
                job.future.cancel()
            elif done.exception() is not None:
                job.future.set_exception(done.exception())  # type: ignore[arg-type]
            else:
                job.future.set_result(done.result())
        if not job.future.cancelled():
            job.future.exception()  # retrieved: its request may be gone
        if not self._closed:
            self._dispatch()

    def _split(self, job: _Job) -> SplitResult:
        self.runs += 1
        try:
            split = job.work()
        except SplitError as e:
            raise ApiError("invalid_request", str(e), param=e.param) from None
        # made here, off the loop: the planner keys these bytes and walks these cuts
        split.token_bytes  # noqa: B018
        split.anchor_cuts  # noqa: B018
        return split

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
