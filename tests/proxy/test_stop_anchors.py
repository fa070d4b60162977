"""A turn ended by a client stop string keeps its anchors: the proxy stops the worker request
(`/stop_request`) instead of aborting it, so what the prefill wrote and the response anchor
up to the stop are confirmed, and the next turn restores the previous prompt and the reply
(the real default model on the embedded worker)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from anchorcache.proxy.tenants import ANONYMOUS
from anchorcache.testing.servers import Server, proxy_process
from tests.proxy.test_metrics import delta, scrape, value

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
def test_the_turn_after_a_stop_string_restores_the_previous_prompt_and_reply(
        stopper, stream, default_model_dir):
    stop_then_next_turn(stopper, default_model_dir, stream)


def stop_then_next_turn(stopper: Server, model_dir: Path, stream: bool,
                        flush: Callable[[], None] = lambda: None) -> None:
    """A greedy turn of the default model ended by a stop string, then the next turn.
    `flush` runs before each anchored request (SGLang: empties its device tree, so what the
    next turn finds comes from the host anchors)."""
    # a system prompt of its own: no earlier anchor of this conversation exists
    messages = [{"role": "system", "content": f"You are assistant {uuid.uuid4().hex[:8]}."},
                {"role": "user", "content": "What is the capital of France?"}]
    stop = " is"
    # the same greedy reply without the stop string, anchors off (it saves nothing)
    unstopped = chat(stopper, messages, max_tokens=64, headers={"X-Anchorcache-Anchors": "off"}
                     )["choices"][0]["message"]["content"]
    assert stop in unstopped, unstopped  # so the stop string ends the reply early
    flush()
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
    assert value(d, "anchorcache_snapshots_total", tenant=ANONYMOUS, kind="response") == 1

    flush()
    before = scrape(stopper)
    nxt = chat(stopper, [*messages, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "And of Italy?"}], max_tokens=1)
    # the previous prompt, generation prompt included, and the reply up to the stop string
    # are where the next one starts: the response anchor holds exactly those tokens
    reply_ids = AutoTokenizer.from_pretrained(model_dir)(answer, add_special_tokens=False
                                                                 )["input_ids"]
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        usage["prompt_tokens"] + len(reply_ids)
    assert value(delta(scrape(stopper), before), "anchorcache_anchor_hits_total",
                 tenant=ANONYMOUS, kind="response") == 1


def test_stop_strings_in_every_choice_keep_the_prompt_anchors(stopper):
    """n = 2: both choices end on a stop string; the worker request is stopped, both samples'
    ends arrive, the prompt anchors are confirmed (no response anchor: the samples differ),
    and the same prompt again restores all of it."""
    messages = [{"role": "system", "content": f"You are assistant {uuid.uuid4().hex[:8]}."},
                {"role": "user", "content": "Describe the sea in many words."}]
    before = scrape(stopper)
    reply = chat(stopper, messages, n=2, temperature=1.0, seed=7, max_tokens=200, stop=[" "])
    assert [c["finish_reason"] for c in reply["choices"]] == ["stop", "stop"]
    assert all(" " not in c["message"]["content"] for c in reply["choices"])
    assert reply["usage"]["completion_tokens"] < 2 * 200
    d = delta(scrape(stopper), before)
    assert value(d, "anchorcache_reservations_total", tenant=ANONYMOUS, outcome="confirmed",
                 reason="stop_sequence") == 1
    assert value(d, "anchorcache_snapshots_total", tenant=ANONYMOUS, kind="response") == 0
    again = chat(stopper, messages, max_tokens=1)
    # the deepest kept cut short of the whole prompt (whose last token must be prefilled);
    # the system prompt is new, so nothing else could have been restored
    assert 0 < again["usage"]["prompt_tokens_details"]["cached_tokens"] \
        < reply["usage"]["prompt_tokens"]
