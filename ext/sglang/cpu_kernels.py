"""Plain-torch reference kernels for SGLang 0.5.23's CPU path of hybrid models (part of
the CPU recipe, docs/sglang.md "Hybrid models on CPU").

SGLang's CPU path for Gated DeltaNet layers (Qwen3.5, Qwen3-Next) calls ops of its CPU
kernel build (`torch.ops.sgl_kernel.*_cpu`; `sgl_kernel.mamba.causal_conv1d_fn_cpu` and
friends are Python wrappers over those ops). That build is not on the package registry:
the PyPI `sgl_kernel` wheel is CUDA-only. `install()` registers the ops below under the
same names and schemas, each only when the namespace lacks it, so a real CPU build wins.

Layouts are those of SGLang's callers (gdn_backend.py, gdn_triton.py, qwen3_5.py):
- tokens are packed: q/k `[1, T, H, K]`, v `[1, T, HV, V]`, g/beta `[1, T, HV]`, with
  `cu_seqlens` `[N + 1]` marking each sequence; value head j reads key head j // (HV/H);
- the recurrent state pool is `[slots, HV, K, V]` (fla's layout); each sequence reads
  its slot (`initial_state_indices`) and its final state is written back in place;
- the conv state pool is `[slots, dim, width - 1]` (the last inputs, oldest first); conv
  inputs are `[dim, T]` (prefill) or `[B, dim]` (decode).
Everything is computed in float32 and cast back. Exactness over speed: the delta rule
runs token by token (fla's recurrent form), which is what a tiny test model needs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import capture

NAMESPACE = "sgl_kernel"

SCHEMAS = {
    "fused_sigmoid_mul_cpu": "(Tensor(a!) input, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu":
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
        " -> (Tensor, Tensor)",
    "fused_qk_gemma_rmsnorm_with_gate_cpu":
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim,"
        " int num_head) -> (Tensor, Tensor, Tensor)",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu":
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk,"
        " int head_v) -> (Tensor, Tensor, Tensor, Tensor)",
    "fused_gdn_gating_cpu": "(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias)"
                            " -> (Tensor, Tensor)",
    "causal_conv1d_fwd_cpu":
        "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states,"
        " Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state,"
        " bool silu_activation, int pad_slot_id, bool is_vnni) -> Tensor",
    "causal_conv1d_update_cpu":
        "(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, bool silu_activation,"
        " Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id, bool is_vnni)"
        " -> Tensor",
    "chunk_gated_delta_rule_cpu":
        "(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta,"
        " Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens,"
        " bool head_first, bool use_qk_l2norm_in_kernel, Tensor? initial_state_indices=None,"
        " float eps=1e-6) -> (Tensor, Tensor)",
    "fused_sigmoid_gating_delta_rule_update_cpu":
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b,"
        " Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens,"
        " bool use_qk_l2norm_in_kernel, float softplus_beta=1.0,"
        " float softplus_threshold=20.0) -> Tensor",
    "fused_rmsnorm_gated_cpu": "(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor",
}


# ---- elementwise and norms (Qwen3.5 attention layers) -------------------------------------

def fused_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x *= sigmoid(gate), in place; `gate` may be a strided `[T, H, D]` view of x's shape."""
    g = gate.reshape(x.shape).float()
    x.copy_((x.float() * torch.sigmoid(g)).to(x.dtype))


def _gemma_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return out.to(x.dtype)


def fused_qk_gemma_rmsnorm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, eps: float, head_dim: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma RMSNorm (weight + 1) of every q and k head: `[rows, head_dim]` each."""
    return (_gemma_rms(q.reshape(-1, head_dim), q_weight, eps).contiguous(),
            _gemma_rms(k.reshape(-1, head_dim), k_weight, eps).contiguous())


def fused_qk_gemma_rmsnorm_with_gate(q_gate: torch.Tensor, k: torch.Tensor,
                                     q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                                     head_dim: int, num_head: int
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and gate interleaved per head (`[q_h0, gate_h0, q_h1, ...]`): normed q, normed k,
    the gate copied out, each `[rows, head_dim]`."""
    qg = q_gate.reshape(q_gate.shape[0], num_head, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:]
    qn, kn = fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim)
    return qn, kn, gate.reshape(-1, head_dim).contiguous()


def fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor,
                                              num_heads_qk: int, num_heads_v: int,
                                              head_qk: int, head_v: int
                                              ) -> tuple[torch.Tensor, ...]:
    """`[q | k | v | z]`, `[b | a]` (Qwen3.5's contiguous projections) -> mixed_qkv
    `[T, q + k + v]`, z `[T, HV, V]`, b and a `[T, HV]`."""
    qk, vv = num_heads_qk * head_qk, num_heads_v * head_v
    q, k, v, z = torch.split(mixed_qkvz, [qk, qk, vv, vv], dim=-1)
    b, a = torch.split(mixed_ba, [num_heads_v, num_heads_v], dim=-1)
    return (torch.cat([q, k, v], dim=-1).contiguous(),
            z.reshape(-1, num_heads_v, head_v).contiguous(), b.contiguous(), a.contiguous())


def fused_rmsnorm_gated(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """RMSNorm of each row, times weight, times silu(gate) (norm before gate: the GDN
    output norm of Qwen3.5 / Qwen3-Next)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (out * F.silu(gate.float())).to(x.dtype)


# ---- Gated DeltaNet --------------------------------------------------------------------------

def _softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    return F.softplus(x, beta=beta, threshold=threshold)


def fused_gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b): `[1, T, HV]` float32."""
    g = -A_log.float().exp() * _softplus(a.float() + dt_bias.float())
    return g.unsqueeze(0), torch.sigmoid(b.float()).unsqueeze(0)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, l2norm: bool,
                at: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token: q/k `[L, H, K]`, v `[L, HV, V]`, g/beta `[L, HV]`,
    state `[HV, K, V]` (float32). Returns (out `[L, HV, V]` float32, final state). `at`:
    {offset: where}: the state after `offset` tokens is copied into `where` on the way
    (ext/sglang/capture.py)."""
    hv = v.shape[1]
    q, k = q.float(), k.float()
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if hv != q.shape[1]:
        q = q.repeat_interleave(hv // q.shape[1], dim=1)
        k = k.repeat_interleave(hv // k.shape[1], dim=1)
    q = q * q.shape[-1] ** -0.5
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(v.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv_mem = (state * k[t][:, :, None]).sum(-2)  # [HV, V]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(-2)
        if at and t + 1 in at:
            at[t + 1].copy_(state)
    return out, state


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor,
                           output_final_state: bool, cu_seqlens: torch.Tensor,
                           head_first: bool, use_qk_l2norm_in_kernel: bool,
                           initial_state_indices: torch.Tensor | None = None,
                           eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over packed sequences (prefill). Sequence i starts from
    `initial_state[initial_state_indices[i]]` (or `initial_state[i]` without indices) and
    its final state is written back there; a capture the running forward asks of that slot
    (`capture.wanted`) is written into its spare slot. Returns (out like value, final
    states `[N, HV, K, V]`)."""
    if head_first:
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    out = torch.empty_like(value)
    bounds = cu_seqlens.tolist()
    finals = []
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        slot = int(initial_state_indices[i]) if initial_state_indices is not None else i
        at = {o: initial_state[spare] for o, spare in capture.wanted(slot)}
        o, final = _delta_rule(query[0, s:e], key[0, s:e], value[0, s:e], g[0, s:e],
                               beta[0, s:e], initial_state[slot].float(),
                               use_qk_l2norm_in_kernel, at)
        for offset, spare in capture.wanted(slot):
            if offset <= e - s:  # (the loop reached it)
                capture.wrote(spare)
        out[0, s:e] = o.to(out.dtype)
        initial_state[slot] = final.to(initial_state.dtype)
        finals.append(final.to(initial_state.dtype))
    if head_first:
        out = out.transpose(1, 2)
    empty = initial_state.new_empty((0, *initial_state.shape[1:]))
    return out, torch.stack(finals) if finals else empty


def fused_sigmoid_gating_delta_rule_update(A_log: torch.Tensor, dt_bias: torch.Tensor,
                                           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                           a: torch.Tensor, b: torch.Tensor,
                                           initial_state_source: torch.Tensor,
                                           initial_state_indices: torch.Tensor,
                                           cu_seqlens: torch.Tensor,
                                           use_qk_l2norm_in_kernel: bool,
                                           softplus_beta: float = 1.0,
                                           softplus_threshold: float = 20.0) -> torch.Tensor:
    """Decode: the gates from a and b (as `fused_gdn_gating`), then the delta rule per
    sequence from its slot, state written back in place. q/k/v `[1, T, heads, dim]` (or
    `[B, 1, ...]`), a/b `[T, HV]`; returns `[1, T, HV, V]`."""
    hv, dv = v.shape[-2], v.shape[-1]
    q2, k2 = q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:])
    v2 = v.reshape(-1, hv, dv)
    g = -A_log.float().exp() * _softplus(a.float().reshape(-1, hv) + dt_bias.float(),
                                         softplus_beta, softplus_threshold)
    beta = torch.sigmoid(b.float().reshape(-1, hv))
    out = torch.empty((1, v2.shape[0], hv, dv), dtype=v.dtype)
    bounds = cu_seqlens.tolist() if cu_seqlens is not None and cu_seqlens.numel() \
        else list(range(v2.shape[0] + 1))
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        slot = int(initial_state_indices[i])
        if slot < 0:  # a padded row: no state to read or write
            out[0, s:e] = 0
            continue
        o, final = _delta_rule(q2[s:e], k2[s:e], v2[s:e], g[s:e], beta[s:e],
                               initial_state_source[slot].float(), use_qk_l2norm_in_kernel)
        out[0, s:e] = o.to(out.dtype)
        initial_state_source[slot] = final.to(initial_state_source.dtype)
    return out


# ---- causal conv1d (the short conv in front of GDN and Mamba2 mixers) ------------------------

def _conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          silu: bool) -> torch.Tensor:
    """Depthwise causal conv of `x` `[dim, width - 1 + L]` (history first): `[dim, L]`."""
    out = F.conv1d(x.float().unsqueeze(0), weight.float().unsqueeze(1),
                   None if bias is None else bias.float(), groups=x.shape[0])[0]
    return F.silu(out) if silu else out


def causal_conv1d_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_states: torch.Tensor | None, query_start_loc: torch.Tensor | None,
                      cache_indices: torch.Tensor | None,
                      has_initial_state: torch.Tensor | None, silu_activation: bool,
                      pad_slot_id: int, is_vnni: bool) -> torch.Tensor:
    """Prefill: x `[dim, T]` packed by `query_start_loc`; each sequence starts from its
    conv state (`conv_states[cache_indices[i]]` when `has_initial_state[i]`, else zeros)
    and leaves its last `width - 1` inputs there; a capture the running forward asks of
    that slot (`capture.wanted`) gets the `width - 1` inputs before its offset in its spare
    slot. Returns `[dim, T]`."""
    dim, total = x.shape
    hist = weight.shape[1] - 1
    out = torch.empty_like(x)
    bounds = query_start_loc.tolist() if query_start_loc is not None else [0, total]
    if conv_states is not None:  # (a Mamba2 scan after it learns its sequences' slots here)
        capture.conv_called(conv_states, [int(cache_indices[i]) if cache_indices is not None
                                          else i for i in range(len(bounds) - 1)])
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        slot = int(cache_indices[i]) if cache_indices is not None else i
        if slot == pad_slot_id:
            continue
        init = has_initial_state is not None and bool(has_initial_state[i])
        if conv_states is not None and init:
            prev = conv_states[slot].float()
        else:
            prev = x.new_zeros((dim, hist), dtype=torch.float32)
        seq = torch.cat([prev, x[:, s:e].float()], dim=1)
        out[:, s:e] = _conv(seq, weight, bias, silu_activation).to(x.dtype)
        if conv_states is not None:
            conv_states[slot] = seq[:, seq.shape[1] - hist:].to(conv_states.dtype)
            for offset, spare in capture.wanted(slot):  # (seq: `hist` inputs, then x)
                conv_states[spare] = seq[:, offset:offset + hist].to(conv_states.dtype)
                capture.wrote(spare)
    return out


def causal_conv1d_update(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, silu_activation: bool,
                         cache_seqlens: torch.Tensor | None,
                         conv_state_indices: torch.Tensor | None, pad_slot_id: int,
                         is_vnni: bool) -> torch.Tensor:
    """Decode: x `[B, dim]` (or `[B, dim, L]`), one row per sequence; its conv state
    (`conv_states[conv_state_indices[b]]`) shifted by the new inputs. Returns x's shape."""
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    hist = weight.shape[1] - 1
    out = torch.empty_like(xs)
    for r in range(xs.shape[0]):
        slot = int(conv_state_indices[r]) if conv_state_indices is not None else r
        if slot == pad_slot_id:
            out[r] = 0
            continue
        seq = torch.cat([conv_states[slot].float(), xs[r].float()], dim=1)
        out[r] = _conv(seq, weight, bias, silu_activation).to(x.dtype)
        conv_states[slot] = seq[:, seq.shape[1] - hist:].to(conv_states.dtype)
    return out.squeeze(-1) if squeeze else out


IMPLS: dict[str, Any] = {
    "fused_sigmoid_mul_cpu": fused_sigmoid_mul,
    "fused_qk_gemma_rmsnorm_cpu": fused_qk_gemma_rmsnorm,
    "fused_qk_gemma_rmsnorm_with_gate_cpu": fused_qk_gemma_rmsnorm_with_gate,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": fused_qkvzba_split_reshape_cat_contiguous,
    "fused_gdn_gating_cpu": fused_gdn_gating,
    "causal_conv1d_fwd_cpu": causal_conv1d_fwd,
    "causal_conv1d_update_cpu": causal_conv1d_update,
    "chunk_gated_delta_rule_cpu": chunk_gated_delta_rule,
    "fused_sigmoid_gating_delta_rule_update_cpu": fused_sigmoid_gating_delta_rule_update,
    "fused_rmsnorm_gated_cpu": fused_rmsnorm_gated,
}

_LIBRARY: torch.library.Library | None = None
INSTALLED: set[str] = set()  # the ops `install` registered in this process
# the ops that write the states a forward captures (ext/sglang/capture.py)
CAPTURING = frozenset({"causal_conv1d_fwd_cpu", "chunk_gated_delta_rule_cpu"})


def missing() -> list[str]:
    """The ops of SCHEMAS that `torch.ops.sgl_kernel` lacks (after loading `sgl_kernel`)."""
    try:
        import sgl_kernel  # noqa: F401  (its libraries register what they have)
    except Exception:  # no wheel, or the CUDA one without a driver
        pass
    return [name for name in SCHEMAS if not hasattr(getattr(torch.ops, NAMESPACE), name)]


def install() -> list[str]:
    """Register the reference kernel of every missing op; the names it registered."""
    global _LIBRARY
    names = missing()
    if not names:
        return []
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name in names:
        _LIBRARY.define(name + SCHEMAS[name])
        _LIBRARY.impl(name, IMPLS[name], "CompositeExplicitAutograd")
        INSTALLED.add(name)
    if "fused_rmsnorm_gated_cpu" in names:
        route_gated_norm()
    return names


# SGLang's gated RMSNorms (fla/layernorm_gated.py: Qwen3.5's; fla/fused_norm_gate.py:
# Qwen3-Next's `FusedRMSNormGated`) take their CPU kernel only on CPUs with AMX (`_use_cpu =
# is_cpu() and cpu_has_amx_support()`); elsewhere they fall through to Triton, which asks
# CUDA for the SM count ("Found no NVIDIA driver") or finds no driver at all ("0 active
# drivers"). With our kernel installed that CPU branch works on any CPU: the recipe turns it on.
GATED_NORM_MODULES = ("sglang.kernels.ops.attention.fla.layernorm_gated",
                      "sglang.kernels.ops.attention.fla.fused_norm_gate")


def route_gated_norm() -> None:
    import importlib

    for name in GATED_NORM_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "_use_cpu"):
            setattr(module, "_use_cpu", True)  # noqa: B010 (a module global SGLang reads)


# ---- the Mamba scheduling strategy ----------------------------------------------------------

# SGLang's default for hybrid models, `extra_buffer`, asserts platform support for Mamba
# state snapshots (`validate_mamba_extra_buffer`), which the CPU platform lacks: the CPU
# recipe picks `no_buffer` (SGLang's other strategy, the one our anchors build on anyway),
# which needs page size 1 and no overlap schedule.
HYBRID_ARGS = {"--mamba-radix-cache-strategy": "no_buffer", "--page-size": "1"}
HYBRID_FLAGS = ("--disable-overlap-schedule",)
# SGLang sizes its Mamba state pool from the memory left under --mem-fraction-static, which
# on a CPU box is RAM: 9 GB for the tiny Qwen3.5 on a 24 GB machine (the OOM killer's first
# pick when a second server starts). On the CPU engine the pool gets a number of states
# instead: 3 per running request (SGLang's count) for 64 requests.
CPU_MAMBA_CACHE_SIZE = 192
# `layer_types` entries of a recurrent layer, and config keys only recurrent mixers have
RECURRENT_LAYERS = {"linear_attention", "mamba", "mamba2", "conv", "linear"}
RECURRENT_KEYS = ("linear_num_value_heads", "mamba_d_state", "mamba_n_heads", "ssm_state_size",
                  "mamba_expand", "hybrid_override_pattern")


def is_hybrid(config: dict[str, Any]) -> bool:
    """Whether a HF `config.json` (its text config) has recurrent layers."""
    cfg = config.get("text_config") or config
    if RECURRENT_LAYERS & set(cfg.get("layer_types") or ()):
        return True
    return any(key in cfg for key in RECURRENT_KEYS)


def has_sliding_window(config: dict[str, Any]) -> bool:
    """Whether a HF `config.json` (its text config) has sliding-window attention layers."""
    cfg = config.get("text_config") or config
    return "sliding_attention" in set(cfg.get("layer_types") or ())


# A sliding-window model (SGLang's `is_hybrid_swa`: gpt-oss, Granite SWA, ...) gets a second
# KV pool for its sliding layers by default, which anchors use at page size 1
# (ext/sglang/swa.py). With a larger page size, or recurrent layers as well, the worker
# serves it on SGLang's plain pool (its own flag, on any device; docs/sglang.md
# "Sliding-window models").
SLIDING_FLAGS = ("--disable-hybrid-swa-memory",)


def _page_size(args: list[str]) -> int:
    """The `--page-size` in SGLang arguments (1 when not given)."""
    for i, arg in enumerate(args):
        value = (arg.split("=", 1)[1] if arg.startswith("--page-size=") else
                 args[i + 1] if arg == "--page-size" and i + 1 < len(args) else None)
        if value is not None and value.isdigit():
            return int(value)
    return 1


def with_hybrid_args(args: list[str], model: str, *, cpu: bool = False) -> list[str]:
    """SGLang arguments plus the CPU strategy for a hybrid `model` (a local folder), those
    the user did not give (with `cpu`, the CPU engine, a Mamba state pool of
    `CPU_MAMBA_CACHE_SIZE` too), and, for a sliding-window one with pages of several tokens
    or recurrent layers too, SGLang's plain KV pool; unchanged for other models."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return list(args)
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    out = list(args)
    if has_sliding_window(config) and (_page_size(args) > 1 or is_hybrid(config)):
        out += [f for f in SLIDING_FLAGS if f not in given]
    if not is_hybrid(config):
        return out
    extra = {**HYBRID_ARGS, "--max-mamba-cache-size": str(CPU_MAMBA_CACHE_SIZE)} if cpu \
        else HYBRID_ARGS
    for name, value in extra.items():
        if name not in given:
            out += [name, value]
    return out + [f for f in HYBRID_FLAGS if f not in given]
