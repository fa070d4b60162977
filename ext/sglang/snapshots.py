"""Snapshots: a request's rows at its planned depths, copied from the KV pool into host slabs.

SGLang calls its tree cache's `checkpoint(req, up_to=...)` after each prefill and when a
request releases its KV; `Snapshots.take` then copies the rows of every planned depth the
request has computed, reading the request's own row of `req_to_token` while it still holds
(and locks) it. The copies run on the copy thread and are joined (`join`) when the request
releases its rows, before the scheduler can hand them to anyone else. When a request that
stopped on a stop token (or was cut by the proxy) releases its KV, its response anchor
(prompt + output) is saved the same way. On a hybrid model an anchor also holds the
recurrent state, which exists at `up_to` only (prefill chunks end at planned depths); on
the sliding-window pool, the sliding layers' window at its depth.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from anchorcache.ext import kernels
from anchorcache.ext.store import AnchorStore
from anchorcache.wire import AnchorKind, Region, anchor_keys

from . import hybrid, tp
from .faults import Faults
from .kv import DeviceKV
from .plans import Plan
from .timing import CallTimes

try:  # SGLang is an optional dependency of the package; this module runs inside it
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
except ImportError:  # pragma: no cover
    FINISH_MATCHED_TOKEN = ()  # type: ignore[misc,assignment]

log = logging.getLogger("anchorcache.sglang")


class Snapshots:
    """Writing anchored requests' rows into the store's host slabs; see the module docstring."""

    def __init__(self, kv: DeviceKV, store: AnchorStore, faults: Faults, times: CallTimes, *,
                 model_id: str, tp_group: Any) -> None:
        self._kv = kv
        self._store = store
        self._faults = faults
        self._times = times
        self._model_id = model_id
        self._tp_group = tp_group

    def take(self, req: Any, p: Plan, up_to: int, *, finished: bool) -> None:
        """Start the copies of every planned cut request `req` has computed up to `up_to`
        (and, when it has `finished`, of its response anchor). A failed snapshot costs the
        request's anchors, never the scheduler."""
        try:
            if p.todo:
                self._planned(req, p, up_to)
            if finished and p.plan.snapshot_response:
                self._response(req, p, up_to)
        except Exception:
            log.exception("snapshot of request %s failed", req.rid)
            p.todo, p.failed = [], True

    def _planned(self, req: Any, p: Plan, up_to: int) -> None:
        ready = [s for s in p.todo if s.depth <= up_to]
        if not ready:
            return
        p.todo = [s for s in p.todo if s.depth > up_to]
        keys, store, window_pool = p.keys, self._store, self._kv.window
        if self._kv.states is not None:  # a state exists at `up_to` and where the forward
            # captured one (ext/sglang/capture.py) only; held anchors need none
            ready = [s for s in ready if s.depth == up_to or s.depth in p.captured
                     or store.table.contains(keys[s.depth], s.depth)]
            if not ready:
                return
        capture = self._capture(req, p, ready[-1].depth, state_at=up_to)
        for spec in ready:
            if spec.depth <= store.tip_depth(req.rid):
                continue  # at or below what the request restored: nothing new to save
            if window_pool is not None and not store.table.contains(keys[spec.depth],
                                                                    spec.depth):
                window = self._window_of(req, p, spec.depth)
                if window is None:
                    continue  # (its window rows are gone: the tree's older part of a prefix)
                capture = self._capture(req, p, ready[-1].depth, state_at=up_to, window=window)
            p.record(store.write(req.rid, keys[spec.depth], spec.depth, spec.kind,
                                 spec.region, capture, ids=p.ids))

    def _window_of(self, req: Any, p: Plan, depth: int) -> torch.Tensor | None:
        """On the sliding-window pool, the window of request `req`'s prefix at `depth`, copied
        now (`WindowPool.gather`): SGLang frees window slots as the request moves on. A
        window of the request's own tokens that SGLang has not freed yet (its evicted-window
        length, `swa_retain_floor` keeping planned ones) is live; any other is checked (on
        CPU every one: it costs nothing there)."""
        window = self._kv.window
        assert window is not None
        lo, hi = window.span(depth)
        rows = self._kv.rows_of(req, lo, hi)
        own = p.own_from is not None and lo >= max(
            p.own_from, req.kv.get_evicted_seqlen(ComponentType.SWA))
        return window.gather(rows, check=not (own and rows.is_cuda))

    def _response(self, req: Any, p: Plan, up_to: int) -> None:
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
        if depth <= len(p.ids) or (self._kv.states is not None and depth != up_to):
            return  # (on a hybrid model the request's state is at `up_to` only)
        has_window = self._kv.window is not None
        window = self._window_of(req, p, depth) if has_window else None
        if has_window and window is None:
            return
        key = anchor_keys(p.plan.namespace, self._model_id, full, [depth])[depth]
        p.record(self._store.write(
            req.rid, key, depth, AnchorKind.RESPONSE, Region.THICK,
            self._capture(req, p, depth, state_at=up_to, window=window), ids=full))

    def _capture(self, req: Any, p: Plan, depth: int, *, state_at: int,
                 window: torch.Tensor | None = None) -> Any:
        """`capture(start, depth)` over the request's own row of `req_to_token`, which it
        still holds (and locks) while SGLang checkpoints it: the slab is allocated here and
        filled on the copy thread (`p.copies`), which `join` waits for. On a hybrid model
        the request's recurrent state, which is at depth `state_at` (SGLang's `up_to`), is
        copied in `capture`, at once: the request's next forward overwrites it in place; a
        state the forward captured at `depth` comes from its spare slot (`p.captured`). On
        the sliding-window pool the state slab is `window` (`_window_of`), made host bytes
        on the copy thread."""
        kv = self._kv
        row = kv.rows_of(req, 0, depth)

        def capture(start: int, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            state = None
            if kv.states is not None:
                if depth in p.captured:
                    slot = p.captured[depth][1]
                elif depth == state_at:
                    slot = hybrid.state_slot(kv.req_to_token_pool, req)
                else:
                    raise RuntimeError(f"no recurrent state at depth {depth} (at {state_at})")
                state = kernels.snapshot_state(kv.states, slot)
            elif window is not None:
                state = torch.empty(window.numel() * window.element_size(), dtype=torch.uint8,
                                    pin_memory=kv.pinned)
            rows = row[start:depth].contiguous()
            k0 = kv.k[0]
            out = torch.empty((len(kv.k), 2, depth - start, *k0.shape[1:]), dtype=k0.dtype,
                              pin_memory=kv.pinned)
            kv.fence()  # (CUDA) after the forward that wrote the rows
            fail = self._faults.take("snapshot_copy_fail")
            p.copies.append(kv.copier.submit(self._copy, rows, out, window, state, fail))
            return out, state

        return capture

    def _copy(self, rows: torch.Tensor, out: torch.Tensor, window: torch.Tensor | None = None,
              state: torch.Tensor | None = None, fail: bool = False) -> float:
        """On the copy thread: rows → `out` (and a gathered `window` → `state`); the seconds
        it took. `fail`: the `snapshot_copy_fail` fault (a copy that raises)."""
        if fail:
            raise RuntimeError("injected fault: snapshot_copy_fail")
        kv = self._kv
        t = time.perf_counter()
        with kv.on_copy_stream():
            kernels.snapshot_kv(kv.k, kv.v, rows, layout="thd", out=out)  # synchronizes
            if window is not None and state is not None:
                state.copy_(window.view(torch.uint8).flatten())
        if window is not None:
            kv.synchronize()  # (the window's copy too)
        return time.perf_counter() - t

    def join(self, rid: str, p: Plan) -> None:
        """Wait for request `rid`'s copies in flight (`copy_wait`: the scheduler's time, zero
        when they are done); if a copy or a snapshot failed, on this rank or any other,
        every anchor the request wrote is dropped, on every rank alike (each rank holds its
        shard of every anchor: one rank's failure is the anchor's). Every rank joins a
        request at the same points (its release, its end), so the ranks agree here."""
        t = time.perf_counter()
        failed = p.failed
        for fut in p.copies:
            try:
                self._times.add("copy", 0.0, 1e3 * fut.result())
            except Exception:
                log.exception("a snapshot copy of request %s failed", rid)
                failed = True
        p.copies = []
        failed = not bool(tp.all_ranks(self._tp_group, torch.tensor([not failed]))[0])
        self._times.add("copy_wait", t)
        if failed:
            p.failed = True
            self._store.abort_request(rid)
            p.written = []
