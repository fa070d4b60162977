"""Adversarial prompts and faults: never a wrong restore (outputs equal anchors-off), the
right anchors still hit, and nothing leaks (no staged snapshot, no reservation)."""

from __future__ import annotations

import copy
import time

import httpx
import pytest

from tests.data import conversations, turn_requests
from tests.servers import proxy_process, worker_process

from .conftest import Stack, tiny_model

pytestmark = pytest.mark.slow

ARCH = "qwen3_next"  # hybrid: a wrong restore of recurrent state shows in the output


@pytest.fixture(scope="module")
def conv():
    return sorted(conversations("base"), key=lambda c: len(str(c)))[0]


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(tiny_model(ARCH), "--anchor-slots", "64")


def same(stack, messages, tools, **kw):
    """Ask both proxies; assert identical output; return the anchors-on reply."""
    off = stack.chat("off", messages, tools, **kw)
    on = stack.chat("on", messages, tools, **kw)
    assert on["choices"][0]["message"] == off["choices"][0]["message"]
    assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"]
    return on


def cached(reply):
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def warm(stack, conv, turns=3):
    reqs = turn_requests(conv, turns)
    for messages in reqs:
        same(stack, messages, conv["tools"])
    return reqs


def test_edit_one_token_early_in_the_history(stack, conv):
    reqs = warm(stack, conv)
    edited = copy.deepcopy(reqs[-1])
    edited[0]["content"] = edited[0]["content"].replace(" ", "  ", 1)  # the first user message
    reply = same(stack, edited, conv["tools"])
    first_user_at = reply["usage"]["prompt_tokens"]  # upper bound; the tools come first
    assert cached(reply) < first_user_at
    hits = reply["usage"]["timings"]["anchor_hits"]
    assert [h["kind"] for h in hits] in ([], ["instruction"])


def test_change_one_tool(stack, conv):
    reqs = warm(stack, conv)
    tools = copy.deepcopy(conv["tools"])
    tools[0]["function"]["description"] += " (v2)"
    assert cached(same(stack, reqs[-1], tools)) == 0


def test_change_the_system_prompt(stack, conv):
    reqs = warm(stack, conv)
    a = [{"role": "system", "content": "You are terse."}, *reqs[-1]]
    b = [{"role": "system", "content": "You are verbose."}, *reqs[-1]]
    same(stack, a, conv["tools"])
    reply = same(stack, a + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
                 conv["tools"])
    assert cached(reply) > 0
    assert cached(same(stack, b, conv["tools"])) == 0


def test_truncated_history_restores_an_earlier_anchor(stack, conv):
    reqs = warm(stack, conv, turns=4)
    reply = same(stack, reqs[1], conv["tools"])
    assert 0 < cached(reply) < reply["usage"]["prompt_tokens"]


def test_branches_from_one_prefix(stack, conv):
    reqs = warm(stack, conv, turns=2)
    base = reqs[-1]
    a = same(stack, [*base, {"role": "assistant", "content": "A"}, {"role": "user", "content": "left"}],
             conv["tools"])
    b = same(stack, [*base, {"role": "assistant", "content": "B"}, {"role": "user", "content": "right"}],
             conv["tools"])
    assert cached(a) > 0 and cached(b) > 0
    assert abs(cached(a) - cached(b)) <= 4  # both restore the shared history, not each other


def test_another_ledgers_salt_never_hits(stack, conv):
    reqs = warm(stack, conv, turns=2)
    # a proxy with its own ledger: its anonymous tenant has another secret salt
    with proxy_process(stack.worker.url, "--anchors") as other:
        reply = httpx.post(other.url + "/v1/chat/completions", timeout=600, json={
            "model": "default", "messages": reqs[-1], "tools": conv["tools"],
            "temperature": 0, "max_tokens": 8}).json()
    assert cached(reply) == 0
    off = stack.chat("off", reqs[-1], conv["tools"])
    assert reply["choices"][0]["message"] == off["choices"][0]["message"]


def test_interleaved_conversations_past_capacity(stack_factory):
    small = stack_factory(tiny_model(ARCH), "--anchor-slots", "6")
    convs = sorted(conversations("base"), key=lambda c: len(str(c)))[1:6]
    reqs = [turn_requests(c, 3) for c in convs]
    hits = 0
    for turn in range(3):
        for c, r in zip(convs, reqs, strict=True):
            if turn < len(r):
                hits += cached(same(small, r[turn], c["tools"])) > 0
    assert hits > 0  # the most recent anchors still hit
    stats = small.stats()
    assert stats["staged"] == 0


def test_snapshot_failure_still_serves(stack, conv):
    msgs = [{"role": "system", "content": "Fault probe: a system prompt no other test uses."},
            {"role": "user", "content": "hello"}]
    before = stack.stats()
    httpx.post(stack.worker.url + "/debug/fault", json={"where": "snapshot"}).raise_for_status()
    reply = same(stack, msgs, conv["tools"])  # the first snapshot (instruction) fails
    assert cached(reply) == 0
    after = stack.stats()
    assert after["staged"] == 0 and after["reserved_slots"] == 0
    assert after["aborts"] == before["aborts"] + 1
    follow = same(stack, [*msgs, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
                  conv["tools"])
    # the later snapshots of the failed request (end of its messages, end of its prompt)
    # were saved without the failed instruction anchor as their root
    assert cached(follow) > 0
    kinds = [h["kind"] for h in follow["usage"]["timings"]["anchor_hits"]]
    assert kinds and "instruction" not in kinds


def test_client_disconnect_leaks_nothing(stack, conv):
    body = {"model": "default", "messages": turn_requests(conv, 1)[0], "tools": conv["tools"],
            "temperature": 0, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", stack.on.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(stack.worker.url + "/health").json()
        if not health["running_requests"] and stack.stats()["staged"] == 0:
            break
        time.sleep(0.2)
    assert health["running_requests"] == []
    assert stack.stats()["staged"] == 0


def test_worker_restart_new_epoch(conv):
    model = tiny_model(ARCH)
    reqs = turn_requests(conv, 2)
    with worker_process(model=model) as w1:
        port = int(w1.url.rsplit(":", 1)[1])
        with proxy_process(w1.url, "--anchors") as on, proxy_process(w1.url, "--no-anchors") as off:
            stack = Stack(w1, on, off)
            for m in reqs:
                same(stack, m, conv["tools"])
            assert cached(stack.chat("on", reqs[-1], conv["tools"])) > 0
            epoch1 = httpx.get(w1.url + "/health").json()["epoch"]
            w1.stop()
            with worker_process(model=model, port=port) as w2:
                stack.worker = w2
                assert httpx.get(w2.url + "/health").json()["epoch"] != epoch1
                reply = same(stack, reqs[-1], conv["tools"])
                assert cached(reply) == 0  # the old epoch's anchors are gone, not restored
                again = same(stack, reqs[-1], conv["tools"])
                assert cached(again) > 0  # and new ones are made
