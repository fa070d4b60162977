"""The SGLang worker at `--page-size 16` (real SGLang 0.5.23 on CPU, tiny dense Qwen3,
BFCL prompts rendered with the Qwen3 template). SGLang's tree holds whole pages only, so a
restore puts back the page-aligned part of an anchor's prefix and the request prefills the
tail (fewer than 16 tokens). The slabs are per token: the same ones serve any page size.

Every check drops SGLang's own device cache first, so a hit can only come from a restore."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from anchorcache.wire import AnchorKind, AnchorPlan, AnchorRef, Region
from tests.ext.sglang.test_sglang_worker import NS, flush_device, generate, post, save, verify
from tests.servers import Server, sglang_worker_process

pytestmark = pytest.mark.slow

PAGE = 16


@pytest.fixture(scope="module")
def paged(tiny_qwen3) -> Iterator[Server]:
    with sglang_worker_process("--page-size", str(PAGE), model=str(tiny_qwen3)) as server:
        yield server


@pytest.fixture(scope="module")
def conversations(qwen3_tokenizer):
    from tests.data import two_turn_prompts

    convs = two_turn_prompts(qwen3_tokenizer, 6)
    # anchors that end inside a page, so the tail is really prefilled
    return [c for c in convs if c[0] % PAGE and c[1] % PAGE]


def aligned(depth: int) -> int:
    return depth - depth % PAGE


def test_paged_restore_puts_back_whole_pages_and_equals_cold(paged, conversations):
    url = paged.url
    tool_depth, depth, p1, p2 = conversations[0]
    keys, _ = save(url, p1, [(tool_depth, AnchorKind.INSTRUCTION, Region.THIN),
                               (depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    cold = generate(url, p2)
    assert cold["meta_info"]["cached_tokens"] == 0
    flush_device(url)
    chain = (AnchorRef(keys[tool_depth], tool_depth), AnchorRef(keys[depth], depth))
    warm = generate(url, p2, AnchorPlan(NS, restore=chain))
    meta = warm["meta_info"]
    assert [r["depth"] for r in meta["anchors"]["restored"]] == [tool_depth, depth]
    assert meta["cached_tokens"] == aligned(depth) > depth - PAGE
    assert meta["anchors"]["restored_tokens"] == aligned(depth)
    assert warm["output_ids"] == cold["output_ids"]
    # the rows now in SGLang's pages are the slabs' own, byte for byte
    check = verify(url, keys[depth])
    assert check["device_tokens"] == aligned(depth) and check["mismatch"] is None
    # the scheduler's own time in anchor work is counted per kind, with its maximum
    calls = {c["op"]: c for c in httpx.get(url + "/anchor/stats").json()["scheduler_calls"]}
    assert calls["restore"]["calls"] >= 2 and calls["snapshot"]["calls"] >= 1
    assert 0 < calls["restore"]["max_ms"] <= calls["restore"]["total_ms"]
    # the chain's first link alone: its pages come back, the rest is prefilled
    flush_device(url)
    partial = generate(url, p2, AnchorPlan(NS, restore=chain[:1]))
    assert partial["meta_info"]["cached_tokens"] == aligned(tool_depth)
    assert partial["output_ids"] == cold["output_ids"]


def test_paged_pin_locks_whole_pages(paged, conversations):
    url = paged.url
    post(url, "/anchor/flush")
    _, depth, p1, p2 = conversations[1]
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


def test_an_anchor_under_one_page_is_a_miss_not_a_restore(paged, conversations):
    url = paged.url
    _, _, p1, _ = conversations[2]
    short = PAGE - 3
    keys, _ = save(url, p1, [(short, AnchorKind.CONVERSATION, Region.THICK)], max_new=1)
    flush_device(url)
    out = generate(url, p1, AnchorPlan(NS, restore=(AnchorRef(keys[short], short),)))
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["meta_info"]["anchors"]["restore_miss"][0]["reason"] == "under_one_page"
