"""Anchors on SGLang's device tree: rows put back into the KV pool, pins kept there.

`DeviceTree` is a mixin of `AnchorRadixCache` (cache.py), so it runs on the scheduler's loop
as all of it does, and uses SGLang's own tree operations (`match_prefix`, `insert`, `lock`,
`evict`) and allocator. A prefix is placed whole pages at a time (`--page-size N`: the
tail of an anchor past its last whole page is prefilled by the request). On a hybrid model
(`_states` set) a prefix goes in with the recurrent state at its end, in a Mamba slot of
its own (ext/sglang/hybrid.py).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch

from anchorcache.ext import ops
from anchorcache.ext.store import AnchorStore, Slab

try:  # SGLang is an optional dependency of the package; this module runs inside it
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
except ImportError:  # pragma: no cover
    pass


@dataclass
class DevicePin:
    """A pinned anchor's prefix, held in SGLang's tree by a lock reference."""

    lock: Any
    tokens: int


class DeviceTree:
    """Placing anchors' prefixes in SGLang's tree (restores, pins); see the module docstring.
    The attributes below are `AnchorRadixCache`'s (set in `attach_anchors`) and SGLang's."""

    anchors: AnchorStore
    page_size: int
    token_to_kv_pool_allocator: Any
    _k: list[torch.Tensor]
    _v: list[torch.Tensor]
    _pins: dict[bytes, DevicePin]
    _pinned_tokens: int
    _pin_budget: int
    _pin_states: int | None  # a hybrid model's bound on pins (each holds a Mamba slot)
    _repin: set[bytes]
    _fault: str | None
    _states: list[torch.Tensor] | None  # a hybrid model's state tensors (hybrid.state_views)
    req_to_token_pool: Any
    tree_core: Any
    match_prefix: Any
    insert: Any
    lock: Any
    unlock: Any
    evict: Any
    evictable_size: Any
    path_device_indices: Any

    # ---- device pins --------------------------------------------------------------------
    def _pin_device(self, key: bytes) -> str:
        """Lock the committed anchor `key`'s prefix in the tree; how it went: `locked`,
        or why not (`over_budget`, `no_device_space`, `no_tokens`)."""
        if key in self._pins:
            return "locked"
        found = self.anchors.prefix_of(key)
        if found is None:
            return "no_tokens"
        chain, ids = found
        ids = ids[:self._paged(len(ids))]
        if not ids:
            return "no_tokens"  # shorter than one page: nothing the tree can hold
        if self._pinned_tokens + len(ids) > self._pin_budget or (
                self._pin_states is not None and len(self._pins) >= self._pin_states):
            return "over_budget"
        placed = self._to_device(chain, ids)
        if placed is None:
            return "no_device_space"
        self._pins[key] = DevicePin(placed[0], len(ids))
        self._pinned_tokens += len(ids)
        return "locked"

    def _unpin_device(self, key: bytes) -> None:
        self._repin.discard(key)
        pin = self._pins.pop(key, None)
        if pin is not None:
            self.unlock(pin.lock)
            self._pinned_tokens -= pin.tokens

    def _pin_again(self) -> None:
        keys, self._repin = self._repin, set()
        pinned = {e.key for e in self.anchors.table.entries() if e.pinned}
        for key in keys & pinned:
            self._pin_device(key)

    def _paged(self, depth: int) -> int:
        """The page-aligned part of a prefix of `depth` tokens."""
        return depth - depth % self.page_size

    def _to_device(self, chain: tuple[Slab, ...], ids: tuple[int, ...]
                   ) -> tuple[Any, int, int] | None:
        """Put the prefix `ids` (the rows of `chain`) into the tree and lock it: what SGLang
        still holds stays, the rest is scattered from the slabs into fresh pool slots.
        (lock, tokens scattered, tokens found on the device), or None without room. `ids` is
        whole pages; the chain may reach further (its rows past `ids` are left alone)."""
        if self._states is not None:
            return self._to_device_hybrid(chain, ids)
        depth = len(ids)
        key = RadixKey(array("q", ids))
        fresh = self._alloc(depth)  # before the match: allocation may evict tree nodes
        match = self.match_prefix(MatchPrefixParams(key=key))
        on_device = int(match.device_prefix_len)
        scattered = 0
        if on_device < depth:
            if fresh is None:
                return None
            need = depth - on_device
            rows = fresh[:need]
            if need < len(fresh):
                self.token_to_kv_pool_allocator.free(fresh[need:])
            self._scatter(chain, on_device, depth, rows)
            prefix = self.path_device_indices(match.last_device_node)[:on_device].to(torch.int64)
            # `prev_prefix_len`: the head is the tree's own slots, not duplicates to free
            # (the insert frees any other overlap itself)
            self.insert(InsertParams(key=key, value=torch.cat([prefix, rows]),
                                     prev_prefix_len=on_device))
            scattered = need
            match = self.match_prefix(MatchPrefixParams(key=key))
        elif fresh is not None:
            self.token_to_kv_pool_allocator.free(fresh)
        assert int(match.device_prefix_len) == depth, (match.device_prefix_len, depth)
        return self.lock(match.last_device_node), scattered, on_device

    def _to_device_hybrid(self, chain: tuple[Slab, ...], ids: tuple[int, ...]
                          ) -> tuple[Any, int, int] | None:
        """`_to_device` on a hybrid model: the KV rows the tree lacks, and the chain's state
        at `len(ids)` in a fresh Mamba slot, inserted together, so that SGLang's own match
        finds the state there (it matches only nodes that have one). None without room, or
        when the chain has no state at exactly `len(ids)` (a state exists nowhere else)."""
        depth = len(ids)
        tip = chain[-1] if chain else None
        if tip is None or tip.depth != depth or tip.state is None:
            return None
        key = RadixKey(array("q", ids))
        fresh = self._alloc(depth)  # before the match: allocation may evict tree nodes
        slot = self._alloc_state()
        if slot is None:
            if fresh is not None:
                self.token_to_kv_pool_allocator.free(fresh)
            return None
        # the KV the tree holds, with or without states (SGLang's match stops at the last)
        n_full, node, _ = self.tree_core.match_full_device_prefix(key)
        path = self.path_device_indices(node).to(torch.int64)
        on_device = min(int(n_full), len(path), depth)
        need = depth - on_device
        if need and fresh is None:
            self.req_to_token_pool.mamba_allocator.free(slot)
            return None
        rows = fresh[:need] if fresh is not None else path[:0]
        if fresh is not None and need < len(fresh):
            self.token_to_kv_pool_allocator.free(fresh[need:])
        slabs, where = self._slabs(chain, on_device, depth, rows)
        index = int(self.req_to_token_pool.translate_mamba_indices(slot)[0])
        state = tip.state
        if self._fault == "restore_state_flip":
            self._fault = None
            state = state.clone()
            state[1] ^= 0x40  # an exponent bit of the first value (float32 or bf16)
            state[3] ^= 0x40
        ops.restore_chain(slabs, where, self._k, self._v, layout="thd", state_slab=state,
                          states=self._states, state_index=index)
        result = self.insert(InsertParams(key=key, value=torch.cat([path[:on_device], rows]),
                                          prev_prefix_len=on_device, mamba_value=slot))
        if result.mamba_exist:  # the tree had a state there already: ours is not needed
            self.req_to_token_pool.mamba_allocator.free(slot)
        match = self.match_prefix(MatchPrefixParams(key=key))
        if int(match.device_prefix_len) != depth:
            return None  # (never seen: SGLang dropped the state at once)
        return self.lock(match.last_device_node), need, on_device

    def _alloc_state(self) -> torch.Tensor | None:
        """A free Mamba slot (`[1]`), evicting one unlocked tree state for it if need be."""
        allocator = self.req_to_token_pool.mamba_allocator
        got = allocator.alloc(1)
        if got is None:
            self.evict(EvictParams(num_tokens=0, mamba_num=1))
            got = allocator.alloc(1)
        return None if got is None else got.view(1)

    def _alloc(self, n: int) -> torch.Tensor | None:
        """`n` fresh pool slots, evicting unlocked tree nodes for them; None (and nothing
        evicted) when even that would not make room."""
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() + self.evictable_size() < n:
            return None
        if allocator.available_size() < n:
            self.evict(EvictParams(num_tokens=n - allocator.available_size()))
        if allocator.available_size() < n:
            return None
        got = allocator.alloc(n)
        return None if got is None else got.to(torch.int64)

    def _scatter(self, chain: tuple[Slab, ...], skip: int, end: int, rows: torch.Tensor) -> None:
        """Write the chain's rows `[skip, end)` into pool slots `rows`."""
        slabs, where = self._slabs(chain, skip, end, rows)
        ops.restore_chain(slabs, where, self._k, self._v, layout="thd")

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
        if self._fault == "restore_shift_row" and slabs and slabs[-1].shape[2] > 1:
            self._fault = None
            kv = slabs[-1].clone()
            mid = kv.shape[2] // 2
            kv[:, :, mid] = kv[:, :, mid - 1]
            slabs[-1] = kv
        return slabs, where
