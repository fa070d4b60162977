"""Hybrid (attention + Mamba / Gated DeltaNet) models: a recurrent state at exactly each
anchor depth.

SGLang keeps a Mamba state only at a tree node's end (`no_buffer`: where a prefill chunk or
a finished request ended), so a prefix that ends at an anchor boundary inside a node matches
nothing: the recurrent state for it is gone. So on a hybrid model:

- `AnchorRadixCache.next_cut` names a request's next planned anchor depth, and our prefill
  adder (ext/sglang/admission.py, around `Scheduler.get_prefill_adder_class`) ends a
  prefill chunk there. SGLang's own checkpoint at the chunk end then runs with the request's state
  at exactly that depth, and our checkpoint hook copies it (`state_slot`) with the KV rows.
- A restore puts the rows into fresh token slots and the state into a fresh Mamba slot,
  and inserts both under the anchor's tokens (`DeviceTree._place`), so SGLang's own
  match finds the state and copies it into the request's slot (its copy-on-write).

Layouts (SGLang 0.5.23, `HybridReqToTokenPool` + `HybridLinearKVPool`): KV rows live in
the full-attention pool (`full_kv_pool.k_buffer[layer][slot]`, `thd`); the Mamba pool's
`mamba_cache.conv[i]` and `.temporal` are `[mamba_layers, slots, ...]`, so a slot's
state is `conv[i][layer][slot]` and `temporal[layer][slot]` for every layer: the state
views below list them per layer, conv before temporal, so `ops.snapshot_state` /
`ops.restore_chain` copy exactly one slot. Runs on the scheduler's loop.
"""

from __future__ import annotations

from typing import Any

import torch


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


def refusal(server_args: Any) -> str | None:
    """Why anchors cannot run on a hybrid model with these SGLang settings, or None. They
    need SGLang's `no_buffer` Mamba strategy (states at chunk ends, which our prefill cuts
    place; it implies `--page-size 1` and no overlap schedule), and states kept as plain
    slots: not the int8 checkpoint pool, not ReplaySSM's ring."""
    strategy = getattr(server_args, "mamba_radix_cache_strategy", "no_buffer")
    if strategy != "no_buffer":
        return (f"anchorcache on a hybrid model needs --mamba-radix-cache-strategy no_buffer "
                f"(got {strategy}): anchors end prefill chunks at their depths")
    for flag in ("enable_int8_mamba_checkpoint", "enable_linear_replayssm"):
        if getattr(server_args, flag, False):
            return (f"anchorcache on a hybrid model does not support "
                    f"--{flag.replace('_', '-')}")
    return None


def state_slot(req_to_token_pool: Any, req: Any) -> int:
    """The physical Mamba slot holding request `req`'s running state."""
    idx = req.kv.mamba_pool_idx.view(1)
    return int(req_to_token_pool.translate_mamba_indices(idx)[0])
