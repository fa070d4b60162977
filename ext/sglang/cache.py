"""Scheduler side of the SGLang worker: SGLang's radix cache with our anchor store inside.

`AnchorRadixCache` is SGLang's own `UnifiedRadixCache` (built by SGLang's
`create_unified_radix_cache`, so every scheduler path stays SGLang's) whose overrides hand
each event to an object that owns its state:

- `DeviceKV` (kv.py): views of SGLang's pools and the copy thread every copy runs on;
- the anchor store (`anchorcache.ext.store`) with its host slabs, owned by this process;
- `Plans` (plans.py): anchored requests, registered at their first admission match
  (`match_prefix`) from the plan their sampling parameters carry, ended at their release
  (`on_release`: the report is pushed to the HTTP process unasked) or by `finish`;
- `Restores` (restores.py) over `Placer` (device.py): a request's verified chain is
  scattered into fresh pool slots by the copy thread while the request waits in the queue
  (our prefill adder asks `admit_restore`), then inserted into the tree, unlocked;
- `Snapshots` (snapshots.py): SGLang's `checkpoint` hook copies the rows of every planned
  depth the request has computed, and its response anchor when it stops;
- `Pins` (pins.py): pinned anchors' prefixes stay locked in the tree, within a budget;
- `RpcOps` (rpc_ops.py): `__call__` is the entry point of the RPC path
  (`Scheduler.handle_rpc_request` → `scheduler.tree_cache(**parameters)`), one op table.

Everything is built in `__init__`, before SGLang's constructor runs (which calls `reset`).
With `--page-size N` SGLang's tree holds whole pages only: a restore or a pin puts back the
page-aligned part of the anchor's prefix and the request prefills the tail.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

from anchorcache.ext.slots import SlotTable
from anchorcache.ext.store import AnchorStore
from anchorcache.wire import CaptureStatsRecord

from . import cpu, hybrid, swa, tp
from .capture import Captures, capture_mode
from .config import SGLangAnchorConfig
from .device import Placer
from .faults import Faults
from .kv import DeviceKV
from .pins import Pins
from .plans import Plans
from .restores import Restores
from .rpc_ops import RpcOps
from .snapshots import Snapshots
from .timing import CallTimes

log = logging.getLogger("anchorcache.sglang")

try:  # SGLang is an optional dependency of the package; this module runs inside it
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
except ImportError:  # pragma: no cover
    UnifiedRadixCache = object  # type: ignore[misc,assignment]


@dataclass(frozen=True)
class AnchorSetup:
    """What the cache needs besides SGLang's `CacheInitParams` (`build` reads it from the
    scheduler's build context and the launcher's environment)."""

    config: SGLangAnchorConfig
    model_id: str
    epoch: str  # one per worker: TP rank 0 draws it and the others receive it
    tp_rank: int = 0
    tp_group: Any = None  # SGLang's TP group (ext/sglang/tp.py); None: one rank
    server_args: Any = None  # SGLang's, for the disk tier (model path, TP and DP size)


def _disk_tier(kv: DeviceKV, store: AnchorStore, config: SGLangAnchorConfig,
               server_args: Any, tp_rank: int) -> Any:
    """The disk tier the config asks for (its directory indexed), or None.

    Tensor parallel: each rank keeps its own shard's files (`<fingerprint>-tp<rank>of<size>`)
    and the ranks agree on every file before any of them restores one (ext/store.py). Data
    parallel: the ranks are workers of their own sharing the directory, as workers on shared
    storage do (a file one rank wrote, another restores). The byte budget is the worker's:
    each process keeps its share of it."""
    if config.anchor_disk_dir is None or config.anchor_disk_bytes == 0:
        return None
    from anchorcache.ext.disk_tier import DiskTier, default_budget_bytes, model_fingerprint

    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    k0 = kv.k[0]
    fingerprint = model_fingerprint(server_args.model_path, "sglang", k0.dtype, len(kv.k),
                                    k0.shape[1], k0.shape[2], store.state_bytes)
    budget = config.anchor_disk_bytes or default_budget_bytes(config.anchor_disk_dir)
    share = max(1, budget // (tp_size * dp_size))
    disk = DiskTier(config.anchor_disk_dir, fingerprint, budget_bytes=share, tp_rank=tp_rank,
                    tp_size=tp_size)
    log.info("disk tier %s: %d anchors indexed, budget %d bytes", disk.dir, disk.index(), share)
    return disk


class AnchorRadixCache(UnifiedRadixCache):  # type: ignore[misc,valid-type]
    """SGLang's unified radix cache that also keeps anchors; see the module docstring."""

    def __init__(self, params: Any, *, setup: AnchorSetup) -> None:
        config, model_id = setup.config, setup.model_id
        components = tuple(params.tree_components or ())
        self.kv = kv = DeviceKV(
            params.req_to_token_pool, params.token_to_kv_pool_allocator,
            mamba=ComponentType.MAMBA in components,
            sliding_window=params.swa_retain_window if ComponentType.SWA in components else None)
        table = SlotTable(config.anchor_slots, config.anchor_capacity_bytes,
                          pinned_slots=config.pinned_slots)
        self.anchors = AnchorStore(model_id, table, kv_bytes_per_token=kv.kv_bytes_per_token,
                                   state_bytes=kv.state_bytes)
        self.model_id, self.epoch = model_id, setup.epoch
        faults, self.times = Faults(), CallTimes()
        self.placer = Placer(self, kv, faults, self.times, setup.tp_group)
        pool_tokens = int(kv.allocator.size)
        # on a hybrid model each pin also holds a Mamba slot: at most a quarter of them
        max_pins = (len(params.req_to_token_pool.mamba_allocator.free_slots) // 4
                    if kv.states is not None else None)
        self.pins = Pins(self, self.placer, self.anchors, max_pins=max_pins,
                         budget_tokens=int(config.pin_budget_fraction * pool_tokens))
        self.snapshots = Snapshots(kv, self.anchors, faults, self.times, model_id=model_id,
                                   tp_group=setup.tp_group)
        self.restores = Restores(self, self.placer, self.anchors, self.times)
        self.plans = Plans(model_id, self.anchors, settle=self.restores.settle,
                           join=self._join)
        # hybrid: states captured inside the forward where the layers can, else cuts
        mode = (capture_mode(params.req_to_token_pool.mamba_pool, config.hybrid_capture)
                if kv.states is not None else None)
        self.captures = (Captures(params.req_to_token_pool, self.placer.alloc_state, mode)
                         if mode is not None else None)
        self.rpc = RpcOps(tree=self, kv=kv, store=self.anchors, plans=self.plans,
                          pins=self.pins, faults=faults, times=self.times, config=config,
                          model_id=model_id, epoch=setup.epoch, tp_rank=setup.tp_rank,
                          tp_group=setup.tp_group)
        # the store's TTL reads the call's time, not this process's clock (ext/sglang/tp.py)
        self.anchors.clock = self.rpc.call_time
        self.anchors.disk = _disk_tier(kv, self.anchors, config, setup.server_args,
                                       setup.tp_rank)
        self.anchors.ranks = tp.disk_ranks(setup.tp_group) or self.anchors.ranks
        super().__init__(params)

    @property
    def forward_stream(self) -> Any:
        """SGLang's forward stream (CUDA), set by our adder hook (ext/sglang/__init__.py)."""
        return self.kv.forward_stream

    @forward_stream.setter
    def forward_stream(self, stream: Any) -> None:
        self.kv.forward_stream = stream

    # ---- RPC entry (scheduler loop) ---------------------------------------------------
    def __call__(self, op: str, payload: str, reply_to: str, call_id: int,
                 now: float | None = None) -> None:
        self.rpc.call(op, payload, reply_to, call_id, now)

    # ---- our prefill adder's questions (ext/sglang/admission.py) ------------------------
    def admit_restore(self, req: Any, room: Callable[[], int]) -> str:
        """Before the adder admits `req`: `go`, `wait` or `no_room` (`Restores.admit`)."""
        p = self.plans.get(req.rid)
        return "go" if p is None else self.restores.admit(req, p, room)

    def land_ready(self) -> None:
        """At the start of every admission round: insert every restore whose copy is done
        (on every rank), whether or not the round reaches its request. A placement holds
        its fresh slots out of the tree until it lands; were it to land only at its own
        request's match, a round whose admission stops before that request (a chunked
        request that needs those very slots for its next chunk) would stop every round, for
        good. Landed, the slots are an unlocked part of the tree: evictable if another
        request needs them before this one is admitted, which then prefills what is gone."""
        for rid, p in list(self.plans.active.items()):
            self.restores.land_if_copied(rid, p)

    def next_cut(self, req: Any, start: int) -> int | None:
        """On a hybrid model whose kernels cannot capture a state inside the forward
        (ext/sglang/capture.py), the depth where request `req`'s prefill chunk from `start`
        must end: its next planned snapshot past `start` and past what it restored (the
        prefill adder asks, after SGLang matched the request). An anchor the store already
        holds needs no cut: the request chains on it without a copy."""
        c = self.captures
        p = (self.plans.get(req.rid)
             if self.kv.states is not None and (c is None or c.dead) else None)
        if p is None:
            return None
        floor = max(start, self.anchors.tip_depth(req.rid))
        return next((s.depth for s in p.todo if s.depth > floor
                     and not self.anchors.table.contains(p.keys[s.depth], s.depth)), None)

    # ---- around each forward (`Scheduler.run_batch`, hooked in ext/sglang/__init__.py) ---
    def begin_forward(self, batch: Any) -> None:
        """Before an extend batch runs: the states to capture inside it (`Captures.begin`)."""
        c = self.captures
        if c is not None and not c.dead and self.plans.active and batch.forward_mode.is_extend():
            c.begin(batch, self.plans, self.anchors)

    def end_forward(self) -> None:
        c = self.captures
        if c is None:
            return
        dead = c.dead
        c.end()
        if c.dead and not dead:  # (every rank alike: the same code sees the same forward)
            log.warning("hybrid anchors: this model's layers took none of the captures "
                        "named to them (mode %s); prefill chunks end at anchor depths from "
                        "now on", c.mode)

    def capture_stats(self) -> CaptureStatsRecord | None:
        """How this hybrid model's anchors get their state (`/anchor/stats` `captures`)."""
        if self.kv.states is None:
            return None
        c = self.captures
        if c is None:
            return CaptureStatsRecord("chunk_cut")
        return CaptureStatsRecord("chunk_cut" if c.dead else "in_forward", c.taken, c.no_slot,
                                  c.unwritten, by=c.mode)

    def _join(self, rid: str, p: Any) -> None:
        """A request's copies joined at its release or end; its spare Mamba slots freed."""
        self.snapshots.join(rid, p)
        if p.captured and self.captures is not None:
            self.captures.free(p)

    # ---- SGLang's tree, overridden ------------------------------------------------------
    def match_prefix(self, params: Any) -> Any:
        """SGLang's match; for a request whose restore has landed (its copy done on every
        rank), after inserting the prefix, which is then an ordinary unlocked part of the
        tree: SGLang locks it as it admits the request, in this round (its admission budget
        counts the tree's unlocked tokens, so the insert changes nothing there). A request
        with no plan registered yet registers it here (`Plans.register`)."""
        req = params.req
        p = self.plans.register(req) if req is not None else None
        if p is not None:
            self.restores.land_if_copied(req.rid, p)
        return super().match_prefix(params)

    def swa_retain_floor(self, req: Any) -> int | None:
        """SGLang's own floor (SGLang frees no window slot of a running request at or past
        it), lowered to the window of the request's next planned anchor: on the sliding-window
        pool its window rows must still be there when the checkpoint hook copies them."""
        floor = super().swa_retain_floor(req)
        window = self.kv.window
        p = self.plans.get(req.rid) if window is not None else None
        if window is None or p is None or not p.todo:
            return floor
        ours = window.span(p.todo[0].depth)[0]
        return ours if floor is None else min(floor, ours)

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Snapshot every planned cut the request has computed (`Snapshots.take`). A running
        request's rows are read after SGLang's own checkpoint: SGLang then points the
        request's row at the tree's copy of any prefix another request inserted first, and
        frees its duplicates; what the row names is locked by the request until it
        releases it. A finished request's rows are read before SGLang's checkpoint."""
        p = self.plans.get(req.rid)
        finished = req.finished()
        if p is not None and p.own_from is None:  # (before SGLang's checkpoint inserts them)
            p.own_from = int(req.kv.cache_protected_len)
        if p is None or not finished:
            super().checkpoint(req, up_to=up_to, **kwargs)
        if p is None:
            return
        t = time.perf_counter()
        self.snapshots.take(req, p, up_to, finished=finished)
        if p.captured and self.captures is not None:  # (their states are copied now)
            self.captures.free(p, up_to)
        p.snapshot_s += time.perf_counter() - t
        self.times.add("snapshot", t)
        if finished:
            super().checkpoint(req, up_to=up_to, **kwargs)

    def on_release(self, req: Any, **kwargs: Any) -> None:
        """SGLang released a request's KV (after its last checkpoint): its snapshot copies
        are joined; when it has finished, its report is pushed to the HTTP process unasked
        (by the reply rank), and its staged anchors wait for the proxy's confirm, their TTL
        started by the next call."""
        super().on_release(req, **kwargs)
        p = self.plans.get(req.rid)
        if p is None:
            return
        # its rows are free now, though no one can take them before this returns
        self._join(req.rid, p)
        if not req.finished():  # (a retracted request comes back)
            return
        t = time.perf_counter()
        report = self.plans.end(req.rid, ok=True, start_ttl=False)
        self.rpc.push_finish(req.rid, p.token, report)
        self.times.add("release", t)

    def release_aborted_request(self, handle: Any) -> None:
        """SGLang dropped a request from its queue (an abort, a timeout): a restore in flight
        is inserted all the same."""
        super().release_aborted_request(handle)
        p = self.plans.get(handle.rid)
        if p is not None:
            self.restores.settle(handle.rid, p)

    # SGLang's idle memory check counts every slot: those a restore in flight holds are ours
    def protected_size(self) -> int:
        return int(super().protected_size()) + self.placer.placing_rows

    def full_protected_size(self) -> int:
        return int(super().full_protected_size()) + self.placer.placing_rows

    def mamba_protected_size(self) -> int:
        return int(super().mamba_protected_size()) + self.placer.placing_states

    def swa_protected_size(self) -> int:
        return int(super().swa_protected_size()) + self.placer.placing_windows

    def reset(self) -> None:
        """A flush drops the tree our pin locks point into: they are forgotten, never
        unlocked, and pinned anchors go back on the device at the next anchor operation."""
        self.restores.forget(self.plans.active.values())
        self.pins.forget()
        super().reset()


def build(ctx: Any) -> AnchorRadixCache:
    """The `--radix-cache-backend anchorcache` factory (runs in the scheduler process)."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    if ctx.disable_radix_cache:
        raise NotImplementedError("anchorcache on SGLang needs its radix cache on")
    if ctx.is_hybrid_swa:
        refusal = swa.refusal(ctx, ctx.params.token_to_kv_pool_allocator)
        if refusal is not None:
            raise NotImplementedError(refusal)
    if ctx.is_hybrid_ssm:
        refusal = hybrid.refusal(ctx.server_args)
        if refusal is not None:
            raise NotImplementedError(refusal)
    # the CLI refuses these first; a direct launch is refused here, by the same rule
    # (`--pp-size` is ServerArgs.pp_size, and so on)
    given = [f"{names[0]}={getattr(ctx.server_args, names[0][2:].replace('-', '_'), 1)}"
             for names in cpu.UNSERVED_PARALLELISM]
    refusal = cpu.parallelism_refusal(given)
    if refusal is not None:
        raise NotImplementedError(refusal)
    tp_rank = int(ctx.tp_rank)
    setup = AnchorSetup(SGLangAnchorConfig.from_env(), Path(ctx.server_args.model_path).name,
                        tp.shared_epoch(ctx.tp_group, tp_rank), tp_rank, ctx.tp_group,
                        ctx.server_args)
    # SGLang builds the cache as `cache_class(params)`
    cache = create_unified_radix_cache(ctx, cache_class=cast(Any, partial(AnchorRadixCache,
                                                                          setup=setup)))
    assert isinstance(cache, AnchorRadixCache)
    log.info("anchorcache radix cache ready: %s, epoch %s", cache.model_id, cache.epoch)
    return cache
