"""Hybrid (attention + Mamba) models: a recurrent state at exactly each anchor boundary.

SGLang keeps a Mamba state only at a tree node's end (`no_buffer`: a finished request's
prompt end; `extra_buffer`: chunk-aligned positions), so a prefix that ends at an anchor
boundary inside a node matches nothing: the recurrent state for it is gone. An anchor
carries the state at its depth (captured at the boundary during prefill), and
`checkpoint_anchor` puts it back as a tree node of its own: the prefix's KV rows into
fresh token slots, the state into a fresh Mamba slot, both inserted under the anchor's
tokens. The next request over that prefix then matches it in full.

Layouts (SGLang 0.5.23, `HybridReqToTokenPool` + `HybridLinearKVPool`): KV rows live in
the full-attention pool (`full_kv_pool.k_buffer[layer][slot]`, `thd`); the Mamba pool's
`mamba_cache.conv[i]` and `.temporal` are `[mamba_layers, slots, ...]`, so a slot's
state is `conv[i][layer][slot]` and `temporal[layer][slot]` for every layer: the state
views below list them per layer, conv before temporal, so `ops.snapshot_state` /
`ops.restore_chain` copy exactly one slot.

Hybrid models do not serve on CPU with SGLang's PyPI kernels; this path is exercised
with SGLang's own unified radix cache test kit (tests/ext/sglang/test_hybrid_kit.py).
Runs on the scheduler's loop (it changes the tree).
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from anchorcache.ext import ops


def kv_views(allocator: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per full-attention layer K and V tensors `[slots, kv_heads, head_dim]`."""
    kvcache = allocator.get_kvcache()
    full = getattr(kvcache, "full_kv_pool", kvcache)
    return list(full.k_buffer), list(full.v_buffer)


def state_views(req_to_token_pool: Any) -> list[torch.Tensor]:
    """Every Mamba state tensor indexed by slot first, per layer (conv pieces, temporal)."""
    cache = req_to_token_pool.mamba_pool.mamba_cache
    views: list[torch.Tensor] = []
    for layer in range(cache.temporal.shape[0]):
        views.extend(conv[layer] for conv in cache.conv)
        views.append(cache.temporal[layer])
    return views


def capture(tree: Any, kv_indices: torch.Tensor, mamba_slot: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(KV slab of the token slots `kv_indices`, state slab of Mamba slot `mamba_slot`)."""
    k, v = kv_views(tree.token_to_kv_pool_allocator)
    kv = ops.snapshot_kv(k, v, kv_indices.to(torch.int64), layout="thd")
    return kv, ops.snapshot_state(state_views(tree.req_to_token_pool), mamba_slot)


def checkpoint_anchor(tree: Any, ids: list[int], kv_slab: torch.Tensor,
                      state_slab: torch.Tensor) -> int:
    """Insert `ids` (an anchor's whole prefix) with its KV rows and its end state into the
    tree; returns how many tokens of `ids` now match. Raises RuntimeError when the pools
    have no room."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey

    n = len(ids)
    allocator = tree.token_to_kv_pool_allocator
    if allocator.available_size() < n:
        tree.evict(EvictParams(num_tokens=n - allocator.available_size(), mamba_num=1))
    rows = allocator.alloc(n)
    slot = tree.req_to_token_pool.mamba_allocator.alloc(1)
    if rows is None or slot is None:
        if rows is not None:
            allocator.free(rows)
        raise RuntimeError("no room in the KV or Mamba pool for the anchor")
    k, v = kv_views(allocator)
    ops.restore_chain([kv_slab], [rows.to(torch.int64)], k, v, layout="thd",
                      state_slab=state_slab, states=state_views(tree.req_to_token_pool),
                      state_index=int(slot[0]))
    key = RadixKey(array("q", ids))
    # rows over a prefix the tree already holds are duplicates: the insert frees them
    tree.insert(InsertParams(key=key, value=rows.to(torch.int64), mamba_value=slot.view(1)))
    return int(tree.match_prefix(MatchPrefixParams(key=key)).device_prefix_len)
