"""The SGLang worker with tensor parallelism: `--tp 2` on CPU (SGLang's own CPU TP over
gloo, each rank on its own core: the CPU recipe sets SGLANG_CPU_OMP_THREADS_BIND) with the
tiny Qwen3, whose 2 KV heads are split one per rank. Each rank keeps its own anchor store
over its own head; rank 0 answers (ext/sglang/tp.py).

Checked: one epoch for the worker (rank 0's, shared), one reply per call; a snapshot
flushed from the device and restored gives the cold output token for token (so both ranks
restored their shard: a rank without its head's rows would attend to garbage); the
restored rows equal the snapshot byte for byte on every rank (`/anchor/verify` combines
the ranks); a copy slow on one rank holds the request on both."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from anchorcache.wire import AnchorKind, AnchorPlan, AnchorRef, Region
from tests.data import two_turn_prompts
from tests.ext.sglang.test_sglang_worker import flush_device, generate, post, save, verify
from tests.servers import Server, sglang_worker_process

pytestmark = pytest.mark.slow

NS = bytes(range(16, 32))


@pytest.fixture(scope="module")
def sglang_tp(tiny_qwen3) -> Iterator[Server]:
    with sglang_worker_process("--tp", "2", model=str(tiny_qwen3)) as server:
        yield server


@pytest.fixture(scope="module")
def conversations(qwen3_tokenizer):
    return two_turn_prompts(qwen3_tokenizer, 3)


def test_one_epoch_and_one_reply_per_call(sglang_tp):
    url = sglang_tp.url
    epochs = {httpx.get(url + "/health", timeout=60).json()["epoch"]}
    for _ in range(12):  # were both ranks to answer, whichever came first would answer
        epochs.add(httpx.get(url + "/anchor/stats", timeout=60).json()["epoch"])
    assert len(epochs) == 1, epochs


def test_flush_restore_equals_cold_on_two_ranks(sglang_tp, conversations):
    url = sglang_tp.url
    tool_depth, conv_depth, p1, p2 = conversations[0]
    keys, _ = save(url, p1, [(tool_depth, AnchorKind.INSTRUCTION, Region.THIN),
                             (conv_depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    cold = generate(url, p2)
    assert cold["meta_info"]["cached_tokens"] == 0
    flush_device(url)
    chain = (AnchorRef(keys[tool_depth], tool_depth), AnchorRef(keys[conv_depth], conv_depth))
    warm = generate(url, p2, AnchorPlan(NS, restore=chain))
    meta = warm["meta_info"]
    assert meta["cached_tokens"] == conv_depth
    assert meta["anchors"]["restored_tokens"] == conv_depth
    assert warm["output_ids"] == cold["output_ids"]
    check = verify(url, keys[conv_depth])
    assert check["device_tokens"] == conv_depth and check["mismatch"] is None, check


def test_anchors_on_equal_off_over_turns(sglang_tp, conversations):
    url = sglang_tp.url
    for _, depth, p1, p2 in conversations[1:]:
        flush_device(url)
        off = [generate(url, p1)["output_ids"]]
        flush_device(url)
        off.append(generate(url, p2)["output_ids"])
        flush_device(url)
        keys, out1 = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
        flush_device(url)
        out2 = generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),)))
        assert out2["meta_info"]["anchors"]["restored_tokens"] == depth
        assert [out1["output_ids"], out2["output_ids"]] == off


@pytest.mark.parametrize("rank", [0, 1])
def test_a_fault_on_one_rank_is_seen(sglang_tp, conversations, rank):
    """A row shifted on one rank's shard only: verify, combining the ranks, sees it (each
    rank compares its own head; rank 0 alone would miss a fault on rank 1)."""
    url = sglang_tp.url
    _, depth, p1, p2 = conversations[2]
    keys, _ = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    post(url, "/debug/fault", {"where": "restore_shift_row", "rank": rank})
    generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),)))
    check = verify(url, keys[depth])
    assert check["device_tokens"] == depth and check["mismatch"] is not None, check


def test_a_slow_copy_on_one_rank_holds_the_request_on_both(sglang_tp, conversations):
    """A restore's copy held back a second on rank 1 only (fault `restore_slow`): rank 0's
    copy is done at once, but the request is admitted only when both have landed (the
    ranks agree through an all-reduce), or the ranks' batches would part ways. The output
    is the cold one, with the whole anchor restored on both shards."""
    url = sglang_tp.url
    _, depth, p1, p2 = conversations[1]
    flush_device(url)
    cold = generate(url, p2)["output_ids"]
    keys, _ = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    post(url, "/debug/fault", {"where": "restore_slow", "rank": 1})
    warm = generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),)))
    assert warm["meta_info"]["anchors"]["restored_tokens"] == depth
    assert warm["output_ids"] == cold
    check = verify(url, keys[depth])
    assert check["device_tokens"] == depth and check["mismatch"] is None, check
