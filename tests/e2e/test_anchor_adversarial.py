"""Adversarial prompts and faults: never a wrong restore (outputs equal anchors-off), the
right anchors still hit, and nothing leaks (no staged snapshot, no reservation)."""

from __future__ import annotations

import copy
import time

import httpx
import pytest

from anchorcache.proxy.planner import Planner
from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.servers import worker_process
from anchorcache.testing.stacks import Stack, tiny_model

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


def split_of(messages, tools):
    """The request as the proxy splits it for the stack's model."""
    from anchorcache.proxy.splitter import get_adapter
    from anchorcache.proxy.splitter.tokenizers import load_tokenizer

    return get_adapter("auto", load_tokenizer(tiny_model(ARCH))).split(messages, tools)


def planned_depths(messages, tools) -> list[int]:
    """The tool and instruction anchor depths the proxy plans for a new toolset (its
    default tool anchor gap)."""
    split = split_of(messages, tools)
    return [*Planner("m", "e")._tool_cuts(split), split.instruction_cut]


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
    hits = reply["usage"]["timings"]["anchor_hits"]  # at most the toolset's own chain
    assert {h["kind"] for h in hits} <= {"tool", "instruction"}


def test_change_one_tool(stack, conv):
    reqs = warm(stack, conv)
    tools = copy.deepcopy(conv["tools"])
    tools[0]["function"]["description"] += " (v2)"
    assert cached(same(stack, reqs[-1], tools)) == 0


def test_a_toolset_sharing_the_first_tools_restores_their_tool_anchors(stack, conv):
    """Two toolsets that start with the same 12 tools: the second one's first request
    restores the first one's tool anchors up to where they part, recurrent state included,
    and answers as a cold prefill does."""
    msgs = turn_requests(conv, 1)[0]
    first = copy.deepcopy(conv["tools"])
    first[-1]["function"]["description"] += " (a toolset no other test sends)"
    second = copy.deepcopy(conv["tools"][:12]) + [{"type": "function", "function": {
        "name": "zz_extra", "description": "Only the second toolset has it.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    a, b = split_of(msgs, first), split_of(msgs, second)
    shared = next(i for i, (x, y) in enumerate(zip(a.input_ids, b.input_ids, strict=False))
                  if x != y)
    want = [d for d in planned_depths(msgs, first) if d <= shared]
    assert len(want) >= 2 and b.instruction_cut is not None and shared < b.instruction_cut
    same(stack, msgs, first)
    reply = same(stack, msgs, second)
    hits = reply["usage"]["timings"]["anchor_hits"]
    assert [(h["kind"], h["depth"]) for h in hits] == [("tool", d) for d in want]
    assert cached(reply) == want[-1]
    # its own tool anchors and instruction anchor chain on: the same request again restores
    # past its instruction cut
    assert cached(same(stack, msgs, second)) >= b.instruction_cut


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
    with proxy_in_process(stack.worker.url) as other:
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
    reply = same(stack, msgs, conv["tools"])  # the first snapshot (a tool anchor) fails
    assert cached(reply) == 0
    after = stack.stats()
    assert after["staged"] == 0 and after["reserved_slots"] == 0
    assert after["aborts"] == before["aborts"] + 1
    follow = same(stack, [*msgs, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
                  conv["tools"])
    # the later snapshots of the failed request (its other tool anchors, instruction anchor,
    # end of its messages and prompt) were saved without the failed one as their root
    assert cached(follow) > 0
    hits = follow["usage"]["timings"]["anchor_hits"]
    failed = min(planned_depths(msgs, conv["tools"]))
    assert hits and failed not in [h["depth"] for h in hits]


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
        with proxy_in_process(w1.url) as on, proxy_in_process(w1.url, anchors=False) as off:
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
