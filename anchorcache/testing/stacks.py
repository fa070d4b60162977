"""A worker behind an anchors-on and an anchors-off proxy (`Stack`), for the end-to-end
comparisons of the two, and the tiny random models those workers load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from anchorcache.testing.servers import Endpoint, Server


def tiny_model(arch: str) -> str:
    """The tiny random model of `arch` (seed 0, real Qwen3 tokenizer), built at most once
    per cache dir."""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    return str(build_tiny_model(arch, tiny_model_dir(arch), seed=0))


@dataclass
class Stack:
    worker: Server
    on: Endpoint
    off: Endpoint

    def chat(self, which: str, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None = None, **kw: Any) -> dict[str, Any]:
        """A greedy chat completion (8 tokens unless `kw` says) through the anchors-`which`
        ("on" or "off") proxy; its reply."""
        proxy = self.on if which == "on" else self.off
        body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": 8, **kw}
        if tools:
            body["tools"] = tools
        resp = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.worker.url + "/anchor/stats", timeout=30).json()
