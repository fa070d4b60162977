"""Planner and anchor index: pure bookkeeping, milliseconds, no model or server."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest

from anchorcache.proxy.anchor_index import AnchorIndex
from anchorcache.proxy.planner import Planner, PromptKeys, tenant_namespace
from anchorcache.proxy.splitter.types import Cut, CutKind, SplitResult
from anchorcache.wire import (
    AnchorHeld,
    AnchorKind,
    AnchorReport,
    AnchorWritten,
    RestoreMiss,
    SnapshotSpec,
    anchor_keys,
)

MODEL = "m"
NS = tenant_namespace(b"s" * 32, "t")


def split(ids, instruction=None, conversation=None, turns=()):
    cuts = []
    if instruction:
        cuts.append(Cut(CutKind.INSTRUCTION, instruction))
    cuts += [Cut(CutKind.TURN, t) for t in turns]
    if conversation:
        cuts.append(Cut(CutKind.CONVERSATION, conversation))
    return SplitResult("test", tuple(ids), tuple(cuts))


def commit_all(planner, plan, ids, slot0=0, *, held=False, reply=()):
    """Pretend the worker wrote (or already held) every requested snapshot, chained, and
    confirmed it; and, given the `reply` it generated, the response anchor past it."""
    written, parent = [], plan.chain[-1].key if plan.chain else None
    specs = [s for s in plan.request.snapshot if s.depth > plan.restore_depth]  # as the worker
    if reply:
        specs.append(SnapshotSpec(len(ids) + len(reply), AnchorKind.RESPONSE))
    keys = anchor_keys(plan.namespace, MODEL, list(ids) + list(reply), [s.depth for s in specs])
    cls = AnchorHeld if held else AnchorWritten
    for i, s in enumerate(specs):
        written.append(cls(slot0 + i, keys[s.depth], s.depth, parent, 1, s.kind))
        parent = keys[s.depth]
    report = AnchorReport(held=tuple(written)) if held else AnchorReport(written=tuple(written))
    planner.record(plan.namespace, report, [w.slot for w in written], [])
    return written


def ids_of(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def restores(plan):
    """The planned chain's depths; the request names its leaf only (the worker completes
    the chain by its own parent links), in the leaf's namespace where not the plan's."""
    leaf = plan.chain[-1:]
    assert [(r.key, r.depth) for r in plan.request.restore] == [(r.key, r.depth) for r in leaf]
    assert all(r.namespace is None if rec.namespace == plan.namespace else r.namespace
               == rec.namespace for r, rec in zip(plan.request.restore, leaf, strict=True))
    return [r.depth for r in plan.chain]


def test_cold_plan_snapshots_instruction_and_conversation():
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    plan = p.plan(split(ids, instruction=30, conversation=70, turns=(50,)), NS)
    assert plan.chain == ()
    assert [(s.depth, s.kind) for s in plan.request.snapshot] == [
        (30, AnchorKind.INSTRUCTION), (70, AnchorKind.CONVERSATION), (100, AnchorKind.CONVERSATION)]
    assert plan.request.chunk_at == (30, 70)
    assert plan.request.snapshot_response
    assert plan.request.restore == ()


def test_next_turn_restores_the_deepest_chain():
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    commit_all(p, p.plan(split(ids, instruction=30, conversation=70), NS), ids)
    longer = ids + ids_of(40, seed=1)
    plan = p.plan(split(longer, instruction=30, conversation=120), NS)
    assert restores(plan) == [30, 70, 100]  # the old prompt's end
    assert plan.restore_depth == 100
    assert [s.depth for s in plan.request.snapshot] == [30, 120, 140]  # the worker skips held ones


def test_an_edited_early_token_restores_nothing_past_it():
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    commit_all(p, p.plan(split(ids, instruction=30, conversation=70), NS), ids)
    edited = list(ids)
    edited[40] += 1  # inside the conversation, after the instruction anchor
    plan = p.plan(split(edited + [7], instruction=30, conversation=100), NS)
    assert restores(plan) == [30]
    edited[3] += 1  # inside the instruction anchor
    assert p.plan(split(edited + [7], instruction=30, conversation=100), NS).request.restore == ()


def test_tenants_and_salts_never_share():
    index = AnchorIndex()
    a = Planner(MODEL, "e1", index=index)
    ids = ids_of(100)
    commit_all(a, a.plan(split(ids, instruction=30, conversation=70), NS), ids)
    again = split(ids + [1, 2], instruction=30, conversation=100)
    assert a.plan(again, NS).chain != ()
    assert a.plan(again, tenant_namespace(b"s" * 32, "other")).chain == ()
    assert a.plan(again, tenant_namespace(b"x" * 32, "t")).chain == ()
    assert a.plan(again, tenant_namespace(b"s" * 32, "t", "narrower")).chain == ()
    assert Planner("other-model", "e1", index=index).plan(again, NS).chain == ()


def test_a_shared_toolset_roots_other_tenants_chains_and_nothing_else():
    p = Planner(MODEL, "e1")
    shared, other = tenant_namespace(b"z" * 32, "@shared"), tenant_namespace(b"o" * 32, "o")
    ids = ids_of(100)
    # the admin warmed the instruction prefix in the shared namespace
    warm = p.plan(split(ids[:30]), shared)
    commit_all(p, warm, ids[:30])
    plan = p.plan(split(ids, instruction=30, conversation=70), other, shared=shared)
    assert restores(plan) == [30] and plan.request.restore[0].namespace == shared
    # without the shared namespace offered, or past a different instruction prefix: nothing
    assert p.plan(split(ids, instruction=30, conversation=70), other).chain == ()
    edited = list(ids)
    edited[5] += 1
    assert p.plan(split(edited, instruction=30, conversation=70), other, shared=shared).chain == ()
    # the tenant's own chain on top of the shared root is planned whole; another tenant's
    # conversation anchors on the same root are not
    commit_all(p, plan, ids)
    longer = split(ids + ids_of(10, seed=3), instruction=30, conversation=100)
    mine = p.plan(longer, other, shared=shared)
    assert restores(mine) == [30, 70, 100]
    assert mine.chain[0].namespace == shared  # the shared root, then the tenant's own
    assert mine.request.restore[0].namespace is None  # the plan's own namespace
    theirs = p.plan(longer, NS, shared=shared)
    assert restores(theirs) == [30]


def test_a_plan_from_a_probe_is_the_plan_routing_compared():
    """Routing probes each worker's planner and plans once, from the chosen worker's probe
    (Targets.route, AnchorLifecycle.begin): that plan is the one a fresh plan gives (the
    shared root, the tenant's chain, the snapshots), and a probe of another worker, split,
    namespace or shared namespace is not planned from."""
    a, b = Planner(MODEL, "e1"), Planner(MODEL, "e1")
    shared, other = tenant_namespace(b"z" * 32, "@shared"), tenant_namespace(b"o" * 32, "o")
    ids = ids_of(100)
    commit_all(a, a.plan(split(ids[:30]), shared), ids[:30])
    first = split(ids, instruction=30, conversation=70)
    commit_all(a, a.plan(first, other, shared=shared), ids)
    turn = split(ids + ids_of(10, seed=3), instruction=30, conversation=100)
    on_a, on_b = a.probe(turn, other, shared=shared), b.probe(turn, other, shared=shared)
    assert (on_a.restore_depth, on_b.restore_depth) == (100, 0)  # routing picks a
    anchors = len(a.index)
    planned = a.plan(turn, other, shared=shared, probe=on_a)
    assert planned == a.plan(turn, other, shared=shared) and restores(planned) == [30, 70, 100]
    assert len(a.index) == anchors  # probing and planning learn nothing
    assert b.plan(turn, other, shared=shared, probe=on_a).chain == ()  # b's own index
    for other_probe in (a.probe(first, other, shared=shared), a.probe(turn, other),
                        a.probe(turn, NS, shared=shared), a.probe(turn, other, floor=None)):
        assert a.plan(turn, other, shared=shared, probe=other_probe) == planned
    assert a.plan(first, other, probe=on_a) == a.plan(first, other)


def test_a_probe_scans_only_from_its_floor():
    """Routing's two passes (Targets._probes): down the conversation's own anchors alone
    (`floor=None`), then a scan from the depth another worker restores. A probe is whole
    (planned from) only where its chain is the deepest there is."""
    p = Planner(MODEL, "e1")
    ids = ids_of(120)
    first = split(ids[:100], instruction=30, conversation=70)
    commit_all(p, p.plan(first, NS), ids[:100])  # anchors at 30, 70, 100
    turn = split(ids, instruction=30, conversation=100)
    extends = dataclasses.replace(turn, prior_token_bytes=first.token_bytes)
    down_the_line = p.probe(extends, NS, floor=None)  # the splitter named the prior turn
    assert (down_the_line.restore_depth, down_the_line.whole) == (100, True)
    unnamed = p.probe(turn, NS, floor=None)  # no prior named: no line to follow, no scan
    assert (unnamed.restore_depth, unnamed.whole) == (0, False)
    assert p.plan(turn, NS, probe=unnamed) == p.plan(turn, NS)  # not planned from
    for floor, depth, whole in ((0, 100, True), (70, 100, True), (100, 100, True),
                                (101, 0, False)):
        probe = p.probe(turn, NS, floor=floor)
        assert (probe.restore_depth, probe.whole) == (depth, whole), floor
        # routing's second pass searches its first pass's probe again, keys as they are
        deeper = p.deepen(unnamed, floor)
        assert (deeper.chain, deeper.whole) == (probe.chain, probe.whole), floor
    edited = list(ids)
    edited[80] += 1  # shares the anchors at 30 and 70 only
    other_turn = split(edited, instruction=30, conversation=100)
    assert p.probe(other_turn, NS, floor=71).chain == []
    at_floor = p.probe(other_turn, NS, floor=70)
    assert (at_floor.restore_depth, at_floor.whole) == (70, True)
    assert restores(p.plan(other_turn, NS, probe=at_floor)) == [30, 70]


def test_a_broken_chain_is_not_planned():
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    written = commit_all(p, p.plan(split(ids, instruction=30, conversation=70), NS), ids)
    p.index.remove(written[0].key)  # the instruction anchor is gone
    plan = p.plan(split(ids + [5], instruction=30, conversation=100), NS)
    assert plan.chain == ()
    assert [s.depth for s in plan.request.snapshot] == [30, 100, 101]


def test_misses_and_evictions_leave_the_index_and_epochs_reset_it():
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    written = commit_all(p, p.plan(split(ids, instruction=30, conversation=70), NS), ids)
    assert [w.depth for w in written] == [30, 70, 100]
    assert len(p.index) == 3
    p.record(NS, AnchorReport(restore_miss=(RestoreMiss(written[1].key, 70, "not_resident"),)), [], [])
    assert len(p.index) == 2
    p.record(NS, AnchorReport(), [], [written[0].key])
    assert len(p.index) == 1
    # the survivor's chain is broken: it is never planned
    assert p.plan(split([*ids, 1, 2], instruction=30, conversation=101), NS).chain == ()
    commit_all(p, p.plan(split(ids, instruction=30, conversation=70), NS), ids)
    assert p.reset("e2") == 3
    assert p.plan(split([*ids, 1], instruction=30, conversation=100), NS).chain == ()


def test_held_anchors_are_learned_without_a_confirm():
    """The restart bug: a proxy that forgot its anchors learns them from the worker's
    `held` report, so the next request restores them."""
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    cold = p.plan(split(ids, instruction=30, conversation=70), NS)
    commit_all(p, cold, ids, held=True)
    plan = p.plan(split(ids + [4, 5], instruction=30, conversation=100), NS)
    assert restores(plan) == [30, 70, 100]


def test_unconfirmed_writes_are_not_learned():
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    plan = p.plan(split(ids, instruction=30, conversation=70), NS)
    keys = anchor_keys(NS, MODEL, ids, [30])
    p.record(NS, AnchorReport(written=(AnchorWritten(0, keys[30], 30, None, 1, AnchorKind.INSTRUCTION),)),
             [], [])
    assert len(p.index) == 0
    assert plan.instruction == (30, keys[30])


def test_skip_instruction_leaves_the_instruction_cut_to_another_request():
    p = Planner(MODEL, "e1")
    plan = p.plan(split(ids_of(100), instruction=30, conversation=70), NS, skip_instruction=True)
    assert [s.depth for s in plan.request.snapshot] == [70, 100]
    assert plan.request.chunk_at == (30, 70)


def test_the_prompt_end_is_snapshot_but_never_a_chunk_boundary_or_restored():
    p = Planner(MODEL, "e1")
    ids = ids_of(50)
    plan = p.plan(split(ids, instruction=50), NS)
    assert [s.depth for s in plan.request.snapshot] == [50]
    assert plan.request.chunk_at == ()
    commit_all(p, plan, ids)
    assert p.plan(split(ids), NS).chain == ()  # the same prompt again: its last token is prefilled


def test_chunk_only_keeps_the_chunking_and_nothing_else():
    p = Planner(MODEL, "e1")
    plan = p.chunk_only(split(ids_of(100), instruction=30, conversation=70))
    assert plan.request.chunk_at == (30, 70)
    assert plan.request.restore == () and plan.request.snapshot == ()
    assert not plan.request.snapshot_response


def test_a_hybrid_model_is_not_cut_where_only_a_fallback_would_be():
    """On a hybrid model every cut costs a prefill round: the conversation cut is left out
    when the messages cut follows it and the template renders the newest messages alike in
    the next turn (`stable_tail`: the next turn restores the messages anchor, or the
    prompt's end), anchors on and off alike (the same chunks); a dense model keeps it, and
    so does a template whose newest messages may render differently later."""
    ids = ids_of(100)
    cuts = split(ids, instruction=30, conversation=70).cuts + (Cut(CutKind.MESSAGES, 96),)
    stable = SplitResult("test", tuple(ids), cuts, stable_tail=True)
    dense, hybrid = Planner(MODEL, "e1"), Planner(MODEL, "e1", hybrid=True)
    assert [s.depth for s in dense.plan(stable, NS).request.snapshot] == [30, 70, 96, 100]
    plan = hybrid.plan(stable, NS)
    assert [s.depth for s in plan.request.snapshot] == [30, 96, 100]
    assert plan.request.chunk_at == (30, 96) == hybrid.chunk_only(stable).request.chunk_at
    unknown = SplitResult("test", tuple(ids), cuts)
    assert [s.depth for s in hybrid.plan(unknown, NS).request.snapshot] == [30, 70, 96, 100]
    # without a messages cut it stays
    alone = SplitResult("test", tuple(ids), split(ids, 30, 70).cuts, stable_tail=True)
    assert [s.depth for s in hybrid.plan(alone, NS).request.snapshot] == [30, 70, 100]


def tooled(ids, tools, instruction, conversation=None):
    s = split(ids, instruction=instruction, conversation=conversation)
    return SplitResult(s.adapter, s.input_ids, s.cuts, tool_cuts=tuple(tools))


def test_tool_anchors_are_spaced_and_thin_and_chunk_too():
    p = Planner(MODEL, "e1", tool_gap=100)
    ids = ids_of(1200)
    s = tooled(ids, [60, 150, 260, 300, 420, 800, 950], instruction=1000, conversation=1100)
    plan = p.plan(s, NS)
    tools = [(x.depth, x.region.value) for x in plan.request.snapshot if x.kind == AnchorKind.TOOL]
    # 60 is under the gap from the start, 300 from 260, 950 from the instruction cut
    assert tools == [(150, "thin"), (260, "thin"), (420, "thin"), (800, "thin")]
    assert plan.request.chunk_at == (150, 260, 420, 800, 1000, 1100)
    assert p.chunk_only(s).request.chunk_at == plan.request.chunk_at  # anchors off: same chunks
    assert Planner(MODEL, "e1", tool_gap=0).plan(s, NS).request.chunk_at == (1000, 1100)
    skipped = p.plan(s, NS, skip_instruction=True).request.snapshot
    assert {x.kind for x in skipped} == {AnchorKind.CONVERSATION}


def test_a_toolset_sharing_the_first_tools_restores_their_tool_anchors():
    p = Planner(MODEL, "e1", tool_gap=100)
    ids = ids_of(1200)
    commit_all(p, p.plan(tooled(ids, [150, 260, 420, 800], 1000, 1100), NS), ids)
    other = ids[:420] + ids_of(800, seed=9)  # the same first tools, then others
    plan = p.plan(tooled(other, [150, 260, 420, 700, 900], 1000, 1100), NS)
    assert restores(plan) == [150, 260, 420]
    # what it writes next chains on: its own tool anchors past 420, its instruction anchor
    assert [(x.depth, x.kind) for x in plan.request.snapshot if x.depth <= 1000] == [
        (150, AnchorKind.TOOL), (260, AnchorKind.TOOL), (420, AnchorKind.TOOL),
        (700, AnchorKind.TOOL), (900, AnchorKind.TOOL), (1000, AnchorKind.INSTRUCTION)]
    # the same toolset again restores through the instruction anchor, tool links first
    again = p.plan(tooled(ids[:1100] + [5], [150, 260, 420, 800], 1000, 1100), NS)
    assert restores(again) == [150, 260, 420, 800, 1000, 1100]


def brute_force_chain(planner, ns, ids):
    """The chain as the planner defines it, keying every depth the namespace knows: the
    deepest live anchor of `ns` that prefixes `ids`, every link of its chain live."""
    known = [d for d in planner.index.depths(ns) if d < len(ids)]
    keys = anchor_keys(ns, MODEL, ids, known)
    for depth in sorted(known, reverse=True):
        rec = planner.index.get(keys[depth])
        if rec is None or rec.namespace != ns or rec.depth != depth or rec.epoch != planner.epoch:
            continue
        links = planner.index.chain(rec.key)
        if links is not None and all(r.namespace == ns and r.epoch == planner.epoch
                                     for r in links):
            return links
    return []


@pytest.mark.parametrize("prior", [False, True], ids=["scanned", "down_the_lineage"])
def test_the_chain_planned_is_the_one_every_known_depth_gives(prior):
    """Many conversations of one namespace (shared prefixes, diverging turns), anchors of
    every turn, some evicted and some of an older epoch: each new turn's chain, found keying
    a few depths at a time from the deepest (or, where the split names the prompt it
    extends, down that prompt's anchors), is the chain keying all of them finds."""
    rng = random.Random(7)
    p = Planner(MODEL, "e1")
    system = ids_of(40, seed=1)
    convs = [list(system) for _ in range(12)]
    last: dict[int, bytes] = {}  # each conversation's last prompt, as the splitter keeps it
    slot = 0
    for step in range(60):
        k = rng.randrange(len(convs))
        convs[k] += ids_of(rng.randrange(5, 60), seed=1000 + step)
        ids = convs[k]
        turns = tuple(sorted(rng.sample(range(41, len(ids)), min(3, len(ids) - 41))))
        s = split(ids, instruction=40, conversation=max(turns) if turns else None, turns=turns)
        if prior:
            s = dataclasses.replace(s, prior_token_bytes=last.get(k))
            last[k] = s.token_bytes
        plan = p.plan(s, NS)
        assert list(plan.chain) == brute_force_chain(p, NS, ids), step
        # the index keeps its depths sorted as anchors come and go
        assert p.index.depths(NS) == sorted({r.depth for r in p.index._by_key.values()})
        reply = ids_of(rng.randrange(3, 20), seed=2000 + step)
        commit_all(p, plan, ids, slot0=slot, reply=reply)
        slot += 10
        # the next turn renders the reply as generated (its response anchor a prefix), or not
        convs[k] += reply if rng.random() < 0.7 else [7] + reply
        if rng.random() < 0.3:  # an eviction somewhere in the namespace
            depths = p.index.depths(NS)
            victim = anchor_keys(NS, MODEL, convs[rng.randrange(len(convs))],
                                 [d for d in depths[-3:] if d < 40] or [40])
            for key in victim.values():
                p.index.remove(key)
        if step == 40:  # an older epoch's anchor stays in the index, dead
            p.epoch = "e2"
    assert any(brute_force_chain(p, NS, c) for c in convs)


def test_a_turn_keys_its_own_anchors_whatever_else_the_namespace_holds(monkeypatch):
    """24 conversations of one tenant take turns: where each split names the prompt it
    extends, a turn keys a bounded few depths (its own anchors, down its lineage), the same
    chain as scanning every depth gives, while the scan keys other conversations' anchors."""
    keyed: list[int] = []
    real = PromptKeys.keys

    def counting(self, depths):
        depths = list(depths)
        keyed.extend(depths)
        return real(self, depths)

    monkeypatch.setattr(PromptKeys, "keys", counting)

    def last_round(prior: bool) -> list[int]:
        p = Planner(MODEL, "e1")
        system = ids_of(40, seed=1)
        convs = [list(system) for _ in range(24)]
        last: list[bytes | None] = [None] * 24
        per_plan: list[int] = []
        for turn in range(4):
            for k, ids in enumerate(convs):
                ids += ids_of(20 + (k * 7 + turn * 13) % 50, seed=k * 100 + turn)
                s = split(ids, instruction=40, conversation=len(ids) - 10)
                s = dataclasses.replace(s, prior_token_bytes=last[k] if prior else None)
                last[k] = s.token_bytes
                keyed.clear()
                plan = p.plan(s, NS)
                per_plan.append(len(set(keyed)))
                assert list(plan.chain) == brute_force_chain(p, NS, ids)
                reply = ids_of(5 + k % 7, seed=k * 100 + turn + 50)
                commit_all(p, plan, ids, slot0=100 * k + 10 * turn, reply=reply)
                ids += reply
        return per_plan[-24:]

    lineage, scanned = last_round(True), last_round(False)
    assert max(lineage) <= 12, lineage
    assert sum(scanned) > 4 * sum(lineage), (scanned, lineage)


def test_a_worker_reporting_a_loop_of_parents_cannot_hang_the_lineage():
    """A faulty worker names an anchor its own parent, or two anchors each other's: the
    planner following a conversation down its anchors still ends, with a chain that holds."""
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    first = split(ids, instruction=30, conversation=70)
    plan = p.plan(first, NS)
    written = commit_all(p, plan, ids)
    tip = written[-1]
    keys = anchor_keys(NS, MODEL, ids + [5, 6], [101, 102])
    loop = AnchorReport(written=(
        AnchorWritten(50, tip.key, tip.depth, tip.key, 1, AnchorKind.CONVERSATION),
        AnchorWritten(51, keys[101], 101, keys[102], 1, AnchorKind.RESPONSE),
        AnchorWritten(52, keys[102], 102, keys[101], 1, AnchorKind.RESPONSE)))
    p.record(NS, loop, [50, 51, 52], [])
    later = dataclasses.replace(split(ids + [5, 6, 7], instruction=30, conversation=102),
                                prior_token_bytes=first.token_bytes)
    planned: list = []
    worker = threading.Thread(target=lambda: planned.append(p.plan(later, NS)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert planned, "planning did not end"
    assert list(planned[0].chain) == brute_force_chain(p, NS, ids + [5, 6, 7])


def test_a_retried_prompt_restores_below_its_end_down_the_lineage():
    """The same prompt again (a retry: the split names the first as its prior, whose end
    holds an anchor): the chain stops below the prompt's end, as the worker must prefill
    at least its last token (a chain to the end would be a miss, and drop that anchor)."""
    p = Planner(MODEL, "e1")
    ids = ids_of(100)
    first = split(ids, instruction=30, conversation=70)
    commit_all(p, p.plan(first, NS), ids)
    again = dataclasses.replace(split(ids, instruction=30, conversation=70),
                                prior_token_bytes=first.token_bytes)
    plan = p.plan(again, NS)
    assert plan.restore_depth == 70
    assert list(plan.chain) == brute_force_chain(p, NS, ids)
