"""States captured inside a prefill by a second pass of a recurrent layer's own kernels
(issue 38): the `subpass` mode of ext/sglang/capture.py, for kernels that cannot hand out
a state inside a sequence (a GPU's FLA Triton kernels, FlashInfer's, a real `sgl_kernel`
CPU build's, the Triton SSD scan).

Gated DeltaNet layers (`install(gdn=True)`):

Around SGLang's `GDNAttnBackend.forward_extend` (wrapped once per scheduler process by
`install`), before the layer's forward: for each capture `Captures.begin` named
(`capture.rounds()`), the layer's conv and chunked delta rule run over the request's
tokens from its extend's start (or its previous capture) to the anchor depth, from the
state the forward itself starts from, on gathered copies of the states; the conv window
and the recurrent state they end with go into the capture's spare slot. The same
functions the forward calls (`gdn_backend.causal_conv1d_fn`, the backend's gates and
extend kernel) with the same arguments, so the state at the depth is the one a prefill
chunk ending there would leave: what the chunk-cut path gave, without the cut. The forward
itself then runs as it would have: no chunk ends at an anchor, its outputs and final state
are the plain run's, bit for bit.

Costs: the recurrent part of each captured prefix twice (the projections, attention and
MLPs once), a few more kernel launches per layer: one round per capture depth of a
request (round r: every request's r-th capture, which starts from its r - 1th).

Mamba2 layers (`install(gdn=False)`; SGLang's `MambaMixer2` calls the conv and the SSD scan
by their names in its module, which are wrapped): the conv window at a depth is the last
`width - 1` conv inputs before it (after the state it starts from), written by the conv
wrapper; the scan wrapper runs the layer's own scan over each captured prefix, from the
state the forward starts from (or the request's previous capture), with the sequence
metadata SGLang's `Mamba2Metadata.prepare_mixed` builds for a batch, and writes the final
states. Only where asked (`ANCHORCACHE_SGLANG_HYBRID_CAPTURE=subpass`): checked on CPU and
by `bench/gpu_check.sh`'s CUDA tests, it becomes a GPU's default once a GPU check has run
it (`auto` keeps Mamba2 layers off CPU on prefill cuts until then).

A forward this does not take (speculative verify, multi-item scoring), or a pass that
fails (logged; the forward runs on), writes nothing: the capture is dropped with its
request's anchors (`Captures.end`), never read stale. Its pieces go into the spare slots
only once a round's kernels are done, from gathered copies: the pool's own slots are never
touched but the spares'. Any of SGLang's GDN extend kernels (Triton/FLA, FlashInfer's on
Hopper and Blackwell, the CPU ones) is called as the backend calls it.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

import torch

from . import capture

log = logging.getLogger("anchorcache.sglang")
MIXER_MODULE = "sglang.srt.layers.attention.mamba.mamba"  # SGLang's Mamba2 mixer
_INSTALLED: set[str] = set()  # "gdn", "mamba2": wrapped in this process
_SKIPPED: set[str] = set()  # why layers did not take captures, logged once each
# Mamba2: the SSM state tensor of the layer whose conv ran last (the scan after it reads it)
_SCAN_POOL: torch.Tensor | None = None


def install(gdn: bool = True) -> bool:
    """Wrap, in this process (once), the calls of SGLang's Gated DeltaNet (`gdn`) or Mamba2
    layers that take the captures; False where SGLang has none."""
    return _install_gdn() if gdn else _install_mamba2()


def _install_gdn() -> bool:
    if "gdn" in _INSTALLED:
        return True
    try:
        from sglang.srt.layers.attention.linear import gdn_backend
    except Exception as exc:  # (an SGLang without it, a device it cannot import on)
        log.warning("hybrid anchors: no GDN backend to take captures (%s)", exc)
        return False
    original = gdn_backend.GDNAttnBackend.forward_extend

    @functools.wraps(original)
    def forward_extend(self: Any, layer: Any, forward_batch: Any, mixed_qkv: Any,
                       a: Any, b: Any, **kwargs: Any) -> Any:
        rounds = capture.rounds()
        if rounds:
            take(self, layer, forward_batch, mixed_qkv, a, b, rounds)
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)

    gdn_backend.GDNAttnBackend.forward_extend = forward_extend
    _INSTALLED.add("gdn")
    return True


def _install_mamba2() -> bool:
    if "mamba2" in _INSTALLED:
        return True
    try:
        module = importlib.import_module(MIXER_MODULE)
    except Exception as exc:
        log.warning("hybrid anchors: no Mamba2 mixer to take captures (%s)", exc)
        return False
    for name in ("causal_conv1d_fn", "causal_conv1d_fn_triton"):
        if getattr(module, name, None) is not None:
            setattr(module, name, mamba2_conv(getattr(module, name)))
    setattr(module, "mamba_chunk_scan_combined",  # noqa: B010
            mamba2_scan(getattr(module, "mamba_chunk_scan_combined")))  # noqa: B009
    _INSTALLED.add("mamba2")
    return True


def mamba2_conv(original: Any) -> Any:
    """The Mamba2 mixer's prefill conv, which first writes each capture's conv window."""

    @functools.wraps(original)
    def conv(x: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        global _SCAN_POOL
        rounds, states = capture.rounds(), kwargs.get("conv_states")
        _SCAN_POOL = None
        if rounds and states is not None:
            try:
                _SCAN_POOL = capture.layer_states(states)
                windows(rounds, x, states, weight.shape[-1] - 1)
            except Exception as exc:
                _skipped(f"{type(exc).__name__}: {exc}")
        return original(x, weight, *args, **kwargs)

    return conv


def windows(rounds: list[list[capture.Segment]], x: torch.Tensor, states: torch.Tensor,
            hist: int) -> None:
    """Each capture's conv window: the last `hist` conv inputs (`x` `[dim, T]`, packed)
    before its depth, after those of the state it starts from (none: zeros)."""
    for segments in rounds:
        for s in segments:
            new = x[:, s.lo:s.hi].to(states.dtype)
            if new.shape[1] < hist:
                prev = (states[s.source] if s.initial
                        else states.new_zeros((states.shape[1], hist)))
                new = torch.cat([prev, new], dim=1)
            states[s.spare] = new[:, new.shape[1] - hist:]
            capture.wrote(s.spare)


def mamba2_scan(original: Any) -> Any:
    """The Mamba2 mixer's SSD scan, which first writes each capture's state, through itself
    over the captured prefixes (`scan_segments`)."""

    @functools.wraps(original)
    def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        global _SCAN_POOL
        rounds, pool, _SCAN_POOL = capture.rounds(), _SCAN_POOL, None
        if rounds and pool is not None:
            try:
                scan_segments(original, rounds, pool, x, dt, A, B, C, *args, **kwargs)
            except Exception as exc:
                _skipped(f"{type(exc).__name__}: {exc}")
        return original(x, dt, A, B, C, *args, **kwargs)

    return scan


def scan_segments(scan: Any, rounds: list[list[capture.Segment]], pool: torch.Tensor,
                  x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """`scan` (the layer's SSD scan, called as the mixer calls it: x `[1, T, H, P]`, dt
    `[1, T, H]`, B and C `[1, T, G, N]`) over each round's segments, from their sources'
    states, the final states into their spare slots of the layer's SSM states `pool`."""

    chunk_size = args[0] if args else kwargs["chunk_size"]
    z = kwargs.get("z")
    for segments, r in zip(rounds, forward_rows(rounds, x.device), strict=True):
        seq_idx, chunk_indices, chunk_offsets = r.scan_metadata(chunk_size)
        zero = pool.new_zeros(pool.shape[1:])
        initial = torch.stack([pool[s.source] if s.initial else zero for s in segments])
        xs = x.index_select(1, r.tokens)
        sub = {**kwargs, "seq_idx": seq_idx, "chunk_indices": chunk_indices,
               "chunk_offsets": chunk_offsets, "cu_seqlens": r.starts,
               "initial_states": initial, "out": torch.empty_like(xs),
               "z": None if z is None else z.index_select(1, r.tokens),
               "return_varlen_states": True, "return_final_states": False,
               "return_intermediate_states": False, "return_track_states": False,
               "track_seq_idx": None, "track_end_locs": None}
        varlen = scan(xs, dt.index_select(1, r.tokens), A, B.index_select(1, r.tokens),
                      C.index_select(1, r.tokens), *args, **sub)
        pool.index_copy_(0, r.spares, varlen.to(pool.dtype))
        for s in segments:
            capture.wrote(s.spare)


def _refused(backend: Any, forward_batch: Any, mixed_qkv: Any) -> str | None:
    """Why this layer's forward cannot take captures (None: it can)."""
    if not isinstance(mixed_qkv, torch.Tensor):
        return "split q/k/v inputs"
    if forward_batch.forward_mode.is_target_verify():
        return "speculative verify"
    if getattr(backend, "mis_metadata", None) is not None:
        return "multi-item scoring"
    return None


def take(backend: Any, layer: Any, forward_batch: Any, mixed_qkv: torch.Tensor,
         a: torch.Tensor, b: torch.Tensor, rounds: list[list[capture.Segment]]) -> None:
    """Write the conv window and recurrent state of layer `layer` at each capture of
    `rounds` into its spare slot, before the layer's forward over `mixed_qkv` runs."""
    from sglang.srt.layers.attention.linear import gdn_backend

    why = _refused(backend, forward_batch, mixed_qkv)
    if why is not None:
        _skipped(why)
        return
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv_pool, ssm_pool = cache.conv[0], cache.temporal

    def conv(x: torch.Tensor, states: torch.Tensor, rows: _Rows) -> torch.Tensor:
        return gdn_backend.causal_conv1d_fn(
            x.transpose(0, 1), layer.conv_weights, layer.bias, activation=layer.activation,
            conv_states=states, has_initial_state=rows.initial, cache_indices=rows.slots,
            query_start_loc=rows.starts, seq_lens_cpu=rows.lens).transpose(0, 1)

    def gates(rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
        return backend._prefill_gates(layer, _gather(a, rows.tokens), _gather(b, rows.tokens))

    def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, states: torch.Tensor, rows: _Rows) -> None:
        backend.kernel_dispatcher.extend(q=q, k=k, v=v, g=g, beta=beta, ssm_states=states,
                                         cache_indices=rows.slots,
                                         query_start_loc=rows.starts)

    try:
        run(rounds, mixed_qkv, conv_pool, ssm_pool, layer, conv, gates, delta_rule)
    except Exception as exc:  # (never the forward's failure: the capture is not written)
        _skipped(f"{type(exc).__name__}: {exc}")


def _skipped(why: str) -> None:
    if why not in _SKIPPED:
        _SKIPPED.add(why)
        log.warning("hybrid anchors: a GDN layer took no captures (%s); those anchors are "
                    "dropped", why)


class _Rows:
    """One round's segments as the kernels take them, on `device`: the input rows
    (`tokens`), their sequences' bounds (`starts`, `lens`), whether each starts from a
    state (`initial`), state slots 0..n-1 (`slots`: the segments' gathered copies); for a
    Mamba2 scan, its sequence metadata (`scan_metadata`). Built once a forward, on the
    host, and copied over once (`forward_rows`): every layer reads the same."""

    def __init__(self, segments: list[capture.Segment], device: torch.device) -> None:
        self.lens = [s.hi - s.lo for s in segments]
        bounds = [0]
        for n in self.lens:
            bounds.append(bounds[-1] + n)
        self.bounds = torch.tensor(bounds, dtype=torch.int32)
        self.tokens = torch.cat([torch.arange(s.lo, s.hi) for s in segments]).to(device)
        self.starts = self.bounds.to(device)
        self.initial = torch.tensor([s.initial for s in segments], device=device)
        self.slots = torch.arange(len(segments), dtype=torch.int32, device=device)
        self.sources = torch.tensor([s.source for s in segments], device=device)
        self.spares = torch.tensor([s.spare for s in segments], device=device)
        self._scan: dict[int, tuple[torch.Tensor, ...]] = {}

    def scan_metadata(self, chunk_size: int) -> tuple[torch.Tensor, ...]:
        """(seq_idx `[1, T]`, chunk_indices, chunk_offsets) of these sequences for a Mamba2
        scan in chunks of `chunk_size`, as `Mamba2Metadata.prepare_mixed` builds them."""
        if chunk_size not in self._scan:
            from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

            total = sum(self.lens)
            seq_idx = torch.repeat_interleave(
                torch.arange(len(self.lens), dtype=torch.int32), self.bounds.diff(),
                output_size=total).unsqueeze(0)
            indices, offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(
                self.bounds, chunk_size, total)
            device = self.starts.device
            self._scan[chunk_size] = (seq_idx.to(device), indices.to(device),
                                      offsets.to(device))
        return self._scan[chunk_size]


# the running forward's rounds, as `_Rows` on a device: (rounds, device, rows)
_ROWS: tuple[Any, torch.device, list[_Rows]] | None = None


def forward_rows(rounds: list[list[capture.Segment]], device: torch.device) -> list[_Rows]:
    """`rounds` as `_Rows` on `device`, built at the forward's first layer."""
    global _ROWS
    if _ROWS is None or _ROWS[0] is not rounds or _ROWS[1] != device:
        _ROWS = (rounds, device, [_Rows(segments, device) for segments in rounds])
    return _ROWS[2]


def _gather(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return x.index_select(0 if x.dim() == 2 else 1, tokens)


def run(rounds: list[list[capture.Segment]], mixed_qkv: torch.Tensor,
        conv_pool: torch.Tensor, ssm_pool: torch.Tensor, layer: Any, conv: Any, gates: Any,
        delta_rule: Any) -> None:
    """The captures of one layer, round by round: each segment's conv window and state
    start as its source slot's (gathered copies), the layer's kernels run over its rows,
    and what they end with is written into its spare slot. `conv(x, states, rows)`,
    `gates(rows)` and `delta_rule(q, k, v, g, beta, states, rows)` are the layer's own
    kernels, updating `states` in place at `rows.slots` (`take` binds SGLang's)."""
    for segments, r in zip(rounds, forward_rows(rounds, mixed_qkv.device), strict=True):
        conv_states = conv_pool.index_select(0, r.sources)
        ssm_states = ssm_pool.index_select(0, r.sources)
        x = conv(mixed_qkv.index_select(0, r.tokens), conv_states, r)
        n = x.shape[0]
        q, k, v = torch.split(x, [layer.q_dim, layer.k_dim, layer.v_dim], dim=-1)
        # (contiguous, as SGLang's fused split hands them to a GPU's kernels)
        q = q.reshape(1, n, layer.num_q_heads, layer.head_q_dim).contiguous()
        k = k.reshape(1, n, layer.num_k_heads, layer.head_k_dim).contiguous()
        v = v.reshape(1, n, layer.num_v_heads, layer.head_v_dim).contiguous()
        g, beta = gates(r)
        delta_rule(q, k, v, g, beta, ssm_states, r)
        conv_pool.index_copy_(0, r.spares, conv_states)
        ssm_pool.index_copy_(0, r.spares, ssm_states)
        for s in segments:
            capture.wrote(s.spare)  # (its conv window
            capture.wrote(s.spare)  # and its state)
