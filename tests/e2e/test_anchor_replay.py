"""Anchors on vs off: replaying agent conversations turn by turn gives identical greedy
outputs, for the default model, a dense Qwen3 and the hybrid models, while anchors hit."""

from __future__ import annotations

import pytest

from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.stacks import tiny_model

pytestmark = pytest.mark.slow


def replay(stack, convs, max_turns, max_tokens=8):
    """Replay each conversation; per conversation, per turn (prompt_tokens, cached, timings)."""
    out = []
    for conv in convs:
        seen = []
        out.append(seen)
        for messages in turn_requests(conv, max_turns):
            off = stack.chat("off", messages, conv["tools"], max_tokens=max_tokens)
            on = stack.chat("on", messages, conv["tools"], max_tokens=max_tokens)
            assert on["choices"][0]["message"] == off["choices"][0]["message"]
            assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"]
            assert on["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]
            assert off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            seen.append((on["usage"]["prompt_tokens"],
                         on["usage"]["prompt_tokens_details"]["cached_tokens"],
                         on["usage"]["timings"]))
    return out


def short_conversations(n):
    """The n shortest conversations (by JSON size): the fastest to replay."""
    convs = sorted(conversations("base"), key=lambda c: len(str(c)))
    return convs[:n]


# Not jamba: its tiny random MoE router flips experts on float noise, so even two cold
# prefills that differ only in chunking disagree (tests/ext/embedded checks its restore with
# identical chunking instead).
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next", "qwen3_5", "mamba2", "falcon_h1",
                                  "bamba", "lfm2"])
def test_tiny_models_on_equals_off(stack_factory, arch):
    stack = stack_factory(tiny_model(arch))
    for turns in replay(stack, short_conversations(2), max_turns=3, max_tokens=12):
        assert len(turns) >= 2
        for prompt, cached, timings in turns[1:]:  # every later turn restores its history
            assert 0 < cached < prompt
            assert timings["prefill_tokens"] == prompt - cached
    assert stack.stats()["staged"] == 0


@pytest.fixture(scope="module")
def default_stack(stack_factory, default_model_dir):
    """One default-model worker (and its two proxies) for both tests below (the factory does
    not reuse stacks). Neither test depends on the other's anchors:
    the echo test checks its deepest hit, which only its own first reply can have written."""
    return stack_factory(str(default_model_dir))


def test_default_model_on_equals_off(default_stack):
    stack = default_stack
    conv = short_conversations(1)[0]
    [seen] = replay(stack, [conv], max_turns=3, max_tokens=16)
    assert seen[0][1] == 0
    assert all(cached > 0 for _, cached, _ in seen[1:])


def test_an_echoed_reply_hits_the_response_anchor(default_stack):
    stack = default_stack
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    first = stack.chat("on", msgs, max_tokens=40)
    assert first["choices"][0]["finish_reason"] == "stop"
    follow = [*msgs, first["choices"][0]["message"], {"role": "user", "content": "And of Italy?"}]
    off = stack.chat("off", follow, max_tokens=20)
    on = stack.chat("on", follow, max_tokens=20)
    assert on["choices"][0]["message"] == off["choices"][0]["message"]
    hits = on["usage"]["timings"]["anchor_hits"]
    assert hits[-1]["kind"] == "response"
    # the whole first exchange, its reply's end-of-turn token included, came from the anchor
    assert hits[-1]["depth"] == first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert on["usage"]["prompt_tokens_details"]["cached_tokens"] == hits[-1]["depth"]
