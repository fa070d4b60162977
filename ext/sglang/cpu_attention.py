"""Attention sinks and the sliding-window pool on SGLang's CPU attention backend (part of the
CPU recipe, cpu.py).

Sliding-window models with attention sinks (Granite SWA, gpt-oss: SGLang's `SWA_SINK_ARCHS`)
call `RadixAttention(..., sinks=...)`: a learned per-head logit that joins every softmax
denominator. SGLang 0.5.23's `torch_native` backend, the one the CPU recipe serves with,
takes no `sinks` argument (a `TypeError` at the first prefill), and on SGLang's
sliding-window pool (`SWAKVPool`, its default for these models) it reads a sliding layer's
keys by full-pool slot, where they live by window slot (`translate_loc_from_full_to_swa`):
wrong keys. On the CPU engine an AROUND hook on its `forward_extend` / `forward_decode` runs
here every call that carries sinks, and every call on the sliding-window pool; any other is
SGLang's own. The KV write is SGLang's (`set_kv_buffer`, with the window slots the backend
translated); the attention is a plain torch reference: per request, causal, the layer's
sliding window (`sliding_window_size`, SGLang's: a query at position p sees keys p - size ..
p; on the window pool read through the translation), then with sinks transformers' rule,
`softmax(scores) @ v * sigmoid(logsumexp(scores) - sink)`, in float32.
"""

from __future__ import annotations

from typing import Any

import torch

BACKEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
EXTEND_TARGET = f"{BACKEND}.forward_extend"
DECODE_TARGET = f"{BACKEND}.forward_decode"


BLOCK = 512  # queries per block: the scores of one block are [heads, BLOCK, keys] float32


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   sinks: torch.Tensor | None,
                   *, scaling: float, q_start: int, window: int | None,
                   k_start: int = 0) -> torch.Tensor:
    """Attention of the queries `q` `[heads, Lq, D]` at positions `q_start ..` over the keys
    and values `k`, `v` `[kv_heads, Lk, D]` at positions `k_start .. k_start+Lk-1` (every
    key a query can see), with a per-head sink logit; float32 `[heads, Lq, Dv]`. Queries go
    `BLOCK` at a time, each over the keys it can see (with a window, its last
    `BLOCK + window` keys). Without `sinks`, plain causal (windowed) attention."""
    heads, kv_heads = q.shape[0], k.shape[0]
    k = k.float().repeat_interleave(heads // kv_heads, 0)
    v = v.float().repeat_interleave(heads // kv_heads, 0)
    sink = sinks.float().view(-1, 1, 1) if sinks is not None else None
    out = []
    for b in range(0, q.shape[1], BLOCK):
        first, last = q_start + b, q_start + min(b + BLOCK, q.shape[1]) - 1
        lo = k_start if window is None else max(k_start, first - window)
        keys, values = (t[:, lo - k_start:last + 1 - k_start] for t in (k, v))
        scores = (q[:, b:b + BLOCK].float() @ keys.transpose(-1, -2)) * scaling
        q_pos = torch.arange(first, last + 1).unsqueeze(1)
        k_pos = torch.arange(lo, last + 1).unsqueeze(0)
        seen = k_pos <= q_pos
        if window is not None:
            seen &= k_pos >= q_pos - window
        scores = scores.masked_fill(~seen, float("-inf"))
        o = scores.softmax(-1) @ values
        if sink is not None:
            o = o * torch.sigmoid(torch.logsumexp(scores, dim=-1, keepdim=True) - sink)
        out.append(o)
    return torch.cat(out, dim=1)


def _window(layer: Any) -> int | None:
    size = getattr(layer, "sliding_window_size", None)
    return int(size) if size is not None and size > -1 else None


def _attend(backend: Any, q: torch.Tensor, layer: Any, forward_batch: Any,
            sinks: torch.Tensor | None, *, decode: bool) -> torch.Tensor:
    """Every request's attention (with sinks if given), from the pool (its keys written
    already); on the sliding-window pool a sliding layer's keys are read by window slot."""
    q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    pool = backend.token_to_kv_pool
    k_cache = pool.get_key_buffer(layer.layer_id)
    v_cache = pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens.tolist()
    q_lens = [1] * len(seq_lens) if decode else forward_batch.extend_seq_lens.tolist()
    start = 0
    window = _window(layer)
    translate = (backend.use_sliding_window_kv_pool
                 and pool.layers_mapping[layer.layer_id][1])  # (a sliding layer's own pool)
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        first = 0 if window is None else max(0, seq_len - q_len - window)  # the keys it sees
        slots = req_to_token[forward_batch.req_pool_indices[i], first:seq_len]
        if translate:
            slots = pool.translate_loc_from_full_to_swa(slots.to(torch.int64))
        mine = q[start:start + q_len].transpose(0, 1)
        o = sink_attention(mine, k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1),
                           sinks, scaling=layer.scaling, q_start=seq_len - q_len,
                           window=window, k_start=first)
        out[start:start + q_len] = o.transpose(0, 1).reshape(q_len, -1).to(out.dtype)
        start += q_len
    return out


def _around(decode: bool):  # type: ignore[no-untyped-def]
    def hook(original: Any, backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             layer: Any, forward_batch: Any, save_kv_cache: bool = True, *,
             sinks: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        window_pool = bool(getattr(backend, "use_sliding_window_kv_pool", False))
        if sinks is None and not window_pool:
            return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if kwargs or layer.is_cross_attention:
            raise NotImplementedError(f"attention with {sorted(kwargs)} on the CPU recipe's "
                                      f"torch_native backend")
        if save_kv_cache and k is not None and v is not None:
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            backend.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(
                forward_batch.out_cache_loc, backend.swa_out_cache_loc if window_pool else None),
                k, v)
        return _attend(backend, q, layer, forward_batch, sinks, decode=decode)

    return hook


def register() -> None:
    """Route the CPU backend's calls that carry sinks, or run on the sliding-window pool,
    through `sink_attention`."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(EXTEND_TARGET, _around(decode=False), HookType.AROUND)
    HookRegistry.register(DECODE_TARGET, _around(decode=True), HookType.AROUND)
