"""The worker contract (docs/worker-protocol.md) over HTTP, against both real workers:
the embedded one (tiny hybrid Qwen3-Next) and SGLang with our plugin (tiny dense Qwen3).

The worker itself refuses a restore whose key, depth or chain does not match the prompt
it was given, whatever the proxy planned. On SGLang every check first drops SGLang's own
device cache (`/flush_cache`), so a hit can only come from a restored anchor.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import httpx
import pytest

from anchorcache import wire
from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
from anchorcache.testing.servers import worker_process
from anchorcache.wire import (
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    GenerateRequest,
    Region,
    SamplingParams,
    SnapshotSpec,
    anchor_keys,
)

pytestmark = pytest.mark.slow

NS = bytes(range(16))
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


class Worker:
    def __init__(self, backend: str, url: str) -> None:
        self.backend = backend
        self.url = url
        self.model_id = httpx.get(url + "/model_info", timeout=30).json()["model_id"]

    def forget_device(self) -> None:
        """SGLang: drop its device prefix cache (anchors stay on the host). Embedded: no-op."""
        if self.backend == "sglang":
            resp = httpx.post(self.url + "/flush_cache", timeout=60)
            assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module", params=["embedded", "sglang"])
def worker(request):
    if request.param == "embedded":
        model = build_tiny_model("qwen3_next", tiny_model_dir("qwen3_next"))
        with worker_process(model=str(model)) as server:
            yield Worker("embedded", server.url)
    else:
        yield Worker("sglang", request.getfixturevalue("sglang").url)


def generate(worker, ids, plan=None):
    req = GenerateRequest(input_ids=tuple(ids), sampling=GREEDY, anchor=plan)
    resp = httpx.post(worker.url + "/generate", json=req.to_json(), timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def post(worker, path, body):
    resp = httpx.post(worker.url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def prompt(seed, n=300):
    rng = random.Random(seed)
    return [rng.randrange(1000, 100000) for _ in range(n)]


def save(worker, ids, depths):
    """Snapshot `ids` at `depths` and confirm; return {depth: key}."""
    plan = AnchorPlan(NS, snapshot=tuple(SnapshotSpec(d, AnchorKind.CONVERSATION, Region.THICK)
                                         for d in depths), chunk_at=tuple(depths))
    out = generate(worker, ids, plan)
    written = out["meta_info"]["anchors"]["written"]
    assert [w["depth"] for w in written] == list(depths)
    confirmed = post(worker, "/anchor/confirm", {"slots": [w["slot"] for w in written]})
    assert sorted(confirmed["confirmed"]) == sorted(w["slot"] for w in written)
    assert confirmed["epoch"] == out["meta_info"]["epoch"]
    worker.forget_device()
    return {w["depth"]: bytes.fromhex(w["key"]) for w in written}


def test_restore_gives_the_cold_output(worker):
    ids = prompt(1)
    keys = save(worker, ids[:200], [100, 150])
    cold = generate(worker, ids, AnchorPlan(NS, chunk_at=(100, 150)))
    worker.forget_device()
    warm = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(keys[100], 100),
                                                         AnchorRef(keys[150], 150))))
    assert warm["meta_info"]["cached_tokens"] == 150
    assert [r["depth"] for r in warm["meta_info"]["anchors"]["restored"]] == [100, 150]
    assert warm["output_ids"] == cold["output_ids"]


def test_a_key_of_another_prompt_is_refused(worker):
    a, b = prompt(2), prompt(3)
    keys = save(worker, a[:200], [120])
    # the proxy (wrongly) names a's anchor for prompt b: the worker recomputes b's key
    out = generate(worker, b, AnchorPlan(NS, restore=(AnchorRef(keys[120], 120),)))
    assert out["meta_info"]["cached_tokens"] == 0
    [miss] = out["meta_info"]["anchors"]["restore_miss"]
    assert miss["reason"] == "key_mismatch"
    worker.forget_device()
    assert out["output_ids"] == generate(worker, b)["output_ids"]


def test_same_tokens_other_namespace_is_refused(worker):
    ids = prompt(4)
    keys = save(worker, ids[:200], [90])
    other = AnchorPlan(bytes(16), restore=(AnchorRef(keys[90], 90),))
    out = generate(worker, ids, other)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["meta_info"]["anchors"]["restore_miss"][0]["reason"] == "key_mismatch"


def test_a_chain_that_skips_a_link_restores_only_its_verified_prefix(worker):
    ids = prompt(5)
    keys = save(worker, ids[:250], [80, 160, 240])
    # 240's slab holds rows [160, 240): restoring it right after 80 would leave a hole
    out = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(keys[80], 80),
                                                        AnchorRef(keys[240], 240))))
    assert out["meta_info"]["cached_tokens"] == 80
    assert out["meta_info"]["anchors"]["restore_miss"][0]["reason"] == "chain_mismatch"
    worker.forget_device()
    assert out["output_ids"] == generate(worker, ids, AnchorPlan(NS, chunk_at=(80,)))["output_ids"]


def test_a_chain_named_by_its_leaf_is_restored_whole(worker):
    """The proxy names a chain's leaf only: the worker restores it from the root by its own
    parent links, and lists only what was named."""
    ids = prompt(15)
    keys = save(worker, ids[:250], [80, 160, 240])
    cold = generate(worker, ids, AnchorPlan(NS, chunk_at=(80, 160, 240)))
    worker.forget_device()
    warm = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(keys[240], 240),)))
    assert warm["meta_info"]["cached_tokens"] == 240
    anchors = warm["meta_info"]["anchors"]
    assert [r["depth"] for r in anchors["restored"]] == [240] and not anchors["restore_miss"]
    assert warm["output_ids"] == cold["output_ids"]
    worker.forget_device()
    # named from a middle link down: the same chain
    mid = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(keys[160], 160),
                                                        AnchorRef(keys[240], 240))))
    assert mid["meta_info"]["cached_tokens"] == 240
    assert [r["depth"] for r in mid["meta_info"]["anchors"]["restored"]] == [160, 240]
    assert mid["output_ids"] == cold["output_ids"]
    worker.forget_device()


def test_a_leaf_whose_ancestor_is_gone_restores_nothing_and_names_it(worker):
    ids = prompt(16)
    keys = save(worker, ids[:250], [80, 160, 240])
    assert post(worker, "/anchor/evict", {"key": keys[160].hex()})["evicted"] is True
    out = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(keys[240], 240),)))
    assert out["meta_info"]["cached_tokens"] == 0
    anchors = out["meta_info"]["anchors"]
    assert anchors["restored"] == []
    [miss] = anchors["restore_miss"]  # the link that is gone, for the proxy to forget
    assert (miss["key"], miss["depth"], miss["reason"]) == (keys[160].hex(), 160, "not_resident")
    worker.forget_device()
    assert out["output_ids"] == generate(worker, ids, AnchorPlan(NS, chunk_at=(80, 160, 240)))[
        "output_ids"]
    worker.forget_device()


def test_a_leaf_of_another_prompt_is_refused_whatever_its_ancestors(worker):
    """Prompt b shares a's first 160 tokens: a's leaf at 240 is refused for b (its key is
    recomputed over b), though its ancestors are b's prefixes too."""
    a = prompt(17)
    b = a[:160] + prompt(18)[160:]
    keys = save(worker, a[:250], [80, 160, 240])
    out = generate(worker, b, AnchorPlan(NS, restore=(AnchorRef(keys[240], 240),)))
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["meta_info"]["anchors"]["restore_miss"][0]["reason"] == "key_mismatch"
    worker.forget_device()
    ok = generate(worker, b, AnchorPlan(NS, restore=(AnchorRef(keys[160], 160),)))
    assert ok["meta_info"]["cached_tokens"] == 160
    worker.forget_device()


def test_wrong_depth_for_a_key_is_refused(worker):
    ids = prompt(6)
    keys = save(worker, ids[:200], [110])
    out = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(keys[110], 111),)))
    assert out["meta_info"]["cached_tokens"] == 0


def test_unconfirmed_snapshots_are_invisible_and_abortable(worker):
    ids = prompt(7)
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(100, AnchorKind.CONVERSATION),), chunk_at=(100,))
    written = generate(worker, ids, plan)["meta_info"]["anchors"]["written"]
    worker.forget_device()
    key = anchor_keys(NS, worker.model_id, ids, [100])[100]
    assert written[0]["key"] == key.hex()
    look = post(worker, "/anchor/lookup", {"namespace": NS.hex(), "input_ids": ids, "depths": [100]})
    assert look["hits"][0]["committed"] is False
    out = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(key, 100),)))
    assert out["meta_info"]["cached_tokens"] == 0  # staged, not restorable
    assert post(worker, "/anchor/abort", {"slots": [written[0]["slot"]]})["aborted"] == [written[0]["slot"]]
    assert httpx.get(worker.url + "/anchor/stats").json()["staged"] == 0
    assert post(worker, "/anchor/confirm", {"slots": [written[0]["slot"]]})["confirmed"] == []


def test_a_plan_that_asks_confirm_is_confirmed_as_its_request_ends(worker):
    """`AnchorPlan.confirm` (what the proxy sends): each sample's end comes with the anchors
    it lists written confirmed (streamed, n samples that all list the one prompt anchor),
    committed without an `/anchor/confirm`, and restorable by the next request. Without it,
    nothing is confirmed (`confirmed` null)."""
    ids = prompt(31, 160)
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(120, AnchorKind.CONVERSATION, Region.THICK),),
                      chunk_at=(120,), confirm=True)
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3, n=2)
    body = {**GenerateRequest(input_ids=tuple(ids), sampling=sampling, anchor=plan,
                              stream=True).to_json()}
    with httpx.stream("POST", worker.url + "/generate", json=body, timeout=300) as r:
        metas = [json.loads(line[6:])["meta_info"] for line in r.iter_lines()
                 if line.startswith("data: {") and "meta_info" in line]
    assert len(metas) == 2
    [slot] = {w["slot"] for m in metas for w in m["anchors"]["written"]}
    assert [m["anchors"]["confirmed"] for m in metas] == [{"slots": [slot], "evicted": []}] * 2
    listed = {s["slot"]: s for s in httpx.get(worker.url + "/anchor/slots").json()["slots"]}
    key = anchor_keys(NS, worker.model_id, ids, [120])[120]
    assert listed[slot]["state"] == "committed" and listed[slot]["key"] == key.hex()
    assert httpx.get(worker.url + "/anchor/stats").json()["staged"] == 0
    worker.forget_device()
    cold = generate(worker, ids)
    worker.forget_device()
    warm = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(key, 120),)))
    assert warm["meta_info"]["cached_tokens"] == 120
    assert warm["output_ids"] == cold["output_ids"]
    # the plan without `confirm`: staged, unconfirmed, as before
    other = prompt(32, 160)
    plain = generate(worker, other, AnchorPlan(NS, snapshot=plan.snapshot, chunk_at=(120,)))
    anchors = plain["meta_info"]["anchors"]
    assert anchors["confirmed"] is None and len(anchors["written"]) == 1
    post(worker, "/anchor/abort", {"slots": [anchors["written"][0]["slot"]]})
    assert post(worker, "/anchor/evict", {"key": key.hex()})["evicted"]


def test_an_abort_after_the_end_drops_what_the_request_confirmed_in_band(worker):
    """The proxy aborts a request it did not settle (its client went away, perhaps after the
    worker had ended it and confirmed its anchors in band, before the proxy read that end):
    the abort drops those anchors too, as it drops staged ones, so none outlives a request
    the proxy never recorded (a client leaving at the right moment would otherwise keep
    anchors outside its tenant's quota)."""
    ids = prompt(33, 160)
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(120, AnchorKind.CONVERSATION, Region.THICK),),
                      chunk_at=(120,), confirm=True)
    rid = f"in-band-{worker.backend}"
    req = GenerateRequest(input_ids=tuple(ids), sampling=GREEDY, anchor=plan, rid=rid)
    resp = httpx.post(worker.url + "/generate", json=req.to_json(), timeout=120)
    assert resp.status_code == 200, resp.text
    anchors = resp.json()["meta_info"]["anchors"]
    [written] = anchors["written"]
    assert anchors["confirmed"]["slots"] == [written["slot"]]
    def listed():
        return {s["key"] for s in httpx.get(worker.url + "/anchor/slots").json()["slots"]}
    assert written["key"] in listed()
    assert post(worker, "/abort_request", {"rid": rid})["aborted"] is True
    assert written["key"] not in listed()
    worker.forget_device()
    key = bytes.fromhex(written["key"])
    out = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(key, 120),)))
    assert out["meta_info"]["cached_tokens"] == 0
    assert post(worker, "/abort_request", {"rid": rid})["aborted"] is False


def test_a_prefix_already_held_is_reported_not_rewritten(worker):
    ids = prompt(9)
    keys = save(worker, ids[:200], [90])
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(90, AnchorKind.CONVERSATION),
                                    SnapshotSpec(180, AnchorKind.CONVERSATION)), chunk_at=(90, 180))
    anchors = generate(worker, ids, plan)["meta_info"]["anchors"]
    [held] = anchors["held"]
    assert (held["key"], held["depth"], held["kind"]) == (keys[90].hex(), 90, "conversation")
    assert isinstance(held["slot"], int)
    [written] = anchors["written"]
    # the new anchor stores only the rows past the held one and names it as its parent
    assert written["depth"] == 180 and written["parent"] == keys[90].hex()
    post(worker, "/anchor/abort", {"slots": [written["slot"]]})
    worker.forget_device()


def test_slots_pin_unpin_evict_flush(worker):
    ids = prompt(8)
    keys = save(worker, ids[:150], [70])
    key = keys[70].hex()
    slots = httpx.get(worker.url + "/anchor/slots").json()["slots"]
    [entry] = [s for s in slots if s["key"] == key]
    assert entry["depth"] == 70 and entry["state"] == "committed" and not entry["pinned"]
    assert post(worker, "/anchor/pin", {"key": key})["pinned"] is True
    assert next(s for s in httpx.get(worker.url + "/anchor/slots").json()["slots"] if s["key"] == key)["pinned"]
    assert post(worker, "/anchor/unpin", {"key": key})["unpinned"] is True
    assert post(worker, "/anchor/evict", {"key": key})["evicted"] is True
    out = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(keys[70], 70),)))
    assert out["meta_info"]["anchors"]["restore_miss"][0]["reason"] == "not_resident"
    save(worker, ids[:150], [60])
    assert post(worker, "/anchor/flush", {})["flushed_anchors"] >= 1
    assert [s for s in httpx.get(worker.url + "/anchor/slots").json()["slots"]
            if s["state"] == "committed"] == []


def test_bad_anchor_bodies_are_400(worker):
    for path, body in [("/anchor/confirm", {"slots": "x"}), ("/anchor/pin", {"key": "zz"}),
                       ("/generate", {"input_ids": [1, 2], "anchor": {"restore": [{"key": "00", "depth": 5}]}}),
                       ("/generate", {"input_ids": []}),
                       ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}),
                       ("/stop_request", {"rid": "x", "output_tokens": -1}),
                       ("/stop_request", {"rid": "x", "output_tokens": "3"}),
                       # a depth past the ids (found by a fuzz of the routes: it was a 500)
                       ("/anchor/lookup", {"namespace": "00", "input_ids": [1, 2], "depths": [5]}),
                       ("/anchor/lookup", {"namespace": "00", "input_ids": [1, 2], "depths": [0]}),
                       ("/generate", {"input_ids": [1], "cache_key": "tenant-a"}),
                       ("/anchor/pin", {"key": "00" * 16, "device": "yes"}),
                       ("/anchor/pin", {"key": "00" * 16, "cache_key": 7})]:
        resp = httpx.post(worker.url + path, json=body, timeout=30)
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error"


def test_every_reply_carries_the_epoch(worker):
    epoch = httpx.get(worker.url + "/health").json()["epoch"]
    assert epoch
    assert httpx.get(worker.url + "/model_info").json()["epoch"] == epoch
    assert httpx.get(worker.url + "/anchor/slots").json()["epoch"] == epoch
    assert generate(worker, prompt(10, 20))["meta_info"]["epoch"] == epoch


def test_a_prefix_already_held_is_reported_not_skipped_silently(worker):
    ids = prompt(11)
    keys = save(worker, ids[:200], [100, 200])
    # a proxy that forgot these anchors asks for them again: the worker reports them held
    again = generate(worker, ids, AnchorPlan(NS, snapshot=(
        SnapshotSpec(100, AnchorKind.INSTRUCTION, Region.THIN),
        SnapshotSpec(200, AnchorKind.CONVERSATION, Region.THICK)), chunk_at=(100, 200)))
    report = again["meta_info"]["anchors"]
    assert report["written"] == []
    held = {h["depth"]: h for h in report["held"]}
    assert sorted(held) == [100, 200]
    assert held[100]["key"] == keys[100].hex() and held[100]["parent"] is None
    assert held[200]["key"] == keys[200].hex() and held[200]["parent"] == keys[100].hex()
    assert held[100]["kind"] == "conversation"  # the slab's own kind, as it was written
    slots = {s["slot"]: s for s in httpx.get(worker.url + "/anchor/slots").json()["slots"]}
    assert slots[held[200]["slot"]]["key"] == keys[200].hex()
    # (restored by the late lookup there; a snapshot at the prompt's end is never restored,
    # and is reported held instead of being written twice)
    assert [r["depth"] for r in report["restored"]] == [100, 200]
    same = generate(worker, ids[:200], AnchorPlan(NS, snapshot=(
        SnapshotSpec(200, AnchorKind.CONVERSATION, Region.THICK),)))
    assert same["meta_info"]["anchors"]["written"] == []
    assert [(h["depth"], h["key"]) for h in same["meta_info"]["anchors"]["held"]] == [(200, keys[200].hex())]


def test_a_link_in_its_own_namespace(worker):
    """A shared toolset's root lives in another namespace than the rest of the chain."""
    shared = bytes(range(16, 32))
    ids = prompt(12)
    root = anchor_keys(shared, worker.model_id, ids, [100])[100]
    gen = generate(worker, ids[:100], AnchorPlan(shared, snapshot=(
        SnapshotSpec(100, AnchorKind.INSTRUCTION, Region.THIN),)))
    post(worker, "/anchor/confirm", {"slots": [w["slot"] for w in gen["meta_info"]["anchors"]["written"]]})
    worker.forget_device()
    cold = generate(worker, ids, AnchorPlan(NS, chunk_at=(100,)))
    worker.forget_device()
    plan = AnchorPlan(NS, restore=(AnchorRef(root, 100, shared),),
                      snapshot=(SnapshotSpec(200, AnchorKind.CONVERSATION, Region.THICK),))
    warm = generate(worker, ids, plan)
    assert warm["meta_info"]["cached_tokens"] == 100
    assert warm["output_ids"] == cold["output_ids"]
    [w] = warm["meta_info"]["anchors"]["written"]
    assert w["parent"] == root.hex() and w["key"] == anchor_keys(NS, worker.model_id, ids, [200])[200].hex()
    # without the link's namespace the worker computes the plan's key and refuses it
    refused = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(root, 100),)))
    assert refused["meta_info"]["anchors"]["restore_miss"][0]["reason"] == "key_mismatch"


def run(worker, ids, sampling, plan=None, **extra):
    body = {**GenerateRequest(input_ids=tuple(ids), sampling=sampling, anchor=plan).to_json(),
            **extra}
    resp = httpx.post(worker.url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def next_turn_restores(worker, written, following):
    """Confirm `written` (a conversation anchor at 200 and the response anchor); the next
    turn `following` restores both and gives its cold output."""
    post(worker, "/anchor/confirm", {"slots": [w["slot"] for w in written.values()]})
    worker.forget_device()
    cold = generate(worker, following)
    worker.forget_device()
    response = written["response"]
    warm = generate(worker, following, AnchorPlan(NS, restore=(
        AnchorRef(bytes.fromhex(written["conversation"]["key"]), 200),
        AnchorRef(bytes.fromhex(response["key"]), response["depth"]))))
    assert warm["meta_info"]["cached_tokens"] == response["depth"]
    assert warm["output_ids"] == cold["output_ids"]


def test_a_response_anchor_restores_the_next_turn(worker):
    """A generation that stops on a stop token saves prompt + output as a response anchor
    (SGLang: all of it but the stop token, whose row it never computed); the next turn's
    prompt starts with it and restores it: output as cold."""
    ids = prompt(13, 200)
    probe = generate(worker, ids)["output_ids"]
    k = next(i for i in range(2, len(probe)) if probe[i] not in probe[:i])
    stop = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(probe[k],))
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(200, AnchorKind.CONVERSATION, Region.THICK),),
                      snapshot_response=True)
    out = run(worker, ids, stop, plan)
    assert out["output_ids"] == probe[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": probe[k]}
    written = {w["kind"]: w for w in out["meta_info"]["anchors"]["written"]}
    response = written["response"]
    full = ids + out["output_ids"]
    depth = len(full) - (1 if worker.backend == "sglang" else 0)
    assert response["depth"] == depth
    assert response["parent"] == written["conversation"]["key"]
    assert response["key"] == anchor_keys(NS, worker.model_id, full, [depth])[depth].hex()
    next_turn_restores(worker, written, full + prompt(14, 30))
    # a length finish saves no response anchor
    cut = run(worker, ids, SamplingParams(max_new_tokens=2, temperature=0.0),
              AnchorPlan(NS, snapshot_response=True))
    assert cut["meta_info"]["anchors"]["written"] == []


def test_a_stopped_request_ends_as_a_stop_and_keeps_its_anchors(worker):
    """`/stop_request` mid-stream (a stop sequence the proxy found): the stream ends with a
    stop finish and the request's anchors, never an abort. The response anchor is prompt +
    the named output ids, and restores the next turn as cold. The embedded worker here is
    recurrent: its state exists only at the newest token, so it keeps no response anchor
    for an earlier cut, only the prompt's."""
    ids = prompt(21, 200)
    rid = f"stop-{worker.backend}"
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(200, AnchorKind.CONVERSATION, Region.THICK),),
                      snapshot_response=True)
    sampling = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    body = {**GenerateRequest(input_ids=tuple(ids), sampling=sampling, anchor=plan,
                              rid=rid).to_json(), "stream": True}
    out: list[int] = []
    metas = []
    with httpx.stream("POST", worker.url + "/generate", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            out += event.get("output_ids", [])
            if "meta_info" in event:
                metas.append(event["meta_info"])
            if len(out) >= 6 and not metas and rid:
                assert post(worker, "/stop_request", {"rid": rid, "output_tokens": 3})["stopped"]
                rid = ""
    assert not rid and len(metas) == 1 and len(out) < 400
    meta = metas[0]
    assert meta["finish_reason"] == {"type": "stop", "matched": None}
    written = {w["kind"]: w for w in meta["anchors"]["written"]}
    assert written["conversation"]["depth"] == 200
    depth = 203
    if worker.backend == "embedded":
        assert "response" not in written
        return
    full = ids + out[:3]
    assert written["response"]["depth"] == depth
    assert written["response"]["key"] == anchor_keys(NS, worker.model_id, full, [depth])[depth].hex()
    next_turn_restores(worker, written, full + prompt(22, 30))


def test_n_samples_share_one_prefill_and_a_seed_reproduces_them(worker):
    """`n` samples from one prefill, sample i drawing from seed + i. SGLang honours
    per-request seeds only under its own `--enable-deterministic-inference`, which its CPU
    attention backend cannot combine with the radix cache: there the samples still share
    the prefill, and differ, but a seed does not reproduce them (docs/sglang.md)."""
    ids = prompt(15, 120)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7, n=3)
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(100, AnchorKind.CONVERSATION, Region.THICK),),
                      snapshot_response=True)
    first = run(worker, ids, sampling, plan)
    assert [o["index"] for o in first] == [0, 1, 2]
    metas = [o["meta_info"] for o in first]
    # one prefill: every sample reports the same prompt figures and the one snapshot
    assert len({(m["prompt_tokens"], m["cached_tokens"], m["prefill_tokens"]) for m in metas}) == 1
    assert [[w["depth"] for w in m["anchors"]["written"]] for m in metas] == [[100]] * 3
    assert len({tuple(o["output_ids"]) for o in first}) > 1
    post(worker, "/anchor/abort", {"slots": [w["slot"] for w in metas[0]["anchors"]["written"]]})
    if worker.backend == "sglang":
        # the prompt is in SGLang's tree now: a second request prefills its last token only
        again = run(worker, ids, sampling)
        assert {o["meta_info"]["cached_tokens"] for o in again} == {len(ids) - 1}
        return
    again = run(worker, ids, sampling)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    single = run(worker, ids, SamplingParams(max_new_tokens=6, temperature=1.0, seed=8))
    assert single["output_ids"] == first[1]["output_ids"]  # sample i draws from seed + i


def test_a_constraint_shapes_the_output_and_a_bad_one_is_a_400(worker, qwen3_tokenizer):
    ids = prompt(16, 80)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, regex="[0-9]{3}-[a-c]{2}")
    out = run(worker, ids, sampling)
    text = qwen3_tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", text), text
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    out = run(worker, ids, SamplingParams(max_new_tokens=8, temperature=0.0,
                                          ebnf='root ::= "yes" | "no" | "maybe"'))
    assert qwen3_tokenizer.decode(out["output_ids"], skip_special_tokens=True) in {"yes", "no", "maybe"}
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "regex": "[0-9"}}
    resp = httpx.post(worker.url + "/generate", json=body, timeout=120)
    assert resp.status_code == 400, resp.text


def test_logprobs_describe_the_output(worker):
    ids = prompt(17, 80)
    out = run(worker, ids, GREEDY, return_logprob=True, top_logprobs_num=3)
    chosen = out["output_token_logprobs"]
    tops = out["output_top_logprobs"]
    assert [t for _, t, _ in chosen] == out["output_ids"]
    assert len(tops) == len(chosen) and all(len(top) == 3 for top in tops)
    for (lp, token, _), top in zip(chosen, tops, strict=True):
        assert lp <= 0 and top[0][1] == token  # greedy: the chosen token is the likeliest
        assert abs(top[0][0] - lp) < 1e-3 and top[0][0] >= top[1][0] >= top[2][0]
    events = []
    body = {**GenerateRequest(input_ids=tuple(ids), sampling=GREEDY, stream=True).to_json(),
            "return_logprob": True, "top_logprobs_num": 0}
    with httpx.stream("POST", worker.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    streamed = [row for e in events for row in e.get("output_token_logprobs", [])]
    assert [t for _, t, _ in streamed] == out["output_ids"]
    assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(streamed, chosen, strict=True))


# ---- reply records: both backends answer the same calls with the same shape ---------------

SHAPES: dict[str, dict[str, Any]] = {}  # backend → {call: shape of its reply}


def shape(value: Any) -> Any:
    """A reply's shape: keys and JSON types (numbers alike; null stands for any type)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):  # every element's shape, once
        return sorted({json.dumps(shape(v), sort_keys=True) for v in value})
    if value is None:
        return None
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else type(value).__name__


def same_shape(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_shape(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):  # an empty list fits any
        return not a or not b or all(same_shape(json.loads(x), json.loads(y)) for x in a for y in b)
    return a == b


def test_replies_are_their_records_and_match_across_backends(worker):
    """Every reply parses into its record in anchorcache/wire/ and serializes back to
    itself, byte for byte; the second backend to run answers with the first's shapes."""
    ids = prompt(18, 160)
    replies: dict[str, tuple[Any, Any]] = {}  # call → (reply, its record)

    def meta_of(out: dict[str, Any]) -> dict[str, Any]:
        return out["meta_info"]

    worker.forget_device()
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(80, AnchorKind.CONVERSATION, Region.THICK),),
                      chunk_at=(80,))
    saved = generate(worker, ids[:120], plan)
    replies["generate_meta"] = (meta_of(saved), wire.GenerateMeta)
    slot = saved["meta_info"]["anchors"]["written"][0]["slot"]
    replies["confirm"] = (post(worker, "/anchor/confirm", {"slots": [slot]}), wire.ConfirmReply)
    worker.forget_device()
    key = anchor_keys(NS, worker.model_id, ids, [80])[80]
    warm = generate(worker, ids, AnchorPlan(NS, restore=(AnchorRef(key, 80),)))
    assert warm["meta_info"]["cached_tokens"] == 80
    replies["generate_meta_restored"] = (meta_of(warm), wire.GenerateMeta)
    events = []
    with httpx.stream("POST", worker.url + "/generate", timeout=120, json={
            **GenerateRequest(input_ids=tuple(ids[:40]), sampling=GREEDY).to_json(),
            "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    replies["generate_meta_streamed"] = (events[-1]["meta_info"], wire.GenerateMeta)
    replies["lookup"] = (post(worker, "/anchor/lookup", {
        "namespace": NS.hex(), "input_ids": ids, "depths": [80, 100]}), wire.LookupReply)
    replies["slots"] = (httpx.get(worker.url + "/anchor/slots").json(), wire.SlotsReply)
    replies["stats"] = (httpx.get(worker.url + "/anchor/stats").json(), wire.StatsReply)
    for path, record in [("pin", wire.PinReply), ("unpin", wire.UnpinReply),
                         ("evict", wire.EvictReply)]:
        replies[path] = (post(worker, f"/anchor/{path}", {"key": key.hex()}), record)
    replies["anchor_abort"] = (post(worker, "/anchor/abort", {"slots": [slot]}),
                               wire.SlotsAborted)
    replies["abort_request"] = (post(worker, "/abort_request", {"rid": "nobody"}), wire.AbortReply)
    replies["stop_request"] = (post(worker, "/stop_request", {"rid": "nobody", "output_tokens": 1}),
                               wire.StopReply)
    assert replies["stop_request"][0]["stopped"] is False
    replies["health"] = (httpx.get(worker.url + "/health").json(), wire.WorkerHealth)
    replies["model_info"] = (httpx.get(worker.url + "/model_info").json(), wire.ModelInfo)
    replies["anchor_flush"] = (post(worker, "/anchor/flush", {}), wire.FlushReply)
    replies["flush_cache"] = (post(worker, "/flush_cache", {}), wire.FlushReply)

    for call, (reply, record) in replies.items():
        assert wire.from_json(record, reply).to_json() == reply, call
    shapes = {call: shape(reply) for call, (reply, _) in replies.items()}
    for other, theirs in SHAPES.items():
        for call, mine in shapes.items():
            assert same_shape(mine, theirs[call]), (call, worker.backend, other, mine, theirs[call])
    SHAPES[worker.backend] = shapes


def test_a_confirm_makes_visible_only_what_its_request_staged_in_this_epoch(worker):
    """The proxy confirms with the request's rid and the epoch it saw: another request's
    rid confirms nothing of this one's, and slot numbers of another epoch (a worker that
    restarted) are a 409, never some other anchor's slots."""
    ids = prompt(8)
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(100, AnchorKind.CONVERSATION),), chunk_at=(100,))
    req = GenerateRequest(input_ids=tuple(ids), sampling=GREEDY, anchor=plan, rid="confirm-own")
    resp = httpx.post(worker.url + "/generate", json=req.to_json(), timeout=120)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    slots = [w["slot"] for w in meta["anchors"]["written"]]
    assert len(slots) == 1
    other = post(worker, "/anchor/confirm", {"slots": slots, "rid": "someone-else"})
    assert other["confirmed"] == []
    stale = httpx.post(worker.url + "/anchor/confirm", timeout=60,
                       json={"slots": slots, "rid": "confirm-own", "epoch": "0123456789abcdef"})
    assert stale.status_code == 409 and "restarted" in stale.json()["error"]["message"]
    own = post(worker, "/anchor/confirm", {"slots": slots, "rid": "confirm-own",
                                           "epoch": meta["epoch"]})
    assert own["confirmed"] == slots
    worker.forget_device()
