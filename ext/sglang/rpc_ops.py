"""The scheduler's end of the anchor RPC: one call in, one reply out, each op a handler.

`Scheduler.handle_rpc_request` runs `scheduler.tree_cache(**parameters)` on the scheduler's
own loop (ext/sglang/rpc.py is the HTTP process's end), so every anchor operation runs
between batches, never on a foreign thread. `AnchorRadixCache.__call__` hands the call to
`RpcOps.call`, which looks its op up in a table built once (`ops`) and pushes the reply to
the PUSH socket named in the call (`RpcReqOutput` carries only success and a message).
Only TP rank 0 replies; the others apply the call and stay silent (ext/sglang/tp.py). The
same socket carries a finished request's report, unasked (`push_finish`).
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import orjson
import zmq
from msgspec.structs import replace

from anchorcache.ext.contract import (
    ContractError,
    export_from,
    import_into,
    key_arg,
    slots_arg,
)
from anchorcache.ext.store import AnchorStore
from anchorcache.wire import (
    ConfirmReply,
    EvictReply,
    FlushReply,
    PinReply,
    SlotsAborted,
    UnpinReply,
    VerifyReply,
    WireError,
    parse_cache_key,
)

from . import hybrid, tp
from .config import SGLangAnchorConfig
from .faults import NAMES as FAULT_NAMES
from .faults import Faults
from .kv import DeviceKV
from .pins import Pins
from .plans import FinishReport, Plans
from .timing import CallTimes
from .verify import check_device

log = logging.getLogger("anchorcache.sglang")

Handler = Callable[[dict[str, Any]], dict[str, Any]]  # a call's body → its reply's fields


class RpcOps:
    """The RPC operations of one scheduler (one TP rank); see the module docstring. It owns
    the call's time, which the store's TTL reads (`call_time`): every TP rank runs a call
    with the time the HTTP process stamped into it, so the ranks' stores decide alike."""

    def __init__(self, *, tree: Any, kv: DeviceKV, store: AnchorStore, plans: Plans,
                 pins: Pins, faults: Faults, times: CallTimes, config: SGLangAnchorConfig,
                 model_id: str, epoch: str, tp_rank: int, tp_group: Any) -> None:
        self._tree = tree  # SGLang's tree (`page_size`, and its match for `verify`)
        self._kv = kv
        self._store = store
        self._plans = plans
        self._pins = pins
        self._faults = faults
        self._times = times
        self._config = config
        self._model_id = model_id
        self._epoch = epoch
        self._tp_rank, self._tp_group = tp_rank, tp_group
        self._pool_tokens = int(kv.allocator.size)
        self._now: float | None = None
        self._zmq: zmq.Context[Any] = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket[Any]] = {}
        self._push_to: str | None = None  # the HTTP process's reply socket (from every call)
        self.ops: Mapping[str, Handler] = MappingProxyType({
            "hello": self._hello, "finish": self._finish, "cut": self._cut,
            "confirm": self._confirm, "abort": self._abort,
            "abort_request": self._abort_request, "lookup": self._lookup,
            "slots": self._slots, "stats": self._stats, "pin": self._pin,
            "unpin": self._unpin, "evict": self._evict, "flush_anchors": self._flush_anchors,
            "verify": self._verify, "fault": self._fault,
            "import_slab": self._import_slab, "export_slab": self._export_slab,
        })

    def call_time(self) -> float:
        """The current call's time (the caller's clock), else this process's."""
        return time.monotonic() if self._now is None else self._now

    def call(self, op: str, payload: str, reply_to: str, call_id: int,
             now: float | None) -> None:
        self._now = now  # every TP rank runs this call with the same `now`
        self._push_to = reply_to
        t = time.perf_counter()
        try:
            self._store.start_ttl()  # of requests released since the last call
            self._pins.pin_again()
            handler = self.ops[op]
            result = {"ok": True, **handler(orjson.loads(payload))}
        except WireError as e:
            result = {"ok": False, "status": 400, "message": str(e)}
        except Exception as e:
            status = getattr(e, "status", None)  # ContractError, the disk tier's refusals
            if isinstance(status, int) and 400 <= status < 500:
                result = {"ok": False, "status": status, "message": str(e)}
            else:
                log.exception("anchor op %s failed", op)
                result = {"ok": False, "status": 500, "message": f"{type(e).__name__}: {e}"}
        result["epoch"] = self._epoch
        result["call_id"] = call_id
        self._times.add(op, t)
        if not tp.is_reply_rank(self._tp_rank):
            return  # one reply per call: rank 0's (the ranks decided alike)
        self._socket(reply_to).send(orjson.dumps(result))

    def push_finish(self, rid: str, token: str, report: FinishReport) -> None:
        """A finished request's report, pushed unasked to the HTTP process (by rank 0)."""
        if self._push_to is not None and tp.is_reply_rank(self._tp_rank):
            self._socket(self._push_to).send(orjson.dumps(
                {"push": "finish", "rid": rid, "token": token, "epoch": self._epoch,
                 **report.to_json()}))

    def _socket(self, reply_to: str) -> zmq.Socket[Any]:
        sock = self._sockets.get(reply_to)
        if sock is None:
            sock = self._sockets[reply_to] = self._zmq.socket(zmq.PUSH)
            sock.connect(reply_to)
        return sock

    # ---- the ops (docs/worker-protocol.md; their bodies as ext/sglang/rpc.py sends them) --
    def _hello(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"model_id": self._model_id, "page_size": self._tree.page_size,
                "pool_tokens": self._pool_tokens, "pin_budget_tokens": self._pins.budget_tokens}

    def _finish(self, body: dict[str, Any]) -> dict[str, Any]:
        """The HTTP side's end of request `rid` (`Plans.finish`)."""
        rid, token, ok = str(body["rid"]), str(body["token"]), bool(body.get("ok"))
        return self._plans.finish(rid, token, ok=ok).to_json()

    def _cut(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"cut": self._plans.cut(str(body.get("rid")), body.get("depth"))}

    def _confirm(self, body: dict[str, Any]) -> dict[str, Any]:
        rid = body.get("rid")
        confirmed, evicted = self._store.confirm(slots_arg(body),
                                                 rid if isinstance(rid, str) else None)
        for key in evicted:
            self._pins.unpin(key)
        if self._config.slab_dump_dir is not None and self._tp_rank == 0:
            hybrid.dump_slabs(self._store, confirmed, self._config.slab_dump_dir,
                              self._kv.states)
        return ConfirmReply(tuple(confirmed), tuple(evicted), self._epoch).to_json()

    def _abort(self, body: dict[str, Any]) -> dict[str, Any]:
        return SlotsAborted(tuple(self._store.abort(slots_arg(body))), self._epoch).to_json()

    def _abort_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"dropped": self._store.abort_request(str(body["rid"]))}

    def _lookup(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            hits = self._store.lookup(bytes.fromhex(body.get("namespace", "")),
                                      body.get("input_ids"), body.get("depths"), self._epoch)
        except (TypeError, ValueError) as e:
            raise WireError(f"lookup needs namespace, input_ids and depths: {e}") from None
        return hits.to_json()

    def _slots(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._store.slots(self._epoch).to_json()

    def _stats(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = self._store.stats(self._epoch, device_pinned_tokens=self._pins.pinned_tokens,
                                  device_pin_budget_tokens=self._pins.budget_tokens)
        return replace(reply, scheduler_calls=self._times.rows(),
                       captures=self._tree.capture_stats()).to_json()

    def _pin(self, body: dict[str, Any]) -> dict[str, Any]:
        """Pin in the host tier (never evicted from the slot table) and, with `device`, lock
        the anchor's prefix in SGLang's tree under `cache_key` (SGLang's `extra_key`: where
        the requests carrying that key find it), placing it there first if it is not on
        the device."""
        key, extra_key = key_arg(body), parse_cache_key(body.get("cache_key"))
        pinned = self._store.pin(key)  # (loaded from the disk tier first if need be)
        on_device = pinned and body.get("device", True)
        return PinReply(pinned, self._epoch,
                        self._pins.pin(key, extra_key) if on_device else "none").to_json()

    def _unpin(self, body: dict[str, Any]) -> dict[str, Any]:
        key = key_arg(body)
        self._pins.unpin(key)
        return UnpinReply(self._store.unpin(key), self._epoch).to_json()

    def _evict(self, body: dict[str, Any]) -> dict[str, Any]:
        key = key_arg(body)
        evicted = self._store.evict(key)
        if evicted:
            self._pins.unpin(key)
        return EvictReply(evicted, self._epoch).to_json()

    def _import_slab(self, body: dict[str, Any]) -> dict[str, Any]:
        """A slab file another worker exported, onto the disk tier (its checks: a full read
        and checksum, on this loop: an operator's call, not a request's)."""
        try:
            data = base64.b64decode(body["data"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"import needs the file as base64 'data': {e}") from None
        self._one_file_per_anchor()
        return import_into(self._store.disk, data, self._epoch).to_json()

    def _export_slab(self, body: dict[str, Any]) -> dict[str, Any]:
        self._one_file_per_anchor()
        data = export_from(self._store.disk, key_arg(body))
        return {"data": base64.b64encode(data).decode()}

    def _one_file_per_anchor(self) -> None:
        """Files move over the contract one per anchor; a tensor-parallel worker keeps one
        per rank (its shard), which share the directory instead."""
        if tp.ranks(self._tp_group) > 1:
            raise ContractError(409, "a tensor-parallel worker keeps one file per rank: "
                                     "share the disk directory instead of moving files")

    def _flush_anchors(self, body: dict[str, Any]) -> dict[str, Any]:
        self._pins.unpin_all()
        return FlushReply(self._store.flush(), self._epoch).to_json()

    def _verify(self, body: dict[str, Any]) -> dict[str, Any]:
        """Compare, byte for byte, the rows SGLang's tree holds on the device for a committed
        anchor's prefix with the anchor's host slabs (ext/sglang/verify.py)."""
        key, extra_key = key_arg(body), parse_cache_key(body.get("cache_key"))
        found = self._store.prefix_of(key)
        if found is None:
            raise WireError(f"no committed anchor {key.hex()} with its tokens in this worker")
        chain, ids = found
        got = check_device(self._tree, self._kv, self._tp_group, chain, ids, extra_key)
        return VerifyReply(key, len(ids), got.device_tokens, got.mismatch, self._epoch,
                           got.state_equal).to_json()

    def _fault(self, body: dict[str, Any]) -> dict[str, Any]:
        """Arm one fault for the next restore or snapshot (tests, ext/sglang/faults.py):
        `restore_shift_row` scatters a chain's middle row with its neighbour's bytes,
        `restore_state_flip` (a hybrid model) restores the state with one byte changed,
        `restore_slow` holds the copy thread a second before it writes; with `rank`, on that
        TP rank only (`armed` is rank 0's)."""
        if not self._config.fault_injection:
            raise WireError("fault injection is off (start the worker with --fault-injection)")
        where = body.get("where")
        if where not in FAULT_NAMES:
            raise WireError(f"'where' must be one of {', '.join(FAULT_NAMES)}")
        if body.get("rank") in (None, self._tp_rank):
            self._faults.arm(where)
        return {"armed": self._faults.armed}
