"""Late anchor lookup (ext/held_chain.py) on plain records: which chain a queued request may
restore when it starts executing. Every way it could restore a wrong prefix has a case."""

from __future__ import annotations

from dataclasses import dataclass

from anchorcache.ext.held_chain import deepest_held_chain
from anchorcache.wire import anchor_keys

NS = b"tenant-a"
OTHER_NS = b"tenant-b"
MODEL = "m"
IDS = tuple(range(100, 400))


@dataclass(frozen=True)
class Link:
    key: bytes
    depth: int
    start: int
    parent: bytes | None


class Store:
    """What a worker holds: (key, depth) → link; counts lookups."""

    def __init__(self) -> None:
        self.links: dict[tuple[bytes, int], Link] = {}
        self.calls = 0

    def write_chain(self, ids, depths, ns=NS) -> list[Link]:
        keys = anchor_keys(ns, MODEL, ids, depths)
        out, start, parent = [], 0, None
        for d in depths:
            link = Link(keys[d], d, start, parent)
            self.links[(link.key, d)] = link
            out.append(link)
            start, parent = d, link.key
        return out

    def held(self, key: bytes, depth: int) -> Link | None:
        self.calls += 1
        return self.links.get((key, depth))


def test_finds_the_deepest_held_chain_root_first():
    store = Store()
    written = store.write_chain(IDS, [50, 120, 200])
    chain = deepest_held_chain(NS, MODEL, IDS, [50, 120, 200, 300], store.held)
    assert chain == written


def test_a_depth_at_or_past_the_prompt_end_is_never_restored():
    store = Store()
    store.write_chain(IDS, [50, 300])  # 300 = the whole prompt
    chain = deepest_held_chain(NS, MODEL, IDS, [50, 300, 400], store.held)
    assert [link.depth for link in chain] == [50]


def test_nothing_held_or_no_depths_gives_nothing():
    store = Store()
    assert deepest_held_chain(NS, MODEL, IDS, [50, 120], store.held) == []
    store.write_chain(IDS, [50])
    assert deepest_held_chain(NS, MODEL, IDS, [], store.held) == []
    assert deepest_held_chain(NS, MODEL, IDS, [0, -5], store.held) == []


def test_another_prompt_with_a_shared_prefix_restores_only_the_shared_part():
    store = Store()
    other = IDS[:120] + tuple(range(900, 1080))  # equal up to 120, different after
    store.write_chain(other, [50, 120, 200])
    chain = deepest_held_chain(NS, MODEL, IDS, [50, 120, 200], store.held)
    assert [link.depth for link in chain] == [50, 120]
    assert chain[-1].key == anchor_keys(NS, MODEL, IDS, [120])[120]


def test_one_token_difference_before_the_cut_is_a_miss():
    store = Store()
    other = (IDS[0] + 1, *IDS[1:])
    store.write_chain(other, [50, 120])
    assert deepest_held_chain(NS, MODEL, IDS, [50, 120], store.held) == []


def test_another_tenants_chain_is_never_found():
    store = Store()
    store.write_chain(IDS, [50, 120], ns=OTHER_NS)
    assert deepest_held_chain(NS, MODEL, IDS, [50, 120], store.held) == []


def test_a_chain_with_a_missing_link_falls_back_to_a_shallower_complete_one():
    store = Store()
    links = store.write_chain(IDS, [50, 120, 200])
    del store.links[(links[1].key, 120)]  # the middle link was evicted
    chain = deepest_held_chain(NS, MODEL, IDS, [50, 120, 200], store.held)
    assert [link.depth for link in chain] == [50]


def test_a_leaf_whose_parent_is_another_prompts_anchor_is_refused():
    store = Store()
    other = (7, *IDS[1:])
    (foreign,) = store.write_chain(other, [50])
    key = anchor_keys(NS, MODEL, IDS, [120])[120]
    # a leaf keyed on our prefix but chained onto a foreign root: its rows [50, 120) would
    # be restored over the wrong first 50 tokens
    store.links[(key, 120)] = Link(key, 120, 50, foreign.key)
    assert deepest_held_chain(NS, MODEL, IDS, [120], store.held) == []


def test_a_link_that_does_not_continue_its_parent_is_refused():
    store = Store()
    root, _ = store.write_chain(IDS, [50, 120])
    key = anchor_keys(NS, MODEL, IDS, [200])[200]
    store.links[(key, 200)] = Link(key, 200, 60, root.key)  # rows start at 60, parent ends at 50
    chain = deepest_held_chain(NS, MODEL, IDS, [200], store.held)
    assert chain == []


def test_a_root_that_does_not_start_at_zero_is_refused():
    store = Store()
    key = anchor_keys(NS, MODEL, IDS, [80])[80]
    store.links[(key, 80)] = Link(key, 80, 10, None)
    assert deepest_held_chain(NS, MODEL, IDS, [80], store.held) == []


def test_a_held_record_under_the_wrong_depth_is_refused():
    store = Store()
    (link,) = store.write_chain(IDS, [50])
    store.links[(link.key, 60)] = link  # a store that answers for a depth the link lacks
    assert deepest_held_chain(NS, MODEL, IDS, [60], store.held) == []


def test_a_parent_cycle_terminates():
    store = Store()
    k120 = anchor_keys(NS, MODEL, IDS, [120])[120]
    store.links[(k120, 120)] = Link(k120, 120, 120, k120)  # names itself as parent
    assert deepest_held_chain(NS, MODEL, IDS, [120], store.held) == []
    assert store.calls < 10
