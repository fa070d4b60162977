"""Plain-torch reference kernels for SGLang 0.5.23's Mamba2 mixer on CPU (part of the CPU
recipe, docs/sglang.md "Mamba2 hybrids on CPU").

SGLang's `MambaMixer2` (layers/attention/mamba/mamba.py: Nemotron-H, Granite-4.0-H,
Falcon-H1) calls four functions it binds at import: the causal conv (`causal_conv1d_fn` /
`causal_conv1d_update`, bound only on CUDA, NPU and XPU, so on CPU the prefill reaches an
unbound name) and the SSD scan (`mamba_chunk_scan_combined`, prefill) and
`selective_state_update` (decode), both Triton. `install()` binds these reference kernels
to the same names in that module, with the same signatures and in-place state semantics:

- tokens are packed: the conv input is `[dim, T]` (prefill, `query_start_loc` marking each
  sequence) or `[B, dim]` (decode); the scan's x is `[1, T, heads, head_dim]`, dt
  `[1, T, heads]`, B and C `[1, T, groups, state]` (head h reads group h // (heads/groups));
- the conv state pool is `[slots, dim, width - 1]` (the last inputs, oldest first), read
  and written per sequence at its slot (`cache_indices` / `conv_state_indices`), the SSM
  state pool `[slots, heads, head_dim, state]`; the scan takes each sequence's initial
  state from `initial_states[i]` and returns the final ones (`varlen_states`), which the
  mixer writes into its slots, while decode updates its slots in place.
Everything is computed in float32 and cast back, token by token (the recurrent form):
exact, slow on long prompts, what a tiny test model needs. Checked against transformers'
torch implementations (tests/ext/sglang/test_mamba2_cpu_kernels.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import capture
from .cpu_kernels import causal_conv1d_fwd
from .cpu_kernels import causal_conv1d_update as _conv_update

MIXER_MODULE = "sglang.srt.layers.attention.mamba.mamba"
PAD_SLOT_ID = -1  # SGLang's (kernels/ops/mamba/causal_conv1d_triton.py)
SILU = (None, "silu", "swish")


def _silu(activation: str | None) -> bool:
    if activation not in SILU:
        raise NotImplementedError(f"activation must be None, silu or swish, not {activation}")
    return activation is not None


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None,
                     cache_indices: torch.Tensor | None = None,
                     has_initial_state: torch.Tensor | None = None,
                     conv_states: torch.Tensor | None = None,
                     activation: str | None = "silu", pad_slot_id: int = PAD_SLOT_ID,
                     **kwargs: Any) -> torch.Tensor:
    """Prefill: x `[dim, T]` packed by `query_start_loc`, weight `[dim, width]`; each
    sequence starts from its conv state when `has_initial_state[i]` (else zeros) and leaves
    its last `width - 1` inputs in `conv_states[cache_indices[i]]`. Returns `[dim, T]`."""
    return causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices,
                             has_initial_state, _silu(activation), pad_slot_id, False)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         cache_seqlens: torch.Tensor | None = None,
                         conv_state_indices: torch.Tensor | None = None,
                         pad_slot_id: int = PAD_SLOT_ID, **kwargs: Any) -> torch.Tensor:
    """Decode: x `[B, dim]` (or `[B, dim, L]`), row b shifting `conv_state[
    conv_state_indices[b]]` in place. Returns x's shape."""
    if cache_seqlens is not None:
        raise NotImplementedError("a circular conv state (cache_seqlens) is not supported")
    return _conv_update(x, conv_state, weight, bias, _silu(activation), None,
                        conv_state_indices, pad_slot_id, False)


def _ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         C: torch.Tensor, state: torch.Tensor, at: dict[int, torch.Tensor] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token, all float32: x `[L, H, P]`, dt `[L, H, P]` (already
    discretized: bias, softplus, limits), A `[H, P, N]`, B and C `[L, H, N]` (per head),
    state `[H, P, N]`. Returns (y `[L, H, P]` without the D skip, final state). `at`:
    {offset: where}: the state after `offset` tokens is copied into `where` on the way
    (ext/sglang/capture.py)."""
    y = torch.empty(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t, :, :, None] * A) \
            + (dt[t] * x[t])[:, :, None] * B[t][:, None, :]
        y[t] = (state * C[t][:, None, :]).sum(-1)
        if at and t + 1 in at:
            at[t + 1].copy_(state)
    return y, state


def _per_head(groups: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C `[..., G, N]` -> `[..., H, N]` (head h reads group h // (H / G)), float32."""
    return groups.float().repeat_interleave(heads // groups.shape[-2], dim=-2)


def _dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool,
        limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    dt = dt.float() + (0.0 if dt_bias is None else dt_bias.float())
    if softplus:
        dt = F.softplus(dt)  # threshold 20, as the Triton kernels
    return dt.clamp(limit[0], limit[1]) if limit != (0.0, float("inf")) else dt


def _bounds(batch: int, seqlen: int, cu_seqlens: torch.Tensor | None,
            seq_idx: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """Each sequence as (batch row, start, end): from `cu_seqlens`, else from the changes of
    `seq_idx`, else one sequence per batch row."""
    if cu_seqlens is not None:
        b = cu_seqlens.tolist()
        return [(0, b[i], b[i + 1]) for i in range(len(b) - 1)]
    if seq_idx is not None:
        out = []
        for r in range(batch):
            ids = seq_idx[r].tolist()
            starts = [0] + [t for t in range(1, seqlen) if ids[t] != ids[t - 1]]
            out += [(r, s, e) for s, e in zip(starts, starts[1:] + [seqlen], strict=True)]
        return out
    return [(r, 0, seqlen) for r in range(batch)]


def mamba_chunk_scan_combined(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                              B: torch.Tensor, C: torch.Tensor, chunk_size: int,
                              D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                              dt_bias: torch.Tensor | None = None,
                              initial_states: torch.Tensor | None = None,
                              seq_idx: torch.Tensor | None = None,
                              chunk_indices: torch.Tensor | None = None,
                              chunk_offsets: torch.Tensor | None = None,
                              cu_seqlens: torch.Tensor | None = None,
                              dt_softplus: bool = False,
                              dt_limit: tuple[float, float] = (0.0, float("inf")),
                              out: torch.Tensor | None = None,
                              return_final_states: bool = False,
                              return_varlen_states: bool = False,
                              return_intermediate_states: bool = False,
                              state_dtype: torch.dtype | None = None,
                              return_track_states: bool = False,
                              track_seq_idx: torch.Tensor | None = None,
                              track_end_locs: torch.Tensor | None = None) -> Any:
    """Prefill: the SSD scan of x `[batch, T, H, P]` with dt `[batch, T, H]`, A `[H]` (the
    negative decay rate), B and C `[batch, T, G, N]`, D `[H]` or `[H, P]`, over packed
    sequences (`cu_seqlens`, else `seq_idx`); sequence i starts from `initial_states[i]`
    `[H, P, N]` (zeros without). The output goes into `out` (allocated if None), as the
    Triton kernel's does; returns what it returns: the final state of each sequence
    (`varlen_states` `[sequences, H, P, N]`) and/or of each batch row (`final_states`). The
    per-chunk states (`return_intermediate_states`, `return_track_states`: only SGLang's
    `extra_buffer` strategy reads them) come back as None; a tracked position raises."""
    if track_end_locs is not None and track_end_locs.numel():
        raise NotImplementedError("mamba state tracking (extra_buffer) is not supported on CPU")
    if not return_varlen_states:
        cu_seqlens = None  # as the Triton kernel: sequences then come from seq_idx
    batch, seqlen, heads, head_dim = x.shape
    out = torch.empty_like(x) if out is None else out
    dtype = state_dtype or (initial_states.dtype if initial_states is not None
                            else torch.float32)
    Bh, Ch = _per_head(B, heads), _per_head(C, heads)
    step = _dt(dt, dt_bias, dt_softplus, dt_limit)[..., None].expand(-1, -1, -1, head_dim)
    decay = A.float()[:, None, None].expand(heads, head_dim, B.shape[-1])
    skip = None if D is None else (D.float()[:, None] if D.dim() == 1 else D.float())
    finals = []
    # states captured inside this prefill go into the layer's pool (ext/sglang/capture.py)
    targets = capture.scan_targets()
    for i, (r, s, e) in enumerate(_bounds(batch, seqlen, cu_seqlens, seq_idx)):
        state = initial_states[i].float() if initial_states is not None \
            else x.new_zeros((heads, head_dim, B.shape[-1]), dtype=torch.float32)
        xs = x[r, s:e].float()
        caps = capture.wanted(targets[1][i]) if targets is not None and i < len(targets[1]) \
            else []
        at = {o: targets[0][spare] for o, spare in caps} if targets is not None else None
        y, state = _ssd(xs, step[r, s:e], decay, Bh[r, s:e], Ch[r, s:e], state, at)
        for offset, spare in caps:
            if offset <= e - s:  # (the loop reached it)
                capture.wrote(spare)
        if skip is not None:
            y = y + skip * xs
        if z is not None:
            y = y * F.silu(z[r, s:e].float())
        out[r, s:e] = y.to(out.dtype)
        finals.append(state.to(dtype))
    varlen = torch.stack(finals) if finals else x.new_empty((0, heads, head_dim, B.shape[-1]),
                                                             dtype=dtype)
    final = varlen[-batch:] if cu_seqlens is None and seq_idx is None else varlen[-1:]
    if return_track_states:
        return None, varlen, None
    if return_intermediate_states:
        if return_varlen_states:
            return (None, final, varlen) if return_final_states else (None, varlen)
        return (None, final) if return_final_states else None
    if return_varlen_states:
        return (final, varlen) if return_final_states else varlen
    return final if return_final_states else None


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                           state_batch_indices: torch.Tensor | None = None,
                           pad_slot_id: int = PAD_SLOT_ID, out: torch.Tensor | None = None,
                           disable_state_update: bool = False,
                           intermediate_states_buffer: torch.Tensor | None = None,
                           **kwargs: Any) -> torch.Tensor:
    """Decode, one token per row: state `[slots, H, P, N]`, x and dt `[B, H, P]`, A
    `[H, P, N]`, B and C `[B, G, N]`, D and dt_bias `[H, P]`, z like x; row b reads and
    updates `state[state_batch_indices[b]]` in place (a `pad_slot_id` row is skipped, its
    output zero). The output goes into `out` (allocated if None) and is returned."""
    if disable_state_update or intermediate_states_buffer is not None or x.dim() != 3:
        raise NotImplementedError("speculative decoding's state update is not supported on CPU")
    heads = x.shape[1]
    out = torch.empty_like(x) if out is None else out
    step = _dt(dt, dt_bias, dt_softplus)
    Bh, Ch = _per_head(B, heads), _per_head(C, heads)
    for b in range(x.shape[0]):
        slot = int(state_batch_indices[b]) if state_batch_indices is not None else b
        if slot == pad_slot_id:
            out[b] = 0
            continue
        xs = x[b].float()
        y, final = _ssd(xs[None], step[b][None], A.float(), Bh[b][None], Ch[b][None],
                        state[slot].float())
        y = y[0] + (0.0 if D is None else D.float().reshape(heads, -1) * xs)
        if z is not None:
            y = y * F.silu(z[b].float())
        out[b] = y.to(out.dtype)
        state[slot] = final.to(state.dtype)
    return out


# the names SGLang's Mamba2 mixer calls, bound to ours on the CPU engine (its Triton
# variants of the conv too: Nemotron-H asks for those)
BINDINGS: dict[str, Any] = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "causal_conv1d_fn_triton": causal_conv1d_fn,
    "causal_conv1d_update_triton": causal_conv1d_update,
    "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
    "selective_state_update": selective_state_update,
}


INSTALLED: set[str] = set()  # the names `install` bound in this process
# the kernels that write the states a forward captures (ext/sglang/capture.py)
CAPTURING = frozenset({"causal_conv1d_fn", "mamba_chunk_scan_combined"})


def install() -> list[str]:
    """Bind every name of BINDINGS in SGLang's Mamba2 mixer module to our kernel (the CPU
    engine has no other: the conv names are unbound there, the scan and the state update
    are Triton); the names bound. Nothing when the module does not import."""
    import importlib

    try:
        module = importlib.import_module(MIXER_MODULE)
    except ImportError:
        return []
    for name, kernel in BINDINGS.items():
        setattr(module, name, kernel)
    INSTALLED.update(BINDINGS)
    return list(BINDINGS)
