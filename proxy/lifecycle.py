"""The one owner of the proxy's anchor life cycle: plan → generate → confirm/abort → record.

`AnchorLifecycle` owns the pure planner (and its in-memory index): no other code touches
it. It holds the ledger and the worker client too, and is the only code that changes any of
them for anchors:

- `begin()` plans a request and opens its reservation in the ledger. A request whose
  instruction cut is new and already being written by another request waits for that one
  (bounded), so a burst of one new toolset writes one instruction anchor, not one each.
- `settle()` (success) records what the worker wrote and commits what the worker confirmed
  (as the request ended, in its reply: the plan asks it to; else, recorded as reserved
  first, by `/anchor/confirm`), learns the anchors the worker reported already held, and
  closes the reservation; `fail()` closes it aborted, with a reason (the pipeline aborts the
  worker request by rid, which drops its staged snapshots). A request a client stop
  sequence ended is stopped on the worker (`/stop_request`) and settled like any other.
- It watches the worker's epoch: the worker client passes it the epoch of every reply
  (`WorkerClient.on_epoch`, the one place epochs are observed); a new epoch forgets the
  index, reconciles the ledger against the worker's slot listing (its disk tier's anchors
  included: those the ledger knows the tenant of are recovered under the new epoch) and
  re-warms pinned toolsets, in the background (a toolset recovered from disk is pinned from
  there, not prefilled). `start()` reconciles once at proxy start, then loads the
  committed anchors the worker still holds, so they are offered again after a proxy restart.
- `warm()` makes an instruction prefix an anchor (a one-token request); `toolsets`
  (`toolsets.py`) warms, pins and re-warms toolsets with it and enforces the anchor-bytes
  quota.
- `leases` (`leases.py`) keeps the anchors a request's client marked with a TTL
  (`cache_control`): `settle()` grants or refreshes them (a pin) within the tenant's budget,
  and refreshes the tenant's leases the request restored; a background sweep (and every
  settle) unpins the expired ones. A new epoch drops the old one's leases; `close()` unpins
  the leases it still holds, and `start()` unpins what a proxy that stopped without doing
  so left pinned.
- Several processes of one proxy (`processes` > 1, proxy/processes.py) share the ledger and
  the workers: `absorb()` folds the anchors the others committed or let go into this one's
  index (the app reads the ledger's changes once per request), reconcile leaves the others'
  open reservations alone, `warm()` takes a ledger lock so that a toolset is warmed once, not
  once per process, and only the first process unpins strays at start (`unpin_strays`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from anchorcache.defaults import LEASE_BUDGET_BYTES, TOOL_ANCHOR_GAP_TOKENS
from anchorcache.state.ledger import Ledger
from anchorcache.state.records import (
    AnchorRow,
    AnchorStatus,
    HeldSlot,
    NewAnchor,
    ReconcileReport,
    ReservationOutcome,
)
from anchorcache.wire import (
    AnchorKind,
    AnchorWritten,
    GenerateMeta,
    GenerateRequest,
    SamplingParams,
    TokenIds,
    anchor_keys,
    engine_cache_key,
)

from .anchor_index import AnchorRecord
from .errors import ApiError
from .leases import LeaseTable
from .planner import Plan, Planner, PrefixKeys, Probe
from .splitter.types import SplitResult
from .toolsets import SHARED_TENANT, ToolsetAnchors
from .worker_client import WorkerClient

log = logging.getLogger("anchorcache.proxy")

LEASE_SWEEP_S = 1.0  # how often expired leases are looked for while there are any
LEASE_RELEASE_S = 10.0  # how long `close()` tries to unpin the leases it holds
WARM_POLL_S = 0.05  # how often a process waits on another's warming of a toolset looks again


@dataclass(frozen=True)
class Caller:
    """Who a request runs for: the tenant and the namespace its keys are derived in."""

    tenant: str
    namespace: bytes
    own_namespace: bool = True  # False when a client cache_salt narrowed it (no toolsets then)
    max_anchor_bytes: int | None = None  # past it, the tenant's least recently hit anchors go


@dataclass
class AnchoredRequest:
    """One request's anchor state between `begin` and `settle`/`fail`."""

    rid: str
    caller: Caller
    plan: Plan
    input_ids: tuple[int, ...] | TokenIds
    leads: bytes | None = None  # the instruction key this request writes for everyone
    closed: bool = False


def _record(row: AnchorRow) -> AnchorRecord:
    return AnchorRecord(row.namespace, row.key, row.depth, row.parent, AnchorKind(row.kind),
                        row.slot, row.nbytes, row.epoch)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (a sibling process of this proxy)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: not ours, but it exists
        return True
    return True


def _new(entries: Iterable[AnchorWritten]) -> list[NewAnchor]:
    return [NewAnchor(w.key, w.depth, w.parent, w.slot, w.nbytes, w.kind.value) for w in entries]


class AnchorLifecycle:
    def __init__(self, worker: WorkerClient, ledger: Ledger, *, model_id: str, epoch: str,
                 worker_id: str, shared_namespace: bytes,
                 single_flight_wait_s: float = 60.0, hybrid: bool = False,
                 tool_gap: int = TOOL_ANCHOR_GAP_TOKENS, tenant_anchor_share: float = 1.0,
                 lease_budget_bytes: int = LEASE_BUDGET_BYTES,
                 on_lease: Callable[[str, str], None] | None = None,
                 processes: int = 1, unpin_strays: bool = True,
                 prefix_keys: PrefixKeys | None = None) -> None:
        """`on_lease(tenant, outcome)`: told each lease granted, refreshed, refused, expired
        or dropped (metrics); `prefix_keys`: the planner's key states, shared by the proxy's
        workers (`Planner`). `processes`: how many processes of this proxy share the ledger
        and the worker; `unpin_strays`: whether `start()` unpins what an earlier proxy left
        pinned (in one process of several, the first at the proxy's start only: later, a
        pinned anchor may be a sibling's lease)."""
        self.worker = worker
        self.ledger = ledger
        self._planner = Planner(model_id, epoch, hybrid=hybrid, tool_gap=tool_gap,
                                prefix_keys=prefix_keys)
        self.worker_id = worker_id
        self.shared_namespace = shared_namespace
        self.single_flight_wait_s = single_flight_wait_s
        self.tenant_anchor_share = tenant_anchor_share  # of the worker's bytes, per tenant
        self.processes = processes
        self.unpin_strays = unpin_strays
        self._instruction_writers: dict[bytes, asyncio.Future[None]] = {}
        self._running: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.last_reconcile: ReconcileReport | None = None
        # settled requests since start: count, hits (restored anything), prompt/cached tokens
        self.counters: Counter[str] = Counter()
        worker.on_epoch = self.observe_epoch
        self.leases = LeaseTable()  # cache_control TTLs kept
        self.lease_budget_bytes = lease_budget_bytes  # all leases on this worker together
        self._on_lease = on_lease
        self._sweeper: asyncio.Task[None] | None = None  # while there are leases
        # warm, pin, re-warm; the anchor-bytes quota
        self.toolsets = ToolsetAnchors(
            worker, ledger, worker_id=worker_id, shared_namespace=shared_namespace,
            tenant_anchor_share=tenant_anchor_share, epoch=lambda: self.epoch, key=self.key,
            warm=self.warm, evict=self.evict, leased=self.leases.keys)

    @property
    def epoch(self) -> str:
        return self._planner.epoch

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop the background work and unpin the leased anchors (the leases end with this
        proxy; a worker that does not answer in time keeps them pinned until `start()` of
        the next proxy on this ledger, or its own restart)."""
        tasks = [*self._tasks, *([self._sweeper] if self._sweeper is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            async with asyncio.timeout(LEASE_RELEASE_S):
                await self.expire_leases(everything=True)
        except TimeoutError:
            log.warning("worker %s: %d anchor leases left pinned at close", self.worker_id,
                        len(self.leases))

    async def idle(self) -> None:
        """Wait for background work (reconcile, re-warm) to finish (tests, admin)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- start and epochs ---------------------------------------------------------------
    async def start(self) -> ReconcileReport | None:
        """Reconcile with the worker, load what it still holds, re-warm pinned toolsets."""
        report = await self.reconcile("proxy_start")
        if self.unpin_strays:
            await self._unpin_strays()
        self._spawn(self.toolsets.rewarm_pinned())
        return report

    async def _unpin_strays(self) -> None:
        """Unpin what a proxy on this ledger that stopped without unpinning its leases left
        pinned: only toolsets and leases pin, so an anchor the ledger knows on this worker
        that no pinned toolset holds is a lease's (another ledger's anchors are left alone)."""
        try:
            listing = await self.worker.slots()
            pinned = {s.key for s in listing.slots if s.pinned}
            pinned |= {d.key for d in listing.disk if d.pinned}
            known = {r.key for r in self.ledger.anchors(worker=self.worker_id, epoch=listing.epoch,
                                                        status=AnchorStatus.COMMITTED)}
            for key in (pinned & known) - self.toolsets.pinned_keys():
                await self.worker.unpin(key)
        except ApiError as e:
            log.warning("could not unpin leftover leases: %s", e.message)

    async def reconcile(self, reason: str) -> ReconcileReport | None:
        try:
            listing = await self.worker.slots()
        except ApiError as e:
            log.warning("reconcile skipped, no slot listing: %s", e.message)
            return None
        # the disk tier's anchors too: a restarted worker (or one sharing another's directory)
        # lists them, and the ledger recovers those it knows the tenant of
        held = [HeldSlot(s.slot, s.key, s.depth, s.parent, s.nbytes)
                for s in listing.slots if s.state == "committed"]
        held += [HeldSlot(None, d.key, d.depth, d.parent, d.nbytes) for d in listing.disk]
        staged = [(s.slot, s.key) for s in listing.slots if s.state == "reserved"]
        report = self.ledger.reconcile(self.worker_id, listing.epoch, held, staged=staged,
                                       in_flight=self._running, reason=reason,
                                       alive=pid_alive if self.processes > 1 else None)
        if report.stale_reserved_slots:
            try:
                await self.worker.abort_slots(list(report.stale_reserved_slots))
            except ApiError as e:
                log.warning("could not abort orphaned reservations: %s", e.message)
        for row in self.ledger.anchors(worker=self.worker_id, epoch=listing.epoch,
                                       status=AnchorStatus.COMMITTED):
            if self._planner.index.get(row.key) is None:
                self._planner.index.add(_record(row))
        self.last_reconcile = report
        log.info("reconcile (%s): %s", reason, report.to_json())
        return report

    def observe_epoch(self, epoch: str) -> None:
        """The worker client passes every reply's epoch here; a new one means the worker
        restarted."""
        if not epoch or epoch == self.epoch:
            return
        old = self.epoch
        dropped = self._planner.reset(epoch)
        for lease in self.leases.keep_epoch(epoch):  # their anchors went with the old epoch
            self._count(lease.tenant, "dropped")
        log.info("worker epoch %s → %s: %d anchors lost", old, epoch, dropped)
        self.ledger.event("epoch_changed", None, old=old, new=epoch, dropped=dropped)

        async def after() -> None:
            await self.reconcile("epoch_changed")
            await self.toolsets.rewarm_pinned()

        self._spawn(after())

    def lose(self, why: str) -> int:
        """The worker is out of reach (`targets.py` took it out): forget its anchors and
        mark them lost in the ledger. Its next reply's epoch, the same or a new one, is then
        a change: reconciled as a restart is. Returns how many anchors were marked."""
        if not self.epoch:
            return 0
        old = self.epoch
        self._planner.reset("")
        lost = self.ledger.lose_worker(self.worker_id)
        self.ledger.event("worker_lost", None, worker=self.worker_id, epoch=old, lost=lost,
                          error=why)
        return lost

    def absorb(self, rows: Iterable[AnchorRow]) -> int:
        """Fold ledger rows of this worker, as they are now, into the index: committed ones
        in, evicted, lost and aborted ones out (reserved ones wait for their outcome); rows
        of another epoch than the one this process knows are left out (a new epoch reconciles,
        which loads them all). Another process of this proxy wrote them; each keeps the
        namespace its request derived the key in, as this process's own do. How many changed
        the index."""
        index, n = self._planner.index, 0
        for row in rows:
            if row.worker != self.worker_id or row.epoch != self.epoch or not self.epoch:
                continue
            have = index.get(row.key)
            if row.status == AnchorStatus.COMMITTED:
                rec = _record(row)
                if have != rec:
                    index.add(rec)
                    n += 1
            elif row.status != AnchorStatus.RESERVED and have is not None:
                index.remove(row.key)
                n += 1
        return n

    def anchor_count(self) -> int:
        return len(self._planner.index)

    def anchor_bytes(self) -> int:
        return self._planner.index.nbytes()

    # ---- requests ----------------------------------------------------------------------
    def probe(self, split: SplitResult, caller: Caller, floor: int | None = 0) -> Probe:
        """What this worker's anchors would give `split` (routing compares the restore
        depths, and hands the chosen worker's probe to `begin`, which plans from it);
        `floor`: `Planner.probe`'s."""
        return self._planner.probe(split, caller.namespace, shared=self.shared_namespace,
                                   floor=floor)

    def deepen(self, probe: Probe, floor: int) -> Probe:
        """This worker's `probe` searched again from `floor` (`Planner.deepen`)."""
        return self._planner.deepen(probe, floor)

    def chunk_only(self, split: SplitResult) -> Plan:
        """Anchors off: the plan that only chunks the prefill at the cuts."""
        return self._planner.chunk_only(split)

    async def begin(self, rid: str, caller: Caller, split: SplitResult,
                    probe: Probe | None = None) -> AnchoredRequest:
        """`probe`: this worker's `probe(split, caller)`, made since the loop last yielded."""
        plan = self._planner.plan(split, caller.namespace, shared=self.shared_namespace,
                                  probe=probe)
        leads = None
        inst = plan.instruction
        if inst is not None and plan.restore_depth < inst[0]:
            other = self._instruction_writers.get(inst[1])
            if other is not None:  # someone writes this instruction anchor now: wait for it
                try:
                    await asyncio.wait_for(asyncio.shield(other), self.single_flight_wait_s)
                except TimeoutError:
                    pass
                plan = self._planner.plan(split, caller.namespace, shared=self.shared_namespace)
            if plan.restore_depth < inst[0]:
                if inst[1] in self._instruction_writers:
                    plan = self._planner.plan(split, caller.namespace, shared=self.shared_namespace,
                                             skip_instruction=True)
                else:
                    self._instruction_writers[inst[1]] = asyncio.get_running_loop().create_future()
                    leads = inst[1]
        self._open(rid, caller.tenant, leads)
        return AnchoredRequest(rid, caller, plan, split.input_ids, leads)

    def _open(self, rid: str, tenant: str, leads: bytes | None) -> None:
        """Open request `rid`'s reservation in the ledger. If that fails, the instruction
        anchor it was to write for everyone (`leads`) is let go at once: the requests
        waiting for it go on, and the next one writes it."""
        try:
            self.ledger.open_reservation(rid, tenant, self.worker_id, self.epoch)
        except BaseException:
            if leads is not None:
                self._let_go(leads)
            raise
        self._running.add(rid)

    def _let_go(self, leads: bytes) -> None:
        fut = self._instruction_writers.pop(leads, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _release(self, anchored: AnchoredRequest) -> None:
        anchored.closed = True
        self._running.discard(anchored.rid)
        if anchored.leads is not None:
            self._let_go(anchored.leads)

    def fail(self, anchored: AnchoredRequest, reason: str) -> None:
        """The request ended without success; the caller aborts it on the worker by rid."""
        if anchored.closed:
            return
        try:
            self.ledger.close_reservation(anchored.rid, ReservationOutcome.ABORTED, reason)
        finally:
            self._release(anchored)

    async def settle(self, anchored: AnchoredRequest, meta: GenerateMeta, reason: str | None = None, *,
                     leases: Mapping[int, float] | None = None) -> None:
        """The request succeeded: confirm what the worker wrote and record it all (`reason`:
        why it ended, when not on its own, e.g. `stop_sequence`); lease the anchors at the
        prompt depths of `leases` (depth → TTL in seconds) for its tenant."""
        if anchored.closed:
            return
        try:
            await self._settle(anchored, meta, reason)
        finally:
            self._release(anchored)
        await self._lease(anchored, meta, leases or {})
        await self.toolsets.enforce_quota(anchored.caller.tenant, anchored.caller.max_anchor_bytes)

    async def _settle(self, anchored: AnchoredRequest, meta: GenerateMeta, reason: str | None) -> None:
        if not anchored.rid.startswith("warm-"):
            self.counters.update(count=1, hits=int(meta.cached_tokens > 0),
                                 prompt_tokens=meta.prompt_tokens, cached_tokens=meta.cached_tokens)
        if meta.epoch != self.epoch:  # the worker client observed it as the reply came
            self.ledger.close_reservation(anchored.rid, ReservationOutcome.ABANDONED, "epoch_changed")
            return
        # record what the worker wrote, confirm it (unless the worker did as the request
        # ended: the plan asks it to), commit what the worker acknowledged and close the
        # reservation (`reason`: why, when it closes confirmed)
        report, epoch = meta.anchors, meta.epoch
        caller, led = anchored.caller, self.ledger
        done = report.confirmed
        confirmed: tuple[int, ...] = done.slots if done is not None else ()
        evicted: tuple[bytes, ...] = done.evicted if done is not None else ()
        if report.written and done is None:  # recorded before the confirm, in case we stop
            led.record_written(anchored.rid, self.worker_id, epoch, caller.namespace, caller.tenant,
                               _new(report.written))
            try:
                reply = await self.worker.confirm([w.slot for w in report.written], anchored.rid,
                                                  self.epoch)
            except ApiError as e:  # the request succeeded; only these anchors are lost
                log.warning("anchor confirm failed: %s", e.message)
                led.close_reservation(anchored.rid, ReservationOutcome.ABORTED, "confirm_failed")
                return
            if reply.epoch != epoch:
                led.close_reservation(anchored.rid, ReservationOutcome.ABANDONED, "epoch_changed")
                return
            confirmed, evicted = reply.confirmed, reply.evicted
        settled = self._planner.record(caller.namespace, report, confirmed, evicted)
        ok = set(confirmed)
        with led.transaction():  # one commit for all of it
            if done is None:
                led.commit(self.worker_id, epoch, [w.key for w in report.written if w.slot in ok])
            elif report.written:  # confirmed in band: committed as recorded (the rest reserved,
                # which the close below aborts)
                args = (anchored.rid, self.worker_id, epoch, caller.namespace, caller.tenant)
                led.record_committed(*args, _new(w for w in report.written if w.slot in ok))
                if refused := [w for w in report.written if w.slot not in ok]:
                    led.record_written(*args, _new(refused))
            if report.held:
                led.record_held(self.worker_id, epoch, caller.namespace, caller.tenant,
                                _new(report.held))
            if settled.removed:
                led.mark(self.worker_id, epoch, settled.removed, AnchorStatus.EVICTED)
            if report.restored:  # the links the worker looked up: the plan's leaf (its
                # ancestors are touched, not hit, as in the worker's slot table)
                led.note_hits(self.worker_id, epoch, [h.key for h in report.restored])
            led.close_reservation(anchored.rid, ReservationOutcome.CONFIRMED, reason
                                  if ok == {w.slot for w in report.written} else "confirm_refused")
        if caller.own_namespace and caller.tenant != SHARED_TENANT:
            for rec in settled.committed:
                if rec.kind == AnchorKind.INSTRUCTION and rec.namespace == caller.namespace:
                    led.put_toolset(caller.tenant, rec.namespace, rec.key,
                                    anchored.input_ids[:rec.depth])

    # ---- leases --------------------------------------------------------------------------
    def _count(self, tenant: str, outcome: str) -> None:
        if self._on_lease is not None:
            try:
                self._on_lease(tenant, outcome)
            except Exception:  # a metrics bug must not fail a settled request
                log.exception("counting a lease failed")

    async def _lease(self, anchored: AnchoredRequest, meta: GenerateMeta, depths: Mapping[int, float]
                     ) -> None:
        """Let the expired leases go; refresh the caller's leases on the anchors the request
        restored; lease (or refresh) its own anchors at `depths`. A worker failure is
        logged, not raised: the request succeeded."""
        caller = anchored.caller
        try:
            await self.expire_leases()
            if meta.epoch != self.epoch:
                return
            report = meta.anchors
            links = anchored.plan.restored(report)
            self.leases.refresh((h.key for h in links), caller.tenant)
            if not depths:
                return
            keys = {h.depth: h.key for h in links}
            keys |= {w.depth: w.key for w in (*report.written, *report.held)}
            for depth, ttl_s in sorted(depths.items()):
                rec = self.live(keys[depth]) if depth in keys else None
                if rec is None or rec.namespace != caller.namespace:  # a shared toolset's
                    rec = self.live(self.key(caller.namespace, anchored.input_ids[:depth]))
                if rec is not None:  # else not kept (no slot or memory): nothing to lease
                    self._count(caller.tenant, await self._grant(caller, rec, ttl_s))
        except ApiError as e:
            log.warning("anchor leases of request %s: %s", anchored.rid, e.message)

    async def _grant(self, caller: Caller, rec: AnchorRecord, ttl_s: float) -> str:
        """Lease `rec` (the caller's own anchor) for `ttl_s`; "granted", "refreshed" (it was
        leased) or "refused" (past the budget, or the worker would not pin it)."""
        if self.leases.get(rec.key) is not None:
            self.leases.grant(rec.key, caller.tenant, self.epoch, {}, ttl_s)
            return "refreshed"
        chain = {r.key: r.nbytes for r in self._planner.index.chain(rec.key) or [rec]}
        limit = await self.toolsets.limit(caller.max_anchor_bytes)
        capacity = await self.toolsets.capacity()
        budget = min(self.lease_budget_bytes, capacity // 2 if capacity else self.lease_budget_bytes)
        if not self.leases.fits(caller.tenant, chain, tenant_limit=limit, budget=budget):
            return "refused"
        # in the table before the pin: a request settling meanwhile sees these bytes taken
        lease = self.leases.grant(rec.key, caller.tenant, self.epoch, chain, ttl_s)
        try:
            pinned = await self.worker.pin(rec.key, None)  # the host tier: no device memory
        except ApiError:
            return "granted"  # it may have pinned it: the lease's expiry unpins it
        if not pinned:  # gone, or claimed by a pending reservation
            if self.leases.get(rec.key) is lease:
                self.leases.drop(rec.key)
            return "refused"
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return "granted"

    async def _sweep(self) -> None:
        while len(self.leases):
            await asyncio.sleep(LEASE_SWEEP_S)
            try:
                await self.expire_leases()
            except Exception:  # a bug here must not end the sweeps
                log.exception("expiring anchor leases failed")

    async def expire_leases(self, *, everything: bool = False) -> None:
        """Unpin the anchors whose leases expired (`everything`: of every lease), but not a
        pinned toolset's. A lease whose unpin the worker did not answer stays, due: an
        anchor left pinned would never go."""
        due = self.leases.due(math.inf if everything else None)
        if not due:
            return
        toolsets = self.toolsets.pinned_keys()
        for lease in due:
            if self.leases.get(lease.key) is not lease:
                continue  # refreshed or dropped meanwhile
            self.leases.drop(lease.key)
            if lease.key not in toolsets:
                try:
                    await self.worker.unpin(lease.key)
                    if self.leases.get(lease.key) is not None:  # leased again meanwhile
                        await self.worker.pin(lease.key, None)
                except ApiError as e:
                    self.leases.put_back(lease)
                    log.warning("unpinning an expired lease failed: %s", e.message)
                    return
            self._count(lease.tenant, "expired")

    # ---- warming, evicting --------------------------------------------------------------
    def key(self, namespace: bytes, ids: tuple[int, ...]) -> bytes:
        """The key of the anchor of the whole prefix `ids` in `namespace`."""
        return anchor_keys(namespace, self._planner.model_id, ids, [len(ids)])[len(ids)]

    def live(self, key: bytes) -> AnchorRecord | None:
        rec = self._planner.index.get(key)
        return rec if rec is not None and rec.epoch == self.epoch else None

    async def warm(self, tenant: str, namespace: bytes, ids: tuple[int, ...]) -> AnchorRecord:
        """Make the instruction prefix `ids` a committed anchor in `namespace` (no-op if it
        is one). Raises ApiError if the worker fails or could not store it."""
        key = self.key(namespace, ids)
        if (rec := self.live(key)) is not None:
            return rec
        other = self._instruction_writers.get(key)
        if other is not None:
            try:
                await asyncio.wait_for(asyncio.shield(other), self.single_flight_wait_s)
            except TimeoutError:
                pass
            if (rec := self.live(key)) is not None:
                return rec
        if self.processes == 1:
            return await self._warm(tenant, namespace, ids, key)
        # another process of this proxy may be warming it: one warms, the others wait for
        # its anchor to show up in the ledger (bounded, as within one process)
        lock, owner = f"warm/{self.worker_id}/{key.hex()}", f"{os.getpid()}/{uuid.uuid4().hex}"
        deadline = asyncio.get_running_loop().time() + self.single_flight_wait_s
        while not self.ledger.try_lock(lock, owner, self.single_flight_wait_s):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(WARM_POLL_S)
        try:
            self.absorb(self.ledger.anchors(worker=self.worker_id, epoch=self.epoch, key=key))
            if (rec := self.live(key)) is not None:
                return rec
            return await self._warm(tenant, namespace, ids, key)
        finally:
            self.ledger.unlock(lock, owner)

    async def _warm(self, tenant: str, namespace: bytes, ids: tuple[int, ...],
                    key: bytes) -> AnchorRecord:
        rid = "warm-" + uuid.uuid4().hex
        plan = Plan(namespace, self._planner.warm(ids, namespace))
        anchored = AnchoredRequest(rid, Caller(tenant, namespace, own_namespace=tenant != SHARED_TENANT),
                        plan, ids)
        if key not in self._instruction_writers:
            self._instruction_writers[key] = asyncio.get_running_loop().create_future()
            anchored.leads = key
        self._open(rid, tenant, anchored.leads)
        req = GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
                              rid=rid, stream=True, anchor=plan.request,
                              cache_key=engine_cache_key(namespace))
        meta = None
        try:
            async for chunk in self.worker.generate(req):
                meta = chunk.meta or meta
        except BaseException:
            self.fail(anchored, "warm_failed")
            raise
        if meta is None:
            self.fail(anchored, "warm_failed")
            raise ApiError("worker_error", "the worker ended the warm-up without a reply")
        await self.settle(anchored, meta)
        rec = self.live(key)
        if rec is None:
            raise ApiError("worker_error", "the worker could not store the toolset anchor "
                                           "(no free slot or memory)")
        return rec

    async def evict(self, key: bytes) -> bool:
        """Evict an anchor from the worker now (pinned or not)."""
        ok = await self.worker.evict(key)
        self.leases.drop(key)
        rec = self._planner.index.remove(key)
        self.ledger.mark(self.worker_id, self.epoch, [key], AnchorStatus.EVICTED)
        return ok or rec is not None
