"""Planner and anchor index: pure bookkeeping, milliseconds, no model or server."""

from __future__ import annotations

import random

from anchorcache.proxy.anchor_index import AnchorIndex
from anchorcache.proxy.planner import Planner
from anchorcache.proxy.splitter.types import Cut, CutKind, SplitResult
from anchorcache.wire import AnchorKind, anchor_keys

MODEL = "m"


def split(ids, instruction=None, conversation=None, turns=()):
    cuts = []
    if instruction:
        cuts.append(Cut(CutKind.INSTRUCTION, instruction))
    cuts += [Cut(CutKind.TURN, t) for t in turns]
    if conversation:
        cuts.append(Cut(CutKind.CONVERSATION, conversation))
    return SplitResult("test", tuple(ids), tuple(cuts))


def commit_all(planner, plan, ids, slot0=0):
    """Pretend the worker wrote and confirmed every requested snapshot, chained."""
    written, parent = [], plan.chain[-1].key if plan.chain else None
    keys = anchor_keys(plan.namespace, MODEL, ids, [s.depth for s in plan.request.snapshot])
    for i, s in enumerate(plan.request.snapshot):
        written.append({"slot": slot0 + i, "key": keys[s.depth].hex(), "depth": s.depth,
                        "parent": parent.hex() if parent else None, "nbytes": 1,
                        "kind": s.kind.value})
        parent = keys[s.depth]
    meta = {"anchors": {"written": written, "restore_miss": []}}
    planner.record_result(plan, meta, {"confirmed": [w["slot"] for w in written], "evicted": []})
    return written


def ids_of(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def test_cold_plan_snapshots_instruction_and_conversation():
    p = Planner(MODEL, "e1", salt="s")
    ids = ids_of(100)
    plan = p.plan(split(ids, instruction=30, conversation=70, turns=(50,)))
    assert plan.chain == ()
    assert [(s.depth, s.kind) for s in plan.request.snapshot] == [
        (30, AnchorKind.INSTRUCTION), (70, AnchorKind.CONVERSATION), (100, AnchorKind.CONVERSATION)]
    assert plan.request.chunk_at == (30, 70)
    assert plan.request.snapshot_response
    assert plan.request.restore == ()


def test_next_turn_restores_the_deepest_chain():
    p = Planner(MODEL, "e1", salt="s")
    ids = ids_of(100)
    commit_all(p, p.plan(split(ids, instruction=30, conversation=70)), ids)
    longer = ids + ids_of(40, seed=1)
    plan = p.plan(split(longer, instruction=30, conversation=120))
    assert [r.depth for r in plan.request.restore] == [30, 70, 100]  # the old prompt's end
    assert plan.restore_depth == 100
    assert [s.depth for s in plan.request.snapshot] == [30, 120, 140]  # the worker skips held ones


def test_an_edited_early_token_restores_nothing_past_it():
    p = Planner(MODEL, "e1", salt="s")
    ids = ids_of(100)
    commit_all(p, p.plan(split(ids, instruction=30, conversation=70)), ids)
    edited = list(ids)
    edited[40] += 1  # inside the conversation, after the instruction anchor
    plan = p.plan(split(edited + [7], instruction=30, conversation=100))
    assert [r.depth for r in plan.request.restore] == [30]
    edited[3] += 1  # inside the instruction anchor
    assert p.plan(split(edited + [7], instruction=30, conversation=100)).request.restore == ()


def test_tenants_and_salts_never_share():
    index = AnchorIndex()
    a = Planner(MODEL, "e1", salt="s", index=index)
    ids = ids_of(100)
    commit_all(a, a.plan(split(ids, instruction=30, conversation=70)), ids)
    again = split(ids + [1, 2], instruction=30, conversation=100)
    assert a.plan(again).chain != ()
    assert a.plan(again, tenant="other").chain == ()
    assert Planner(MODEL, "e1", salt="s2", index=index).plan(again).chain == ()
    assert Planner("other-model", "e1", salt="s", index=index).plan(again).chain == ()


def test_a_broken_chain_is_not_planned():
    p = Planner(MODEL, "e1", salt="s")
    ids = ids_of(100)
    written = commit_all(p, p.plan(split(ids, instruction=30, conversation=70)), ids)
    p.index.remove(bytes.fromhex(written[0]["key"]))  # the instruction anchor is gone
    plan = p.plan(split(ids + [5], instruction=30, conversation=100))
    assert plan.chain == ()
    assert [s.depth for s in plan.request.snapshot] == [30, 100, 101]


def test_misses_and_evictions_leave_the_index_and_epochs_reset_it():
    p = Planner(MODEL, "e1", salt="s")
    ids = ids_of(100)
    written = commit_all(p, p.plan(split(ids, instruction=30, conversation=70)), ids)
    assert [w["depth"] for w in written] == [30, 70, 100]
    assert len(p.index) == 3
    p.record_result(p.plan(split(ids, instruction=30)),
                    {"anchors": {"restore_miss": [{"key": written[1]["key"], "depth": 70}]}}, {})
    assert len(p.index) == 2
    p.record_result(p.plan(split(ids)), {"anchors": {}}, {"evicted": [written[0]["key"]]})
    assert len(p.index) == 1
    # the survivor's chain is broken: it is never planned
    assert p.plan(split([*ids, 1, 2], instruction=30, conversation=101)).chain == ()
    commit_all(p, p.plan(split(ids, instruction=30, conversation=70)), ids)
    p.observe_epoch("e2")
    assert len(p.index) == 0
    assert p.plan(split([*ids, 1], instruction=30, conversation=100)).chain == ()


def test_the_prompt_end_is_snapshot_but_never_a_chunk_boundary_or_restored():
    p = Planner(MODEL, "e1", salt="s")
    ids = ids_of(50)
    plan = p.plan(split(ids, instruction=50))
    assert [s.depth for s in plan.request.snapshot] == [50]
    assert plan.request.chunk_at == ()
    commit_all(p, plan, ids)
    assert p.plan(split(ids)).chain == ()  # the same prompt again: its last token is prefilled


def test_chunk_only_keeps_the_chunking_and_nothing_else():
    p = Planner(MODEL, "e1", salt="s")
    plan = p.chunk_only(split(ids_of(100), instruction=30, conversation=70))
    assert plan.request.chunk_at == (30, 70)
    assert plan.request.restore == () and plan.request.snapshot == ()
    assert not plan.request.snapshot_response
