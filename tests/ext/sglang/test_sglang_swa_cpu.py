"""A sliding-window model with attention sinks (tiny random Granite SWA: a 32-token window
in three layers of four, the family of gpt-oss) served by the SGLang worker on CPU: SGLang
0.5.23's scheduler and radix cache, its sliding-window pool (the sliding layers' rows by a
second slot, freed once out of the window), the CPU recipe's attention
(ext/sglang/cpu_attention.py), our anchor cache (its windows: ext/sglang/swa.py).

- Its greedy tokens and their logprobs equal transformers' on the same weights, for prompts
  shorter and longer than the window, cold and over SGLang's own cached prefix.
- An anchor's slabs are compact: the full layer's rows, and the sliding layers' last window.
- The seeds' headline case after a flush: a second conversation with the same tools and
  another first message restores the instruction anchor (`cached_tokens` its depth) and
  answers as a cold run does; a chain whose second link spans windows comes back the same
  way, and the rows and the window on the device equal the slabs (`/anchor/verify`).
- A restored row shifted by one, or a window with one value changed (fault injection), is
  caught by that check, and a restore after a flush is clean again.
- An anchor whose window SGLang already freed (inside the tree's older part of a prefix) is
  not written; interleaved restores, flushes, SGLang's own cache of the prompt and long
  prompts that make SGLang evict (windows included) never change turn 2's output; a
  pinned anchor keeps its window on the device through that pressure.
- Through the proxy, a BFCL replay with anchors on equals anchors off.

One server for the module (about a minute to start on a 2-core machine)."""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchorcache.testing.data import conversations, two_turn_prompts
from anchorcache.testing.exactness import (
    NEW,
    NS,
    equal_to_transformers,
    generate,
    replay_on_equals_off,
    restore,
    save,
)
from anchorcache.testing.servers import sglang_worker_process
from anchorcache.testing.worker_api import flush_device, post
from anchorcache.wire import AnchorKind, AnchorPlan, Region, SnapshotSpec

pytestmark = pytest.mark.slow

POOL = 6000
WINDOW = 32  # the tiny model's sliding window (tiny_models._granite_swa)


@pytest.fixture(scope="module")
def swa():
    """(worker, model dir): the SGLang worker with our anchor cache on the tiny Granite SWA,
    float32 as transformers runs it (SGLang's `--dtype auto` would serve it in float16), on
    SGLang's sliding-window pool (its default at page size 1)."""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    model = build_tiny_model("granite_swa", tiny_model_dir("granite_swa"))
    with sglang_worker_process("--max-total-tokens", str(POOL), "--dtype", "float32",
                               model=str(model)) as worker:
        yield worker, model


@pytest.fixture(scope="module")
def prompts(qwen3_tokenizer):
    return two_turn_prompts(qwen3_tokenizer, 2)


def test_it_is_served_on_the_window_pool_with_compact_slabs(swa, prompts):
    """SGLang built its sliding-window pool (`anchorcache worker` no longer turns it off at
    page size 1), and an anchor's slab holds the full layer's rows for every token and the
    three sliding layers' rows for the last window only: for an instruction anchor of more
    than four windows, under half of what the plain pool's slab (every layer, every token)
    holds."""
    import json

    worker, model_dir = swa
    info = httpx.get(worker.url + "/model_info", timeout=30).json()
    assert info["architecture"] == "GraniteSWAForCausalLM" and info["hybrid"] is False
    args = httpx.get(worker.url + "/server_info", timeout=30).json()
    assert args["disable_hybrid_swa_memory"] is False
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    row = 2 * config["num_key_value_heads"] * head_dim * 4  # K and V, float32
    tool_depth, _, p1, _ = prompts[0]
    flush_device(worker.url)
    keys = save(worker.url, p1, tool_depth)
    slots = httpx.get(worker.url + "/anchor/slots", timeout=30).json()["slots"]
    nbytes = next(s["nbytes"] for s in slots if s["key"] == keys[tool_depth].hex())
    assert nbytes == row * (tool_depth + 3 * WINDOW)  # (the tree's window: 32 tokens)
    assert nbytes < row * 4 * tool_depth / 2


def test_greedy_tokens_and_logprobs_equal_transformers(swa):
    """Within and past the window; cold, and over SGLang's own cached prefix. Logprobs
    measured at most 1.5e-5 apart (float32 rounding); 2e-3 with transformers' sinks not
    rounded to SGLang's bfloat16 (the tiny build now draws bfloat16 values)."""
    from transformers import AutoModelForCausalLM

    worker, model_dir = swa
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check = partial(equal_to_transformers, model, worker.url)
    flush_device(worker.url)
    short = [9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30, 576, 6722, 374]
    long = list(range(1000, 1000 + 4 * WINDOW))
    check(short)
    out, _ = check(long)
    _, cached = check(long + out + [5, 6, 7])
    assert cached >= len(long)  # the first turn's rows, from SGLang's tree


def test_instruction_anchor_serves_a_new_conversation_after_a_flush(swa, prompts):
    """The seeds' headline case: same system prompt and tools, another first message; the
    tree flushed (as eviction would), the instruction anchor comes back from the host."""
    worker, _ = swa
    url = worker.url
    tool_depth, _, p1, _ = prompts[0]
    other = p1[:tool_depth] + prompts[1][2][prompts[1][0]:]
    assert other[:tool_depth] == p1[:tool_depth] and other != p1 and tool_depth > 4 * WINDOW
    flush_device(url)
    cold = generate(url, other)
    flush_device(url)
    keys = save(url, p1, tool_depth)
    flush_device(url)
    alone = generate(url, other)
    assert alone["meta_info"]["cached_tokens"] == 0
    flush_device(url)
    warm = generate(url, other, restore((tool_depth, keys[tool_depth])))
    assert warm["meta_info"]["cached_tokens"] == tool_depth
    assert warm["meta_info"]["anchors"]["restored"][0]["depth"] == tool_depth
    assert warm["output_ids"] == cold["output_ids"] == alone["output_ids"]


def test_chain_restores_after_a_flush_and_verifies(swa, prompts):
    """A chain (instruction anchor, then an anchor more than a window further: its link holds
    every layer's rows, the sliding layers' last window among them) comes back from the
    host tier: the cold run's output, the rows on the device equal to the slabs; a shifted
    row is caught."""
    worker, _ = swa
    url = worker.url
    tool_depth, _, _, p2 = prompts[1]
    conv_depth = len(p2) - NEW  # the request prefills its last NEW tokens
    assert conv_depth - tool_depth > WINDOW
    flush_device(url)
    cold = generate(url, p2)
    flush_device(url)
    keys = save(url, p2, tool_depth, conv_depth)
    flush_device(url)
    chain = restore((tool_depth, keys[tool_depth]), (conv_depth, keys[conv_depth]))
    warm = generate(url, p2, chain)
    assert warm["meta_info"]["cached_tokens"] == conv_depth
    assert warm["output_ids"] == cold["output_ids"]
    ok = post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})
    assert ok["device_tokens"] == conv_depth and ok["mismatch"] is None
    assert ok["state_equal"] is True  # the window
    flush_device(url)
    assert post(url, "/debug/fault", {"where": "restore_shift_row"})["armed"]
    generate(url, p2, chain)
    bad = post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})
    assert bad["mismatch"] is not None  # (the conversation link's middle row)
    flush_device(url)
    assert post(url, "/debug/fault", {"where": "restore_state_flip"})["armed"]
    flipped = generate(url, p2, chain)
    bad = post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})
    assert bad["mismatch"] is None and bad["state_equal"] is False
    assert flipped["meta_info"]["cached_tokens"] == conv_depth
    flush_device(url)
    again = generate(url, p2, chain)
    assert again["output_ids"] == cold["output_ids"]
    ok = post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})
    assert ok["mismatch"] is None and ok["state_equal"] is True


def test_an_anchor_whose_window_is_gone_is_not_written(swa):
    """A finished request leaves its tokens in SGLang's tree with window rows for its last
    window only. A second request that continues them matches them from the tree; an anchor
    it plans deep inside that part has no window rows left: it is not written (a slab
    there would hold freed rows), while one at the end of its own prompt is."""
    url = swa[0].url
    first = list(range(2000, 2000 + 6 * WINDOW))
    flush_device(url)
    second = first + generate(url, first)["output_ids"] + list(range(500, 500 + 2 * WINDOW))
    plan = AnchorPlan(NS, snapshot=(
        SnapshotSpec(2 * WINDOW, AnchorKind.INSTRUCTION, Region.THICK),
        SnapshotSpec(len(second) - 8, AnchorKind.CONVERSATION, Region.THICK)))
    out = generate(url, second, plan)
    assert out["meta_info"]["cached_tokens"] >= len(first)  # the first turn, from the tree
    written = out["meta_info"]["anchors"]["written"]
    assert [w["depth"] for w in written] == [len(second) - 8]
    post(url, "/anchor/abort", {"slots": [w["slot"] for w in written]})


@pytest.fixture(scope="module")
def churn(swa, prompts):
    """A chain saved for turn 2 (instruction anchor, then one more than a window further) and
    turn 2's cold output, for the interleaving test."""
    url = swa[0].url
    tool_depth, _, _, p2 = prompts[1]
    conv_depth = len(p2) - NEW
    flush_device(url)
    cold = generate(url, p2)
    flush_device(url)
    keys = save(url, p2, tool_depth, conv_depth)
    return restore((tool_depth, keys[tool_depth]), (conv_depth, keys[conv_depth])), p2, cold


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["restore", "flush", "other", "plain"]), min_size=3,
                max_size=6))
def test_interleaved_requests_flushes_and_pool_pressure_never_restore_a_stale_window(
        swa, churn, ops):
    """Whatever ran before (restores over a tree that holds turn 2's prefix with its older
    part tombstoned, flushes, long other prompts that make SGLang evict tree nodes and their
    windows, SGLang's own cache of the same prompt), turn 2 gives its cold output."""
    url = swa[0].url
    chain, p2, cold = churn
    for i, op in enumerate(ops):
        if op == "flush":
            flush_device(url)
        elif op == "other":  # (two of them fill most of the pool)
            generate(url, list(range(3000 + 97 * i, 5200 + 97 * i)), max_new=3)
        else:
            out = generate(url, p2, chain if op == "restore" else None)
            assert out["output_ids"] == cold["output_ids"], (ops, i)


def test_a_pinned_anchor_keeps_its_window_on_the_device(swa, churn):
    """A pinned instruction anchor goes on the device with its window (verify: rows and
    window equal the slabs) and stays there, locked, while long prompts make SGLang evict
    everything else: turn 2 then finds it on the device (nothing scattered from the host)
    and gives its cold output."""
    url = swa[0].url
    chain, p2, cold = churn
    link = chain.restore[0]  # the instruction anchor (within the pin budget)
    flush_device(url)
    assert post(url, "/anchor/pin", {"key": link.key.hex()})["device"] == "locked"
    placed = post(url, "/anchor/verify", {"key": link.key.hex()})
    assert placed["device_tokens"] == link.depth and placed["mismatch"] is None
    assert placed["state_equal"] is True
    for i in range(3):
        generate(url, list(range(6000 + 89 * i, 8200 + 89 * i)), max_new=2)
    warm = generate(url, p2, restore((link.depth, link.key)))
    assert warm["meta_info"]["cached_tokens"] >= link.depth
    assert warm["meta_info"]["anchors"]["restored_tokens"] == 0
    assert warm["output_ids"] == cold["output_ids"]
    post(url, "/anchor/unpin", {"key": link.key.hex()})


def test_bfcl_replay_through_the_proxy_with_anchors_equals_without(swa):
    replay_on_equals_off(swa[0].url, conversations("base")[3])
