"""The proxy in front of SGLang serving the default model (SmolLM2-135M-Instruct, a real
instruct model, on CPU): anchors on equals anchors off token for token over a BFCL replay
with every request from an empty device tree; forced tool calls and `response_format`
through SGLang's own grammar backend (the constraint passed through, not reimplemented)
parse and validate."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.servers import proxy_process, sglang_worker_process
from anchorcache.testing.turns import TRIP, agent_cases, stop_then_next_turn, validate_calls

pytestmark = pytest.mark.slow


# SmolLM2's config says float32, which SGLang's `--dtype auto` turns into float16; on a CPU
# without native half-precision matmuls (AVX2 only) that doubled every prefill and decode step
# here (a 660-token prefill 23 s, a 34-token forced call 42 s; in float32 10 s and 21 s, on a
# busy 2-core machine). float32 is also the embedded worker's default dtype.
DTYPE = ("--dtype", "float32")


@pytest.fixture(scope="module")
def stack(default_model_dir):
    with sglang_worker_process(*DTYPE, model=str(default_model_dir)) as w, \
            proxy_process(w.url, "--anchors") as on, proxy_process(w.url, "--no-anchors") as off:
        yield w, on, off


def client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0, timeout=600)


def test_replay_with_anchors_equals_without(stack):
    """Two tools of the conversation's set keep prompts near 1k tokens: SGLang's CPU
    attention (`torch_native`) prefills a real model's 4k-token prompt in ~30 s."""
    worker, on, off = stack
    for conv in conversations("base")[:1]:
        tools = conv["tools"][:2]
        for turn, messages in enumerate(turn_requests(conv, 3), 1):
            replies = []
            for proxy in (off, on):
                httpx.post(worker.url + "/flush_cache", timeout=60).raise_for_status()
                replies.append(client(proxy).chat.completions.create(
                    model="default", messages=messages, tools=tools, temperature=0,
                    max_tokens=16))
            cold, warm = replies
            assert warm.choices[0].message == cold.choices[0].message, (conv["id"], turn)
            assert warm.usage.completion_tokens == cold.usage.completion_tokens
            if turn >= 2:  # restored from the host tier: SGLang's tree was empty
                assert warm.usage.prompt_tokens_details.cached_tokens > 0


# Of the first 8 agent turns: every tool they offer, both tool_choice modes (named on even
# indices, required on odd) and the 8th turn. The 5th (named `ls` beside turn 1's other tools;
# `ls` is called in turn 2) and the 6th (required over turn 1's tools, as the 8th) add none,
# at ~35 s each on a 2-core CPU.
FORCED_CASES = (0, 1, 2, 3, 6, 7)


def test_the_turn_after_a_stop_string_restores_the_previous_prompt_and_reply(
        stack, default_model_dir):
    """SGLang aborts the stopped request after the scheduler took its response anchor's
    cut; the next turn finds prompt and reply in the host anchors (the tree was flushed)."""
    worker, on, _ = stack
    stop_then_next_turn(on, default_model_dir, stream=True, flush=lambda: httpx.post(
        worker.url + "/flush_cache", timeout=60).raise_for_status())


def test_forced_tool_calls_through_sglangs_grammar(stack):
    """SGLang's grammar backend masks without the embedded worker's tokenizer-spelling
    check (docs/structured-output.md), so in one of these agent turns (the 8th) SmolLM2
    spells a forced tool name with a stray one-letter token there, picks the wrong tool
    and loops in its argument until max_tokens. Every reply is well formed either way."""
    _, on, _ = stack
    cases = agent_cases(8)
    complete = 0
    for i in FORCED_CASES:
        msgs, tools, name = cases[i]
        choice = "required" if i % 2 else {"type": "function", "function": {"name": name}}
        c = client(on).chat.completions.create(
            model="default", messages=msgs, tools=tools, tool_choice=choice, temperature=0,
            max_tokens=80, parallel_tool_calls=False).choices[0]
        assert c.message.content is None, (i, c)
        if c.finish_reason == "length":  # the partial call, or why there is none
            assert c.message.tool_calls or \
                "cut off by max_tokens" in c.model_extra["tool_call_error"]
            continue
        assert c.finish_reason == "tool_calls", (i, c)
        validate_calls(c.message, tools)
        complete += 1
    assert complete >= len(FORCED_CASES) - 1


def test_response_format_json_schema_validates(stack):
    _, on, _ = stack
    reply = client(on).chat.completions.create(
        model="default", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Suggest a city to visit and for how many days."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "trip", "strict": True, "schema": TRIP}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), TRIP)
