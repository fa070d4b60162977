"""The SGLang worker against a real SGLang 0.5.23 server on CPU (tiny dense Qwen3 with
the real Qwen3 tokenizer; prompts are real BFCL agent conversations rendered with its
chat template). One server is shared by the session (tests/conftest.py).

Every check drops SGLang's own device cache first (`/flush_cache`), so a hit can only
come from an anchor restored out of the host tier."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading

import httpx
import pytest

from anchorcache.testing.data import two_turn_prompts
from anchorcache.testing.worker_api import (
    NS,
    flush_device,
    generate,
    post,
    save,
    snapshot_plan,
    verify,
)
from anchorcache.wire import (
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    GenerateRequest,
    Region,
    SamplingParams,
    SnapshotSpec,
)

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def conversations(qwen3_tokenizer):
    """Per conversation: (tool anchor depth, conversation anchor depth, turn-1 prompt ids,
    turn-2 prompt ids); see `anchorcache.testing.data.two_turn_prompts`."""
    return two_turn_prompts(qwen3_tokenizer, 8)


def test_snapshot_flush_restore_equals_cold(sglang, conversations):
    url = sglang.url
    _, depth, p1, p2 = conversations[0]
    keys, _ = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    cold = generate(url, p2)
    assert cold["meta_info"]["cached_tokens"] == 0
    flush_device(url)
    warm = generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),)))
    meta = warm["meta_info"]
    assert meta["cached_tokens"] == depth
    assert meta["anchors"]["restored_tokens"] == depth  # scattered from the host slabs
    assert warm["output_ids"] == cold["output_ids"]


def test_chain_restore_of_tool_and_conversation_anchors(sglang, conversations):
    url = sglang.url
    tool_depth, conv_depth, p1, p2 = conversations[1]
    keys, out = save(url, p1, [(tool_depth, AnchorKind.INSTRUCTION, Region.THIN),
                               (conv_depth, AnchorKind.CONVERSATION, Region.THICK)])
    written = {w["depth"]: w for w in out["meta_info"]["anchors"]["written"]}
    assert written[conv_depth]["parent"] == keys[tool_depth].hex()  # rows past the tool anchor
    flush_device(url)
    cold = generate(url, p2)
    flush_device(url)
    chain = (AnchorRef(keys[tool_depth], tool_depth), AnchorRef(keys[conv_depth], conv_depth))
    warm = generate(url, p2, AnchorPlan(NS, restore=chain))
    assert [r["depth"] for r in warm["meta_info"]["anchors"]["restored"]] == [tool_depth, conv_depth]
    assert warm["meta_info"]["cached_tokens"] == conv_depth
    assert warm["output_ids"] == cold["output_ids"]
    # the chain's first link alone: only the tool block comes back, the rest is prefilled
    flush_device(url)
    partial = generate(url, p2, AnchorPlan(NS, restore=chain[:1]))
    assert partial["meta_info"]["cached_tokens"] == tool_depth
    assert partial["output_ids"] == cold["output_ids"]


def test_a_restored_prefix_on_the_device_is_not_rewritten(sglang, conversations):
    url = sglang.url
    _, depth, p1, p2 = conversations[2]
    keys, _ = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    # no flush: SGLang still holds the prefix, so nothing is scattered
    warm = generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),)))
    assert warm["meta_info"]["anchors"]["restored_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] >= depth
    flush_device(url)
    assert warm["output_ids"] == generate(url, p2)["output_ids"]


def until(check) -> None:
    """Poll `check` (every 50 ms, up to 30 s) until it holds."""
    for _ in range(600):
        if check():
            return
        threading.Event().wait(0.05)
    raise AssertionError("the state waited for never came")


def _num_running(url) -> int:
    """Requests in SGLang's running batch right now (its own `/v1/loads`, asked of the
    scheduler)."""
    loads = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=60).json()
    return int(loads["loads"][0]["num_running_reqs"])


def test_eight_concurrent_restores_are_exact_and_batched(sglang, conversations):
    """Eight turn-2 requests restore their chains concurrently and SGLang batches them.

    Their outputs are not compared with unbatched runs: SGLang's batched forward on CPU is
    not bit-identical to an unbatched one (a decode step of several requests runs its
    linear layers as one matrix product, whose rounding differs from a single row's; a
    greedy tiny model turns that into another token on some CPUs). What a restore must
    get right is checked exactly instead:
    - every restored row on the device equals the snapshot's row, byte for byte;
    - those same device rows, reused by each conversation's turn-1 prompt run alone (it
      shares exactly the restored prefix with turn 2), give the turn-1 cold output;
    - SGLang ran several of the concurrent requests in one batch."""
    url = sglang.url
    convs = conversations[:8]
    cold = []  # turn 1 of each, alone, from scratch
    for _, _, p1, _ in convs:
        flush_device(url)
        cold.append(generate(url, p1, max_new=24)["output_ids"])
    flush_device(url)
    post(url, "/anchor/flush")
    # turn 1 of each (tool + conversation anchors); conversations sharing a tool block
    # hold one tool anchor, the later ones report it held and chain on from it
    chains = []
    for tool_depth, conv_depth, p1, _ in convs:
        keys, _ = save(url, p1, [(tool_depth, AnchorKind.INSTRUCTION, Region.THIN),
                                 (conv_depth, AnchorKind.CONVERSATION, Region.THICK)])
        chains.append((AnchorRef(keys[tool_depth], tool_depth),
                       AnchorRef(keys[conv_depth], conv_depth)))

    def turn2(i):
        *_, p2 = convs[i]
        plan = AnchorPlan(NS, restore=chains[i],
                          snapshot=(SnapshotSpec(len(p2), AnchorKind.CONVERSATION),))
        return generate(url, p2, plan, max_new=48)  # long decodes, so that requests overlap

    # Whether two requests overlap depends on the machine's load: up to three rounds, each
    # checked in full, until one shows SGLang running several of them in one batch.
    for _ in range(3):
        flush_device(url)  # every turn 2 must restore from the host tier
        running: list[int] = []
        stop = threading.Event()

        def watch(running=running, stop=stop):
            while not stop.is_set():
                running.append(_num_running(url))

        with cf.ThreadPoolExecutor(9) as pool:
            watcher = pool.submit(watch)
            try:
                warm = list(pool.map(turn2, range(len(convs))))
            finally:
                stop.set()
            watcher.result()
        for i, out in enumerate(warm):
            assert out["meta_info"]["cached_tokens"] == convs[i][1], i
            assert out["meta_info"]["anchors"]["restored_tokens"] > 0, i
            assert len(out["meta_info"]["anchors"]["written"]) == 1
        # drop this round's staged snapshots, so that the next round writes them again
        post(url, "/anchor/abort", {"slots": [w["slot"] for out in warm
                                              for w in out["meta_info"]["anchors"]["written"]]})
        if max(running) > 1:
            break
    assert max(running) > 1, running  # SGLang ran several of them in one batch
    for i, (_, conv) in enumerate(chains):
        check = verify(url, conv.key)
        assert check["device_tokens"] == conv.depth, i
        assert check["mismatch"] is None, (i, check)
    for i, (_, conv_depth, p1, _) in enumerate(convs):
        alone = generate(url, p1, max_new=24)  # no plan: the tree's restored rows serve it
        assert alone["meta_info"]["cached_tokens"] == conv_depth, i
        assert alone["output_ids"] == cold[i], i


def test_a_wrong_restored_row_fails_the_checks(sglang, conversations):
    """The checks above catch a restore that scatters one wrong row (an injected fault
    that writes a middle row of the chain with its neighbour's bytes)."""
    url = sglang.url
    post(url, "/anchor/flush")  # one slab covering [0, depth): the shifted row is depth // 2
    _, conv_depth, p1, _ = conversations[3]
    keys, _ = save(url, p1, [(conv_depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    post(url, "/debug/fault", {"where": "restore_shift_row"})
    plan = AnchorPlan(NS, restore=(AnchorRef(keys[conv_depth], conv_depth),))
    generate(url, p1, plan, max_new=1)
    check = verify(url, keys[conv_depth])
    assert check["device_tokens"] == conv_depth
    assert check["mismatch"] == conv_depth // 2
    flush_device(url)  # the wrong rows must not serve later tests


def test_pinned_anchor_survives_eviction_pressure(sglang, conversations):
    """A pinned anchor stays in the host tier (the slot table never evicts it) and its
    prefix stays locked in SGLang's tree (within the pin budget): after other conversations
    overflowed both the slot table and the KV pool, it is still a device hit, while an
    unpinned anchor is gone from both."""
    url = sglang.url
    post(url, "/anchor/flush")
    _, depth, p1, p2 = conversations[3]
    keys, _ = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    _, v_depth, v1, v2 = conversations[4]
    victim_keys, _ = save(url, v1, [(v_depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    pin = post(url, "/anchor/pin", {"key": keys[depth].hex()})
    assert pin["pinned"] and pin["device"] == "locked"
    stats = httpx.get(url + "/anchor/stats").json()
    assert stats["device_pinned_tokens"] == depth <= stats["device_pin_budget_tokens"]
    slots = stats["num_slots"]
    # many other conversations' anchors (more than the table holds), then prompts that
    # fill the 10,000-token pool twice over
    for seed in range(slots + 2):
        ids = [1000 + (seed * 7919 + i * 31) % 90000 for i in range(120)]
        save(url, ids, [(100, AnchorKind.CONVERSATION, Region.THICK)], max_new=1)
    for seed in range(8):
        generate(url, [2000 + (seed * 104729 + i * 37) % 90000 for i in range(2500)], max_new=1)
    warm = generate(url, p2, AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),)))
    assert warm["meta_info"]["cached_tokens"] >= depth
    assert warm["meta_info"]["anchors"]["restored_tokens"] == 0  # it never left the device
    flush_device(url)
    cold = generate(url, p2)
    assert warm["output_ids"] == cold["output_ids"]
    gone = generate(url, v2,
                    AnchorPlan(NS, restore=(AnchorRef(victim_keys[v_depth], v_depth),)))
    assert gone["meta_info"]["anchors"]["restore_miss"][0]["reason"] == "not_resident"
    assert gone["meta_info"]["cached_tokens"] < v_depth
    # a device flush drops the lock; the next anchor operation puts the pin back
    assert httpx.get(url + "/anchor/stats").json()["device_pinned_tokens"] == depth
    assert post(url, "/anchor/unpin", {"key": keys[depth].hex()})["unpinned"]
    assert httpx.get(url + "/anchor/stats").json()["device_pinned_tokens"] == 0


def test_pins_stay_within_their_budget(sglang, conversations):
    url = sglang.url
    post(url, "/anchor/flush")
    budget = httpx.get(url + "/anchor/stats").json()["device_pin_budget_tokens"]
    info = httpx.get(url + "/model_info").json()
    assert info["max_context_tokens"] <= 10000 - budget  # a request always fits beside them
    pinned, refused = 0, []
    for seed in range(12):
        ids = [3000 + (seed * 7907 + i * 29) % 90000 for i in range(400)]
        keys, _ = save(url, ids, [(350, AnchorKind.CONVERSATION, Region.THICK)], max_new=1)
        reply = post(url, "/anchor/pin", {"key": keys[350].hex()})
        assert reply["pinned"]  # the host tier pins it either way
        if reply["device"] == "locked":
            pinned += 350
        else:
            refused.append(reply["device"])
    stats = httpx.get(url + "/anchor/stats").json()
    assert stats["device_pinned_tokens"] == pinned <= budget
    assert refused and set(refused) == {"over_budget"}
    post(url, "/anchor/flush")
    assert httpx.get(url + "/anchor/stats").json()["device_pinned_tokens"] == 0


def test_prompt_over_the_pool_is_a_400_and_model_info_fits_the_pool(sglang, conversations):
    """The session's pool is 10,000 tokens (tests/servers.py): SGLang refuses prompts of
    `max_req_input_len` (pool - 6) tokens, so the contract refuses them with a 400 up front
    and `/model_info` never promises more than the pool holds for one request."""
    url = sglang.url
    info = httpx.get(url + "/model_info", timeout=30).json()
    limit = info["max_context_tokens"]
    assert limit <= 10000 - 6
    p1 = conversations[0][2]
    long_ids = (p1 * (limit // len(p1) + 2))[:limit]
    req = GenerateRequest(input_ids=tuple(long_ids), sampling=GREEDY)
    for stream in (False, True):
        body = {**req.to_json(), "stream": stream}
        resp = httpx.post(url + "/generate", json=body, timeout=300)
        assert resp.status_code == 400, resp.text
        assert "context" in resp.json()["error"]["message"]
    fits = long_ids[:limit - GREEDY.max_new_tokens]
    assert generate(url, fits)["meta_info"]["prompt_tokens"] == len(fits)


def test_an_aborted_request_is_an_error_never_a_completion(sglang, conversations):
    """A request SGLang aborts mid-run (here through `/abort_request`) answers a 5xx, or
    ends its stream with an error event, never with output and a `finish_reason`."""
    url = sglang.url
    ids = conversations[1][2]
    sampling = SamplingParams(max_new_tokens=3000, temperature=0.0, ignore_eos=True)

    def abort_when_running(rid):
        for _ in range(600):
            if rid in httpx.get(url + "/health", timeout=30).json()["running_requests"]:
                post(url, "/abort_request", {"rid": rid})
                return
            threading.Event().wait(0.05)
        raise AssertionError("the request never ran")

    with cf.ThreadPoolExecutor(1) as pool:
        req = GenerateRequest(input_ids=tuple(ids), sampling=sampling, rid="abort-plain")
        fut = pool.submit(abort_when_running, "abort-plain")
        resp = httpx.post(url + "/generate", json=req.to_json(), timeout=300)
        fut.result()
        assert resp.status_code >= 500 and "abort" in resp.json()["error"]["message"], resp.text

        req = GenerateRequest(input_ids=tuple(ids), sampling=sampling, rid="abort-stream",
                              stream=True)
        fut = pool.submit(abort_when_running, "abort-stream")
        events = []
        with httpx.stream("POST", url + "/generate", json=req.to_json(), timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        fut.result()
    assert "error" in events[-1], events[-1]
    assert not any("meta_info" in e for e in events)


def test_a_sample_id_taken_by_a_running_request_is_a_400(sglang, conversations):
    """`n > 1` runs its samples as SGLang requests `rid-i`: an id another running request
    holds is refused up front, never handed to SGLang twice."""
    url = sglang.url
    ids = conversations[2][2]
    sampling = SamplingParams(max_new_tokens=3000, temperature=0.0, ignore_eos=True)
    long = GenerateRequest(input_ids=tuple(ids), sampling=sampling, rid="dup-1")
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, url + "/generate", json=long.to_json(), timeout=300)
        until(lambda: "dup-1" in httpx.get(url + "/health", timeout=30).json()[
            "running_requests"])
        twin = GenerateRequest(input_ids=tuple(ids[:50]), rid="dup",
                               sampling=SamplingParams(max_new_tokens=2, n=2))
        resp = httpx.post(url + "/generate", json=twin.to_json(), timeout=60)
        post(url, "/abort_request", {"rid": "dup-1"})
        fut.result()
    assert resp.status_code == 400 and "already running" in resp.json()["error"]["message"]


def test_a_queued_restore_never_stalls_admission(sglang):
    """SGLang admits first come, first served, and stops at the first waiting request that
    does not fit. Here R runs (45% of the pool), H waits behind it (65%: fits only once R is
    done), and Q, queued behind H, restores an anchor of 40% of the pool. A restore that
    locked its prefix while queued would leave H 60% of the pool for good (the scheduler
    spinning, nobody served); restored at admission, everything completes and Q's output is
    its cold output."""
    from anchorcache.testing.servers import SGLANG_TEST_ARGS

    url = sglang.url
    pool = int(SGLANG_TEST_ARGS[SGLANG_TEST_ARGS.index("--max-total-tokens") + 1])
    rng = __import__("random").Random(31)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(n)]

    anchor, r_ids, h_ids = ids(int(0.40 * pool)), ids(int(0.45 * pool)), ids(int(0.65 * pool))
    q_ids = anchor + ids(10)
    flush_device(url)
    cold = generate(url, q_ids)["output_ids"]
    depth = len(anchor)
    keys, _ = save(url, anchor + ids(1), [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)

    with cf.ThreadPoolExecutor(3) as pool_:
        r = pool_.submit(generate, url, r_ids, None, 300)
        until(lambda: _num_running(url) == 1)
        h = pool_.submit(generate, url, h_ids, None, 4)
        until(lambda: _waiting(url) == 1)
        assert not r.done(), "R ended before H queued: the scenario needs it running"
        q = pool_.submit(generate, url, q_ids, AnchorPlan(NS, restore=(
            AnchorRef(keys[depth], depth),)))
        done, _ = cf.wait([r, h, q], timeout=120)
        assert len(done) == 3, "admission stalled"
        warm = q.result()
    assert warm["output_ids"] == cold


def _waiting(url) -> int:
    loads = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=60).json()
    return int(loads["loads"][0]["num_waiting_reqs"])


def test_a_restore_is_copied_off_the_loop_and_its_request_waits_for_it(sglang, conversations):
    """A restore's rows are written by the copy thread while its request waits in the queue.
    With the copy held back a second (fault `restore_slow`) the scheduler keeps going round
    (a long request decodes meanwhile, and the restoring one is passed over round after
    round), and admits the request only once its rows have landed: its output is its cold
    output, with the whole anchor cached and the device rows equal to the slab. A request
    aborted while its copy is in flight leaves nothing held: the prefix lands in the tree
    all the same, where the next request finds it."""
    url = sglang.url
    _, depth, p1, p2 = conversations[6]
    keys, _ = save(url, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    flush_device(url)
    cold = generate(url, p2)
    flush_device(url)
    plan = AnchorPlan(NS, restore=(AnchorRef(keys[depth], depth),))
    other = tuple(1000 + (i * 7919) % 90000 for i in range(300))  # shares no prefix
    long = GenerateRequest(input_ids=other, sampling=SamplingParams(
        max_new_tokens=400, temperature=0.0, ignore_eos=True))
    before = _rpc_calls(url)
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, url + "/generate", json=long.to_json(), timeout=300)
        until(lambda: _num_running(url) == 1)
        post(url, "/debug/fault", {"where": "restore_slow"})
        warm = generate(url, p2, plan)
        assert not running.done(), "the long request ended first: the check needs it running"
        assert running.result().status_code == 200
    waits = _rpc_calls(url).get("restore_wait", 0) - before.get("restore_wait", 0)
    assert waits >= 2, waits  # rounds the scheduler ran while the copy was held
    meta = warm["meta_info"]
    assert meta["cached_tokens"] == depth and meta["anchors"]["restored_tokens"] == depth
    assert warm["output_ids"] == cold["output_ids"]
    assert verify(url, keys[depth])["mismatch"] is None

    # aborted while its copy is in flight
    flush_device(url)
    post(url, "/debug/fault", {"where": "restore_slow"})
    req = GenerateRequest(input_ids=tuple(p2), rid="slow-abort", anchor=plan,
                          sampling=SamplingParams(max_new_tokens=6, temperature=0.0))
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, url + "/generate", json=req.to_json(), timeout=300)
        until(lambda: _waiting(url) == 1)
        post(url, "/abort_request", {"rid": "slow-abort"})
        assert fut.result().status_code >= 400
    threading.Event().wait(1.5)  # the scheduler idles (and checks its pools) meanwhile
    again = generate(url, p2, plan)
    assert again["meta_info"]["cached_tokens"] == depth
    assert again["meta_info"]["anchors"]["restored_tokens"] == 0  # landed by the aborted one
    assert again["output_ids"] == cold["output_ids"]
    assert verify(url, keys[depth])["mismatch"] is None


def _rpc_calls(url) -> dict[str, int]:
    """Scheduler calls so far by op (`scheduler_calls`), with the scheduler's own work
    (restores at admission and their copies, checkpoint copies, reports pushed at release)."""
    stats = httpx.get(url + "/anchor/stats", timeout=60).json()
    return {c["op"]: c["calls"] for c in stats["scheduler_calls"]}


def test_an_anchored_request_costs_one_scheduler_call(sglang, conversations):
    """The plan rides with the request and the report is pushed at release, so a request
    that snapshots, or restores, costs one scheduler call: the confirm. A request that
    fails ends with the `finish` call, which drops what it staged."""
    url = sglang.url
    tool_depth, conv_depth, p1, p2 = conversations[3]
    flush_device(url)
    before = _rpc_calls(url)
    keys, _ = save(url, p1, [(tool_depth, AnchorKind.INSTRUCTION, Region.THIN),
                               (conv_depth, AnchorKind.CONVERSATION, Region.THICK)])
    assert sorted(keys) == [tool_depth, conv_depth]
    flush_device(url)
    chain = (AnchorRef(keys[tool_depth], tool_depth), AnchorRef(keys[conv_depth], conv_depth))
    warm = generate(url, p2, AnchorPlan(NS, restore=chain))
    assert warm["meta_info"]["anchors"]["restored_tokens"] == conv_depth
    # n = 2: the prompt's own request carries the plan; its report is pushed after the prefill
    two = GenerateRequest(input_ids=tuple(p2), sampling=SamplingParams(max_new_tokens=3, n=2),
                          anchor=AnchorPlan(NS, restore=chain))
    resp = httpx.post(url + "/generate", json=two.to_json(), timeout=300)
    assert resp.status_code == 200, resp.text
    assert all(out["meta_info"]["cached_tokens"] >= conv_depth for out in resp.json())
    after = _rpc_calls(url)
    delta = {op: after.get(op, 0) - before.get(op, 0) for op in after}
    assert delta.get("release") == 3  # every report pushed, none asked for
    assert delta.get("copy") == 2  # both slabs filled on the copy thread, joined at release
    # the restore's rows were written on the copy thread too, then inserted (the n = 2
    # request found them on the device: nothing to copy)
    assert delta.get("restore_copy") == 1 and delta.get("land") == 1
    own = ("release", "restore", "restore_wait", "land", "snapshot", "copy", "copy_wait",
           "restore_copy")
    calls = {op: n for op, n in delta.items() if op not in (*own, "stats") and n}
    assert calls == {"confirm": 1}, calls  # save's confirm; the restore confirmed nothing

    # a failed request: its `finish` call drops the anchor it staged at prefill
    staged = httpx.get(url + "/anchor/stats", timeout=60).json()["staged"]
    req = GenerateRequest(input_ids=tuple(p2), rid="abort-anchored",
                          anchor=snapshot_plan((conv_depth, AnchorKind.CONVERSATION,
                                                Region.THICK)),
                          sampling=SamplingParams(max_new_tokens=3000, ignore_eos=True))
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, url + "/generate", json=req.to_json(), timeout=300)
        until(lambda: "abort-anchored" in httpx.get(url + "/health", timeout=30).json()[
            "running_requests"])
        post(url, "/abort_request", {"rid": "abort-anchored"})
        assert fut.result().status_code >= 500
    final = _rpc_calls(url)
    assert final.get("finish", 0) - after.get("finish", 0) == 1
    assert httpx.get(url + "/anchor/stats", timeout=60).json()["staged"] == staged
