"""Scheduler side of the SGLang worker: SGLang's radix cache with our anchor store inside.

`AnchorRadixCache` is SGLang's own `UnifiedRadixCache` (built by SGLang's
`create_unified_radix_cache`, so every scheduler path stays SGLang's) plus:

- the anchor store (`anchorcache.ext.store`) with its host slabs, owned by this process;
- `__call__`: the entry point of the RPC path. `Scheduler.handle_rpc_request` runs
  `getattr(scheduler, method)(**parameters)` on the scheduler's own loop; the HTTP process
  sends `method="tree_cache"`, so every anchor operation runs here, between batches,
  never on a foreign thread. The reply travels back on a PUSH socket named in the call
  (`RpcReqOutput` carries only success and a message);
- a request's anchor plan rides in its own sampling parameters (`custom_params`), read
  when SGLang first matches the request for admission (`_plan_of`); no call precedes it;
- restore (`match_prefix`, at admission): the verified chain is scattered into freshly
  allocated pool slots by the copy thread while the request waits in the queue, then the
  prefix is inserted into the tree, unlocked: SGLang's admission locks it as any prefix hit;
- `checkpoint` (SGLang calls it after a prefill and when a request releases its KV): rows
  of every planned snapshot depth the request has computed are copied from the token
  pool into host slabs, reading the request's own row of `req_to_token` while it still
  holds (and locks) it. When a request that stopped on a stop token releases its KV, its
  response anchor (prompt + output) is saved the same way;
- `on_release`: a finished request's report (restored, written, held) is pushed to the
  HTTP process on the same PUSH socket, unasked;
- pins: a pinned anchor's prefix is put on the device the same way and stays locked in
  the tree, within a budget the contract keeps out of every request's limit.

Rows are addressed `thd` by token slot (`k_buffer[layer][slot]`), so a slab written by
the embedded worker's `bhtd` cache has the same bytes, at any page size. On a hybrid model
(Gated DeltaNet / Mamba layers) an anchor also holds the recurrent state at its depth:
prefill chunks end at planned depths (`next_cut`, ext/sglang/hybrid.py), where the
checkpoint hook copies the request's state; a restore inserts it with the rows. With
`--page-size N` SGLang's tree holds whole pages only: a restore or a pin puts back the
page-aligned part of the anchor's prefix (fresh pages from SGLang's own allocator) and the
request prefills the tail, fewer than N tokens.
"""

from __future__ import annotations

import logging
import secrets
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import torch
import zmq

from anchorcache.ext import ops
from anchorcache.ext.contract import key_arg as _key
from anchorcache.ext.contract import slots_arg as _slots
from anchorcache.ext.slots import SlotTable
from anchorcache.ext.store import AnchorStore, RestoreCheck
from anchorcache.wire import (
    AnchorHeld,
    AnchorKind,
    AnchorPlan,
    AnchorWritten,
    CallTime,
    ConfirmReply,
    FlushReply,
    KeyOpReply,
    SlotsAborted,
    VerifyReply,
    WireError,
    anchor_keys,
    parse_anchor_plan,
    parse_cache_key,
)

from . import cpu, hybrid, swa, tp
from .config import SGLangAnchorConfig
from .device import DevicePin, DeviceTree, Placement
from .rpc import PLAN_PARAM

log = logging.getLogger("anchorcache.sglang")

ENDED_KEPT = 1024  # ended runs whose report (or failure) the scheduler remembers
FAULTS = ("restore_shift_row", "restore_state_flip", "restore_slow", "restore_copy_fail",
          "snapshot_copy_fail")  # `_op_fault`

try:  # SGLang is an optional dependency of the package; this module runs inside it
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
except ImportError:  # pragma: no cover
    UnifiedRadixCache = object  # type: ignore[misc,assignment]
    FINISH_MATCHED_TOKEN = ()  # type: ignore[misc,assignment]


@dataclass
class _Pending:
    """One anchored request, from its first admission match to its release."""

    ids: tuple[int, ...]
    plan: AnchorPlan
    info: dict[str, Any]  # the chain check's report (`restored`, `restore_miss`, `held`, ...)
    token: str = ""  # the HTTP side's id of this run (a client may reuse a rid)
    check: RestoreCheck | None = None  # the chain, verified at the first admission match
    placed: bool = False  # its restore is settled: in the tree, or not to be (`missed`)
    missed: str | None = None  # why the verified prefix is not in the tree
    landing: Placement | None = None  # its verified prefix, on its way into the tree
    restored_tokens: int = 0  # scattered from the host slabs
    restore_s: float = 0.0
    todo: list[Any] = field(default_factory=list)  # SnapshotSpec, by depth
    keys: dict[int, bytes] = field(default_factory=dict)  # todo's keys, by depth
    written: list[AnchorWritten] = field(default_factory=list)
    held: list[AnchorHeld] = field(default_factory=list)
    snapshot_s: float = 0.0  # spent writing the request's anchors (snapshot_ms)
    copies: list[Future[float]] = field(default_factory=list)  # its slabs' copies in flight
    cut: int | None = None  # stopped by the proxy: the response anchor's depth (`_op_cut`)
    failed: bool = False  # a snapshot of it failed on this rank (its anchors go on every rank)
    own_from: int | None = None  # its rows past what it matched in the tree (first checkpoint)


def _disk_tier(cache: AnchorRadixCache, config: SGLangAnchorConfig, server_args: Any) -> Any:
    """The disk tier the config asks for (its directory indexed), or None. Only at TP 1 and
    DP 1: ranks would have to agree on every file's checks before any of them restores, and
    data-parallel ranks would share one directory's bookkeeping."""
    if config.anchor_disk_dir is None or config.anchor_disk_bytes == 0:
        return None
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    if tp_size != 1 or dp_size != 1:
        log.warning("disk tier off: it serves tensor and data parallel size 1 only")
        return None
    from anchorcache.ext.disk_tier import DiskTier, default_budget_bytes, model_fingerprint

    k0 = cache._k[0]
    fingerprint = model_fingerprint(server_args.model_path, "sglang", k0.dtype, len(cache._k),
                                    k0.shape[1], k0.shape[2], cache.anchors.state_bytes)
    budget = config.anchor_disk_bytes or default_budget_bytes(config.anchor_disk_dir)
    disk = DiskTier(config.anchor_disk_dir, fingerprint, budget_bytes=budget)
    log.info("disk tier %s: %d anchors indexed, budget %d bytes", disk.dir, disk.index(), budget)
    return disk


class AnchorRadixCache(DeviceTree, UnifiedRadixCache):  # type: ignore[misc,valid-type]
    """SGLang's unified radix cache that also keeps anchors; see the module docstring."""

    def attach_anchors(self, config: SGLangAnchorConfig, model_id: str) -> None:
        self._k, self._v = hybrid.kv_views(self.token_to_kv_pool_allocator)
        k0 = self._k[0]
        kv_bytes = len(self._k) * 2 * k0.shape[1] * k0.shape[2] * k0.element_size()
        # a hybrid model's recurrent state tensors: an anchor holds them at its depth, and
        # our prefill adder ends a chunk there (`next_cut`, ext/sglang/admission.py)
        self._states = (hybrid.state_views(self.req_to_token_pool) if self.supports_mamba()
                        else None)
        # SGLang's sliding-window pool: `_k`, `_v` are the full-attention layers' and an
        # anchor's state slab is its sliding layers' last window (ext/sglang/swa.py)
        self._window = (swa.WindowPool(self.token_to_kv_pool_allocator,
                                       self.components[ComponentType.SWA].sliding_window_size)
                        if self.supports_swa() else None)
        state_bytes = (ops.state_slab_nbytes(self._states) if self._states
                       else self._window.nbytes if self._window is not None else 0)
        table = SlotTable(config.anchor_slots, config.anchor_capacity_bytes,
                          pinned_slots=config.pinned_slots)
        self.anchors = AnchorStore(model_id, table, kv_bytes_per_token=kv_bytes,
                                   state_bytes=state_bytes)
        self.anchor_config = config
        self.epoch = secrets.token_hex(8)
        # tensor parallelism (ext/sglang/tp.py): `build` sets the rank and group and shares
        # rank 0's epoch; the store's TTL reads the call's time, not this process's clock
        self._tp_rank, self._tp_group = 0, None
        self._call_now: float | None = None
        self.anchors.clock = self._call_time
        self.model_id = model_id
        self._pending: dict[str, _Pending] = {}
        self._pool_tokens = int(self.token_to_kv_pool_allocator.size)
        # pinned anchors' prefixes stay locked in the tree, within their own budget, which
        # the contract's request limit leaves free (so no admitted request can starve)
        self._pins: dict[bytes, DevicePin] = {}
        self._pinned_tokens = 0
        self._pin_budget = int(config.pin_budget_fraction * self._pool_tokens)
        # on a hybrid model each pin also holds a Mamba slot: at most a quarter of them
        self._pin_states = (len(self.req_to_token_pool.mamba_allocator.free_slots) // 4
                            if self._states is not None else None)
        self._repin: dict[bytes, str | None] = {}  # pins a device flush dropped, placed again lazily
        self._fault: str | None = None  # one armed fault (`--fault-injection` only)
        self._zmq: zmq.Context[Any] = zmq.Context.instance()
        self._reply: dict[str, zmq.Socket[Any]] = {}
        self._push_to: str | None = None  # the HTTP process's reply socket (from every call)
        self._ended: OrderedDict[str, str] = OrderedDict()  # rid → token of its ended run
        self._reports: OrderedDict[str, dict[str, Any]] = OrderedDict()  # token → report
        self._call_ms: dict[str, tuple[int, float, float]] = {}  # op: (calls, total, max)
        # snapshots' copies run here, off the scheduler's loop (on CUDA on their own stream)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="anchorcache-copy")
        self._copy_stream = torch.cuda.Stream(k0.device) if k0.is_cuda else None
        self.forward_stream: Any = None  # SGLang's, set by our adder hook (__init__.py)
        self._placing_rows = self._placing_states = 0  # held by restores in flight
        self._placing_windows = 0

    # ---- RPC entry (scheduler loop) ---------------------------------------------------
    def __call__(self, op: str, payload: str, reply_to: str, call_id: int,
                 now: float | None = None) -> None:
        self._call_now = now  # every TP rank runs this call with the same `now`
        self._push_to = reply_to
        t = time.perf_counter()
        try:
            self.anchors.start_ttl()  # of requests released since the last call
            if self._repin:
                self._pin_again()
            handler = getattr(self, "_op_" + op)
            result = {"ok": True, **handler(orjson.loads(payload))}
        except WireError as e:
            result = {"ok": False, "status": 400, "message": str(e)}
        except Exception as e:
            log.exception("anchor op %s failed", op)
            result = {"ok": False, "status": 500, "message": f"{type(e).__name__}: {e}"}
        result["epoch"] = self.epoch
        result["call_id"] = call_id
        self._timed(op, t)
        if not tp.is_reply_rank(self._tp_rank):
            return  # one reply per call: rank 0's (the ranks decided alike)
        self._socket(reply_to).send(orjson.dumps(result))

    def _socket(self, reply_to: str) -> zmq.Socket[Any]:
        sock = self._reply.get(reply_to)
        if sock is None:
            sock = self._reply[reply_to] = self._zmq.socket(zmq.PUSH)
            sock.connect(reply_to)
        return sock

    def _timed(self, op: str, since: float, ms: float | None = None) -> None:
        """Count the scheduler's time in anchor work of kind `op` (`/anchor/stats`
        `scheduler_calls`): every running request waits that long. (`copy`: the copy
        thread's time, `ms`, which no request waits for.)"""
        if ms is None:
            ms = 1e3 * (time.perf_counter() - since)
        calls, total, peak = self._call_ms.get(op, (0, 0.0, 0.0))
        self._call_ms[op] = (calls + 1, total + ms, max(peak, ms))

    def _call_time(self) -> float:
        """The current call's time (the caller's clock), else this process's."""
        return time.monotonic() if self._call_now is None else self._call_now

    def _op_hello(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"model_id": self.model_id, "page_size": self.page_size,
                "pool_tokens": self._pool_tokens, "pin_budget_tokens": self._pin_budget}

    # ---- a request's plan and its end (one round trip: see ext/sglang/rpc.py) ----------
    def _plan_of(self, req: Any) -> _Pending | None:
        """The pending record of `req`, registered from the plan its sampling parameters
        carry (`custom_params[PLAN_PARAM]`) when SGLang first matches it: its restore runs
        then (`match_prefix`), its snapshots in the checkpoint hook."""
        p = self._pending.get(req.rid)
        if p is not None:
            return p
        params = getattr(req.sampling_params, "custom_params", None)
        raw = params.get(PLAN_PARAM) if isinstance(params, dict) else None
        if not isinstance(raw, str):
            return None
        try:
            body = orjson.loads(raw)
            token, plan = str(body["token"]), parse_anchor_plan(body["anchor"])
        except (orjson.JSONDecodeError, KeyError, TypeError, WireError):
            log.warning("request %s carries an unreadable anchor plan; served without", req.rid)
            return None
        if plan is None or self._ended.get(req.rid) == token:
            return None  # already ended (its `finish` came first: the client went away)
        ids = tuple(req.origin_input_ids)
        p = _Pending(ids, plan, {"restored": [], "restore_miss": []}, token=token)
        p.todo = sorted((s for s in plan.snapshot if s.depth <= len(ids)), key=lambda s: s.depth)
        p.keys = anchor_keys(plan.namespace, self.model_id, ids, [s.depth for s in p.todo])
        self._pending[req.rid] = p
        return p

    def next_cut(self, req: Any, start: int) -> int | None:
        """On a hybrid model, the depth where request `req`'s prefill chunk from `start` must
        end: its next planned snapshot past `start` and past what it restored (the prefill
        adder of ext/sglang/hybrid.py asks, after SGLang matched the request). An anchor
        the store already holds needs no cut: the request chains on it without a copy."""
        p = self._pending.get(req.rid) if self._states is not None else None
        if p is None:
            return None
        floor = max(start, self.anchors.tip_depth(req.rid))
        return next((s.depth for s in p.todo if s.depth > floor
                     and not self.anchors.table.contains(p.keys[s.depth], s.depth)), None)

    def swa_retain_floor(self, req: Any) -> int | None:
        """SGLang's own floor (SGLang frees no window slot of a running request at or past
        it), lowered to the window of the request's next planned anchor: on the sliding-window
        pool its window rows must still be there when the checkpoint hook copies them."""
        floor = super().swa_retain_floor(req)
        window = getattr(self, "_window", None)
        p = self._pending.get(req.rid) if window is not None else None
        if window is None or p is None or not p.todo:
            return floor
        ours = window.span(p.todo[0].depth)[0]
        return ours if floor is None else min(floor, ours)

    def on_release(self, req: Any, **kwargs: Any) -> None:
        """SGLang released a request's KV (after its last checkpoint): when it has finished,
        its report is pushed to the HTTP process unasked (by the reply rank), and its staged
        anchors wait for the proxy's confirm, their TTL started by the next call."""
        super().on_release(req, **kwargs)
        p = self._pending.get(req.rid) if hasattr(self, "_pending") else None
        if p is None:
            return
        # its rows are free now, though no one can take them before this returns
        self._join(req.rid, p)
        if not req.finished():  # (a retracted request comes back)
            return
        t = time.perf_counter()
        report = self._end(req.rid, ok=True, start_ttl=False)
        if self._push_to is not None and tp.is_reply_rank(self._tp_rank):
            self._socket(self._push_to).send(orjson.dumps(
                {"push": "finish", "rid": req.rid, "token": p.token, "epoch": self.epoch,
                 **report}))
        self._timed("release", t)

    def _end(self, rid: str, *, ok: bool, start_ttl: bool) -> dict[str, Any]:
        """Drop request `rid`'s pending record and release it in the store; its report."""
        p = self._pending.pop(rid)
        self._settle(rid, p)
        self._join(rid, p)  # its slabs are whole before anyone may read them
        self.anchors.release_request(rid, ok=ok, start_ttl=start_ttl)
        info = p.info
        if p.missed is not None and p.check is not None:  # verified, never placed
            miss = {"key": p.check.chain[-1].key.hex(), "depth": p.check.depth,
                    "reason": p.missed}
            info = {**info, "restored": [], "restore_miss": [*info["restore_miss"], miss]}
        report = {"anchors": info, "restored_tokens": p.restored_tokens,
                  "restore_ms": round(p.restore_s * 1e3, 3),
                  "written": [w.to_json() for w in p.written],
                  "held": [h.to_json() for h in p.held],
                  "snapshot_ms": round(p.snapshot_s * 1e3, 3)}
        self._ended[rid] = p.token
        self._reports[p.token] = report
        for kept in (self._ended, self._reports):
            while len(kept) > ENDED_KEPT:
                kept.popitem(last=False)
        return report

    def _op_finish(self, body: dict[str, Any]) -> dict[str, Any]:
        """The HTTP side's end of request `rid`: when its pushed report did not come (`ok`:
        the report, kept a while), or when the request failed (not `ok`: its staged anchors
        are dropped, and a plan that has not reached the scheduler yet never registers)."""
        rid, token, ok = str(body["rid"]), str(body["token"]), bool(body.get("ok"))
        p = self._pending.get(rid)
        if p is not None and p.token == token:
            return self._end(rid, ok=ok, start_ttl=True)
        if not ok:
            self.anchors.release_request(rid, ok=False)
            self._ended[rid] = token
        return self._reports.pop(token, None) or {
            "anchors": {"restored": [], "restore_miss": []}, "restored_tokens": 0,
            "restore_ms": 0.0, "written": [], "held": [], "snapshot_ms": 0.0}

    def _op_cut(self, body: dict[str, Any]) -> dict[str, Any]:
        """A stop sequence ends request `rid` (its abort follows): its response anchor is
        prompt + output up to `depth`, the prefix the next turn starts with."""
        p = self._pending.get(str(body.get("rid")))
        depth = body.get("depth")
        if p is not None and isinstance(depth, int):
            p.cut = depth
        return {"cut": p is not None}

    def _op_confirm(self, body: dict[str, Any]) -> dict[str, Any]:
        rid = body.get("rid")
        confirmed, evicted = self.anchors.confirm(_slots(body), rid if isinstance(rid, str) else None)
        for key in evicted:
            self._unpin_device(key)
        if self.anchor_config.slab_dump_dir is not None and self._tp_rank == 0:
            hybrid.dump_slabs(self.anchors, confirmed, self.anchor_config.slab_dump_dir,
                              self._states)
        return ConfirmReply(tuple(confirmed), tuple(evicted), self.epoch).to_json()

    def _op_abort(self, body: dict[str, Any]) -> dict[str, Any]:
        return SlotsAborted(tuple(self.anchors.abort(_slots(body))), self.epoch).to_json()

    def _op_abort_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"dropped": self.anchors.abort_request(str(body["rid"]))}

    def _op_lookup(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            hits = self.anchors.lookup(bytes.fromhex(body.get("namespace", "")),
                                       body.get("input_ids"), body.get("depths"), self.epoch)
        except (TypeError, ValueError) as e:
            raise WireError(f"lookup needs namespace, input_ids and depths: {e}") from None
        return hits.to_json()

    def _op_slots(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.anchors.slots(self.epoch).to_json()

    def _op_stats(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.anchors.stats(self.epoch, device_pinned_tokens=self._pinned_tokens,
                                   device_pin_budget_tokens=self._pin_budget)
        calls = tuple(CallTime(op, *c) for op, c in sorted(self._call_ms.items()))
        return replace(reply, scheduler_calls=calls).to_json()

    def _op_pin(self, body: dict[str, Any]) -> dict[str, Any]:
        """Pin in the host tier (never evicted from the slot table) and, with `device`, lock
        the anchor's prefix in SGLang's tree under `cache_key` (SGLang's `extra_key`: where
        the requests carrying that key find it), placing it there first if it is not on
        the device."""
        key, extra_key = _key(body), parse_cache_key(body.get("cache_key"))
        pinned = self.anchors.pin(key)  # (loaded from the disk tier first if need be)
        on_device = pinned and body.get("device", True)
        return KeyOpReply("pinned", pinned, self.epoch,
                          self._pin_device(key, extra_key) if on_device else "none").to_json()

    def _op_unpin(self, body: dict[str, Any]) -> dict[str, Any]:
        key = _key(body)
        self._unpin_device(key)
        return KeyOpReply("unpinned", self.anchors.unpin(key), self.epoch).to_json()

    def _op_evict(self, body: dict[str, Any]) -> dict[str, Any]:
        key = _key(body)
        evicted = self.anchors.evict(key)
        if evicted:
            self._unpin_device(key)
        return KeyOpReply("evicted", evicted, self.epoch).to_json()

    def _op_flush_anchors(self, body: dict[str, Any]) -> dict[str, Any]:
        for key in list(self._pins) + list(self._repin):
            self._unpin_device(key)
        return FlushReply(self.anchors.flush(), self.epoch).to_json()

    def _op_verify(self, body: dict[str, Any]) -> dict[str, Any]:
        """Compare, byte for byte, the rows SGLang's tree holds on the device for a committed
        anchor's prefix with the anchor's host slabs: after a restore they must be equal.
        `device_tokens` is how much of the prefix the tree still holds (only that is compared);
        `mismatch` the first differing token position, or None."""
        key, extra_key = _key(body), parse_cache_key(body.get("cache_key"))
        found = self.anchors.prefix_of(key)
        if found is None:
            raise WireError(f"no committed anchor {key.hex()} with its tokens in this worker")
        chain, ids = found
        match = self.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), extra_key)))
        n = int(match.device_prefix_len)
        rows = self.path_device_indices(match.last_device_node)[:n].to(torch.int64)
        device = ops.snapshot_kv(self._k, self._v, rows.contiguous(), layout="thd")
        host = torch.cat([s.kv for s in chain if s.kv is not None], dim=2)[:, :, :n]
        same = (device.view(torch.uint8) == host.contiguous().view(torch.uint8))
        per_token = same.flatten(3).all(dim=3).all(dim=1).all(dim=0)  # [n]
        per_token = tp.all_ranks(self._tp_group, per_token)  # each rank checked its shard
        bad = (~per_token).nonzero()
        state_equal = None
        if self._window is not None and n == len(ids) and chain[-1].state is not None:
            lo, hi = self._window.span(n)
            window = self._window.gather(rows[lo:hi])
            same_window = window is not None and torch.equal(
                self._window.as_state(window), chain[-1].state)
            state_equal = bool(tp.all_ranks(self._tp_group, torch.tensor([same_window]))[0])
        if self._states is not None and n == len(ids) and chain[-1].state is not None:
            slot = self.tree_core.get_component_device_value(match.last_device_node,
                                                             ComponentType.MAMBA)
            if slot is not None:
                index = int(self.req_to_token_pool.translate_mamba_indices(slot.view(1))[0])
                same_state = torch.equal(ops.snapshot_state(self._states, index),
                                         chain[-1].state)
                state_equal = bool(tp.all_ranks(self._tp_group, torch.tensor([same_state]))[0])
        return VerifyReply(key, len(ids), n, int(bad[0, 0]) if len(bad) else None,
                           self.epoch, state_equal).to_json()

    def _op_fault(self, body: dict[str, Any]) -> dict[str, Any]:
        """Arm one fault for the next restore (tests): `restore_shift_row` scatters a
        chain's middle row with its neighbour's bytes, `restore_state_flip` (a hybrid model)
        restores the state with one byte changed, `restore_slow` holds the copy thread a
        second before it writes; with `rank`, on that TP rank only (`armed` is rank 0's)."""
        if not self.anchor_config.fault_injection:
            raise WireError("fault injection is off (start the worker with --fault-injection)")
        if body.get("where") not in FAULTS:
            raise WireError(f"'where' must be one of {', '.join(FAULTS)}")
        if body.get("rank") in (None, self._tp_rank):
            self._fault = body["where"]
        return {"armed": self._fault}

    # ---- restore (at admission, copied off the loop) -----------------------------------
    def admit_restore(self, req: Any, room: Callable[[], int]) -> str:
        """Asked by our prefill adder (ext/sglang/admission.py) before it admits `req`:
        `go` (nothing to restore, or its prefix is in the tree, or it cannot be: then the
        request prefills it), `wait` (its copy is in flight: pass it over this round),
        `no_room` (the restore's fresh slots exceed `room()`, what this round can still give
        out: SGLang treats it as a request that does not fit). The first time it verifies
        the chain (ext/store.py), once, and starts putting its page-aligned prefix in the
        tree (`_place`: fresh slots, the copy on the copy thread); the match after the copy
        is done inserts it (`match_prefix`)."""
        p = self._pending.get(req.rid) if hasattr(self, "_pending") else None
        if p is None or p.placed:
            return "go"
        t = time.perf_counter()
        if p.landing is not None:
            self._timed("restore_wait", t)  # (counts the rounds it waited)
            return "wait"
        if p.check is None:
            p.check = check = self.anchors.check_chain(p.ids, p.plan)
            p.info = {**check.info(), "held": [h.to_json() for h in check.held]}
        check = p.check
        depth = self._paged(check.depth)  # the tree holds whole pages; the tail is prefilled
        verdict = "go"
        if not check.chain or depth == 0:
            p.placed, p.missed = True, "under_one_page" if check.chain else None
        else:
            started = self._place(check.chain, p.ids[:depth], req.extra_key, room)
            if started == "no_room":
                verdict = "no_room"
            elif isinstance(started, str):
                p.placed, p.missed = True, started  # served without: it prefills the prefix
            elif started.copy is None:  # all of it on the device already (and matched)
                self._placed(req.rid, p, self._land(started))
            else:
                p.landing, verdict = started, "wait"
        p.restore_s += time.perf_counter() - t
        self._timed("restore", t)
        return verdict

    def match_prefix(self, params: Any) -> Any:
        """SGLang's match; for a request whose restore has landed (its copy done on every
        rank), after inserting the prefix, which is then an ordinary unlocked part of the
        tree: SGLang locks it as it admits the request, in this round (its admission budget
        counts the tree's unlocked tokens, so the insert changes nothing there). A request
        with no restore started registers its plan here (`_plan_of`)."""
        req = params.req
        p = self._plan_of(req) if req is not None and hasattr(self, "_pending") else None
        if p is not None:
            self._land_if_copied(req.rid, p)
        return super().match_prefix(params)

    def land_ready(self) -> None:
        """At the start of every admission round (our adder): insert every restore whose copy
        is done (on every rank), whether or not the round reaches its request. A placement
        holds its fresh slots out of the tree until it lands; were it to land only at its
        own request's match, a round whose admission stops before that request (a chunked
        request that needs those very slots for its next chunk) would stop every round, for
        good. Landed, the slots are an unlocked part of the tree: evictable if another
        request needs them before this one is admitted, which then prefills what is gone."""
        for rid, p in list(getattr(self, "_pending", {}).items()):
            self._land_if_copied(rid, p)

    def _land_if_copied(self, rid: str, p: _Pending) -> None:
        """Insert request `rid`'s restore if its copy is done on every rank."""
        if p.landing is not None and self._landed(p.landing):
            t = time.perf_counter()
            landing, p.landing = p.landing, None
            self._placed(rid, p, self._land(landing))
            p.restore_s += time.perf_counter() - t
            self._timed("land", t)

    def _placed(self, rid: str, p: _Pending, placed: tuple[Any, int, int] | None) -> None:
        p.placed = True
        if placed is None:  # (the copy failed: the request prefills the prefix)
            p.missed = "no_device_space"
            return
        lock, p.restored_tokens, _ = placed
        self.unlock(lock)  # SGLang's admission locks what it matches
        p.missed = None
        assert p.check is not None
        self.anchors.chained(rid, p.check.chain[-1].key, p.check.depth)

    def _settle(self, rid: str, p: _Pending) -> None:
        """A request that leaves with its restore in flight: the copy is waited for and the
        prefix inserted all the same (its slots are then the tree's, unlocked)."""
        if p.landing is not None:
            landing, p.landing = p.landing, None
            placed = self._land(landing)
            if placed is not None:
                self.unlock(placed[0])

    def release_aborted_request(self, handle: Any) -> None:
        """SGLang dropped a request from its queue (an abort, a timeout)."""
        super().release_aborted_request(handle)
        p = self._pending.get(handle.rid) if hasattr(self, "_pending") else None
        if p is not None:
            self._settle(handle.rid, p)

    # SGLang's idle memory check counts every slot: those a restore in flight holds are ours
    def protected_size(self) -> int:
        return int(super().protected_size()) + getattr(self, "_placing_rows", 0)

    def full_protected_size(self) -> int:
        return int(super().full_protected_size()) + getattr(self, "_placing_rows", 0)

    def mamba_protected_size(self) -> int:
        return int(super().mamba_protected_size()) + getattr(self, "_placing_states", 0)

    def swa_protected_size(self) -> int:
        return int(super().swa_protected_size()) + getattr(self, "_placing_windows", 0)

    # ---- snapshots (SGLang's checkpoint hook) -----------------------------------------
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Start the copies of every planned cut the request has computed (and, when it
        ends, of its response anchor). They run on the copy thread and are joined when the
        request releases its rows (`on_release`, before the scheduler can hand them to
        anyone else). A running request's rows are read after SGLang's own checkpoint:
        SGLang then points the request's row at the tree's copy of any prefix another
        request inserted first, and frees its duplicates; what the row names is locked by
        the request until it releases it."""
        p = self._pending.get(req.rid) if hasattr(self, "_pending") else None
        finished = req.finished()
        if p is not None and p.own_from is None:  # (before SGLang's checkpoint inserts them)
            p.own_from = int(req.kv.cache_protected_len)
        if p is None or not finished:
            super().checkpoint(req, up_to=up_to, **kwargs)
        if p is None:
            return
        t = time.perf_counter()
        try:
            if p.todo:
                self._snapshot(req, p, up_to)
            if finished and p.plan.snapshot_response:
                self._snapshot_response(req, p, up_to)
        except Exception:  # a failed snapshot costs its anchors, never the scheduler
            log.exception("snapshot of request %s failed", req.rid)
            p.todo, p.failed = [], True
        p.snapshot_s += time.perf_counter() - t
        self._timed("snapshot", t)
        if finished:
            super().checkpoint(req, up_to=up_to, **kwargs)

    def _snapshot(self, req: Any, p: _Pending, up_to: int) -> None:
        ready = [s for s in p.todo if s.depth <= up_to]
        if not ready:
            return
        p.todo = [s for s in p.todo if s.depth > up_to]
        keys = p.keys
        if self._states is not None:  # a state exists at `up_to` only (held ones need none)
            ready = [s for s in ready if s.depth == up_to
                     or self.anchors.table.contains(keys[s.depth], s.depth)]
            if not ready:
                return
        capture = self._capture(req, p, ready[-1].depth, state_at=up_to)
        for spec in ready:
            if spec.depth <= self.anchors.tip_depth(req.rid):
                continue  # at or below what the request restored: nothing new to save
            if self._window is not None and not self.anchors.table.contains(
                    keys[spec.depth], spec.depth):
                window = self._window_of(req, p, spec.depth)
                if window is None:
                    continue  # (its window rows are gone: the tree's older part of a prefix)
                capture = self._capture(req, p, ready[-1].depth, state_at=up_to, window=window)
            self._record(p, self.anchors.write(req.rid, keys[spec.depth], spec.depth, spec.kind,
                                               spec.region.value, capture, ids=p.ids))

    def _window_of(self, req: Any, p: _Pending, depth: int) -> torch.Tensor | None:
        """On the sliding-window pool, the window of request `req`'s prefix at `depth`, copied
        now (`WindowPool.gather`): SGLang frees window slots as the request moves on. A
        window of the request's own tokens that SGLang has not freed yet (its evicted-window
        length, `swa_retain_floor` keeping planned ones) is live; any other is checked (on
        CPU every one: it costs nothing there)."""
        assert self._window is not None
        lo, hi = self._window.span(depth)
        rows = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, lo:hi].to(torch.int64)
        own = p.own_from is not None and lo >= max(
            p.own_from, req.kv.get_evicted_seqlen(ComponentType.SWA))
        return self._window.gather(rows, check=not (own and rows.is_cuda))

    def _snapshot_response(self, req: Any, p: _Pending, up_to: int) -> None:
        """The response anchor of a request that stopped on a stop token: prompt + output
        but the stop token. The stop token's row exists only when SGLang's overlap schedule
        already ran the next step (then `up_to` covers it), and that step's forward may
        still be in flight: the anchor stops one short, at rows whose forward has finished
        (one token short of the embedded worker's; the next turn starts with it all the same).
        A request the proxy stopped (a stop sequence; SGLang aborted it) keeps prompt +
        output up to its `cut`."""
        if p.cut is None and not isinstance(req.finished_reason, FINISH_MATCHED_TOKEN):
            return
        full = p.ids + tuple(req.output_ids)
        depth = min(up_to, len(full) - 1, len(full) if p.cut is None else p.cut)
        if depth <= len(p.ids) or (self._states is not None and depth != up_to):
            return  # (on a hybrid model the request's state is at `up_to` only)
        window = self._window_of(req, p, depth) if self._window is not None else None
        if self._window is not None and window is None:
            return
        key = anchor_keys(p.plan.namespace, self.model_id, full, [depth])[depth]
        self._record(p, self.anchors.write(
            req.rid, key, depth, AnchorKind.RESPONSE, "thick",
            self._capture(req, p, depth, state_at=up_to, window=window), ids=full))

    def _capture(self, req: Any, p: _Pending, depth: int, *, state_at: int,
                 window: torch.Tensor | None = None) -> Any:
        """`capture(start, depth)` over the request's own row of `req_to_token`, which it
        still holds (and locks) while SGLang checkpoints it: the slab is allocated here and
        filled on the copy thread (`p.copies`), which `_join` waits for. On a hybrid model
        the request's recurrent state, which is at depth `state_at` (SGLang's `up_to`), is
        copied in `capture`, at once: the request's next forward overwrites it in place. On
        the sliding-window pool the state slab is `window` (`_window_of`), made host bytes
        on the copy thread."""
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :depth].to(torch.int64)

        def capture(start: int, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            state = None
            if self._states is not None:
                if depth != state_at:
                    raise RuntimeError(f"no recurrent state at depth {depth} (at {state_at})")
                state = ops.snapshot_state(self._states,
                                           hybrid.state_slot(self.req_to_token_pool, req))
            elif window is not None:
                state = torch.empty(window.numel() * window.element_size(), dtype=torch.uint8,
                                    pin_memory=self._copy_stream is not None)
            rows = row[start:depth].contiguous()
            k0 = self._k[0]
            out = torch.empty((len(self._k), 2, depth - start, *k0.shape[1:]), dtype=k0.dtype,
                              pin_memory=self._copy_stream is not None)
            self._fence()  # (CUDA) after the forward that wrote the rows
            fail = self._fault == "snapshot_copy_fail"
            if fail:
                self._fault = None
            p.copies.append(self._copier.submit(self._copy, rows, out, window, state, fail))
            return out, state

        return capture

    def _copy(self, rows: torch.Tensor, out: torch.Tensor, window: torch.Tensor | None = None,
              state: torch.Tensor | None = None, fail: bool = False) -> float:
        """On the copy thread: rows → `out` (and a gathered `window` → `state`); the seconds
        it took. `fail`: the `snapshot_copy_fail` fault (a copy that raises)."""
        if fail:
            raise RuntimeError("injected fault: snapshot_copy_fail")
        t = time.perf_counter()
        with torch.cuda.stream(self._copy_stream) if self._copy_stream is not None \
                else nullcontext():
            ops.snapshot_kv(self._k, self._v, rows, layout="thd", out=out)  # synchronizes
            if window is not None and state is not None:
                state.copy_(window.view(torch.uint8).flatten())
        if self._copy_stream is not None and window is not None:
            self._copy_stream.synchronize()  # (the window's copy too)
        return time.perf_counter() - t

    def _join(self, rid: str, p: _Pending) -> None:
        """Wait for request `rid`'s copies in flight (`copy_wait`: the scheduler's time, zero
        when they are done); if a copy or a snapshot failed, on this rank or any other,
        every anchor the request wrote is dropped, on every rank alike (each rank holds its
        shard of every anchor: one rank's failure is the anchor's). Every rank joins a
        request at the same points (its release, its end), so the ranks agree here."""
        t = time.perf_counter()
        failed = p.failed
        for fut in p.copies:
            try:
                self._timed("copy", 0.0, 1e3 * fut.result())
            except Exception:
                log.exception("a snapshot copy of request %s failed", rid)
                failed = True
        p.copies = []
        failed = not bool(tp.all_ranks(self._tp_group, torch.tensor([not failed]))[0])
        self._timed("copy_wait", t)
        if failed:
            p.failed = True
            self.anchors.abort_request(rid)
            p.written = []

    @staticmethod
    def _record(p: _Pending, w: AnchorWritten | AnchorHeld | None) -> None:
        if isinstance(w, AnchorHeld):
            p.held.append(w)
        elif w is not None:
            p.written.append(w)

    def reset(self) -> None:
        # A flush drops the tree our pin locks point into: forget them, never unlock.
        # Pinned anchors go back on the device at the next anchor operation. (SGLang
        # flushes only with no request queued, so no restore is in flight: one would be
        # waited for and forgotten, its slots freed by the allocator's own reset.)
        if hasattr(self, "_pins"):
            for p in self._pending.values():
                if p.landing is not None and p.landing.copy is not None:
                    p.landing.copy.exception()
                p.landing = None
            self._placing_rows = self._placing_states = self._placing_windows = 0
            self._repin.update((key, pin.extra_key) for key, pin in self._pins.items())
            self._pins.clear()
            self._pinned_tokens = 0
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
    cache = create_unified_radix_cache(ctx, cache_class=AnchorRadixCache)
    assert isinstance(cache, AnchorRadixCache)
    config = SGLangAnchorConfig.from_env()
    cache.attach_anchors(config, Path(ctx.server_args.model_path).name)
    cache._tp_rank, cache._tp_group = int(ctx.tp_rank), ctx.tp_group
    cache.epoch = tp.shared_epoch(ctx.tp_group, cache._tp_rank)
    cache.anchors.disk = _disk_tier(cache, config, ctx.server_args)
    log.info("anchorcache radix cache ready: %s, epoch %s", cache.model_id, cache.epoch)
    return cache
