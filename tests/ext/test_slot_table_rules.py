"""Specific slot-table rules: refresh in place, abort keeps the old anchor, thin-region LRU,
chains (touching an anchor touches its ancestors; a pinned anchor protects them)."""

from __future__ import annotations

import threading

import pytest
from msgspec.structs import replace

from anchorcache.ext.slots import Reservation, SlotTable


def key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def commit(table: SlotTable, name: str, depth: int, nbytes: int = 10, **kw) -> int:
    res = table.reserve(key(name), depth, nbytes, **kw)
    assert res is not None, name
    table.confirm(res.slot)
    return res.slot


def test_in_place_refresh_at_a_deeper_cut_makes_the_shallow_key_a_miss():
    table = SlotTable(4, 1000)
    slot = commit(table, "conv@100", 100)
    res = table.reserve(key("conv@180"), 180, 10, parent=key("tools"), slot=slot)
    assert res == Reservation(slot, (key("conv@100"),))
    # Deferred: until the new snapshot is confirmed, the old anchor still serves.
    assert table.lookup(key("conv@100"), 100) == slot
    assert table.lookup(key("conv@180"), 180) is None

    assert table.confirm(slot) == [key("conv@100")]

    assert table.lookup(key("conv@100"), 100) is None
    assert not table.contains(key("conv@100"), 100)
    assert table.lookup(key("conv@180"), 180) == slot
    assert table.lookup(key("conv@180"), 100) is None  # same hash, other depth: never a hit
    [info] = table.entries()
    assert (info.slot, info.key, info.depth, info.parent, info.state) == (
        slot, key("conv@180"), 180, key("tools"), "committed")


def test_an_aborted_reservation_keeps_the_previous_anchor():
    table = SlotTable(2, 1000)
    a = commit(table, "a", 5)
    b = commit(table, "b", 7)
    before = table.entries()
    res = table.reserve(key("c"), 9, 10)
    assert res == Reservation(a, (key("a"),))  # full: the LRU anchor is the victim
    assert table.stats().bytes_reserved == 10

    table.abort(res.slot)

    assert table.lookup(key("a"), 5) == a and table.lookup(key("b"), 7) == b
    assert table.lookup(key("c"), 9) is None
    assert [replace(e, hits=0, last_use=0) for e in table.entries()] == \
           [replace(e, hits=0, last_use=0) for e in before]
    stats = table.stats()
    assert (stats.aborts, stats.bytes_reserved, stats.bytes_used, stats.evictions) == (1, 0, 20, 0)
    with pytest.raises(ValueError, match="holds no reservation"):
        table.confirm(res.slot)


def test_a_full_thin_region_evicts_only_the_lru_unpinned_slot():
    table = SlotTable(8, 10_000, slot_base=2, pinned_slots=3)
    t1 = commit(table, "tools1", 50, region="thin")
    t2 = commit(table, "tools2", 60, region="thin")
    t3 = commit(table, "tools3", 70, region="thin")
    assert sorted([t1, t2, t3]) == [2, 3, 4]
    thick = [commit(table, f"conv{i}", 100 + i) for i in range(5)]
    assert sorted(thick) == [0, 1, 5, 6, 7]
    assert table.pin(key("tools1"))  # oldest, but pinned
    assert table.lookup(key("tools2"), 60) == t2  # now tools3 is the LRU unpinned one

    res = table.reserve(key("tools4"), 80, 10, region="thin")
    assert res == Reservation(t3, (key("tools3"),))
    assert table.confirm(res.slot) == [key("tools3")]

    assert table.lookup(key("tools1"), 50) == t1 and table.lookup(key("tools2"), 60) == t2
    assert all(table.contains(key(f"conv{i}"), 100 + i) for i in range(5))
    # Thin region now: tools1 pinned, tools2 and tools4 recently used; pin both, then full.
    assert table.pin(key("tools2")) and table.pin(key("tools4"))
    assert table.reserve(key("tools5"), 90, 10, region="thin") is None


def test_bytes_capacity_claims_lru_victims_same_region_first():
    table = SlotTable(6, 100, slot_base=0, pinned_slots=2)
    commit(table, "thin-old", 1, 30, region="thin")
    commit(table, "thick-old", 2, 30)
    commit(table, "thick-new", 3, 30)
    res = table.reserve(key("big"), 4, 50)  # needs 40 more bytes: frees 2 thick anchors
    assert res is not None and res.victims == (key("thick-old"), key("thick-new"))
    assert table.lookup(key("thick-old"), 2) is not None  # still visible until confirm
    assert table.reserve(key("huge"), 5, 101) is None
    table.abort(res.slot)
    res = table.reserve(key("bigger"), 4, 90, region="thick")
    # The lookup above made thick-old the most recently used thick anchor.
    assert res.victims == (key("thick-new"), key("thick-old"), key("thin-old"))
    assert sorted(table.confirm(res.slot)) == sorted(res.victims)
    assert table.stats().bytes_used == 90


def test_keys_are_refused_twice_and_validated():
    table = SlotTable(4, 100)
    commit(table, "a", 1)
    assert table.reserve(key("a"), 1, 5) is None  # committed
    res = table.reserve(key("b"), 1, 5)
    assert table.reserve(key("b"), 2, 5) is None  # reserved
    assert table.reserve(key("c"), 1, 5, slot=res.slot) is None  # slot already reserved
    with pytest.raises(ValueError, match="16 bytes"):
        table.reserve(b"short", 1, 5)
    with pytest.raises(ValueError, match="16 bytes"):
        table.lookup("a-str-of-16-char", 1)
    with pytest.raises(ValueError, match="region"):
        table.reserve(key("d"), 1, 5, region="warm")
    with pytest.raises(IndexError):
        table.reserve(key("d"), 1, 5, slot=4)
    with pytest.raises(ValueError, match="thin region"):
        SlotTable(4, 100, slot_base=3, pinned_slots=2)


def test_pinned_anchors_survive_and_evict_clear_report_keys():
    table = SlotTable(2, 100)
    a = commit(table, "a", 1)
    commit(table, "b", 1)
    assert table.pin(key("a")) and table.pin(key("b"))
    assert table.reserve(key("c"), 1, 5) is None
    assert table.reserve(key("c"), 1, 5, slot=a) is None  # no in-place refresh of a pinned slot
    assert table.unpin(key("a"))
    assert table.reserve(key("c"), 1, 5).victims == (key("a"),)
    assert not table.pin(key("a"))  # claimed by the pending reservation
    assert table.evict(key("b")) and not table.evict(key("b"))
    assert table.clear() == [key("a")]
    assert table.confirm(a) == []  # its victim is already gone
    assert table.lookup(key("c"), 1) == a
    stats = table.stats()
    assert (stats.used_slots, stats.free_slots, stats.hits, stats.misses) == (1, 1, 1, 0)


def test_concurrent_reserve_confirm_lookup_keeps_the_books():
    table = SlotTable(16, 1 << 30)
    per_thread, threads = 150, 4
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(per_thread):
                name = f"t{t}-{i}"
                res = None
                while res is None:  # another thread may hold every slot reserved
                    res = table.reserve(key(name), i, 1)
                table.confirm(res.slot)
                table.lookup(key(name), i)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors
    stats = table.stats()
    total = per_thread * threads
    assert (stats.confirms, stats.used_slots, stats.evictions) == (total, 16, total - 16)
    assert stats.bytes_used == 16 and stats.reserved_slots == 0
    assert sorted(e.slot for e in table.entries()) == list(range(16))


def ticks(table: SlotTable) -> dict[bytes, int]:
    return {e.key: e.last_use for e in table.entries() if e.state == "committed"}


def test_a_chain_restored_root_first_loses_its_leaf_first_and_its_root_last():
    table = SlotTable(6, 10_000, slot_base=0, pinned_slots=4)
    commit(table, "root", 10, region="thin")
    commit(table, "mid", 20, parent=key("root"), region="thin")
    commit(table, "leaf", 30, parent=key("mid"), region="thin")
    commit(table, "other", 15, region="thin")  # unrelated, newer than the chain's commits
    # A restore looks the links up root first: pure LRU would leave the root the oldest.
    for name, depth in (("root", 10), ("mid", 20), ("leaf", 30)):
        assert table.lookup(key(name), depth) is not None
    t = ticks(table)
    assert t[key("other")] < t[key("leaf")] < t[key("mid")] < t[key("root")]
    # Each lookup counts a hit for its own anchor only, not for the ancestors it touched.
    assert {e.key: e.hits for e in table.entries()} == {
        key("root"): 1, key("mid"): 1, key("leaf"): 1, key("other"): 0}
    assert table.stats().hits == 3

    evicted = []
    for i in range(4):  # the thin region is full: each new tool anchor takes the LRU slot
        res = table.reserve(key(f"new{i}"), 40 + i, 10, region="thin")
        assert res is not None and len(res.victims) == 1
        evicted += table.confirm(res.slot)
    assert evicted == [key("other"), key("leaf"), key("mid"), key("root")]


def test_a_pinned_leaf_keeps_its_ancestors_until_unpinned():
    table = SlotTable(4, 1000)
    root = commit(table, "root", 10)
    mid = commit(table, "mid", 20, parent=key("root"))
    commit(table, "leaf", 30, parent=key("mid"))
    commit(table, "other", 40)
    assert table.pin(key("leaf"))
    # mid is the LRU unpinned anchor, but it and root are the pinned leaf's ancestors.
    res = table.reserve(key("x"), 50, 10)
    assert res is not None and res.victims == (key("other"),)
    table.confirm(res.slot)
    assert table.pin(key("x"))
    assert table.reserve(key("y"), 60, 10) is None  # nothing else can go
    assert table.reserve(key("y"), 60, 10, slot=mid) is None  # no in-place refresh either
    assert table.reserve(key("y"), 60, 10, slot=root) is None
    assert table.contains(key("mid"), 20) and table.contains(key("root"), 10)

    assert table.unpin(key("leaf"))
    res = table.reserve(key("y"), 60, 10)
    assert res is not None and res.victims == (key("leaf"),)  # leaves before ancestors
    table.abort(res.slot)
    assert table.reserve(key("y"), 60, 10, slot=mid) == Reservation(mid, (key("mid"),))


def test_pin_is_refused_while_an_ancestor_is_claimed():
    table = SlotTable(3, 1000)
    root = commit(table, "root", 10)
    commit(table, "leaf", 20, parent=key("root"))
    res = table.reserve(key("root2"), 15, 10, slot=root)  # root is now a pending victim
    assert res == Reservation(root, (key("root"),))
    assert not table.pin(key("leaf"))  # the confirm would break the pinned chain
    assert not table.pin(key("root"))
    table.abort(res.slot)

    assert table.pin(key("leaf"))
    assert table.reserve(key("root2"), 15, 10, slot=root) is None  # root is protected now
    assert table.evict(key("root"))  # an explicit evict still removes it
    assert not table.contains(key("root"), 10) and table.contains(key("leaf"), 20)


def test_a_parent_cycle_ends_the_walk_and_touches_each_anchor_once():
    table = SlotTable(3, 1000)
    commit(table, "a", 1, parent=key("b"))  # b is not committed yet: the walk stops at a
    assert ticks(table) == {key("a"): 1}
    commit(table, "b", 2, parent=key("a"))  # closes the cycle: b, then a, then b again: stop
    assert ticks(table) == {key("a"): 3, key("b"): 2}
    assert table.lookup(key("a"), 1) is not None
    assert ticks(table) == {key("a"): 4, key("b"): 5}
    commit(table, "self", 3, parent=key("self"))  # its own parent
    assert ticks(table)[key("self")] == 6
    assert table.lookup(key("self"), 3) is not None and ticks(table)[key("self")] == 7

    assert table.pin(key("a"))  # b is a's ancestor (and a is b's): both stay
    res = table.reserve(key("c"), 4, 10)
    assert res is not None and res.victims == (key("self"),)
    table.abort(res.slot)
    assert table.pin(key("self"))
    assert table.reserve(key("c"), 4, 10) is None
    assert {e.key: e.hits for e in table.entries()} == {key("a"): 1, key("b"): 0, key("self"): 1}
