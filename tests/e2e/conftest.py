"""Workers for the anchor end-to-end tests: the default model and tiny random models with
the real Qwen3 tokenizer, each behind an anchors-on and an anchors-off proxy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from anchorcache.testing.servers import Server, proxy_process, worker_process


def tiny_model(arch: str) -> str:
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    return str(build_tiny_model(arch, tiny_model_dir(arch), seed=0))


@dataclass
class Stack:
    worker: Server
    on: Server
    off: Server

    def chat(self, which: str, messages, tools=None, **kw) -> dict:
        proxy = self.on if which == "on" else self.off
        body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": 8, **kw}
        if tools:
            body["tools"] = tools
        resp = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stats(self) -> dict:
        return httpx.get(self.worker.url + "/anchor/stats", timeout=30).json()


@pytest.fixture(scope="module")
def stack_factory() -> Iterator:
    """Start (worker, anchors-on proxy, anchors-off proxy) for a model; stopped at module end."""
    started = []

    def make(model: str, *worker_args: str) -> Stack:
        ctx_w = worker_process(*worker_args, model=model)
        worker = ctx_w.__enter__()
        ctx_on = proxy_process(worker.url, "--anchors")  # its own ledger: its own tenant salts
        ctx_off = proxy_process(worker.url, "--no-anchors")
        started.extend([ctx_w, ctx_on, ctx_off])
        return Stack(worker, ctx_on.__enter__(), ctx_off.__enter__())

    yield make
    for ctx in reversed(started):
        ctx.__exit__(None, None, None)
