"""Anchors' prefixes put back into SGLang's tree: fresh pool slots, filled from host slabs.

`Placer` runs on the scheduler's loop and uses SGLang's own tree operations
(`match_prefix`, `insert`, `lock`, `evict`) and allocator. A prefix is placed whole pages
at a time (`--page-size N`: the tail of an anchor past its last whole page is prefilled by
the request). On a hybrid model a prefix goes in with the recurrent state at its end, in
a Mamba slot of its own (ext/sglang/hybrid.py).

Placing a prefix takes two steps, so that no copy runs on the scheduler's loop: `place`
allocates fresh slots (held out of the tree, so no one else can take or read them) and
hands the slabs → slots copy to the copy thread (on CUDA its own stream); `land` inserts
the prefix once the copy is done. A request whose restore is in flight stays in the
waiting queue until then (ext/sglang/admission.py); a pin waits for its copy.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from anchorcache.ext import kernels
from anchorcache.ext.store import Slab

from . import swa, tp
from .faults import RESTORE_SLOW_S, Faults
from .kv import DeviceKV
from .timing import CallTimes

T = TypeVar("T")

try:  # SGLang is an optional dependency of the package; this module runs inside it
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
except ImportError:  # pragma: no cover
    pass

log = logging.getLogger("anchorcache.sglang")


@dataclass
class Placement:
    """A prefix on its way into the tree (`Placer.place`, then `land`)."""

    key: Any  # the prefix's RadixKey
    depth: int
    head: torch.Tensor  # the tree's own slots of the part it already held (locked)
    head_lock: Any
    rows: torch.Tensor  # fresh slots for the rest, held out of the tree until the insert
    slot: torch.Tensor | None  # a hybrid model's fresh Mamba slot for the state at `depth`
    copy: Future[float] | None  # the copy thread's slabs → slots (None: nothing to copy)
    fresh: swa.Fresh | None = None  # on the sliding-window pool: `rows`, some with a window


Landed = tuple[Any, int, int]  # (lock, tokens scattered, tokens found on the device)


class Placer:
    """Placing anchors' prefixes in SGLang's tree `tree` (restores, pins); see the module
    docstring. It owns the count of slots its placements in flight hold out of the tree."""

    def __init__(self, tree: Any, kv: DeviceKV, faults: Faults, times: CallTimes,
                 tp_group: Any) -> None:
        self._tree = tree  # the AnchorRadixCache: SGLang's tree operations
        self._kv = kv
        self._faults = faults
        self._times = times
        self._tp_group = tp_group
        # slots (Mamba slots, window slots) held by placements in flight: SGLang's idle
        # memory check counts them (`AnchorRadixCache.protected_size`)
        self.placing_rows = self.placing_states = self.placing_windows = 0

    def forget(self) -> None:
        """A flush: the allocator's own reset takes back what placements held."""
        self.placing_rows = self.placing_states = self.placing_windows = 0

    def paged(self, depth: int) -> int:
        """The page-aligned part of a prefix of `depth` tokens."""
        return depth - depth % self._tree.page_size

    def to_device(self, chain: tuple[Slab, ...], ids: tuple[int, ...], extra_key: str | None
                  ) -> Landed | None:
        """Put the prefix `ids` (the rows of `chain`) into the tree and lock it, waiting for
        the copy (pins; a request's restore waits in the queue instead: `place`, `land`).
        (lock, tokens scattered, tokens found on the device), or None without room."""
        room = self._kv.allocator.available_size() + self._tree.evictable_size()
        placement = self.place(chain, ids, extra_key, lambda: room)
        return self.land(placement) if isinstance(placement, Placement) else None

    def place(self, chain: tuple[Slab, ...], ids: tuple[int, ...], extra_key: str | None,
              room: Callable[[], int]) -> Placement | str:
        """Start putting the prefix `ids` (the rows of `chain`) into the tree: what SGLang
        still holds stays (locked until `land`), the rest is written from the slabs into
        fresh pool slots, held out of the tree, by the copy thread; on a hybrid model the
        chain's state at `len(ids)` goes into a fresh Mamba slot the same way (SGLang's own
        match finds a prefix only where a state is). Why not, instead: `no_room` when the
        fresh slots would exceed `room()` (the tokens the scheduler can still give out, read
        after the head is locked), `no_device_space` when they cannot be had, `no_state`
        on a hybrid model when the chain has no state at exactly `len(ids)` (a state exists
        nowhere else). `ids` is whole pages; the chain may reach further (its rows past
        `ids` stay put). The prefix goes in under `extra_key`, the engine cache key of the
        requests it is for: SGLang's match finds it for those only."""
        tree, kv, faults = self._tree, self._kv, self._faults
        depth = len(ids)
        tip = chain[-1] if chain else None
        hybrid = kv.states is not None
        if (hybrid or kv.window is not None) and (
                tip is None or tip.depth != depth or tip.state is None):
            return "no_state"
        key = RadixKey(array("q", ids), extra_key)
        if hybrid:  # the KV the tree holds, with or without states (SGLang's match stops at
            n_full, node, _ = tree.tree_core.match_full_device_prefix(key)  # the last one)
        else:
            match = tree.match_prefix(MatchPrefixParams(key=key))
            n_full, node = match.device_prefix_len, match.last_device_node
        path = tree.path_device_indices(node).to(torch.int64)
        on_device = min(int(n_full), len(path), depth)
        need = depth - on_device
        # the tree's part stays until the insert (its KV; a state there is not ours to hold),
        # and the fresh slots' allocation below cannot evict it
        head_lock = tree.lock(node, (ComponentType.MAMBA,)) if on_device else None
        if need > room():
            tree.unlock(head_lock)
            return "no_room"
        fresh = None
        if kv.window is not None:  # window slots for the tokens in the tip's window only
            windowed = min(need, depth - kv.window.span(depth)[0])
            fresh = self._alloc_windowed(need, windowed)
            rows = fresh.rows if fresh is not None else None
        else:
            rows = self._alloc(need) if need else path[:0]
        slot = self.alloc_state() if hybrid else None
        if rows is None or (hybrid and slot is None):
            self._free(rows, slot)
            tree.unlock(head_lock)
            return "no_device_space"
        slabs, where = self._slabs(chain, on_device, depth, rows)
        state, index = None, 0
        if tip is not None and (slot is not None or fresh is not None):
            index = int(kv.req_to_token_pool.translate_mamba_indices(slot)[0]) if slot else 0
            state = tip.state
            if faults.take("restore_state_flip"):
                state = state.clone()
                at = 1 if fresh is None else len(state) - 3  # (a window's last row is live)
                state[at] ^= 0x40  # an exponent bit of a value (float32 or bf16)
                state[at + 2] ^= 0x40
        copy = None
        if slabs or state is not None:
            delay, fail = 0.0, False
            if faults.take("restore_slow"):
                delay = RESTORE_SLOW_S
            elif faults.take("restore_copy_fail"):
                fail = True
            kv.fence()
            # the tip's window goes to its fresh tokens only: the head's part of it is the
            # tree's, live (SGLang's match ends only after a whole live window)
            window_rows = rows[need - fresh.windowed:] if fresh is not None else None
            copy = kv.copier.submit(self._write, slabs, where, state, index, delay,
                                    window_rows, fail)
        self.placing_rows += need
        self.placing_states += slot is not None
        self.placing_windows += fresh.windowed if fresh is not None else 0
        return Placement(key, depth, path[:on_device], head_lock, rows, slot, copy, fresh)

    def _write(self, slabs: list[torch.Tensor], where: list[torch.Tensor],
               state: torch.Tensor | None, index: int, delay: float,
               window_rows: torch.Tensor | None = None, fail: bool = False) -> float:
        """On the copy thread: slabs → pool rows, state → Mamba slot `index` (on the
        sliding-window pool, the window → the window slots of `window_rows`); the seconds it
        took (with `delay`, the `restore_slow` fault's sleep, first; `fail`: the
        `restore_copy_fail` fault, a copy that raises)."""
        time.sleep(delay)
        if fail:
            raise RuntimeError("injected fault: restore_copy_fail")
        kv = self._kv
        t = time.perf_counter()
        states = kv.states if state is not None and window_rows is None else None
        mamba = state if states is not None else None
        with kv.on_copy_stream():
            kernels.restore_chain(slabs, where, kv.k, kv.v, layout="thd", state_slab=mamba,
                              states=states, state_index=index)
            if window_rows is not None and state is not None and kv.window is not None:
                kv.window.write(state, window_rows)
        kv.synchronize()  # done means on the device
        return time.perf_counter() - t

    def landed(self, placement: Placement) -> bool:
        """Whether `placement`'s copy is done, on every TP rank (each rank copies its own
        shard; they must admit the request in the same round)."""
        return self.done_everywhere(placement.copy)

    def done_everywhere(self, job: Future[Any] | None) -> bool:
        """Whether `job` (a copy-thread job of a request, or None) is done on every TP rank."""
        done = job is None or job.done()
        return bool(tp.all_ranks(self._tp_group, torch.tensor([done]))[0])

    def off_loop(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on the copy thread (a read from the disk tier), in order with the
        copies."""
        return self._kv.copier.submit(fn, *args)

    def land(self, placement: Placement) -> Landed | None:
        """Finish `place`: wait for the copy (if it failed, the slots go back) and insert
        the prefix, with its state on a hybrid model; (lock, tokens scattered, tokens
        found on the device), or None."""
        tree, kv, pl = self._tree, self._kv, placement
        self.placing_rows -= len(pl.rows)
        self.placing_states -= pl.slot is not None
        self.placing_windows -= pl.fresh.windowed if pl.fresh is not None else 0
        copied = True
        try:
            if pl.copy is not None:
                self._times.add("restore_copy", 0.0, 1e3 * pl.copy.result())
        except Exception:
            log.exception("a restore copy failed")
            copied = False
        # each rank wrote its shard: a prefix lands on every rank or on none (the ranks must
        # admit the request alike), so one rank's failed copy is every rank's
        if not bool(tp.all_ranks(self._tp_group, torch.tensor([copied]))[0]):
            tree.unlock(pl.head_lock)
            self._free(pl.rows if pl.fresh is None else None, pl.slot)
            if pl.fresh is not None:
                pl.fresh.free(kv.allocator)
            return None
        on_device = len(pl.head)
        if len(pl.rows) or pl.slot is not None:
            params = InsertParams(
                key=pl.key, value=torch.cat([pl.head, pl.rows]), prev_prefix_len=on_device,
                **({} if pl.slot is None else {"mamba_value": pl.slot}))
            if kv.window is not None:  # the tokens before the window have no window rows
                params.set_evicted_seqlen(ComponentType.SWA, kv.window.span(pl.depth)[0])
            result = tree.insert(params)
            # `prev_prefix_len`: the head is the tree's own slots, not duplicates to free
            # (the insert frees any other overlap itself); a state already there wins
            if pl.slot is not None and result.mamba_exist:
                self._free(None, pl.slot)
        tree.unlock(pl.head_lock)
        match = tree.match_prefix(MatchPrefixParams(key=pl.key))
        if int(match.device_prefix_len) != pl.depth:
            return None  # (never seen: SGLang dropped a hybrid state at once)
        return tree.lock(match.last_device_node), len(pl.rows), on_device

    def _free(self, rows: torch.Tensor | None, slot: torch.Tensor | None) -> None:
        if rows is not None and len(rows):
            self._kv.allocator.free(rows)
        if slot is not None:
            self._kv.req_to_token_pool.mamba_allocator.free(slot)

    def alloc_state(self) -> torch.Tensor | None:
        """A free Mamba slot (`[1]`), evicting one unlocked tree state for it if need be."""
        allocator = self._kv.req_to_token_pool.mamba_allocator
        got = allocator.alloc(1)
        if got is None:
            self._tree.evict(EvictParams(num_tokens=0, mamba_num=1))
            got = allocator.alloc(1)
        return None if got is None else got.view(1)

    def _alloc_windowed(self, n: int, windowed: int) -> swa.Fresh | None:
        """`_alloc` on the sliding-window pool: `n` fresh full slots, the last `windowed` with
        a window slot each, evicting unlocked tree nodes (either kind of slot) for them."""
        window = self._kv.window
        assert window is not None
        allocator = self._kv.allocator
        short_full = n - allocator.full_available_size()
        short_window = windowed - allocator.swa_available_size()
        if short_full > 0 or short_window > 0:
            self._tree.evict(EvictParams(num_tokens=max(0, short_full),
                                         swa_num_tokens=max(0, short_window)))
        return window.take(n, windowed)

    def _alloc(self, n: int) -> torch.Tensor | None:
        """`n` fresh pool slots, evicting unlocked tree nodes for them; None (and nothing
        evicted) when even that would not make room."""
        allocator = self._kv.allocator
        if allocator.available_size() + self._tree.evictable_size() < n:
            return None
        if allocator.available_size() < n:
            self._tree.evict(EvictParams(num_tokens=n - allocator.available_size()))
        if allocator.available_size() < n:
            return None
        got = allocator.alloc(n)
        return None if got is None else got.to(torch.int64)

    def _slabs(self, chain: tuple[Slab, ...], skip: int, end: int, rows: torch.Tensor
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The chain's rows `[skip, end)` as (slab pieces, their pool slots in `rows`); with
        an armed `restore_shift_row` fault, the last piece's middle row is its neighbour's."""
        slabs, where = [], []
        for slab in chain:
            a, b = max(slab.start, skip), min(slab.depth, end)
            if b <= a or slab.kv is None:
                continue
            kv = slab.kv
            if (a, b) != (slab.start, slab.depth):
                kv = kv[:, :, a - slab.start:b - slab.start].contiguous()
            slabs.append(kv)
            where.append(rows[a - skip: b - skip].contiguous())
        if slabs and slabs[-1].shape[2] > 1 and self._faults.take("restore_shift_row"):
            kv = slabs[-1].clone()
            mid = kv.shape[2] // 2
            kv[:, :, mid] = kv[:, :, mid - 1]
            slabs[-1] = kv
        return slabs, where
