"""Anchor planning: which chain to restore and which cuts to snapshot, per request. Pure.

`plan()` picks, from the split's verified cuts and the index of committed anchors, the
deepest anchor whose whole chain is known and that is an exact prefix of this prompt (keys
cover every token, so equal key ⇒ equal prefix), and asks for snapshots at the instruction
cut, the conversation cut, the end of the messages and the end of the prompt, plus the
response anchor. Inside the instruction prefix it also asks for tool anchors at tool cuts
(where a tool's schema ends) at least `tool_gap` tokens apart and from the instruction cut:
they are the instruction anchor's ancestors in its chain, so a toolset that starts with
another one's first tools restores their common part (written only where the restore does
not already cover them: a toolset's first request). `record()` folds a settled request's
outcome into the index. No I/O: the anchor life cycle (`proxy/lifecycle.py`) calls the
worker and the ledger around these.

Namespaces: every key is derived in a namespace, a hash of the tenant's server-side secret
salt, its name and (optionally) the client's `cache_salt`, which can only narrow sharing
inside the tenant. The one exception is a toolset an admin marked shared: its instruction
anchor lives in the shared namespace, and any tenant's chain may start with it (its key
still covers every token of the instruction prefix).
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from anchorcache.defaults import CONVERSATIONS_PER_SCOPE, TOOL_ANCHOR_GAP_TOKENS
from anchorcache.wire import (
    AnchorHit,
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    AnchorReport,
    AnchorWritten,
    Region,
    SnapshotSpec,
    key_hasher,
)

from .anchor_index import AnchorIndex, AnchorRecord
from .splitter.types import CutKind, SplitResult


def tenant_namespace(salt: bytes, tenant: str, cache_salt: str | None = None) -> bytes:
    """The key namespace of `tenant` (narrowed by a client `cache_salt`, if any)."""
    parts = [salt, tenant.encode()] + ([cache_salt.encode()] if cache_salt is not None else [])
    h = hashlib.blake2b(digest_size=16, person=b"acache.tenant")
    for part in parts:
        h.update(len(part).to_bytes(4, "little") + part)
    return h.digest()


@dataclass(frozen=True)
class Probe:
    """A split's chain on one worker (`Planner.probe`): what routing compares, and what
    `Planner.plan` finishes."""

    planner: Planner
    split: SplitResult
    namespace: bytes
    shared: bytes | None
    cuts: list[tuple[int, AnchorKind]]
    instr_depth: int | None
    shared_root: AnchorRecord | None  # the shared toolset's instruction anchor, live here
    prompt: PromptKeys
    chain: list[AnchorRecord]
    # whether `chain` is the deepest there is (the lineage's, or a scan of every depth);
    # else the deepest from the probe's floor on (or down the lineage only): a lower bound
    whole: bool

    @property
    def restore_depth(self) -> int:
        return self.chain[-1].depth if self.chain else 0


@dataclass(frozen=True)
class Plan:
    namespace: bytes
    request: AnchorPlan | None  # what the worker gets; None: no anchor part at all
    chain: tuple[AnchorRecord, ...] = ()  # planned restore, root→leaf
    instruction: tuple[int, bytes] | None = None  # (depth, key) of the instruction cut, if any

    @property
    def restore_depth(self) -> int:
        return self.chain[-1].depth if self.chain else 0

    def restored(self, report: AnchorReport) -> Sequence[AnchorRecord | AnchorHit]:
        """The links the request restored, root→leaf. The request names only the chain's
        leaf and the worker lists only that (it completes the chain by its own parent
        links, which are what this index learnt from it: `chain`), or a late chain whole
        (`late_lookup`, the links it found past the plan). O(1) for a chain restored whole."""
        if not report.restored or report.late_lookup:
            return report.restored
        deepest = report.restored[-1].depth
        if deepest == self.restore_depth:
            return self.chain
        return tuple(r for r in self.chain if r.depth <= deepest)


@dataclass(frozen=True)
class Settled:
    """What `record()` changed: for the ledger and the toolset registry."""

    committed: tuple[AnchorRecord, ...]  # newly confirmed or reported held
    removed: tuple[bytes, ...]  # restore misses and evictions


# Without the prompt a new one extends, the newest of a scope's prompts it is compared with
SCANNED_PROMPTS = 8
# The most children of one anchor the planner keys, following a conversation down its own
# anchors; more (an instruction anchor that many conversations start from): the scan decides
LINEAGE_FANOUT = 8


@dataclass(frozen=True)
class _Marks:
    """A prompt hashed before (its int64 bytes) and the key states at depths in it."""

    buf: bytes
    depths: tuple[int, ...]  # ascending
    states: tuple[Any, ...]  # blake2b state after `depths[i]` tokens (copy before use)


class PrefixKeys:
    """Anchor keys of a prompt's prefixes, hashing only what earlier prompts did not cover.

    A key is a hash of every token of its prefix, so keying a 100k-token conversation's
    anchors costs a pass over 800 KB per request, growing with the conversation, not the
    turn. This keeps, per scope (the caller's namespace and the namespace keyed in), the
    hash states at the depths its last prompts keyed (one per conversation in flight); a
    new prompt resumes from the deepest state whose prefix it repeats byte for byte (a
    memcmp, not a hash) of the prompt it extends where the split names it, else of the
    newest few, and hashes only the rest. The result equals `wire.anchor_keys`.

    Scopes never mix: a prompt is compared only with prompts of the same caller namespace
    (a tenant, narrowed by its cache salt), also when it keys in the shared namespace, so
    no tenant's lookup can depend on, or time, another tenant's prompts. Bounded: at most
    `per_scope` prompts per scope and `max_bytes` of prompts in all (least recently used
    scopes go first); the prompts are the splits' own bytes, shared, not copied.
    """

    def __init__(self, model_id: str, *, per_scope: int = CONVERSATIONS_PER_SCOPE,
                 max_bytes: int = 64 << 20) -> None:
        self.model_id = model_id
        self.per_scope = per_scope
        self.max_bytes = max_bytes
        self._scopes: OrderedDict[tuple[bytes, bytes], list[_Marks]] = OrderedDict()
        self._bytes = 0

    def keys(self, scope: bytes, namespace: bytes, buf: bytes,
             depths: Iterable[int]) -> dict[int, bytes]:
        """Keys in `namespace` of the prefixes `buf[:8 * d]` (int64 tokens) for each depth
        `d` in `depths` (each in `[1, len(buf) // 8]`); states kept under `scope`."""
        prompt = self.prompt(scope, namespace, buf)
        keys = prompt.keys(depths)
        prompt.keep()
        return keys

    def prompt(self, scope: bytes, namespace: bytes, buf: bytes,
               prior: bytes | None = None) -> PromptKeys:
        """The keys of `buf`'s prefixes in `namespace`, resumed from the states of `scope`'s
        earlier prompts that `buf` repeats (verified once, here); `keep()` it when done.
        `prior`: the earlier prompt this one extends (`SplitResult.prior_token_bytes`), the
        one compared where kept (else the newest few are), its depths `lineage`."""
        start: list[tuple[int, Any]] = [(0, key_hasher(namespace, self.model_id))]
        lineage: list[tuple[int, Any]] = []
        marks = self._scopes.get((scope, namespace))
        if marks is not None:
            self._scopes.move_to_end((scope, namespace))
            limit = len(buf) // 8
            before = next((m for m in marks if m.buf is prior), None) if prior else None
            if before is None:
                start += self._verified(marks[:SCANNED_PROMPTS], buf, limit)
            else:
                start += (lineage := self._verified([before], buf, limit))
                same = next((m for m in marks if m.buf is buf), None)  # keyed before
                if same is not None:
                    start += zip(same.depths, same.states, strict=True)
            start.sort(key=lambda s: s[0])
        return PromptKeys(self, (scope, namespace), buf, start, tuple(d for d, _ in lineage))

    @staticmethod
    def _verified(marks: list[_Marks], buf: bytes, limit: int) -> list[tuple[int, Any]]:
        """Each earlier prompt's states at depths up to `limit` whose prefix `buf` repeats.
        Newest first: once one is repeated to some depth, an older one adds only states
        deeper than that (an agent's earlier turns are all prefixes of its last one)."""
        out: list[tuple[int, Any]] = []
        deepest = 0
        for m in marks:
            hi = bisect.bisect_right(m.depths, limit)
            if hi == 0 or m.depths[hi - 1] <= deepest:
                continue
            if m.buf is buf or buf.startswith(memoryview(m.buf)[:m.depths[hi - 1] * 8]):
                lo = hi  # all of them: one memcmp (none for this very prompt)
            else:  # a repeated prefix repeats every shorter one: the deepest by bisection
                lo = 0
                while lo < hi:
                    mid = (lo + hi) // 2
                    if buf.startswith(memoryview(m.buf)[:m.depths[mid] * 8]):
                        lo = mid + 1
                    else:
                        hi = mid
            if lo:
                out += zip(m.depths[:lo], m.states[:lo], strict=True)
                deepest = max(deepest, m.depths[lo - 1])
        return out

    def _keep(self, scope: tuple[bytes, bytes], marks: _Marks) -> None:
        entries = self._scopes.setdefault(scope, [])
        self._scopes.move_to_end(scope)
        if entries and entries[0].buf is marks.buf:  # the same split planned again
            self._bytes -= len(entries.pop(0).buf)
        entries.insert(0, marks)
        self._bytes += len(marks.buf)
        while len(entries) > self.per_scope:
            self._bytes -= len(entries.pop().buf)
        while self._bytes > self.max_bytes:
            oldest_scope, oldest = next(iter(self._scopes.items()))
            if oldest is entries and len(entries) == 1:
                break  # the newest prompt alone: kept whatever its size
            self._bytes -= len(oldest.pop().buf)
            if not oldest:
                del self._scopes[oldest_scope]

    def clear(self) -> None:
        self._scopes.clear()
        self._bytes = 0


class PromptKeys:
    """One prompt's prefix keys in one namespace (`PrefixKeys.prompt`): each depth is hashed
    on from the deepest state below it, verified from an earlier prompt or keyed here, so a
    plan that keys in steps (the deepest known depths first, then its cuts) hashes each
    token once. `keep()` leaves the states of the depths keyed for the next turns."""

    def __init__(self, owner: PrefixKeys, scope: tuple[bytes, bytes], buf: bytes,
                 start: list[tuple[int, Any]], lineage: tuple[int, ...] = ()) -> None:
        self._owner, self._scope, self.buf = owner, scope, buf
        self.lineage = lineage  # the depths the prior prompt keyed that this one repeats
        self._depths = [d for d, _ in start]  # ascending, 0 first
        self._states = [h for _, h in start]
        self._keyed: dict[int, Any] = {}

    def keys(self, depths: Iterable[int]) -> dict[int, bytes]:
        """Keys of the prefixes `buf[:8 * d]` for each `d` in `depths` (in `[1, len // 8]`)."""
        wanted = sorted(set(depths))
        if not wanted:
            return {}
        assert 1 <= wanted[0] and wanted[-1] * 8 <= len(self.buf), "depth outside the prompt"
        keys: dict[int, bytes] = {}
        for d in wanted:
            h = self._keyed.get(d)
            if h is None:
                i = bisect.bisect_right(self._depths, d) - 1
                depth, h = self._depths[i], self._states[i].copy()
                if d > depth:
                    h.update(memoryview(self.buf)[depth * 8:d * 8])
                    self._depths.insert(i + 1, d)  # deeper depths resume from here
                    self._states.insert(i + 1, h)
                self._keyed[d] = h
            keys[d] = h.digest()
        return keys

    def keep(self, depths: Iterable[int] | None = None) -> None:
        """Leave the states at `depths` (keyed here; default: all keyed) for later prompts."""
        kept = sorted(self._keyed if depths is None else set(depths) & self._keyed.keys())
        if kept:
            self._owner._keep(self._scope, _Marks(self.buf, tuple(kept),
                                                  tuple(self._keyed[d] for d in kept)))


class Planner:
    def __init__(self, model_id: str, epoch: str, index: AnchorIndex | None = None, *,
                 hybrid: bool = False, tool_gap: int = TOOL_ANCHOR_GAP_TOKENS,
                 prefix_keys: PrefixKeys | None = None) -> None:
        """`prefix_keys`: the key states of the planners of one proxy's workers (keys do
        not depend on the worker: a turn planned on one resumes the probes of the others)."""
        self.model_id = model_id
        self.epoch = epoch
        self.index = index if index is not None else AnchorIndex()
        # a hybrid (recurrent) model: every cut inside a prompt ends a prefill chunk there,
        # one more prefill round, so only the cuts a later turn needs are made (`_cuts`)
        self.hybrid = hybrid
        if tool_gap < 0:
            raise ValueError("tool_gap must be >= 0")
        self.tool_gap = tool_gap  # tokens between tool anchors (0: none)
        if prefix_keys is not None and prefix_keys.model_id != model_id:
            raise ValueError("prefix keys of another model")
        self.prefix_keys = prefix_keys if prefix_keys is not None else PrefixKeys(model_id)

    def _tool_cuts(self, split: SplitResult) -> list[int]:
        """The tool cuts to anchor: each at least `tool_gap` tokens past the previous one
        (the first past the prompt's start) and before the instruction cut."""
        instr = split.instruction_cut
        if not self.tool_gap or instr is None:
            return []
        out, last = [], 0
        for pos in split.tool_cuts:
            if pos - last >= self.tool_gap and instr - pos >= self.tool_gap:
                out.append(pos)
                last = pos
        return out

    def _cuts(self, split: SplitResult) -> list[tuple[int, AnchorKind]]:
        """Snapshot-worthy cuts strictly inside the prompt (the last token is always
        prefilled). On a hybrid model the conversation cut is left out when a messages cut
        follows it and the template renders the messages between them the same in the next
        turn (`stable_tail`): the next turn then restores the messages anchor (or the
        prompt's end), the conversation anchor would only be their fallback, and each cut
        costs a prefill round. (Where the newest messages render differently later, e.g.
        Mistral's system prompt in the last user message, the conversation cut is the hit.)"""
        n = len(split.input_ids)
        skip_conversation = self.hybrid and split.stable_tail and any(
            c.kind == CutKind.MESSAGES and c.position < n for c in split.anchor_cuts)
        out = [(pos, AnchorKind.TOOL) for pos in self._tool_cuts(split)]  # inside the prompt
        for cut in split.anchor_cuts:  # TURN cuts are never anchored
            if not 0 < cut.position < n:
                continue
            if cut.kind == CutKind.INSTRUCTION:
                out.append((cut.position, AnchorKind.INSTRUCTION))
            elif cut.kind == CutKind.CONVERSATION and skip_conversation:
                continue
            elif cut.kind in (CutKind.CONVERSATION, CutKind.MESSAGES, CutKind.HINT):
                out.append((cut.position, AnchorKind.CONVERSATION))
        return out

    def chunk_only(self, split: SplitResult) -> Plan:
        """Anchors off: same prefill chunking, nothing restored or saved."""
        depths = tuple(sorted({d for d, _ in self._cuts(split)}))
        return Plan(b"", AnchorPlan(namespace=b"", chunk_at=depths) if depths else None)

    def _live(self, rec: AnchorRecord | None, depth: int) -> bool:
        return rec is not None and rec.depth == depth and rec.epoch == self.epoch

    def _deepest_chain(self, ns: bytes, prompt: PromptKeys, n: int,
                       shared_root: AnchorRecord | None, floor: int | None = 0
                       ) -> tuple[list[AnchorRecord], bool]:
        """The chain to the deepest anchor below depth `n` whose anchor in `ns` is live and
        prefixes the prompt, with every link live (or the shared root): found down the
        conversation's own anchors where the prompt extends a prior one (`_lineage_tip`),
        else by the scan of the depths from `floor` (None: no scan); and whether the
        lineage found it."""
        tip = self._lineage_tip(ns, prompt, n) if prompt.lineage else None
        if tip is not None:
            links = self._chain(ns, tip, shared_root)
            if links is not None:
                return links, True
        if floor is None:
            return [], False
        return self._scan(ns, prompt, self.index.depths(ns, below=n, floor=floor),
                          shared_root), False

    def _chain(self, ns: bytes, rec: AnchorRecord, shared_root: AnchorRecord | None
               ) -> list[AnchorRecord] | None:
        """`rec`'s chain, root→leaf, where every link is live in `ns` (or the shared root)."""
        links = self.index.chain(rec.key)
        if links is None:
            return None
        epoch, root = self.epoch, shared_root.key if shared_root is not None else None
        if all((r.namespace == ns and r.epoch == epoch) or r.key == root for r in links):
            return links
        return None

    def _lineage_tip(self, ns: bytes, prompt: PromptKeys, n: int) -> AnchorRecord | None:
        """The deepest anchor of `ns` down the prior prompt's line: of the depths that prompt
        keyed (its cuts, its end, its restore) which this one repeats, the deepest with a
        live anchor, then down its children while one prefixes this prompt (the prior
        turn's response anchor; what other processes wrote since). An agent's turn thus
        costs the few keys of its own anchors, whatever else the namespace holds. None
        where the line holds no anchor, or forks into more than `LINEAGE_FANOUT` children."""
        # (below the prompt's end: its last token is always prefilled; the prior may be this
        # very prompt, a retry)
        lineage = [d for d in prompt.lineage if d < n]
        keys = prompt.keys(lineage)  # states kept from the prior prompt: no hashing
        tip = next((r for d in reversed(lineage)
                    if (r := self.index.get(keys[d])) is not None
                    and r.namespace == ns and self._live(r, d)), None)
        while tip is not None:
            children = [c for c in self.index.children(tip.key)  # (deeper: a worker that
                        if tip.depth < c.depth < n  # names a loop of parents cannot hang this)
                        and c.namespace == ns and self._live(c, c.depth)]
            if not children:
                return tip
            if len(children) > LINEAGE_FANOUT:
                return None
            keys = prompt.keys(c.depth for c in children)
            deeper = [c for c in children if keys[c.depth] == c.key]
            if not deeper:
                return tip
            tip = max(deeper, key=lambda c: c.depth)
        return None

    def _scan(self, ns: bytes, prompt: PromptKeys, known: list[int],
              shared_root: AnchorRecord | None) -> list[AnchorRecord]:
        """The chain to the deepest of the `known` depths (ascending) whose anchor prefixes
        the prompt, links live. Keyed deepest first, a few depths at a time, then four
        times as many, so that a prompt whose anchors are the namespace's deepest keys only
        those; every depth is keyed only where nothing deep is found."""
        hi, batch = len(known), 4
        while hi > 0:
            lo = max(0, hi - batch)
            keys = prompt.keys(known[lo:hi])
            for depth in reversed(known[lo:hi]):
                rec = self.index.get(keys[depth])
                if rec is None or rec.namespace != ns or not self._live(rec, depth):
                    continue
                links = self._chain(ns, rec, shared_root)
                if links is not None:
                    return links
            hi, batch = lo, batch * 4
        return []

    def probe(self, split: SplitResult, namespace: bytes, *, shared: bytes | None = None,
              floor: int | None = 0) -> Probe:
        """What this worker's anchors give `split` in `namespace` (its chain, and so its
        restore depth: routing compares them), the first half of `plan`, which finishes
        it for the worker chosen: a request costs one plan however many workers it was
        routed among. `shared`: the shared-toolset namespace, whose instruction anchor may
        root the chain. `floor`: where the conversation's own line of anchors (`lineage`)
        gives nothing, scan the namespace's depths from there only (another worker restores
        that deep: this one loses below it whatever it holds), None: not at all."""
        ns = namespace
        cuts = self._cuts(split)
        instr_depth = next((d for d, k in cuts if k == AnchorKind.INSTRUCTION), None)
        buf = split.token_bytes
        shared_root = None
        if shared is not None and instr_depth is not None:
            skey = self.prefix_keys.keys(ns, shared, buf, [instr_depth])[instr_depth]
            rec = self.index.get(skey)
            if self._live(rec, instr_depth) and rec is not None and rec.namespace == shared:
                shared_root = rec
        prompt = self.prefix_keys.prompt(ns, ns, buf, split.prior_token_bytes)
        chain, whole = self._search(ns, prompt, len(split.input_ids), shared_root, floor)
        return Probe(self, split, ns, shared, cuts, instr_depth, shared_root, prompt, chain,
                     whole)

    def deepen(self, probe: Probe, floor: int) -> Probe:
        """`probe` (this planner's, made since the index last changed) searched again from
        `floor` (routing's second pass): its cuts, shared root and prompt keys as they are."""
        assert probe.planner is self
        chain, whole = self._search(probe.namespace, probe.prompt, len(probe.split.input_ids),
                                    probe.shared_root, floor)
        return replace(probe, chain=chain, whole=whole)

    def _search(self, ns: bytes, prompt: PromptKeys, n: int,
                shared_root: AnchorRecord | None, floor: int | None
                ) -> tuple[list[AnchorRecord], bool]:
        """A probe's chain from `floor` (`probe`), and whether it is the deepest there is."""
        chain, lineage = self._deepest_chain(ns, prompt, n, shared_root, floor)
        if shared_root is not None and (not chain or chain[-1].depth < shared_root.depth):
            chain = [shared_root]  # deeper than the tenant's own tool anchors
        # the deepest there is: down the lineage, by a scan of every depth, or by one from
        # the floor that found a chain there (a deeper one would have been scanned first)
        whole = lineage or floor == 0 or (floor is not None and bool(chain)
                                          and chain[-1].depth >= floor)
        return chain, whole

    def plan(self, split: SplitResult, namespace: bytes, *, shared: bytes | None = None,
             skip_instruction: bool = False, probe: Probe | None = None) -> Plan:
        """Plan `split` in `namespace` (`probe`: this planner's probe of it, made since
        the index last changed); `skip_instruction`: do not snapshot the instruction cut
        and its tool cuts (another request is writing them)."""
        if probe is None or not probe.whole or probe.planner is not self \
                or probe.split is not split or probe.namespace != namespace \
                or probe.shared != shared:
            probe = self.probe(split, namespace, shared=shared)
        ns, n, cuts, instr_depth = namespace, len(split.input_ids), probe.cuts, probe.instr_depth
        prompt, chain = probe.prompt, probe.chain
        # the snapshot depths' keys (and the chain's): the next turn resumes from their
        # states and looks for its anchors there
        depths = [d for d, _ in cuts] + [n] + ([chain[-1].depth] if chain else [])
        keys = prompt.keys(depths)
        prompt.keep(depths)
        # Every cut is asked for: the worker saves those past what it actually restored and
        # reports (and chains onto) those it already holds. The index cannot know either: a
        # planned link may be gone (eviction, worker restart), so the restore may fail.
        # The chain is named by its leaf: the worker completes it by its own parent links
        # (ext/store.py), so a turn costs the wire one link however long its conversation.
        snapshots = {}
        for depth, kind in cuts:
            thin = kind in (AnchorKind.TOOL, AnchorKind.INSTRUCTION)
            if thin and skip_instruction:
                continue
            region = Region.THIN if thin else Region.THICK
            snapshots[depth] = SnapshotSpec(depth, kind, region)
        # The whole prompt, generation prompt included: the next turn's prompt starts with it
        # whenever the template renders the assistant reply right after it.
        snapshots.setdefault(n, SnapshotSpec(n, AnchorKind.CONVERSATION, Region.THICK))
        request = AnchorPlan(
            namespace=ns,
            restore=tuple(r.ref if r.namespace == ns else AnchorRef(r.key, r.depth, r.namespace)
                          for r in chain[-1:]),
            snapshot=tuple(snapshots[d] for d in sorted(snapshots)),
            snapshot_response=True,
            chunk_at=tuple(sorted({d for d, _ in cuts})),
            confirm=True,
        )
        instruction = (instr_depth, keys[instr_depth]) if instr_depth else None
        return Plan(ns, request, tuple(chain), instruction)

    def warm(self, ids: tuple[int, ...], namespace: bytes) -> AnchorPlan:
        """Snapshot the instruction prefix `ids` as an instruction anchor (thin region)."""
        n = len(ids)
        return AnchorPlan(namespace=namespace,
                          snapshot=(SnapshotSpec(n, AnchorKind.INSTRUCTION, Region.THIN),),
                          confirm=True)

    # ---- after the worker replied ------------------------------------------------------
    def reset(self, epoch: str) -> int:
        """A new worker epoch: its anchors are gone; forget them all. Returns how many."""
        self.epoch = epoch
        return self.index.clear()

    def record(self, namespace: bytes, report: AnchorReport, confirmed: Iterable[int],
               evicted: Iterable[bytes]) -> Settled:
        """Fold a settled request into the index: misses and evictions out, confirmed
        written anchors and held ones in."""
        removed = [m.key for m in report.restore_miss] + list(evicted)
        for key in removed:
            self.index.remove(key)
        ok = set(confirmed)
        added = []
        entries: list[AnchorWritten] = [w for w in report.written if w.slot in ok]
        entries += list(report.held)
        for w in entries:
            # held ones too: the worker derived their keys in this request's namespace
            rec = AnchorRecord(namespace=namespace, key=w.key, depth=w.depth, parent=w.parent,
                               kind=w.kind, slot=w.slot, nbytes=w.nbytes, epoch=self.epoch)
            self.index.add(rec)
            added.append(rec)
        return Settled(tuple(added), tuple(removed))
