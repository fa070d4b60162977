"""Anchor planning: which chain to restore and which cuts to snapshot, per request.

`plan()` is pure: from the split's verified cuts and the index of committed anchors it picks
the deepest anchor whose whole chain is known and that is an exact prefix of this prompt
(keys cover every token, so equal key ⇒ equal prefix), and asks for snapshots at the
instruction cut, the conversation cut, the end of the messages (where the next turn's
history ends) and the end of the prompt, plus the response anchor. `settle()` is the one
place with I/O: after a successful reply it confirms the snapshots the worker wrote (making
them visible); evictions and misses it reports leave the index. A failed request is aborted
by rid instead, and the worker drops what it staged for it.

The key has a namespace from day one: a hash of the server-side tenant salt and tenant id,
so tenants never share anchors unless an admin shares a toolset.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from anchorcache.wire import AnchorKind, AnchorPlan, AnchorRef, Region, SnapshotSpec, anchor_keys

from .anchor_index import AnchorIndex, AnchorRecord
from .errors import ApiError
from .splitter.types import CutKind, SplitResult
from .worker_client import WorkerClient

log = logging.getLogger("anchorcache.proxy")

DEFAULT_TENANT = "default"


def tenant_namespace(salt: str, tenant: str) -> bytes:
    return hashlib.blake2b(f"{len(salt)}:{salt}|{tenant}".encode(), digest_size=16,
                           person=b"acache.tenant").digest()


@dataclass(frozen=True)
class Plan:
    namespace: bytes
    request: AnchorPlan | None  # what the worker gets; None: no anchor part at all
    chain: tuple[AnchorRecord, ...] = ()  # planned restore, root→leaf

    @property
    def restore_depth(self) -> int:
        return self.chain[-1].depth if self.chain else 0


class Planner:
    def __init__(self, model_id: str, epoch: str, *, salt: str, worker: WorkerClient | None = None,
                 index: AnchorIndex | None = None) -> None:
        self.model_id = model_id
        self.epoch = epoch
        self.salt = salt
        self.worker = worker
        self.index = index if index is not None else AnchorIndex()

    def namespace(self, tenant: str = DEFAULT_TENANT) -> bytes:
        return tenant_namespace(self.salt, tenant)

    @staticmethod
    def _cuts(split: SplitResult) -> list[tuple[int, AnchorKind]]:
        """Snapshot-worthy cuts strictly inside the prompt (the last token is always prefilled)."""
        n = len(split.input_ids)
        out = []
        for cut in split.cuts:
            if not 0 < cut.position < n:
                continue
            if cut.kind == CutKind.INSTRUCTION:
                out.append((cut.position, AnchorKind.INSTRUCTION))
            elif cut.kind in (CutKind.CONVERSATION, CutKind.MESSAGES, CutKind.HINT):
                out.append((cut.position, AnchorKind.CONVERSATION))
        return out

    def chunk_only(self, split: SplitResult) -> Plan:
        """Anchors off: same prefill chunking, nothing restored or saved."""
        depths = tuple(sorted({d for d, _ in self._cuts(split)}))
        return Plan(b"", AnchorPlan(namespace=b"", chunk_at=depths) if depths else None)

    def plan(self, split: SplitResult, tenant: str = DEFAULT_TENANT) -> Plan:
        ns = self.namespace(tenant)
        ids = split.input_ids
        n = len(ids)
        cuts = self._cuts(split)
        known = [d for d in self.index.depths(ns) if d < n]
        keys = anchor_keys(ns, self.model_id, ids, known)

        chain: list[AnchorRecord] = []
        for depth in sorted(known, reverse=True):
            rec = self.index.get(keys[depth])
            if rec is None or rec.namespace != ns or rec.depth != depth or rec.epoch != self.epoch:
                continue
            links = self.index.chain(rec.key)
            if links is not None:
                chain = links
                break
        # Every cut is asked for: the worker saves those past what it actually restored and
        # skips (chaining onto) those it already holds. The index cannot know either: a
        # planned link may be gone (eviction, worker restart), so the restore may end early.
        snapshots = {}
        for depth, kind in cuts:
            region = Region.THIN if kind == AnchorKind.INSTRUCTION else Region.THICK
            snapshots[depth] = SnapshotSpec(depth, kind, region)
        # The whole prompt, generation prompt included: the next turn's prompt starts with it
        # whenever the template renders the assistant reply right after it, so only the
        # really new tokens are prefilled (the response anchor covers an echoed reply).
        snapshots[n] = SnapshotSpec(n, AnchorKind.CONVERSATION, Region.THICK)
        request = AnchorPlan(
            namespace=ns,
            restore=tuple(AnchorRef(r.key, r.depth) for r in chain),
            snapshot=tuple(snapshots[d] for d in sorted(snapshots)),
            snapshot_response=True,
            chunk_at=tuple(sorted({d for d, _ in cuts})),
        )
        return Plan(ns, request, tuple(chain))

    # ---- after the worker replied ------------------------------------------------------
    def observe_epoch(self, epoch: str | None) -> None:
        """A new worker epoch means its anchors are gone: forget them all."""
        if epoch and epoch != self.epoch:
            dropped = self.index.clear()
            log.info("worker epoch %s → %s: %d anchors marked lost", self.epoch, epoch, dropped)
            self.epoch = epoch

    def record_result(self, plan: Plan, meta: dict[str, Any], confirmed: dict[str, Any]) -> None:
        """Pure bookkeeping of a settled request: misses out, confirmed anchors in."""
        anchors = meta.get("anchors", {})
        for miss in anchors.get("restore_miss", []):
            self.index.remove(bytes.fromhex(miss["key"]))
        for key in confirmed.get("evicted", []):
            self.index.remove(bytes.fromhex(key))
        ok = set(confirmed.get("confirmed", []))
        for w in anchors.get("written", []):
            if w["slot"] in ok:
                self.index.add(AnchorRecord(
                    namespace=plan.namespace, key=bytes.fromhex(w["key"]), depth=w["depth"],
                    parent=bytes.fromhex(w["parent"]) if w["parent"] else None,
                    kind=AnchorKind(w["kind"]), slot=w["slot"], nbytes=w["nbytes"],
                    epoch=self.epoch))

    async def settle(self, plan: Plan, meta: dict[str, Any]) -> None:
        """Confirm what the worker wrote for a request that succeeded (`meta`: its final meta
        info). A failed request is never settled: aborting it by rid makes the worker drop its
        staged snapshots."""
        if plan.request is None or not plan.namespace or self.worker is None:
            return
        self.observe_epoch(meta.get("epoch"))
        written = [w["slot"] for w in meta.get("anchors", {}).get("written", [])]
        confirmed: dict[str, Any] = {}
        if written:
            try:
                confirmed = await self.worker.post("/anchor/confirm", {"slots": written})
            except ApiError as e:  # the request itself succeeded; only the anchors are lost
                log.warning("anchor confirm failed: %s", e.message)
                return
            self.observe_epoch(confirmed.get("epoch"))
        self.record_result(plan, meta, confirmed)
