"""Tensor-parallel rank consistency (ext/sglang/tp.py).

Every TP rank of an SGLang worker keeps its own anchor store over its own shard of the KV
heads, and runs every call in the same order. Two stores (two ranks) are fed the same call
sequence under clocks that disagree by far more than the staged TTL: every decision
(reserve, write, restore check, confirm, abort, evict, pin, TTL expiry) must come out the
same, because the stores read the call's time (stamped by the caller), never their own.
The control case, each store on its own (late-reading) clock, shows the divergence that would otherwise
restore KV on one rank and not the other."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from anchorcache.ext.slots import SlotTable
from anchorcache.ext.store import STAGED_TTL_S, AnchorStore, Slab
from anchorcache.wire import AnchorKind, AnchorPlan, AnchorRef, anchor_keys

NS = bytes(range(16))
MODEL = "tiny"
LAYERS, HEADS_PER_RANK, HEAD_DIM = 2, 1, 4  # 2 KV heads split over 2 ranks
BYTES_PER_TOKEN = LAYERS * 2 * HEADS_PER_RANK * HEAD_DIM * 4


class Rank:
    """One rank's store. Its process clock runs `skew` ahead of the caller's and reads up
    to `lag` seconds later at each call (a rank reaches a call when its forward ends)."""

    def __init__(self, rank: int, skew: float, *, call_clock: bool, lag: float = 0.0) -> None:
        self.rank, self.skew, self.lag = rank, skew, lag
        self._rng = random.Random(rank)
        self.now = 0.0  # the current call's time, as the caller stamped it
        self.process_now = 0.0  # this rank's own clock during the current call
        table = SlotTable(6, 40 * BYTES_PER_TOKEN, pinned_slots=2)
        self.store = AnchorStore(MODEL, table, kv_bytes_per_token=BYTES_PER_TOKEN)
        # the SGLang cache points the clock at the call's time (RpcOps.call_time, ext/sglang/rpc_ops.py);
        # the control keeps the process clock, here the caller's time plus this rank's skew
        self.store.clock = (lambda: self.now) if call_clock else (lambda: self.process_now)

    def capture(self, ids: tuple[int, ...]) -> Callable[[int, int], tuple[torch.Tensor, None]]:
        def capture(start: int, depth: int) -> tuple[torch.Tensor, None]:
            # this rank's shard: its own head's rows (values differ per rank, shapes do not)
            rows = torch.tensor(ids[start:depth], dtype=torch.float32)
            kv = rows.view(1, 1, -1, 1, 1) + 1000.0 * self.rank
            return kv.expand(LAYERS, 2, depth - start, HEADS_PER_RANK, HEAD_DIM).contiguous(), None
        return capture

    def apply(self, call: dict[str, Any]) -> Any:
        """One call, as `AnchorRadixCache.__call__` would run it, or one request (which
        runs between calls, on the last call's time); what the store decided."""
        op, s = call["op"], self.store
        if op != "request":
            self.now = call["now"]
        self.process_now = call["now"] + self.skew + self._rng.uniform(0.0, self.lag)
        if op != "request":
            s.start_ttl()  # of the requests released since the last call
        if op == "request":  # admission (restore check) + snapshots + release
            ids, plan = call["ids"], call["plan"]
            check = s.check_chain(ids, plan)
            if check.chain:
                s.chained(call["rid"], check.chain[-1].key, check.depth)
            keys = anchor_keys(NS, MODEL, ids, call["depths"])
            written = []
            for d in call["depths"]:
                if d <= s.tip_depth(call["rid"]):
                    continue
                w = s.write(call["rid"], keys[d], d, AnchorKind.CONVERSATION, "thick",
                            self.capture(ids), ids=ids)
                written.append(None if w is None else (type(w).__name__, w.slot, w.key, w.depth))
            if call["ok"]:  # on_release: the TTL starts at the next call
                s.release_request(call["rid"], ok=True, start_ttl=False)
            else:  # the failed request's `finish` call
                s.release_request(call["rid"], ok=False)
            return ([(c.key, c.depth) for c in check.chain], check.misses, check.late_lookup,
                    written)
        if op == "confirm":
            return s.confirm(call["slots"])
        if op == "abort":
            return s.abort(call["slots"])
        if op == "evict":
            return s.evict(call["key"])
        if op == "pin":
            return s.table.pin(call["key"])
        if op == "lookup":
            return s.lookup(NS, list(call["ids"]), call["depths"], "epoch").to_json()
        raise AssertionError(op)

    def state(self) -> Any:
        """What the rank holds: the slot table and which slabs are live or staged."""
        entries = [(e.slot, e.key, e.depth, e.parent, e.nbytes, e.pinned, e.hits, e.state)
                   for e in self.store.table.entries()]
        return entries, self.store.staged_count()


def call_sequence(seed: int, n: int = 120) -> list[dict[str, Any]]:
    """Requests over a few conversations that grow turn by turn, the proxy's confirms (some
    late, past the TTL), aborts, evictions, pins and lookups; time moves on by 0-40 s a call."""
    rng = random.Random(seed)
    convs = [tuple(rng.randrange(1, 500) for _ in range(rng.randrange(8, 14)))
             for _ in range(4)]
    calls: list[dict[str, Any]] = []
    now = 0.0
    for i in range(n):
        now += rng.choice((0.0, 1.0, 5.0, 25.0, 40.0))
        r = rng.random()
        c = rng.randrange(len(convs))
        if r < 0.45:
            convs[c] = convs[c] + tuple(rng.randrange(1, 500) for _ in range(rng.randrange(2, 6)))
            ids = convs[c]
            depths = sorted({rng.randrange(2, len(ids)) for _ in range(2)})
            prior = [d for d in range(2, len(ids)) if rng.random() < 0.15][:2]
            keys = anchor_keys(NS, MODEL, ids, prior) if prior else {}
            plan = AnchorPlan(NS, restore=tuple(AnchorRef(keys[d], d) for d in prior))
            calls.append({"op": "request", "rid": f"r{i}", "ids": ids, "plan": plan,
                          "depths": depths, "ok": rng.random() < 0.9, "now": now})
        elif r < 0.7:
            calls.append({"op": "confirm", "slots": rng.sample(range(6), rng.randrange(1, 4)),
                          "now": now})
        elif r < 0.78:
            calls.append({"op": "abort", "slots": [rng.randrange(6)], "now": now})
        elif r < 0.86:
            ids = convs[c]
            d = rng.randrange(2, len(ids))
            calls.append({"op": "evict", "key": anchor_keys(NS, MODEL, ids, [d])[d], "now": now})
        elif r < 0.9:
            ids = convs[c]
            d = rng.randrange(2, len(ids))
            calls.append({"op": "pin", "key": anchor_keys(NS, MODEL, ids, [d])[d], "now": now})
        else:
            ids = convs[c]
            calls.append({"op": "lookup", "ids": ids, "depths": list(range(2, len(ids))),
                          "now": now})
    return calls


def run(call_clock: bool, seed: int) -> tuple[list[Any], list[Any], Rank, Rank]:
    # the ranks' clocks: rank 1's far ahead, and each reads a call up to 30 s late
    ranks = (Rank(0, 0.0, call_clock=call_clock, lag=30.0),
             Rank(1, 10 * STAGED_TTL_S, call_clock=call_clock, lag=30.0))
    decided: tuple[list[Any], list[Any]] = ([], [])
    for call in call_sequence(seed):
        for rank, out in zip(ranks, decided, strict=True):
            out.append((rank.apply(call), rank.state()))
    return decided[0], decided[1], ranks[0], ranks[1]


@pytest.mark.parametrize("seed", range(6))
def test_ranks_decide_alike_under_different_clocks(seed):
    rank0, rank1, r0, r1 = run(call_clock=True, seed=seed)
    for i, (a, b) in enumerate(zip(rank0, rank1, strict=True)):
        assert a == b, f"call {i}: the ranks decided differently"
    confirmed = sum(len(out[0]) for out, _ in rank0 if isinstance(out, tuple) and len(out) == 2)
    assert confirmed > 0
    # each rank holds its own shard: same keys and slots, its own bytes
    live0 = {s.key: s for s in r0.store._live.values()}
    live1 = {s.key: s for s in r1.store._live.values()}
    assert live0.keys() == live1.keys()
    for key in live0:
        a, b = live0[key], live1[key]
        assert (a.depth, a.start, a.parent, a.nbytes) == (b.depth, b.start, b.parent, b.nbytes)
        assert a.kv is not None and b.kv is not None and not torch.equal(a.kv, b.kv)


def test_the_sequences_restore_and_expire():
    """The generated sequences do reach restores and TTL expiries (else the test above
    would compare ranks that never had a decision to disagree on)."""
    restores = expiries = 0
    for seed in range(6):
        rank0, _, _, _ = run(call_clock=True, seed=seed)
        restores += sum(1 for out, _ in rank0
                        if isinstance(out, tuple) and len(out) == 4 and out[0])
    # expiry: a slab staged, then its confirm past the TTL confirms nothing
    r = Rank(0, 0.0, call_clock=True)
    ids = tuple(range(1, 12))
    r.apply({"op": "request", "rid": "a", "ids": ids, "plan": AnchorPlan(NS), "depths": [6],
             "ok": True, "now": 0.0})
    assert r.store.staged_count() == 1
    r.apply({"op": "lookup", "ids": ids, "depths": [6], "now": 1.0})  # starts the TTL
    confirmed, _ = r.apply({"op": "confirm", "slots": list(range(6)), "now": STAGED_TTL_S + 2})
    expiries += not confirmed
    assert restores > 0 and expiries == 1


def test_on_their_own_clocks_the_ranks_diverge():
    """The control: a store on its process clock expires a staged slab the other still
    confirms, after which one rank would restore that anchor and the other would not."""
    diverged = 0
    for seed in range(6):
        rank0, rank1, _, _ = run(call_clock=False, seed=seed)
        diverged += any(a != b for a, b in zip(rank0, rank1, strict=True))
    assert diverged > 0


def test_one_staged_slab_same_fate_on_both_ranks():
    ids = tuple(range(100, 112))
    ranks = [Rank(0, 0.0, call_clock=True), Rank(1, 1e6, call_clock=True)]
    for rank in ranks:
        rank.apply({"op": "request", "rid": "a", "ids": ids, "plan": AnchorPlan(NS),
                    "depths": [5, 9], "ok": True, "now": 10.0})
    # within the TTL by the call's time: both confirm, whatever their process clocks say
    outs = [rank.apply({"op": "confirm", "slots": [0, 1, 2, 3, 4, 5], "now": 10.0 + STAGED_TTL_S / 2})
            for rank in ranks]
    assert outs[0] == outs[1] and len(outs[0][0]) == 2
    keys = anchor_keys(NS, MODEL, ids, [5, 9])
    plan = AnchorPlan(NS, restore=(AnchorRef(keys[5], 5), AnchorRef(keys[9], 9)))
    checks = [rank.store.check_chain(ids, plan) for rank in ranks]
    assert [(s.key, s.depth) for s in checks[0].chain] \
        == [(s.key, s.depth) for s in checks[1].chain] == [(keys[5], 5), (keys[9], 9)]
    shard: list[Slab] = [c.chain[-1] for c in checks]
    assert shard[0].kv is not None and shard[1].kv is not None
    assert shard[0].kv.shape == shard[1].kv.shape and not torch.equal(shard[0].kv, shard[1].kv)


def test_a_request_released_between_calls_starts_its_ttl_at_the_next_call():
    """The scheduler releases a request between calls, where the store's clock is still the
    last call's time (perhaps minutes old, after a long generation with no call). Stamped
    then, a slab would be dropped before the proxy's confirm came; its TTL starts at the
    next call instead, on every rank alike."""
    ids = tuple(range(200, 212))
    ranks = [Rank(0, 0.0, call_clock=True), Rank(1, 1e6, call_clock=True)]
    outs = []
    for rank in ranks:
        rank.apply({"op": "lookup", "ids": ids, "depths": [6], "now": 0.0})
        rank.apply({"op": "request", "rid": "long", "ids": ids, "plan": AnchorPlan(NS),
                    "depths": [6], "ok": True, "now": 10 * STAGED_TTL_S})
        outs.append(rank.apply({"op": "confirm", "slots": list(range(6)),
                                "now": 10 * STAGED_TTL_S + 1.0}))
    assert outs[0] == outs[1] and len(outs[0][0]) == 1
