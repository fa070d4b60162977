"""The scheduler side's parts (ext/sglang/cache.py and what it composes) over SGLang's own
pools and tree, built on the CPU without a model or a server, as SGLang's radix cache unit
tests build theirs: snapshots copy a request's rows into host slabs, placement puts them
back into fresh pool slots and SGLang's tree, pins survive a device flush, faults show in
verify, and the RPC entry answers on its reply socket. The request is a stand-in carrying
the `Req` fields the cache reads; everything else is SGLang's."""

from __future__ import annotations

import threading
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import torch
import zmq
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.server_args import (
    ServerArgs,
    set_global_server_args_for_scheduler,
)

from anchorcache.ext.sglang.cache import AnchorRadixCache, AnchorSetup
from anchorcache.ext.sglang.config import SGLangAnchorConfig
from anchorcache.ext.sglang.plans import NO_REPORT
from anchorcache.ext.sglang.rpc import PLAN_PARAM
from anchorcache.wire import (
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    SnapshotSpec,
    anchor_keys,
)

MODEL = "tiny"
NAMESPACE = bytes(range(16))
POOL = 512
LAYERS, HEADS, DIM = 2, 2, 8
PROMPT = tuple(range(1, 41))  # 40 tokens, anchors at 16 and 32
DEPTHS = (16, 32)
KEYS = anchor_keys(NAMESPACE, MODEL, PROMPT, DEPTHS)


def _cache(page_size: int, config: SGLangAnchorConfig | None = None,
           server_args: Any = None) -> AnchorRadixCache:
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    req_to_token = ReqToTokenPool(size=4, max_context_len=256, device="cpu",
                                  enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=POOL, page_size=page_size, dtype=torch.bfloat16,
                               head_num=HEADS, head_dim=DIM, layer_num=LAYERS, device="cpu",
                               enable_memory_saver=False)
    allocator = (TokenToKVPoolAllocator(size=POOL, dtype=torch.bfloat16, device="cpu",
                                        kvcache=kv_pool, need_sort=False) if page_size == 1
                 else PagedTokenToKVPoolAllocator(POOL, page_size, torch.bfloat16, "cpu",
                                                  kv_pool, need_sort=False))
    params = CacheInitParams(req_to_token_pool=req_to_token,
                             token_to_kv_pool_allocator=allocator, page_size=page_size,
                             disable=False, tree_components=(ComponentType.FULL,))
    config = config or SGLangAnchorConfig(fault_injection=True)
    setup = AnchorSetup(config, MODEL, "e" * 16, server_args=server_args)
    return AnchorRadixCache(params, setup=setup)


@pytest.fixture
def cache() -> AnchorRadixCache:
    return _cache(page_size=1)


def _request(rid: str, ids: tuple[int, ...], plan: AnchorPlan, row: int) -> Any:
    """The fields of SGLang's `Req` the cache reads; the plan rides as the HTTP side sends it."""
    body = orjson.dumps({"token": f"run-{rid}", "anchor": plan.to_json()}).decode()
    return SimpleNamespace(
        rid=rid, origin_input_ids=list(ids), output_ids=[], finished_reason=None,
        extra_key=None, session=None, finished=lambda: False,
        sampling_params=SimpleNamespace(custom_params={PLAN_PARAM: body}),
        kv=SimpleNamespace(req_pool_idx=row, cache_protected_len=0))


def _rows(cache: AnchorRadixCache, slots: torch.Tensor) -> torch.Tensor:
    """The pool's KV at `slots`, as a slab holds it: `[layers, 2, tokens, heads, dim]`."""
    return torch.stack([torch.stack([k[slots], v[slots]])
                        for k, v in zip(cache.kv.k, cache.kv.v, strict=True)])


def _prefill(cache: AnchorRadixCache, row: int, n: int) -> torch.Tensor:
    """What a prefill leaves: `n` fresh slots named by request row `row`, with KV in them."""
    page = cache.page_size
    slots = cache.kv.allocator.alloc(-(-n // page) * page)[:n].to(torch.int64)
    cache.kv.req_to_token_pool.req_to_token[row, :n] = slots.to(torch.int32)
    gen = torch.Generator().manual_seed(row)
    for k, v in zip(cache.kv.k, cache.kv.v, strict=True):
        k[slots] = torch.randn(n, HEADS, DIM, generator=gen).to(k.dtype)
        v[slots] = torch.randn(n, HEADS, DIM, generator=gen).to(v.dtype)
    return slots


def _commit_anchors(cache: AnchorRadixCache, depths: tuple[int, int] = DEPTHS
                    ) -> torch.Tensor:
    """Snapshot the prompt at `depths` and confirm both anchors; the KV the prompt's first
    32 tokens had."""
    keys = anchor_keys(NAMESPACE, MODEL, PROMPT, depths)
    plan = AnchorPlan(NAMESPACE, snapshot=tuple(SnapshotSpec(d, AnchorKind.CONVERSATION)
                                                for d in depths))
    req = _request("a", PROMPT, plan, row=0)
    slots = _prefill(cache, 0, len(PROMPT))
    p = cache.plans.register(req)
    assert p is not None and [s.depth for s in p.todo] == list(depths)
    cache.snapshots.take(req, p, 20, finished=False)  # after a first chunk of 20
    cache.snapshots.take(req, p, 40, finished=False)
    report = cache.plans.end("a", ok=True, start_ttl=False)
    assert [(w.depth, w.key) for w in report.written] == [(d, keys[d]) for d in depths]
    assert report.written[1].parent == keys[depths[0]] and report.restored_tokens == 0
    confirmed, evicted = cache.anchors.confirm([w.slot for w in report.written], "a")
    assert len(confirmed) == 2 and evicted == []
    expected = _rows(cache, slots[:32]).clone()
    cache.kv.allocator.free(slots)  # the request is gone; its slots are overwritten
    for k, v in zip(cache.kv.k, cache.kv.v, strict=True):
        k.zero_()
        v.zero_()
    return expected


def _pull(address: str) -> zmq.Socket[Any]:
    """The HTTP process's end of the replies (the cache's PUSH sockets share its context)."""
    pull: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(address)
    return pull


def _device_rows(cache: AnchorRadixCache, ids: tuple[int, ...]) -> tuple[int, torch.Tensor]:
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
    n = int(match.device_prefix_len)
    return n, _rows(cache, cache.path_device_indices(match.last_device_node)[:n].to(torch.int64))


def test_snapshots_hold_the_request_rows(cache: AnchorRadixCache) -> None:
    expected = _commit_anchors(cache)
    found = cache.anchors.prefix_of(KEYS[32])
    assert found is not None
    chain, ids = found
    assert ids == PROMPT[:32] and [(s.start, s.depth) for s in chain] == [(0, 16), (16, 32)]
    host = torch.cat([s.kv for s in chain if s.kv is not None], dim=2)
    assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8))
    assert "copy" in {c.op for c in cache.times.rows()}


def test_a_restore_places_the_slabs_in_the_tree(cache: AnchorRadixCache) -> None:
    expected = _commit_anchors(cache)
    prompt = (*PROMPT, 7, 8)
    plan = AnchorPlan(NAMESPACE, restore=tuple(AnchorRef(KEYS[d], d) for d in DEPTHS))
    req = _request("b", prompt, plan, row=1)
    cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=req))
    free = cache.kv.allocator.available_size()
    assert cache.admit_restore(req, lambda: 31) == "no_room"
    assert cache.admit_restore(req, lambda: POOL) == "wait"  # the copy is in flight
    p = cache.plans.get("b")
    assert p is not None and p.landing is not None and p.landing.copy is not None
    assert cache.placer.placing_rows == 32 and cache.kv.allocator.available_size() == free - 32
    p.landing.copy.result()
    cache.land_ready()
    assert p.placed and p.landing is None and cache.placer.placing_rows == 0
    assert cache.admit_restore(req, lambda: POOL) == "go"
    n, rows = _device_rows(cache, prompt)
    assert n == 32 and torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))
    verify = cache.rpc.ops["verify"]({"key": KEYS[32].hex()})
    assert (verify["device_tokens"], verify["mismatch"]) == (32, None)
    report = cache.plans.end("b", ok=True, start_ttl=False)
    assert report.restored_tokens == 32 and report.written == ()
    assert [r["depth"] for r in report.anchors["restored"]] == list(DEPTHS)
    # the HTTP side's `finish` after the push: the report kept for its run, once
    assert cache.rpc.ops["finish"]({"rid": "b", "token": "run-b", "ok": True}) \
        == report.to_json()
    assert cache.rpc.ops["finish"]({"rid": "b", "token": "run-b", "ok": True}) \
        == NO_REPORT.to_json()


def test_pins_survive_a_device_flush(cache: AnchorRadixCache) -> None:
    expected = _commit_anchors(cache)
    reply = cache.rpc.ops["pin"]({"key": KEYS[32].hex()})
    assert (reply["pinned"], reply["device"]) == (True, "locked")
    assert cache.pins.pinned_tokens == 32
    cache.reset()  # SGLang's flush: the tree is gone, the pin forgotten
    assert cache.pins.pinned_tokens == 0 and _device_rows(cache, PROMPT)[0] == 0
    with _pull("inproc://anchor-replies") as pull:
        cache("stats", "{}", "inproc://anchor-replies", 1, now=5.0)  # the next call pins it
        stats = orjson.loads(pull.recv())
    assert stats["ok"] and stats["call_id"] == 1 and stats["epoch"] == "e" * 16
    assert cache.pins.pinned_tokens == 32 and cache.anchors.clock() == 5.0
    n, rows = _device_rows(cache, PROMPT)
    assert n == 32 and torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))
    cache.rpc.ops["unpin"]({"key": KEYS[32].hex()})
    assert cache.pins.pinned_tokens == 0


def test_a_fault_shows_in_verify(cache: AnchorRadixCache) -> None:
    _commit_anchors(cache)
    assert cache.rpc.ops["fault"]({"where": "restore_shift_row"}) == {
        "armed": "restore_shift_row"}
    assert cache.rpc.ops["pin"]({"key": KEYS[32].hex()})["device"] == "locked"
    verify = cache.rpc.ops["verify"]({"key": KEYS[32].hex()})
    # the last slab, [16, 32), has its middle row (token 24) scattered from token 23's
    assert (verify["device_tokens"], verify["mismatch"]) == (32, 24)


def test_rpc_replies_on_the_callers_socket(cache: AnchorRadixCache) -> None:
    with _pull("inproc://anchor-hello") as pull:
        cache("hello", "{}", "inproc://anchor-hello", 3)
        hello = orjson.loads(pull.recv())
        cache("fault", '{"where": "nowhere"}', "inproc://anchor-hello", 4)
        refused = orjson.loads(pull.recv())
        # an op's refusal that carries an HTTP status keeps it (no disk tier here: 409)
        cache("import_slab", '{"data": "AAAA"}', "inproc://anchor-hello", 5)
        no_tier = orjson.loads(pull.recv())
    assert hello == {"ok": True, "model_id": MODEL, "page_size": 1, "pool_tokens": POOL,
                     "pin_budget_tokens": int(0.1 * POOL), "epoch": "e" * 16, "call_id": 3}
    assert (refused["ok"], refused["status"], refused["call_id"]) == (False, 400, 4)
    assert (no_tier["ok"], no_tier["status"], no_tier["call_id"]) == (False, 409, 5)
    assert "disk tier" in no_tier["message"]
    assert set(cache.rpc.ops) == {
        "hello", "finish", "cut", "confirm", "abort", "abort_request", "lookup", "slots",
        "stats", "pin", "unpin", "evict", "flush_anchors", "verify", "fault", "import_slab",
        "export_slab"}


def test_a_paged_restore_places_whole_pages() -> None:
    cache = _cache(page_size=16)
    expected = _commit_anchors(cache, (16, 36))
    keys = anchor_keys(NAMESPACE, MODEL, PROMPT, (16, 36))
    plan = AnchorPlan(NAMESPACE, restore=(AnchorRef(keys[16], 16), AnchorRef(keys[36], 36)))
    req = _request("b", PROMPT, plan, row=1)
    cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", PROMPT)), req=req))
    assert cache.admit_restore(req, lambda: POOL) == "wait"
    p = cache.plans.get("b")
    assert p is not None and p.landing is not None and p.landing.copy is not None
    p.landing.copy.result()
    cache.land_ready()
    # the tree holds whole pages: 32 of the chain's 36 tokens; the request prefills the rest
    n, rows = _device_rows(cache, PROMPT)
    assert n == 32 and torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))
    report = cache.plans.end("b", ok=True, start_ttl=False)
    assert report.restored_tokens == 32
    assert cache.rpc.ops["pin"]({"key": keys[36].hex()})["device"] == "locked"
    assert cache.pins.pinned_tokens == 32


def test_the_disk_tier_serves_a_fresh_scheduler(tmp_path: Path) -> None:
    """Confirmed anchors also go to the disk tier; a new scheduler over the same directory
    (a restarted worker) restores them from there."""
    config = SGLangAnchorConfig(anchor_disk_dir=str(tmp_path), anchor_disk_bytes=1 << 24)
    model = SimpleNamespace(model_path=str(tmp_path / MODEL), tp_size=1, dp_size=1)
    first = _cache(1, config, model)
    assert first.anchors.disk is not None
    expected = _commit_anchors(first)
    first.anchors.disk.drain()
    second = _cache(1, config, model)
    disk = second.anchors.disk
    assert disk is not None
    readers: list[str] = []
    load = disk.load
    gate = threading.Event()  # holds the copy thread's reads until the test has looked

    def traced_load(key: bytes, depth: int) -> Any:
        readers.append(threading.current_thread().name)
        gate.wait(60)
        return load(key, depth)

    disk.load = traced_load  # type: ignore[method-assign]
    plan = AnchorPlan(NAMESPACE, restore=tuple(AnchorRef(KEYS[d], d) for d in DEPTHS))
    req = _request("b", PROMPT, plan, row=1)
    second.match_prefix(MatchPrefixParams(key=RadixKey(array("q", PROMPT)), req=req))
    # first the files are read, on the copy thread: the request waits, unchecked
    assert second.admit_restore(req, lambda: POOL) == "wait"
    p = second.plans.get("b")
    assert p is not None and p.check is None and p.reading is not None
    assert second.admit_restore(req, lambda: POOL) == "wait"  # still reading: still unchecked
    assert p.check is None and not p.reading.done()
    gate.set()
    p.reading.result()
    assert len(readers) == len(DEPTHS) and all(r.startswith("anchorcache-copy") for r in readers)
    # then the chain is checked (no file read on this loop) and its copy starts
    assert second.admit_restore(req, lambda: POOL) == "wait"
    assert len(readers) == len(DEPTHS)
    assert p.check is not None and [s.depth for s in p.check.chain] == list(DEPTHS)
    assert p.landing is not None and p.landing.copy is not None
    p.landing.copy.result()
    second.land_ready()
    n, rows = _device_rows(second, PROMPT)
    assert n == 32 and torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))
    # at TP 2 a rank keeps its own shard's folder; DP ranks share one (workers on shared
    # storage); each process keeps its share of the worker's budget
    for tp, dp, folder in ((2, 1, "tp0of2"), (1, 2, "tp0of1")):
        ranks = SimpleNamespace(model_path=str(tmp_path / MODEL), tp_size=tp, dp_size=dp)
        disk = _cache(1, config, ranks).anchors.disk
        assert disk is not None and disk.dir.name.endswith(folder)
        assert disk.budget_bytes == (1 << 24) // 2
