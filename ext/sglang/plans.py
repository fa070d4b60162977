"""Anchored requests on the scheduler, from their first admission match to their end.

A request's anchor plan rides in its own sampling parameters (`custom_params[PLAN_PARAM]`,
ext/sglang/rpc.py), read when SGLang first matches the request for admission
(`Plans.register`); no call precedes it. Its end comes once: at its release (the report is
pushed to the HTTP process unasked), or by the HTTP side's `finish` when that push did not
come or the request failed. Reports and ended runs are kept a while (`ENDED_KEPT`): a
`finish` may come after the push, and a plan may reach the scheduler after its `finish`
(the client went away).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import orjson

from anchorcache.ext.disk_tier import SlabRecord
from anchorcache.ext.store import AnchorStore, RestoreCheck
from anchorcache.wire import (
    AnchorHeld,
    AnchorPlan,
    AnchorWritten,
    Record,
    SnapshotSpec,
    WireError,
    anchor_keys,
)

from .device import Placement
from .rpc import PLAN_PARAM

log = logging.getLogger("anchorcache.sglang")

ENDED_KEPT = 1024  # ended runs whose report (or failure) the scheduler remembers


@dataclass
class Plan:
    """One anchored request, from its first admission match to its release."""

    ids: tuple[int, ...]
    plan: AnchorPlan
    info: dict[str, Any]  # the chain check's report (`restored`, `restore_miss`, `held`, ...)
    token: str = ""  # the HTTP side's id of this run (a client may reuse a rid)
    check: RestoreCheck | None = None  # the chain, verified at the first admission match
    # its links on disk, read on the copy thread before the check (None: not started)
    reading: Future[dict[tuple[bytes, int], SlabRecord | None]] | None = None
    placed: bool = False  # its restore is settled: in the tree, or not to be (`missed`)
    missed: str | None = None  # why the verified prefix is not in the tree
    landing: Placement | None = None  # its verified prefix, on its way into the tree
    restored_tokens: int = 0  # scattered from the host slabs
    restore_s: float = 0.0
    todo: list[SnapshotSpec] = field(default_factory=list)  # by depth
    keys: dict[int, bytes] = field(default_factory=dict)  # todo's keys, by depth
    written: list[AnchorWritten] = field(default_factory=list)
    held: list[AnchorHeld] = field(default_factory=list)
    snapshot_s: float = 0.0  # spent writing the request's anchors (snapshot_ms)
    copies: list[Future[float]] = field(default_factory=list)  # its slabs' copies in flight
    cut: int | None = None  # stopped by the proxy: the response anchor's depth (`cut` op)
    failed: bool = False  # a snapshot of it failed on this rank (its anchors go on every rank)
    own_from: int | None = None  # its rows past what it matched in the tree (first checkpoint)
    # hybrid: states captured inside a forward, {depth: (spare Mamba slot [1], physical)}
    captured: dict[int, tuple[Any, int]] = field(default_factory=dict)

    def record(self, w: AnchorWritten | AnchorHeld | None) -> None:
        if isinstance(w, AnchorHeld):
            self.held.append(w)
        elif w is not None:
            self.written.append(w)


class FinishReport(Record, frozen=True):
    """What one request restored and wrote: pushed at its release (`push: finish`) or the
    reply to `finish`; the HTTP side (ext/sglang/run.py) reads it into its response."""

    anchors: dict[str, Any]  # the chain check's report (`restored`, `restore_miss`, `held`)
    restored_tokens: int = 0
    restore_ms: float = 0.0
    written: tuple[AnchorWritten, ...] = ()
    held: tuple[AnchorHeld, ...] = ()
    snapshot_ms: float = 0.0


NO_REPORT = FinishReport({"restored": [], "restore_miss": []})  # a run never registered


class Plans:
    """The scheduler's anchored requests, by rid; see the module docstring. Ending one
    settles its restore (`settle`) and joins its snapshot copies (`join`) first."""

    def __init__(self, model_id: str, store: AnchorStore, *,
                 settle: Callable[[str, Plan], None], join: Callable[[str, Plan], None]) -> None:
        self._model_id = model_id
        self._store = store
        self._settle = settle
        self._join = join
        self.active: dict[str, Plan] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # rid → token of its ended run
        self._reports: OrderedDict[str, FinishReport] = OrderedDict()  # token → report

    def get(self, rid: str) -> Plan | None:
        return self.active.get(rid)

    def register(self, req: Any) -> Plan | None:
        """The plan of `req`, registered from what its sampling parameters carry
        (`custom_params[PLAN_PARAM]`) when SGLang first matches it: its restore runs then
        (`AnchorRadixCache.match_prefix`), its snapshots in the checkpoint hook."""
        p = self.active.get(req.rid)
        if p is not None:
            return p
        params = getattr(req.sampling_params, "custom_params", None)
        raw = params.get(PLAN_PARAM) if isinstance(params, dict) else None
        if not isinstance(raw, str):
            return None
        try:
            body = orjson.loads(raw)
            token, plan = str(body["token"]), AnchorPlan.from_json(body["anchor"])
        except (orjson.JSONDecodeError, KeyError, TypeError, WireError):
            log.warning("request %s carries an unreadable anchor plan; served without", req.rid)
            return None
        if self._ended.get(req.rid) == token:
            return None  # already ended (its `finish` came first: the client went away)
        ids = tuple(req.origin_input_ids)
        p = Plan(ids, plan, {"restored": [], "restore_miss": []}, token=token)
        p.todo = sorted((s for s in plan.snapshot if s.depth <= len(ids)), key=lambda s: s.depth)
        p.keys = anchor_keys(plan.namespace, self._model_id, ids, [s.depth for s in p.todo])
        self.active[req.rid] = p
        return p

    def end(self, rid: str, *, ok: bool, start_ttl: bool) -> FinishReport:
        """Drop request `rid`'s plan and release it in the store; its report."""
        p = self.active.pop(rid)
        self._settle(rid, p)
        self._join(rid, p)  # its slabs are whole before anyone may read them
        self._store.release_request(rid, ok=ok, start_ttl=start_ttl)
        info = p.info
        if p.missed is not None and p.check is not None:  # verified, never placed
            miss = {"key": p.check.chain[-1].key.hex(), "depth": p.check.depth,
                    "reason": p.missed}
            info = {**info, "restored": [], "restore_miss": [*info["restore_miss"], miss]}
        report = FinishReport(info, p.restored_tokens, round(p.restore_s * 1e3, 3),
                              tuple(p.written), tuple(p.held), round(p.snapshot_s * 1e3, 3))
        self._ended[rid] = p.token
        self._reports[p.token] = report
        for kept in (self._ended, self._reports):
            while len(kept) > ENDED_KEPT:
                kept.popitem(last=False)
        return report

    def finish(self, rid: str, token: str, *, ok: bool) -> FinishReport:
        """The HTTP side's end of run `token` of request `rid`: when its pushed report did
        not come (`ok`: the report, kept a while), or when the request failed (not `ok`: its
        staged anchors are dropped, and a plan that has not reached the scheduler yet never
        registers)."""
        p = self.active.get(rid)
        if p is not None and p.token == token:
            return self.end(rid, ok=ok, start_ttl=True)
        if not ok:
            self._store.release_request(rid, ok=False)
            self._ended[rid] = token
        return self._reports.pop(token, None) or NO_REPORT

    def cut(self, rid: str, depth: Any) -> bool:
        """A stop sequence ends request `rid` (its abort follows): its response anchor is
        prompt + output up to `depth`, the prefix the next turn starts with."""
        p = self.active.get(rid)
        if p is not None and isinstance(depth, int):
            p.cut = depth
        return p is not None
