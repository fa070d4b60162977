"""Workers for the anchor end-to-end tests: the default model and tiny random models with
the real Qwen3 tokenizer, each behind an anchors-on and an anchors-off proxy
(`anchorcache.testing.stacks`). The worker runs in a process of its own (the tests restart
and fault it); its two proxies run in the test process, the subject here being the anchors,
not the proxy's process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.servers import worker_process
from anchorcache.testing.stacks import Stack


@pytest.fixture(scope="module")
def stack_factory() -> Iterator:
    """Start (worker, anchors-on proxy, anchors-off proxy) for a model; stopped at module end."""
    started = []

    def make(model: str, *worker_args: str) -> Stack:
        ctx_w = worker_process(*worker_args, model=model)
        worker = ctx_w.__enter__()
        ctx_on = proxy_in_process(worker.url)  # its own ledger: its own tenant salts
        ctx_off = proxy_in_process(worker.url, anchors=False)
        started.extend([ctx_w, ctx_on, ctx_off])
        return Stack(worker, ctx_on.__enter__(), ctx_off.__enter__())

    yield make
    for ctx in reversed(started):
        ctx.__exit__(None, None, None)
