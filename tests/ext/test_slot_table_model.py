"""Model-based test: the C++ slot table against a small Python model of its rules.

The model is the executable form of the rules in ext/slots.py. Hypothesis drives both with the
same random sequence of reserve / confirm / abort / lookup / contains / pin / unpin / evict /
clear, and after every step the listings and statistics must agree exactly. Parents are drawn
from committed keys as well as from any key, so chains (and cycles) form often: the touch walk,
the protected ancestors of pinned anchors and the pin rule all get exercised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from anchorcache.ext.slots import SlotTable
from anchorcache.wire import SlotEntry

KEYS = [bytes([i]) * 16 for i in range(1, 9)]
NUM_SLOTS, SLOT_BASE, PINNED_SLOTS = 6, 1, 2  # thin region: slots 1 and 2
CAPACITY_BYTES = 100


@dataclass
class Entry:
    key: bytes
    depth: int
    parent: bytes | None
    nbytes: int
    pinned: bool = False
    hits: int = 0
    last_use: int = 0


@dataclass
class Pending:
    entry: Entry
    victims: list[tuple[bytes, int]] = field(default_factory=list)


class Model:
    def __init__(self) -> None:
        self.committed: dict[int, Entry] = {}
        self.claimed_by: dict[int, int] = {}
        self.pending: dict[int, Pending] = {}
        self.index: dict[bytes, int] = {}
        self.clock = 0
        self.touched_a_cycle = False
        self.counts = dict(hits=0, misses=0, stale_evictions=0, reservations=0, confirms=0,
                           aborts=0, evictions=0)

    @staticmethod
    def thin(slot: int) -> bool:
        return SLOT_BASE <= slot < SLOT_BASE + PINNED_SLOTS

    def ancestors(self, slot: int) -> list[int]:
        """The parent walk from a committed slot, nearest first; ends at a missing parent or
        at a slot already on the walk (the start included), so cycles end."""
        walk = [slot]
        parent = self.committed[slot].parent
        while parent is not None and parent in self.index and self.index[parent] not in walk:
            walk.append(self.index[parent])
            parent = self.committed[walk[-1]].parent
        return walk[1:]

    def touch(self, slot: int) -> None:
        """A fresh tick for the slot, then a fresher one for each ancestor, nearest first."""
        walk = [slot, *self.ancestors(slot)]
        for s in walk:
            self.clock += 1
            self.committed[s].last_use = self.clock
        # Not a rule, an observation for the test: a walk ending at a committed parent stopped
        # on a cycle, whose first link cannot end up newer than its child.
        self.touched_a_cycle |= self.committed[walk[-1]].parent in self.index

    def protected(self) -> set[int]:
        """Ancestors of committed pinned anchors: never victims."""
        return {a for s, e in self.committed.items() if e.pinned for a in self.ancestors(s)}

    def evictable(self, slot: int, protected: set[int]) -> bool:
        e = self.committed.get(slot)
        return (e is not None and not e.pinned and slot not in self.claimed_by
                and slot not in self.pending and slot not in protected)

    def lru(self, thin: bool, taken: set[int], protected: set[int]) -> int | None:
        cands = [s for s in range(NUM_SLOTS)
                 if s not in taken and self.thin(s) == thin and self.evictable(s, protected)]
        return min(cands, key=lambda s: self.committed[s].last_use, default=None)

    def drop(self, slot: int) -> None:
        e = self.committed.pop(slot)
        self.claimed_by.pop(slot, None)
        if self.index.get(e.key) == slot:
            del self.index[e.key]
        self.counts["evictions"] += 1

    def bytes(self, which: str) -> int:
        if which == "used":
            return sum(e.nbytes for e in self.committed.values())
        if which == "reserved":
            return sum(p.entry.nbytes for p in self.pending.values())
        return sum(self.committed[s].nbytes for s in self.claimed_by)

    def reserve(self, key, depth, nbytes, parent, region, slot):
        if key in self.index or any(p.entry.key == key for p in self.pending.values()):
            return None
        protected = self.protected()
        if slot is not None:
            if slot in self.pending:
                return None
            e = self.committed.get(slot)
            if e is not None and (e.pinned or slot in self.claimed_by or slot in protected):
                return None
            chosen = slot
        else:
            free = [s for s in range(NUM_SLOTS) if self.thin(s) == (region == "thin")
                    and s not in self.committed and s not in self.pending]
            chosen = free[0] if free else self.lru(region == "thin", set(), protected)
            if chosen is None:
                return None
        victims = [chosen] if chosen in self.committed else []
        freed = sum(self.committed[s].nbytes for s in victims)
        base = self.bytes("used") - self.bytes("claimed") + self.bytes("reserved") + nbytes
        taken = {chosen}
        for thin in (self.thin(chosen), not self.thin(chosen)):
            while base - freed > CAPACITY_BYTES:
                best = self.lru(thin, taken, protected)
                if best is None:
                    break
                taken.add(best)
                victims.append(best)
                freed += self.committed[best].nbytes
        if base - freed > CAPACITY_BYTES:
            return None
        for s in victims:
            self.claimed_by[s] = chosen
        self.pending[chosen] = Pending(Entry(key, depth, parent, nbytes),
                                       [(self.committed[s].key, s) for s in victims])
        self.counts["reservations"] += 1
        return chosen, tuple(self.committed[s].key for s in victims)

    def confirm(self, slot):
        p = self.pending.pop(slot)
        evicted = []
        for key, s in p.victims:
            e = self.committed.get(s)
            if e is not None and e.key == key and self.claimed_by.get(s) == slot:
                self.drop(s)
                evicted.append(key)
        self.committed[slot] = p.entry
        self.index[p.entry.key] = slot
        self.touch(slot)  # after the victims are gone: an evicted parent ends the walk
        self.counts["confirms"] += 1
        return evicted

    def abort(self, slot):
        p = self.pending.pop(slot)
        for key, s in p.victims:
            e = self.committed.get(s)
            if e is not None and e.key == key and self.claimed_by.get(s) == slot:
                del self.claimed_by[s]
        self.counts["aborts"] += 1

    def find(self, key):
        return self.index.get(key)

    def lookup(self, key, depth):
        slot = self.find(key)
        if slot is None or self.committed[slot].depth != depth:
            self.counts["misses"] += 1
            return None
        self.touch(slot)
        self.committed[slot].hits += 1
        self.counts["hits"] += 1
        return slot

    def contains(self, key, depth):
        slot = self.find(key)
        return slot is not None and self.committed[slot].depth == depth

    def pin(self, key, value):
        slot = self.find(key)
        if slot is None:
            return False
        if value and any(s in self.claimed_by for s in [slot, *self.ancestors(slot)]):
            return False
        self.committed[slot].pinned = value
        return True

    def evict(self, key):
        slot = self.find(key)
        if slot is None:
            return False
        self.drop(slot)
        return True

    def clear(self):
        keys = [self.committed[s].key for s in sorted(self.committed)]
        for s in sorted(self.committed):
            self.drop(s)
        return keys

    def entries(self):
        rows = []
        for s in range(NUM_SLOTS):
            for e, state in ((self.committed.get(s), "committed"),
                             (self.pending[s].entry if s in self.pending else None, "reserved")):
                if e is not None:
                    rows.append(SlotEntry(s, e.key, e.depth, e.parent, e.nbytes, e.pinned,
                                          e.hits, e.last_use, state))
        return rows


keys = st.sampled_from(KEYS)
depths = st.integers(1, 3)


class SlotTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = SlotTable(NUM_SLOTS, CAPACITY_BYTES, slot_base=SLOT_BASE,
                               pinned_slots=PINNED_SLOTS)
        self.model = Model()
        self.last_committed: bytes | None = None

    def committed_keys(self) -> list[bytes]:
        return sorted(e.key for e in self.model.committed.values())

    def draw_key(self, data, label: str) -> bytes:
        """Any key, or often one committed now."""
        committed = self.committed_keys()
        return data.draw(keys | (st.sampled_from(committed) if committed else st.nothing()),
                         label=label)

    def draw_parent(self, data) -> bytes | None:
        """None, any key (a chain may form later, or close a cycle), a committed key, or the
        last one committed (long chains, as a conversation grows)."""
        options = [st.none(), keys]
        if self.model.committed:
            options.append(st.sampled_from(self.committed_keys()))
        if self.last_committed is not None:
            options.append(st.just(self.last_committed))
        return data.draw(st.one_of(options), label="parent")

    def below_a_claim(self) -> list[int]:
        """Committed slots with a claimed ancestor (pin must refuse them)."""
        m = self.model
        return [s for s in sorted(m.committed) if any(a in m.claimed_by for a in m.ancestors(s))]

    @rule(key=keys, depth=depths, nbytes=st.integers(0, 60), data=st.data(),
          region=st.sampled_from(["thin", "thick"]),
          slot=st.none() | st.integers(0, NUM_SLOTS - 1))
    def reserve(self, key, depth, nbytes, data, region, slot):
        parent = self.draw_parent(data)
        got = self.table.reserve(key, depth, nbytes, parent=parent, region=region, slot=slot)
        want = self.model.reserve(key, depth, nbytes, parent, region, slot)
        assert (None if got is None else tuple(got)) == want
        assert want is None or self.fits()

    @rule(key=keys, depth=depths, nbytes=st.integers(0, 30), data=st.data(),
          region=st.sampled_from(["thin", "thick"]))
    def commit(self, key, depth, nbytes, data, region):
        """reserve then confirm at once (the usual path): grows chains faster."""
        parent = self.draw_parent(data)
        got = self.table.reserve(key, depth, nbytes, parent=parent, region=region)
        want = self.model.reserve(key, depth, nbytes, parent, region, None)
        assert (None if got is None else tuple(got)) == want
        if want is not None:
            assert self.fits()
            assert self.table.confirm(want[0]) == self.model.confirm(want[0])
            self.last_committed = key

    @precondition(lambda self: self.model.pending)
    @rule(data=st.data())
    def confirm(self, data):
        slot = data.draw(st.sampled_from(sorted(self.model.pending)))
        assert self.table.confirm(slot) == self.model.confirm(slot)
        self.last_committed = self.model.committed[slot].key

    @precondition(lambda self: self.model.pending)
    @rule(data=st.data())
    def abort(self, data):
        slot = data.draw(st.sampled_from(sorted(self.model.pending)))
        self.table.abort(slot)
        self.model.abort(slot)

    @rule(key=keys, depth=depths)
    def lookup(self, key, depth):
        assert self.table.lookup(key, depth) == self.model.lookup(key, depth)

    @precondition(lambda self: self.model.committed)
    @rule(data=st.data())
    def hit(self, data):
        """A lookup at the committed depth: touches the anchor and its ancestors."""
        slot = data.draw(st.sampled_from(sorted(self.model.committed)))
        e = self.model.committed[slot]
        assert self.table.lookup(e.key, e.depth) == self.model.lookup(e.key, e.depth) == slot

    @rule(key=keys, depth=depths)
    def contains(self, key, depth):
        assert self.table.contains(key, depth) == self.model.contains(key, depth)

    @rule(data=st.data(), value=st.booleans())
    def pin(self, data, value):
        key = self.draw_key(data, "key")
        got = self.table.pin(key) if value else self.table.unpin(key)
        assert got == self.model.pin(key, value)

    @precondition(lambda self: self.model.claimed_by)
    @rule(data=st.data(), value=st.booleans())
    def touch_claimed_victim(self, data, value):
        """A victim of a pending reservation still hits, and cannot be pinned."""
        slot = data.draw(st.sampled_from(sorted(self.model.claimed_by)))
        e = self.model.committed[slot]
        assert self.table.lookup(e.key, e.depth) == self.model.lookup(e.key, e.depth) == slot
        got = self.table.pin(e.key) if value else self.table.unpin(e.key)
        assert got == self.model.pin(e.key, value)

    @precondition(lambda self: self.below_a_claim())
    @rule(data=st.data())
    def pin_below_a_claim(self, data):
        """The claimed ancestor goes at its claimer's confirm: the pin could not keep it."""
        e = self.model.committed[data.draw(st.sampled_from(self.below_a_claim()))]
        assert self.table.pin(e.key) is self.model.pin(e.key, True) is False

    @rule(key=keys)
    def evict(self, key):
        assert self.table.evict(key) == self.model.evict(key)

    @rule()
    def clear(self):
        assert self.table.clear() == self.model.clear()

    @invariant()
    def parents_are_newer_than_children(self):
        """What the touch walk is for: LRU reaches a chain's leaf before its ancestors (holds
        until some touch meets a cycle)."""
        m = self.model
        if m.touched_a_cycle:
            return
        for e in m.committed.values():
            if e.parent in m.index:
                assert m.committed[m.index[e.parent]].last_use > e.last_use

    @invariant()
    def same_listing_and_stats(self):
        assert self.table.entries() == self.model.entries()
        stats = self.table.stats()
        m = self.model
        assert all(m.committed[s].key == k for k, s in m.index.items())  # the model's index
        assert stats.bytes_used == m.bytes("used")
        assert stats.bytes_reserved == m.bytes("reserved")
        assert stats.used_slots == len(m.committed)
        assert stats.reserved_slots == len(m.pending)
        assert stats.free_slots == sum(1 for s in range(NUM_SLOTS)
                                       if s not in m.committed and s not in m.pending)
        assert {k: getattr(stats, k) for k in m.counts} == m.counts

    def fits(self) -> bool:
        """The capacity rule, as slot_table.h states it: after every (successful) reserve, the
        bytes fit once every pending reservation is confirmed. Not after every step: a
        reservation confirmed while another one was pending may have counted on the other's
        claimed victims, and an abort of the other releases them (bytes_used > capacity)."""
        m = self.model
        return m.bytes("used") - m.bytes("claimed") + m.bytes("reserved") <= CAPACITY_BYTES


SlotTableMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                              deadline=None)
test_slot_table_matches_model = SlotTableMachine.TestCase
