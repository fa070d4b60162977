"""The backend-neutral anchor store: slabs of saved cache state behind the slot table.

Both workers keep their anchors here; they differ only in how rows get out of and back
into their cache, which they pass in as callables (`capture`, `load`):

- the embedded worker reads a transformers cache (`bhtd`, one sequence per cache);
- the SGLang worker reads SGLang's token pool (`thd`, rows addressed by token slot,
  from `req_to_token`) and, on hybrid models, its Mamba pool.

The C++ `SlotTable` keeps the bookkeeping (reservations, depth/hash-checked lookup, LRU,
pinning); this store keeps the data: one slab per slot, K/V rows `[start, depth)` of every
attention layer (the rows past the parent anchor) plus, on recurrent models, the state at
`depth`. A snapshot is written into a *staged* slab, invisible to lookups until the proxy
confirms it; the slot's previous anchor stays readable until then (deferred eviction),
and an abort simply drops the staged slab. An unconfirmed slab of a finished request is
dropped after `STAGED_TTL_S`.

Restores are verified three ways before any row is written: the store recomputes each
link's key over the prompt it was actually given, the slot table checks the slot's
committed key and depth, and the slab's own (key, start, parent) must continue the chain.
A failed link ends the chain there: the request still runs, it just prefills more. A plan
may name only a chain's last links (the proxy names its leaf): the store completes it up
to the root by its own parent links, each one slot-checked (`_ancestors`); a missing
ancestor is the miss, and nothing of that chain is restored.

Late lookup (with ext/held_chain.py): a request also restores the deepest chain the store
holds at one of its own snapshot depths, keyed here over its prompt; a staged slab counts
once its request finished well. A queued request thus restores what the request ahead of
it just wrote, though the proxy planned both before either ran.

Tips: per request, the deepest anchor restored, held or written so far; a new snapshot
stores only the rows past it and names it as parent.

Disk tier (ext/disk_tier.py, optional): every confirmed slab is also queued to a file (the
tier's writer thread writes it, never this loop). A restore or late-lookup link that misses
in memory is loaded from its file (header and checksum checked) and promoted into the slot
table as a committed host slab, then restored like any other; a file that fails a check is
quarantined, and the chain ends there (the request prefills more). A worker whose loop must
not wait for a file (SGLang's scheduler) reads the links a check may take ahead of it, on
its copy thread (`disk_reads`, `read_links`), and hands them to `check_chain`. The late lookup keys
every depth the disk holds as well as the plan's snapshot depths, so a restarted worker
restores its files before any proxy plans on them, and reports them as held. Evicting from memory
keeps the file; an admin `evict` or a flush deletes it too.

Replicated stores (SGLang's tensor-parallel ranks, one store each over its own shard, fed
the same calls in the same order) stay alike because their decisions read only the calls.
A rank's files are its own, though: written by its own thread, damaged or deleted apart
from the others'. So every decision that reads the disk is agreed (`Ranks`): the depths the
late lookup scans are the ones every rank's index holds, and a slab is promoted only when
every rank has its file, loaded it whole and found the same place in its chain (key, depth,
start, parent) and kind; otherwise no rank promotes it, and the request prefills it on all.

Thread model: one owner. Every call runs on the worker's own loop (embedded: the engine
thread, to which the contract's calls are queued; SGLang: the scheduler, through the
scheduler RPC), so the store takes no lock: nothing else may call it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import torch

from anchorcache.ext.disk_tier import DiskTier, SlabRecord
from anchorcache.ext.held_chain import deepest_held_chain
from anchorcache.ext.slots import SlotTable
from anchorcache.wire import (
    AnchorHeld,
    AnchorHit,
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    AnchorReport,
    AnchorWritten,
    DiskSlotEntry,
    DiskStatsRecord,
    LookupHit,
    LookupReply,
    Region,
    RestoreMiss,
    SlotsReply,
    StatsReply,
    anchor_keys,
    parse_ids,
)

log = logging.getLogger("anchorcache.worker")

STAGED_TTL_S = 60.0  # an unconfirmed snapshot of a finished request is dropped after this

T = TypeVar("T")


class Ranks(Protocol):
    """Agreement between the replicas of a store (module docstring); every replica makes
    the same calls in the same order."""

    def same(self, value: int | None) -> bool:
        """True when no replica passes None and every one passes the same value."""
        ...

    def common(self, values: list[int]) -> list[int]:
        """The values every replica passes, in the order of this one's."""
        ...


class OneRank:
    """A store that is not replicated: nothing to agree with."""

    def same(self, value: int | None) -> bool:
        return value is not None

    def common(self, values: list[int]) -> list[int]:
        return values


ONE_RANK = OneRank()
# (start, depth) -> (kv slab or None, state slab or None); raises on failure
Capture = Callable[[int, int], tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass(frozen=True)
class Slab:
    key: bytes
    depth: int
    start: int  # = parent's depth (0 for a root)
    parent: bytes | None
    kind: AnchorKind
    kv: torch.Tensor | None  # [kv_layers, 2, depth - start, kv_heads, head_dim]; None: no KV layers
    state: torch.Tensor | None  # flat uint8 states at `depth`; None on dense models
    nbytes: int
    tokens: array | None = None  # int64 token ids `[start, depth)`, when the worker gave them


@dataclass(frozen=True)
class RestoreCheck:
    """The verified prefix of a restore chain and what the reply reports about it."""

    chain: tuple[Slab, ...]  # root→leaf, every link restored
    reported: tuple[Slab, ...]  # what the reply lists: the planned links restored (late: all)
    misses: tuple[dict[str, Any], ...]
    late_lookup: bool = False  # the chain came from the late lookup, not the plan
    held: tuple[AnchorHeld, ...] = ()  # committed links of a late chain the plan did not name

    @property
    def depth(self) -> int:
        return self.chain[-1].depth if self.chain else 0

    def info(self) -> dict[str, Any]:
        return {"restored": [{"key": s.key.hex(), "depth": s.depth, "kind": s.kind.value}
                             for s in self.reported],
                "restore_miss": list(self.misses),
                "late_lookup": self.late_lookup, "held": list(self.held)}

    def report(self) -> AnchorReport:
        """The reply's anchor record so far (the request's snapshots add written/held)."""
        return AnchorReport(
            restored=tuple(AnchorHit(s.key, s.depth, s.kind) for s in self.reported),
            restore_miss=tuple(RestoreMiss(bytes.fromhex(m["key"]), m["depth"], m["reason"])
                               for m in self.misses),
            held=self.held, late_lookup=self.late_lookup)


@dataclass
class _Tip:
    key: bytes | None = None
    depth: int = 0


class AnchorStore:
    """Slabs by slot, staged and committed; see the module docstring.

    `kv_bytes_per_token` and `state_bytes` size a slab for the slot table's byte budget.
    `disk`: the disk tier under it, or None.
    """

    def __init__(self, model_id: str, table: SlotTable, *, kv_bytes_per_token: int,
                 state_bytes: int = 0, disk: DiskTier | None = None) -> None:
        self.model_id = model_id
        self.table = table
        self.kv_bytes_per_token = kv_bytes_per_token
        self.state_bytes = state_bytes
        self.disk = disk
        self.ranks: Ranks = ONE_RANK  # a replicated store's agreement (SGLang at TP > 1)
        self.fault: Callable[[str], None] = lambda where: None
        self._live: dict[int, Slab] = {}
        self._slot_of: dict[bytes, int] = {}
        self._staged: dict[int, tuple[Slab, str]] = {}  # slot → (slab, rid)
        # slot → when an unconfirmed slab of a finished request is dropped; None: its TTL
        # starts at the next `start_ttl` (a store whose clock is only read during calls)
        self._staged_deadline: dict[int, float | None] = {}
        # the staged TTL's clock. A worker whose store is replicated (SGLang's tensor-parallel
        # ranks, one store each) sets one that every replica reads alike (the call's own
        # time, stamped by the caller), so their TTL decisions never depend on a process's clock
        self.clock: Callable[[], float] = time.monotonic
        self._tips: dict[str, _Tip] = {}  # rid → deepest anchor restored, held or written
        self._read: dict[tuple[bytes, int], SlabRecord | None] | None = None  # (check_chain)

    # ---- owning loop --------------------------------------------------------------------
    def disk_reads(self, ids: tuple[int, ...], plan: AnchorPlan) -> list[tuple[bytes, int]]:
        """The (key, depth) links `check_chain(ids, plan)` may take from the disk tier: the
        planned links and the late lookup's depths keyed over `ids` that are on disk and not
        in memory, with their ancestors on disk. A worker reads them off its loop first
        (`read_links`, on its copy thread) and hands them to `check_chain`."""
        if self.disk is None:
            return []
        n = len(ids)
        keys = _link_keys(plan, self.model_id, ids)
        # a planned chain's links, and down from its first the ancestors the store completes
        # (`_ancestors`): past those in memory to those on disk
        leaves = [(r.key, r.depth, True, i == 0) for i, r in enumerate(plan.restore)
                  if r.depth < n and keys.get(r) == r.key]
        planned = {s.depth for s in plan.snapshot if 0 < s.depth < n}
        depths = planned | set(self.disk.depths_below(n))
        leaves += [(k, d, d in planned, False)
                   for d, k in anchor_keys(plan.namespace, self.model_id, ids, depths).items()]
        out: dict[tuple[bytes, int], None] = {}
        for key, depth, discover, through in leaves:
            link: tuple[bytes, int] | None = (key, depth)
            while link is not None and link not in out:
                if self.table.contains(*link):
                    slab = self._committed(*link) if through else None
                    link = (slab.parent, slab.start) if slab is not None and slab.parent \
                        and slab.start < slab.depth else None
                    continue
                if not self.disk.has(*link, discover):
                    break
                out[link] = None
                entry = self.disk.entry(link[0])
                link = (entry.parent, entry.start) if entry is not None and entry.parent else None
                discover = True  # a chain's links another worker wrote: one stat each
        return list(out)

    def read_links(self, links: list[tuple[bytes, int]]
                   ) -> dict[tuple[bytes, int], SlabRecord | None]:
        """Any thread: the slabs of `links` read from the disk tier (every check made; None
        for a file that failed or is gone), for `check_chain`'s `read`."""
        assert self.disk is not None
        return {link: self.disk.load(*link) for link in links}

    def check_chain(self, ids: tuple[int, ...], plan: AnchorPlan,
                    read: dict[tuple[bytes, int], SlabRecord | None] | None = None
                    ) -> RestoreCheck:
        """Verify `plan.restore` against the prompt `ids`; the verified prefix (LRU touched).
        `read`: the disk tier's slabs read ahead (`disk_reads`); given, no file is read
        here (a link it lacks stays on disk: the request prefills it)."""
        self._read = read
        try:
            return self._check_chain(ids, plan)
        finally:
            self._read = None

    def _check_chain(self, ids: tuple[int, ...], plan: AnchorPlan) -> RestoreCheck:
        keys = _link_keys(plan, self.model_id, ids)
        chain: list[Slab] = []
        named: list[Slab] = []
        misses: list[dict[str, Any]] = []
        prev = _Tip()
        for ref in plan.restore:
            reason = None
            slot = None
            above: list[Slab] = []
            if ref.depth >= len(ids):
                reason = "covers_prompt"  # at least the last token must be prefilled
            elif keys[ref] != ref.key:
                reason = "key_mismatch"  # the proxy's key is not this prompt's prefix
            elif (slot := self.table.lookup(ref.key, ref.depth)) is None \
                    and (slot := self._promote(ref.key, ref.depth, ids)) is None:
                reason = "not_resident"
            else:
                slab = self._live.get(slot)
                if slab is None or slab.key != ref.key or slab.depth != ref.depth:
                    reason = "chain_mismatch"
                elif not chain and slab.start != 0:  # a chain's last links: its ancestors
                    above, miss = self._ancestors(slab, ids)  # are this store's own
                    if miss is not None:
                        misses.append(miss)
                        break
                elif slab.start != prev.depth or slab.parent != prev.key:
                    reason = "chain_mismatch"
            if reason is not None:
                misses.append({"key": ref.key.hex(), "depth": ref.depth, "reason": reason})
                break
            assert slot is not None
            chain += above
            chain.append(self._live[slot])
            named.append(self._live[slot])
            prev = _Tip(ref.key, ref.depth)
        # Late lookup (ext/held_chain.py): a cut this request would snapshot may have
        # been written since the proxy planned it, by the request ahead of it in the
        # queue; restore it instead of prefilling it again.
        # With a disk tier, every depth it holds is keyed too: a restarted worker (or a new
        # one sharing the directory) restores what its files hold although no proxy plans
        # on them yet, and reports the links as held, so the proxy learns them.
        # A key missing from the index at one of those scanned depths is simply not on disk
        # (this worker's files are indexed): only the plan's own depths and the links a
        # chain names look for a file another worker wrote (one stat each), so the scan
        # costs no stat per disk depth on every request.
        depths = [s.depth for s in plan.snapshot]
        scanned: set[int] = set()
        if self.disk is not None:
            scanned = set(self.ranks.common(self.disk.depths_below(len(ids)))) - set(depths)
            depths += sorted(scanned)
        late = deepest_held_chain(
            plan.namespace, self.model_id, ids, depths,
            lambda key, depth: self._held(key, depth, ids, discover=depth not in scanned))
        held: list[AnchorHeld] = []
        if late and late[-1].depth > prev.depth:
            planned = {r.key for r in plan.restore} | {s.key for s in chain}  # (and implied)
            for slab in late:
                if slab.key in self._slot_of:  # committed: LRU touch and a hit
                    self.table.lookup(slab.key, slab.depth)
                    if slab.key not in planned:  # the proxy may not know it: report it
                        held.append(AnchorHeld(self._slot_of[slab.key], slab.key, slab.depth,
                                               slab.parent, slab.nbytes, slab.kind))
            chain, named, prev = late, late, _Tip(late[-1].key, late[-1].depth)
        return RestoreCheck(tuple(chain), tuple(named), tuple(misses),
                            late_lookup=bool(late) and chain is late, held=tuple(held))

    def _ancestors(self, slab: Slab, ids: tuple[int, ...]
                   ) -> tuple[list[Slab], dict[str, Any] | None]:
        """The committed ancestors of `slab`, root first, by its parent links (in memory, or
        promoted from the disk tier), or the miss of the first one this store lacks.

        Not keyed again: the store keyed each slab over the prompt it prefilled and linked
        it to the anchor that request restored or wrote below it, so a verified leaf's
        ancestors are prefixes of the same prompt; the slot table's key and depth check
        (and a promoted file's tokens) still hold for each. A chain named by its leaf thus
        costs the proxy one link whatever its length. Touches nothing: the leaf's lookup
        refreshes its ancestors (ext/slots.py)."""
        out: list[Slab] = []
        link = slab
        while link.parent is not None:
            up = self._committed(link.parent, link.start)
            if up is None and (slot := self._promote(link.parent, link.start, ids)) is not None:
                up = self._live.get(slot)
            if up is None or up.key != link.parent or up.depth != link.start \
                    or not up.depth < link.depth:
                return [], {"key": link.parent.hex(), "depth": link.start,
                            "reason": "not_resident" if up is None else "chain_mismatch"}
            out.append(up)
            link = up
        if link.start != 0:
            return [], {"key": link.key.hex(), "depth": link.depth, "reason": "chain_mismatch"}
        out.reverse()
        return out, None

    def _committed(self, key: bytes, depth: int) -> Slab | None:
        """The committed slab of `key` at `depth` in memory (slot-checked, nothing touched)."""
        slot = self._slot_of.get(key)
        if slot is None or not self.table.contains(key, depth):
            return None
        slab = self._live.get(slot)
        return slab if slab is not None and slab.key == key and slab.depth == depth else None

    def _held(self, key: bytes, depth: int, ids: tuple[int, ...] | None = None,
              discover: bool = True) -> Slab | None:
        """The slab of `key` at `depth` if it may be restored: committed (slot-checked), or
        staged by a request that finished well and awaits the proxy's confirm. Such a slab is
        complete and was keyed by this worker over the prompt it prefilled; confirmation
        decides what the proxy may plan on, not whether the data is right."""
        if (slab := self._committed(key, depth)) is not None:
            return slab
        for slot, (slab, _) in self._staged.items():
            if slab.key == key and slab.depth == depth and slot in self._staged_deadline:
                return slab
        promoted = self._promote(key, depth, ids, discover)
        return self._live.get(promoted) if promoted is not None else None

    def _promote(self, key: bytes, depth: int, ids: tuple[int, ...] | None = None,
                 discover: bool = True) -> int | None:
        """Load the anchor `key` at `depth` from the disk tier into a committed host slot;
        its slot, or None (no disk tier, no such file, a file that failed its checks, a
        slab of another size than this worker's, tokens other than `ids[start:depth]` (the
        prompt the caller keyed `key` over), no slot to be had). The key already binds the
        prefix; the tokens check is a second, independent one on a file this process did not
        write (another worker's, a copy). `discover` False: the index only, no stat for
        a file another worker may have written since."""
        if self.disk is None:
            return None
        # replicas agree before any of them reads a file, and again on what they read
        if not self.ranks.same(0 if self.disk.has(key, depth, discover) else None):
            return None
        rec = self.disk.load(key, depth) if self._read is None else self._read.get((key, depth))
        why = self._unfit(rec, depth, ids) if rec is not None else "no file"
        if rec is not None and why is not None:
            self.disk.reject(key, why)
        if not self.ranks.same(None if why is not None else _header_digest(rec)):
            return None
        assert rec is not None
        kind = AnchorKind(rec.kind)
        region = Region.THIN if kind in (AnchorKind.TOOL, AnchorKind.INSTRUCTION) else Region.THICK
        res = self.table.reserve(key, depth, rec.nbytes, parent=rec.parent, region=region)
        if res is None:
            return None
        tokens = array("q", rec.tokens.numpy().tobytes()) if rec.tokens is not None else None
        slab = Slab(key, depth, rec.start, rec.parent, kind, rec.kv, rec.state, rec.nbytes,
                    tokens)
        self._commit(res.slot, slab)
        self.table.lookup(key, depth)  # a hit, as a host restore counts one
        if self.disk.pinned(key):
            self.table.pin(key)
        return res.slot

    def _unfit(self, rec: SlabRecord, depth: int, ids: tuple[int, ...] | None) -> str | None:
        """Why a slab read from disk must not be promoted, or None."""
        n = depth - rec.start
        kv_bytes = rec.kv.numel() * rec.kv.element_size() if rec.kv is not None else 0
        state_bytes = rec.state.numel() * rec.state.element_size() if rec.state is not None else 0
        if rec.nbytes != self.kv_bytes_per_token * n + self.state_bytes \
                or kv_bytes != self.kv_bytes_per_token * n or state_bytes != self.state_bytes:
            return "its slab sizes are not this worker's"
        if ids is not None and rec.tokens is not None \
                and (len(ids) < depth or rec.tokens.tolist() != list(ids[rec.start:depth])):
            return "its tokens are not the prompt's"
        if rec.kind not in _KINDS:
            return f"unknown kind {rec.kind!r}"
        return None

    def restore_chain(self, rid: str, ids: tuple[int, ...], plan: AnchorPlan,
                      load: Callable[[tuple[Slab, ...]], T]) -> tuple[T | None, int, AnchorReport]:
        """Restore the verified prefix of `plan.restore` with `load(chain)`;
        (what load returned or None, depth restored, the reply's anchor record so far)."""
        check = self.check_chain(ids, plan)
        if not check.chain:
            return None, 0, check.report()
        self.fault("restore")
        loaded = load(check.chain)
        self.chained(rid, check.chain[-1].key, check.depth)
        return loaded, check.depth, check.report()

    def chained(self, rid: str, key: bytes | None, depth: int) -> None:
        """Record that request `rid` holds the anchor `key` at `depth` (its next parent)."""
        tip = self._tips.setdefault(rid, _Tip())
        if depth >= tip.depth:
            self._tips[rid] = _Tip(key, depth)

    def tip_depth(self, rid: str) -> int:
        tip = self._tips.get(rid)
        return tip.depth if tip is not None else 0

    def write(self, rid: str, key: bytes, depth: int, kind: AnchorKind, region: Region,
              capture: Capture, *, check: Callable[[], None] | None = None,
              ids: tuple[int, ...] | None = None) -> AnchorWritten | AnchorHeld | None:
        """Stage the anchor `key` at `depth` of request `rid` with the rows past its tip:
        `capture(start, depth)` copies them (and the state at `depth`). A prefix the store
        already holds is reported as held; None when nothing could be reserved or the
        capture failed (the request goes on; the slot's old anchor stays). `check` runs
        before anything is reserved and may raise (a caller bug, not a failed snapshot)."""
        tip = self._tips.setdefault(rid, _Tip())
        held_slot = self._slot_of.get(key)
        live = self._live.get(held_slot) if held_slot is not None else None
        if held_slot is not None and live is not None and live.key == key \
                and self.table.contains(key, depth):
            self._tips[rid] = _Tip(key, depth)  # saved by an earlier request: chain on
            return AnchorHeld(held_slot, key, depth, live.parent, live.nbytes, live.kind)
        if check is not None:
            check()
        start = tip.depth
        if not 0 <= start < depth:
            return None
        nbytes = self.kv_bytes_per_token * (depth - start) + self.state_bytes
        res = self.table.reserve(key, depth, nbytes, parent=tip.key, region=region)
        if res is None:
            return None
        try:
            self.fault("snapshot")
            kv, state = capture(start, depth)
        except Exception:
            log.exception("snapshot at depth %d failed; reservation aborted", depth)
            self.table.abort(res.slot)
            return None
        tokens = array("q", ids[start:depth]) if ids is not None else None
        slab = Slab(key, depth, start, tip.key, kind, kv, state, nbytes, tokens)
        self._staged[res.slot] = (slab, rid)
        self._tips[rid] = _Tip(key, depth)
        return AnchorWritten(res.slot, key, depth, tip.key, nbytes, kind)

    def release_request(self, rid: str, *, ok: bool, start_ttl: bool = True) -> None:
        """The request ended: on failure drop its staged anchors now, else start their TTL
        (or, without `start_ttl`, at the next `start_ttl()`: the SGLang scheduler releases a
        request between calls, where it has no fresh time that every TP rank shares)."""
        self._tips.pop(rid, None)
        self._sweep()
        mine = [slot for slot, (_, r) in self._staged.items() if r == rid]
        if not ok:
            self._abort_slots(mine)
        else:
            deadline = self.clock() + STAGED_TTL_S if start_ttl else None
            for slot in mine:
                self._staged_deadline[slot] = deadline

    def start_ttl(self) -> None:
        """Start the TTL of anchors released without one, from `clock()` now."""
        deadline = self.clock() + STAGED_TTL_S
        for slot, t in self._staged_deadline.items():
            if t is None:
                self._staged_deadline[slot] = deadline

    # ---- any thread ---------------------------------------------------------------------
    def confirm(self, slots: list[int], rid: str | None = None) -> tuple[list[int], list[bytes]]:
        """Make staged anchors visible (with `rid`: only those request `rid` staged); returns
        (confirmed slots, keys evicted)."""
        self.fault("confirm")
        confirmed, evicted = [], []
        self._sweep()
        for slot in slots:
            entry = self._staged.get(slot)
            if entry is None or (rid is not None and entry[1] != rid):
                continue
            del self._staged[slot]
            self._staged_deadline.pop(slot, None)
            slab = entry[0]
            evicted.extend(self._commit(slot, slab))
            confirmed.append(slot)
            if self.disk is not None:
                self.disk.put(_record(slab))
        return confirmed, evicted

    def _commit(self, slot: int, slab: Slab) -> list[bytes]:
        """Confirm `slot`'s reservation in the table and hold `slab` there; keys evicted."""
        gone = self.table.confirm(slot)
        for key in gone:
            old = self._slot_of.pop(key, None)
            if old is not None and old != slot:
                self._live.pop(old, None)
        prev = self._live.get(slot)
        if prev is not None:
            self._slot_of.pop(prev.key, None)
        self._live[slot] = slab
        self._slot_of[slab.key] = slot
        return gone

    def abort(self, slots: list[int]) -> list[int]:
        return self._abort_slots([s for s in slots if s in self._staged])

    def abort_request(self, rid: str) -> list[int]:
        return self._abort_slots([slot for slot, (_, r) in self._staged.items() if r == rid])

    def _abort_slots(self, slots: list[int]) -> list[int]:
        for slot in slots:
            self._staged.pop(slot, None)
            self._staged_deadline.pop(slot, None)
            self.table.abort(slot)
        return slots

    def _sweep(self) -> None:
        now = self.clock()
        self._abort_slots([s for s, t in self._staged_deadline.items()
                           if t is not None and t < now])

    def prefix_of(self, key: bytes) -> tuple[tuple[Slab, ...], tuple[int, ...]] | None:
        """The committed chain root→`key` and the tokens it covers, or None when a link
        is gone or a slab has no tokens."""
        chain: list[Slab] = []
        cur: bytes | None = key
        while cur is not None:
            slot = self._slot_of.get(cur)
            slab = self._live.get(slot) if slot is not None else None
            if slab is None or slab.tokens is None or len(chain) > len(self._live):
                return None
            chain.append(slab)
            cur = slab.parent
        chain.reverse()
        tokens: list[int] = []
        for slab in chain:
            if slab.start != len(tokens) or slab.tokens is None:
                return None
            tokens.extend(slab.tokens)
            if len(tokens) != slab.depth:
                return None
        return tuple(chain), tuple(tokens)

    def lookup(self, namespace: bytes, ids: Any, depths: Any, epoch: str) -> LookupReply:
        """Which prefixes `ids[:d]` are committed (no LRU touch). ValueError (WireError) on
        malformed ids or depths."""
        ids, depths = parse_ids(ids, "input_ids"), parse_ids(depths, "depths")
        keys = anchor_keys(namespace, self.model_id, ids, depths)
        return LookupReply(tuple(LookupHit(d, keys[d], self.table.contains(keys[d], d))
                                 for d in depths), epoch)

    def pin(self, key: bytes) -> bool:
        """Pin a committed anchor (held in memory, else loaded from disk first) in the slot
        table and the disk tier: neither evicts it or its ancestors."""
        slot = self._slot_of.get(key)
        if self.disk is not None:
            depth = self._live[slot].depth if slot is not None else next(
                (e.depth for e in self.disk.entries() if e.key == key), None)
            if not self.ranks.same(depth):
                return False
            assert depth is not None
            if not self._promote_chain(key, depth):
                return False  # a link of its chain is gone: it could never restore
        if not self.table.pin(key):
            return False
        if self.disk is not None:
            self.disk.pin(key)
        return True

    def _promote_chain(self, key: bytes, depth: int) -> bool:
        """Load `key`'s chain from the disk tier, leaf to root, where memory lacks a link;
        whether the whole chain is then in memory."""
        cur: tuple[bytes, int] | None = (key, depth)
        while cur is not None:
            slot = self._slot_of.get(cur[0])
            if slot is None:
                slot = self._promote(*cur)
            slab = self._live.get(slot) if slot is not None else None
            if slab is None or slab.depth != cur[1]:
                return False
            cur = (slab.parent, slab.start) if slab.parent else None
        return True

    def unpin(self, key: bytes) -> bool:
        if self.disk is not None:
            self.disk.unpin(key)
        return self.table.unpin(key)

    def evict(self, key: bytes) -> bool:
        on_disk = self.disk.remove(key) if self.disk is not None else False
        if not self.table.evict(key):
            return on_disk
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._live.pop(slot, None)
        return True

    def flush(self) -> int:
        self._abort_slots(list(self._staged))
        self.table.clear()
        n = len(self._live)
        self._live.clear()
        self._slot_of.clear()
        if self.disk is not None:
            self.disk.clear()
        return n

    def staged_count(self) -> int:
        return len(self._staged)

    def slots(self, epoch: str) -> SlotsReply:
        """The slot table's entries (tier `host`) and, after them, the disk tier's anchors
        that are not in memory (tier `disk`)."""
        disk: tuple[DiskSlotEntry, ...] = ()
        if self.disk is not None:
            disk = tuple(DiskSlotEntry(e.key, e.depth, e.parent, e.nbytes,
                                       self.disk.pinned(e.key))
                         for e in self.disk.entries() if e.key not in self._slot_of)
        return SlotsReply(tuple(self.table.entries()), epoch, disk)

    def stats(self, epoch: str, *, device_pinned_tokens: int = 0,
              device_pin_budget_tokens: int = 0) -> StatsReply:
        """The slot table's counters and the staged count; `device_*`: the worker's device
        figures; the disk tier's figures when there is one."""
        disk = None
        if self.disk is not None:
            d = self.disk.stats()
            disk = DiskStatsRecord(d.enabled, d.bytes, d.files, d.budget_bytes, d.writes,
                                   d.loads, d.skips, d.evictions, d.imports)
        return StatsReply(**msgspec.structs.asdict(self.table.stats()),
                          staged=self.staged_count(), epoch=epoch,
                          device_pinned_tokens=device_pinned_tokens,
                          device_pin_budget_tokens=device_pin_budget_tokens, disk=disk)


_KINDS = frozenset(k.value for k in AnchorKind)


def _header_digest(rec: SlabRecord | None) -> int | None:
    """What replicas compare of a slab read from their own files (module docstring): 63
    bits of a hash over where it sits in its chain and its kind (its payload and size are
    each rank's own shard's, checked by `_unfit`)."""
    if rec is None:
        return None
    h = hashlib.blake2b(digest_size=8, person=b"anchorcache.rk")
    h.update(b"%s|%d|%d|%s|%s" % (rec.key, rec.depth, rec.start, rec.parent or b"",
                                  rec.kind.encode()))
    return int.from_bytes(h.digest(), "big") >> 1


def _record(slab: Slab) -> SlabRecord:
    tokens = (torch.frombuffer(bytearray(slab.tokens.tobytes()), dtype=torch.int64)
              if slab.tokens is not None else None)
    return SlabRecord(slab.key, slab.depth, slab.start, slab.parent, slab.kind.value, slab.kv,
                      slab.state, slab.nbytes, tokens)


def _link_keys(plan: AnchorPlan, model_id: str, ids: tuple[int, ...]) -> dict[AnchorRef, bytes]:
    """Each restore link's key recomputed over `ids`, in the link's own namespace (a shared
    toolset's root) or the plan's."""
    out: dict[AnchorRef, bytes] = {}
    for ns in {r.namespace or plan.namespace for r in plan.restore}:
        links = [r for r in plan.restore if (r.namespace or plan.namespace) == ns]
        keys = anchor_keys(ns, model_id, ids, [r.depth for r in links if r.depth <= len(ids)])
        out.update({r: keys[r.depth] for r in links if r.depth in keys})
    return out
