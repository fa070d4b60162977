"""The SGLang worker at the settings real deployments use: tensor parallelism (`--tp 2` on
CPU: SGLang's own CPU TP over gloo, each rank on its own core, the CPU recipe sets
SGLANG_CPU_OMP_THREADS_BIND) and paged KV (`--page-size 16`), one server for both, with the
tiny Qwen3, whose 2 KV heads are split one per rank. Each rank keeps its own anchor store
over its own head; rank 0 answers (ext/sglang/tp.py). SGLang's tree holds whole pages only,
so a restore puts back the page-aligned part of an anchor's prefix and the request
prefills the tail (fewer than 16 tokens); the slabs are per token, the same at any page
size.

Checked: one epoch for the worker (rank 0's, shared), one reply per call; a snapshot
flushed from the device and restored gives the cold output token for token (so both ranks
restored their shard: a rank without its head's rows would attend to garbage); the
restored rows equal the snapshot byte for byte on every rank (`/anchor/verify` combines
the ranks); a copy slow on one rank holds the request on both; pins lock whole pages; an
anchor under one page is a miss. Every check drops SGLang's own device cache first, so a
hit can only come from a restore. With the disk tier on (each rank its own shard's files):
a restarted server restores a chain from both ranks' files, and a file damaged on one rank
only is restored by neither (the ranks agree on every file, ext/store.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from anchorcache.testing.data import two_turn_prompts
from anchorcache.testing.isolation import check_tenants_stay_apart
from anchorcache.testing.servers import Server, proxy_process, sglang_worker_process
from anchorcache.testing.worker_api import flush_device, generate, post, save, verify
from anchorcache.wire import AnchorKind, AnchorPlan, AnchorRef, Region, anchor_keys

pytestmark = pytest.mark.slow

NS = bytes(range(16, 32))
PAGE = 16


@pytest.fixture(scope="module")
def tp_disk(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp-disk")


def _tp_server(model: str, disk: Path) -> Any:
    return sglang_worker_process("--tp", "2", "--page-size", str(PAGE), model=model,
                                 env={"ANCHORCACHE_ANCHOR_DISK_DIR": str(disk)})


@pytest.fixture(scope="module")
def sglang_tp(tiny_qwen3, tp_disk) -> Iterator[Server]:
    with _tp_server(str(tiny_qwen3), tp_disk) as server:
        yield server


@pytest.fixture(scope="module")
def conversations(qwen3_tokenizer):
    convs = two_turn_prompts(qwen3_tokenizer, 6)
    # anchors that end inside a page, so the tail is really prefilled
    return [c for c in convs if c[0] % PAGE and c[1] % PAGE]


def corrupt_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a byte of the last tensor: the checksum catches it
    path.write_bytes(bytes(data))


def aligned(depth: int) -> int:
    return depth - depth % PAGE


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
    assert [r["depth"] for r in meta["anchors"]["restored"]] == [tool_depth, conv_depth]
    assert meta["cached_tokens"] == aligned(conv_depth) > conv_depth - PAGE
    assert meta["anchors"]["restored_tokens"] == aligned(conv_depth)
    assert warm["output_ids"] == cold["output_ids"]
    check = verify(url, keys[conv_depth])
    assert check["device_tokens"] == aligned(conv_depth) and check["mismatch"] is None, check
    # the scheduler's own time in anchor work is counted per kind, with its maximum
    calls = {c["op"]: c for c in httpx.get(url + "/anchor/stats").json()["scheduler_calls"]}
    assert calls["restore"]["calls"] >= 2 and calls["snapshot"]["calls"] >= 1
    assert 0 < calls["restore"]["max_ms"] <= calls["restore"]["total_ms"]
    # the chain's first link alone: its pages come back, the rest is prefilled
    flush_device(url)
    partial = generate(url, p2, AnchorPlan(NS, restore=chain[:1]))
    assert partial["meta_info"]["cached_tokens"] == aligned(tool_depth)
    assert partial["output_ids"] == cold["output_ids"]


def test_anchors_on_equal_off_over_turns(sglang_tp, conversations):
    url = sglang_tp.url
    for _, depth, p1, p2 in conversations[1:3]:
        flush_device(url)
        off = [generate(url, p1)["output_ids"]]
        flush_device(url)
        off.append(generate(url, p2)["output_ids"])
        flush_device(url)
        keys, out1 = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
        flush_device(url)
        out2 = generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),)))
        assert out2["meta_info"]["anchors"]["restored_tokens"] == aligned(depth)
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
    assert check["device_tokens"] == aligned(depth) and check["mismatch"] is not None, check


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
    assert warm["meta_info"]["anchors"]["restored_tokens"] == aligned(depth)
    assert warm["output_ids"] == cold
    check = verify(url, keys[depth])
    assert check["device_tokens"] == aligned(depth) and check["mismatch"] is None, check


def test_a_failed_snapshot_copy_on_one_rank_drops_the_anchor_on_both(sglang_tp, conversations):
    """Rank 1's snapshot copy fails (fault `snapshot_copy_fail`): the anchor is its shard
    too, so both ranks drop it (the reply writes nothing to confirm), and a later restore
    plan naming its key is a miss on both: the request runs cold, never half restored."""
    url = sglang_tp.url
    _, _, p1, p2 = conversations[0]
    depth = len(p1) + 5  # a prefix of turn 2 no earlier test saved
    post(url, "/anchor/flush")  # (the late lookup would find earlier tests' anchors on disk)
    flush_device(url)
    cold = generate(url, p2)["output_ids"]
    flush_device(url)
    post(url, "/debug/fault", {"where": "snapshot_copy_fail", "rank": 1})
    keys, out = save(url, p2[:depth], [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    assert out["meta_info"]["anchors"]["written"] == [] and keys == {}
    key = anchor_keys(NS, httpx.get(url + "/model_info", timeout=60).json()["model_id"], p2,
                      [depth])[depth]
    flush_device(url)
    warm = generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(key, depth),)))
    assert warm["meta_info"]["anchors"]["restored_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == 0
    assert warm["output_ids"] == cold
    assert not [s for s in httpx.get(url + "/anchor/slots", timeout=60).json()["slots"]
                if s["key"] == key.hex()]


def test_a_failed_restore_copy_on_one_rank_lands_on_neither(sglang_tp, conversations):
    """Rank 1's restore copy fails (fault `restore_copy_fail`): the prefix lands on no rank
    (the ranks must admit the request alike), so the request prefills it and answers as the
    cold run does; the next restore of the same anchor works on both."""
    url = sglang_tp.url
    _, depth, p1, p2 = conversations[1]
    flush_device(url)
    cold = generate(url, p2)["output_ids"]
    keys, _ = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    post(url, "/debug/fault", {"where": "restore_copy_fail", "rank": 1})
    plan = AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),))
    failed = generate(url, p2, plan)
    assert failed["meta_info"]["cached_tokens"] == 0
    assert failed["output_ids"] == cold
    flush_device(url)
    again = generate(url, p2, plan)
    assert again["meta_info"]["anchors"]["restored_tokens"] == aligned(depth)
    assert again["output_ids"] == cold


def test_paged_pin_locks_whole_pages(sglang_tp, conversations):
    url = sglang_tp.url
    post(url, "/anchor/flush")
    _, depth, p1, p2 = conversations[3]
    keys, _ = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    pin = post(url, "/anchor/pin", {"key": keys[depth].hex()})
    assert pin == {**pin, "pinned": True, "device": "locked"}
    assert httpx.get(url + "/anchor/stats").json()["device_pinned_tokens"] == aligned(depth)
    warm = generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),)))
    assert warm["meta_info"]["cached_tokens"] == aligned(depth)
    assert warm["meta_info"]["anchors"]["restored_tokens"] == 0  # already on the device
    assert post(url, "/anchor/unpin", {"key": keys[depth].hex()})["unpinned"]
    flush_device(url)
    assert warm["output_ids"] == generate(url, p2)["output_ids"]


def test_an_anchor_under_one_page_is_a_miss_not_a_restore(sglang_tp, conversations):
    url = sglang_tp.url
    _, _, p1, _ = conversations[0]
    short = PAGE - 3
    keys, _ = save(url, p1, [(short, AnchorKind.CONVERSATION, Region.THICK)], max_new=1)
    flush_device(url)
    out = generate(url, p1, AnchorPlan(NS, restore=(AnchorRef(keys[short], short),)))
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["meta_info"]["anchors"]["restore_miss"][0]["reason"] == "under_one_page"


def test_tenants_never_see_each_others_prompts_on_tp_and_paged(sglang_tp):
    """`--tp 2 --page-size 16`: every rank's tree keys the request's namespace; another
    tenant's identical prompt is a miss through both APIs, a shared toolset still shared."""
    with proxy_process(sglang_tp.url) as proxy:
        check_tenants_stay_apart(proxy, sglang_tp.url)


def test_a_restarted_tp_worker_restores_from_both_ranks_files(sglang_tp, tiny_qwen3, tp_disk,
                                                              qwen3_tokenizer):
    """Last in the module: it SIGKILLs the module's server. Two conversations' anchors are
    written (each rank its own shard's file); rank 1's file of the second is damaged while
    the worker is down. The restarted worker (new epoch) restores the first chain from
    both ranks' files, token for token the cold run; the second is restored by neither rank,
    though rank 0's file is whole (a rank without its shard would attend to garbage), and
    the request prefills it, again the cold run; nothing hangs."""
    url = sglang_tp.url
    convs = [c for c in two_turn_prompts(qwen3_tokenizer, 10) if c[0] % PAGE and c[1] % PAGE]
    (tool, conv, p1, p2), (_, conv_b, p1_b, p2_b) = convs[-2:]
    keys, _ = save(url, p1, [(tool, AnchorKind.INSTRUCTION, Region.THIN),
                             (conv, AnchorKind.CONVERSATION, Region.THICK)])
    keys_b, _ = save(url, p1_b, [(conv_b, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    cold = generate(url, p2)["output_ids"]
    flush_device(url)
    cold_b = generate(url, p2_b)["output_ids"]
    old_epoch = httpx.get(url + "/health", timeout=60).json()["epoch"]
    names = [f"{keys[tool].hex()}-{tool}.slab", f"{keys[conv].hex()}-{conv}.slab",
             f"{keys_b[conv_b].hex()}-{conv_b}.slab"]
    folders = sorted(tp_disk.glob("*-tp[01]of2"))
    deadline = time.monotonic() + 60
    while not all((f / n).is_file() for f in folders for n in names) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [f.name[-6:] for f in folders] == ["tp0of2", "tp1of2"]
    assert all((f / n).is_file() for f in folders for n in names)
    sglang_tp.kill()
    corrupt_payload(folders[1] / names[2])

    with _tp_server(str(tiny_qwen3), tp_disk) as again:
        url = again.url
        assert httpx.get(url + "/health", timeout=60).json()["epoch"] != old_epoch
        listed = {(d["key"], d["depth"]) for d in
                  httpx.get(url + "/anchor/slots", timeout=60).json()["disk"]}
        assert {(keys[tool].hex(), tool), (keys[conv].hex(), conv)} <= listed
        chain = (AnchorRef(keys[tool], tool), AnchorRef(keys[conv], conv))
        warm = generate(url, p2, AnchorPlan(NS, restore=chain))
        assert [r["depth"] for r in warm["meta_info"]["anchors"]["restored"]] == [tool, conv]
        assert warm["meta_info"]["cached_tokens"] == aligned(conv)
        assert warm["output_ids"] == cold
        check = verify(url, keys[conv])
        assert check["device_tokens"] == aligned(conv) and check["mismatch"] is None, check

        flush_device(url)
        damaged = generate(url, p2_b, AnchorPlan(NS, restore=(AnchorRef(keys_b[conv_b],
                                                                        conv_b),)))
        anchors = damaged["meta_info"]["anchors"]
        first = anchors["restore_miss"][0]
        assert (first["key"], first["reason"]) == (keys_b[conv_b].hex(), "not_resident"), anchors
        # (the late lookup may find earlier tests' anchors below it, never it)
        assert conv_b not in [r["depth"] for r in anchors["restored"]]
        assert damaged["meta_info"]["cached_tokens"] < aligned(conv_b)
        assert damaged["output_ids"] == cold_b
        assert (tp_disk / "quarantine" / f"{folders[1].name}-{names[2]}").is_file()
        # rank 0's whole file of it was never promoted: no slab of it in memory
        assert keys_b[conv_b].hex() not in {
            s["key"] for s in httpx.get(url + "/anchor/slots", timeout=60).json()["slots"]}
        assert httpx.get(url + "/health", timeout=60).status_code == 200
