"""A turn ended by a client stop string keeps its prompt anchors: the proxy confirms what the
prefill wrote before it aborts the worker request, so the next turn restores the whole
previous prompt (the real default model on the embedded worker)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from anchorcache.proxy.tenants import ANONYMOUS
from tests.proxy.test_metrics import delta, scrape, value
from tests.servers import Server, proxy_process

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stopper(worker: Server) -> Iterator[Server]:
    with proxy_process(worker.url) as server:  # its own ledger and metrics
        yield server


def chat(proxy: Server, messages: list[dict[str, Any]], *,
         headers: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    resp = httpx.post(proxy.url + CHAT, timeout=300, headers=headers, json={
        "model": "default", "messages": messages, "temperature": 0, **kw})
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_turn_after_a_stop_string_restores_the_whole_previous_prompt(stopper, stream):
    # a system prompt of its own: no earlier anchor of this conversation exists
    messages = [{"role": "system", "content": f"You are assistant {uuid.uuid4().hex[:8]}."},
                {"role": "user", "content": "What is the capital of France?"}]
    stop = " is"
    # the same greedy reply without the stop string, anchors off (it saves nothing)
    unstopped = chat(stopper, messages, max_tokens=64, headers={"X-Anchorcache-Anchors": "off"}
                     )["choices"][0]["message"]["content"]
    assert stop in unstopped, unstopped  # so the stop string ends the reply early
    before = scrape(stopper)
    body = {"max_tokens": 64, "stop": [stop]}
    if stream:
        events = []
        with httpx.stream("POST", stopper.url + CHAT, timeout=300, json={
                "model": "default", "messages": messages, "temperature": 0, **body,
                "stream": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        answer = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        usage = events[-1]["usage"]
    else:
        choice, usage = (reply := chat(stopper, messages, **body))["choices"][0], reply["usage"]
        answer, finish = choice["message"]["content"], [choice["finish_reason"]]
    assert finish == ["stop"]
    assert answer == unstopped[:unstopped.index(stop)]
    d = delta(scrape(stopper), before)
    assert value(d, "anchorcache_reservations_total", tenant=ANONYMOUS, outcome="confirmed",
                 reason="stop_sequence") == 1
    assert value(d, "anchorcache_reservations_total", tenant=ANONYMOUS, outcome="aborted",
                 reason="stop_sequence") == 0

    nxt = chat(stopper, [*messages, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "And of Italy?"}], max_tokens=1)
    # the previous prompt, generation prompt included, is where the next one starts
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
