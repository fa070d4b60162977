"""`/anchor/verify` on the scheduler: the device rows SGLang's tree holds for an anchor's
prefix against the anchor's host slabs, byte for byte (after a restore they must be equal)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch

from anchorcache.ext import kernels
from anchorcache.ext.store import Slab

from . import tp
from .kv import DeviceKV

try:  # SGLang is an optional dependency of the package; this module runs inside it
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
except ImportError:  # pragma: no cover
    pass


@dataclass(frozen=True)
class DeviceCheck:
    device_tokens: int  # how much of the prefix the tree holds (only that is compared)
    mismatch: int | None  # the first differing token position
    state_equal: bool | None  # the state at the prefix's end (hybrid, sliding window)


def check_device(tree: Any, kv: DeviceKV, tp_group: Any, chain: tuple[Slab, ...],
                 ids: tuple[int, ...], extra_key: str | None) -> DeviceCheck:
    """Compare the rows of the prefix `ids` (under `extra_key`) in SGLang's tree `tree` with
    `chain`'s slabs; every TP rank compares its own shard and the results are combined."""
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), extra_key)))
    n = int(match.device_prefix_len)
    rows = tree.path_device_indices(match.last_device_node)[:n].to(torch.int64)
    device = kernels.snapshot_kv(kv.k, kv.v, rows.contiguous(), layout="thd")
    host = torch.cat([s.kv for s in chain if s.kv is not None], dim=2)[:, :, :n]
    same = (device.view(torch.uint8) == host.contiguous().view(torch.uint8))
    per_token = same.flatten(3).all(dim=3).all(dim=1).all(dim=0)  # [n]
    per_token = tp.all_ranks(tp_group, per_token)  # each rank checked its shard
    bad = (~per_token).nonzero()
    state_equal = None
    if kv.window is not None and n == len(ids) and chain[-1].state is not None:
        lo, hi = kv.window.span(n)
        window = kv.window.gather(rows[lo:hi])
        same_window = window is not None and torch.equal(
            kv.window.as_state(window), chain[-1].state)
        state_equal = bool(tp.all_ranks(tp_group, torch.tensor([same_window]))[0])
    if kv.states is not None and n == len(ids) and chain[-1].state is not None:
        slot = tree.tree_core.get_component_device_value(match.last_device_node,
                                                         ComponentType.MAMBA)
        if slot is not None:
            index = int(kv.req_to_token_pool.translate_mamba_indices(slot.view(1))[0])
            same_state = torch.equal(kernels.snapshot_state(kv.states, index), chain[-1].state)
            state_equal = bool(tp.all_ranks(tp_group, torch.tensor([same_state]))[0])
    return DeviceCheck(n, int(bad[0, 0]) if len(bad) else None, state_equal)
