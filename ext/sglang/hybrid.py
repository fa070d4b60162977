"""Hybrid (attention + Mamba / Gated DeltaNet) models: a recurrent state at exactly each
anchor depth.

SGLang keeps a Mamba state only at a tree node's end (`no_buffer`: where a prefill chunk or
a finished request ended), so a prefix that ends at an anchor boundary inside a node matches
nothing: the recurrent state for it is gone. So on a hybrid model:

- Where the kernels can (CPU, Gated DeltaNet), the state at an anchor depth inside a
  prefill is captured by the forward itself into a spare slot (ext/sglang/capture.py).
- Elsewhere `AnchorRadixCache.next_cut` names a request's next planned anchor depth, and our
  prefill adder (ext/sglang/admission.py, around `Scheduler.get_prefill_adder_class`) ends a
  prefill chunk there. SGLang's own checkpoint at the chunk end then runs with the request's state
  at exactly that depth, and our checkpoint hook copies it (`state_slot`) with the KV rows.
- A restore puts the rows into fresh token slots and the state into a fresh Mamba slot,
  and inserts both under the anchor's tokens (`Placer.place`), so SGLang's own
  match finds the state and copies it into the request's slot (its copy-on-write).

Layouts (SGLang 0.5.23, `HybridReqToTokenPool` + `HybridLinearKVPool`): KV rows live in
the full-attention pool (`full_kv_pool.k_buffer[layer][slot]`, `thd`); the Mamba pool's
`mamba_cache.conv[i]` and `.temporal` are `[mamba_layers, slots, ...]`, so a slot's
state is `conv[i][layer][slot]` and `temporal[layer][slot]` for every layer: the state
views below list them per layer, conv before temporal, so `ops.snapshot_state` /
`ops.restore_chain` copy exactly one slot. Runs on the scheduler's loop.

That is the state slab both workers write (docs/ext.md, "State slab layout"; tensor parallel
size 1): per linear layer, in layer order, the conv window `[conv_dim, kernel - 1]`
(`Mamba2StateShape.conv`; an AMX CPU re-strides it, the logical shape, which the slab
copies, stays) in SGLang's conv dtype (`SGLANG_MAMBA_CONV_DTYPE`, bfloat16 unless set),
then the recurrent state `temporal` `[heads, head_dim, state_size]` in its SSM dtype
(`mamba_ssm_dtype`, float32 by default): for Gated DeltaNet `[v_heads, v_head_dim,
k_head_dim]`, as SGLang's CUDA kernels keep it; for Mamba2 `[heads, head_dim, d_state]`
(its kernels on every device, ours on CPU too). So on a GPU this worker copies its pool as
it is; on CPU, whose GDN kernels keep the state's last two dims the other way round, it
copies a GDN state through a transposed view (`temporal_k_first`); the embedded worker
converts too (`cache_io.StateSpec.slab_view`). With tensor parallelism each rank's slab holds its own
shard, which the embedded worker's slabs do not match.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch


def kv_views(allocator: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per full-attention layer K and V tensors `[slots, kv_heads, head_dim]`."""
    kvcache = allocator.get_kvcache()
    full = getattr(kvcache, "full_kv_pool", kvcache)
    return list(full.k_buffer), list(full.v_buffer)


def state_views(req_to_token_pool: Any) -> list[torch.Tensor]:
    """Every Mamba state tensor indexed by slot first, per layer (conv pieces, temporal), in
    the state slab's layout: the pool's own tensors, except where SGLang's CPU GDN kernels
    fill the temporal state (`temporal_k_first`), a view of it."""
    from sglang.srt.utils import is_cpu

    pool = req_to_token_pool.mamba_pool
    cache = pool.mamba_cache
    # SGLang picks its CPU GDN kernels on CPU. Its pool names the conv's sub-blocks
    # (`conv_shard_groups`) exactly for mixers whose conv input is q/k/v (Gated DeltaNet:
    # Qwen3-Next, Qwen3.5); a Mamba2 mixer's (x/B/C) has none, and its state is
    # `[heads, head_dim, state]` on every device (ext/sglang/cpu_mamba2.py)
    k_first = is_cpu() and getattr(pool, "conv_shard_groups", None) is not None
    views: list[torch.Tensor] = []
    for layer in range(cache.temporal.shape[0]):
        views.extend(conv[layer] for conv in cache.conv)
        temporal = cache.temporal[layer]
        views.append(temporal_k_first(temporal) if k_first else temporal)
    return views


def temporal_k_first(temporal: torch.Tensor) -> torch.Tensor:
    """The GDN state as SGLang's CPU kernels keep it, viewed in the slab's layout.

    The pool declares `[slots, v_heads, v_head_dim, k_head_dim]` (`Mamba2StateShape`), which
    is how its CUDA kernels (fla Triton `chunk_delta_h` / `fused_recurrent`, FlashInfer:
    "K-last") read each slot. Its CPU kernels (`sgl_kernel`'s `chunk_gated_delta_rule_cpu`:
    `final_state [N, HV, EK, EV]`; the CPU recipe's, `ext/sglang/cpu_kernels.py`, alike)
    read the same bytes as `[k_head_dim, v_head_dim]` per head. So on CPU each head's bytes
    are reread as `[k, v]` and transposed: a view, `[slots, v_heads, v_head_dim,
    k_head_dim]` again, and the slab holds K-last states from either device. A Mamba2
    state needs no view: its CPU kernels (ext/sglang/cpu_mamba2.py) keep SGLang's layout."""
    v_dim, k_dim = temporal.shape[-2:]
    return temporal.flatten(-2).unflatten(-1, (k_dim, v_dim)).transpose(-1, -2)


def state_layout(states: list[torch.Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """(shape, dtype) of every piece of a state slab over `states` (`state_views`), in slab
    order: what `cache_io.CacheSpec.state_layout` gives for the same model."""
    return tuple((tuple(t.shape[1:]), t.dtype) for t in states)


def dump_slabs(store: Any, slots: Iterable[int], directory: str,
               states: list[torch.Tensor] | None) -> None:
    """Tests only (`SGLangAnchorConfig.slab_dump_dir`): save each committed anchor of
    `slots` as `<key hex>.pt`: `ids` (its tokens), `kv` (its chain's KV slabs, root to
    leaf), `rows` (their `(start, depth)`), `state` (the leaf's state slab or None) and
    `layout` (`state_layout` of the pool's `states`, dtypes as strings)."""
    layout = [(shape, str(dtype)) for shape, dtype in state_layout(states or [])]
    keys = {e.slot: e.key for e in store.table.entries()}
    for slot in slots:
        found = store.prefix_of(keys[slot]) if slot in keys else None
        if found is None:
            continue
        chain, ids = found
        torch.save({"ids": list(ids), "kv": [s.kv for s in chain],
                    "rows": [(s.start, s.depth) for s in chain], "state": chain[-1].state,
                    "layout": layout},
                   Path(directory) / f"{keys[slot].hex()}.pt")


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
