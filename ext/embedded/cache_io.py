"""Typed access to transformers 5.19 cache objects, for dense and hybrid causal LMs.

The embedded worker saves anchors (K/V rows `[0, d)` of every attention layer plus, on
hybrid models, the conv and recurrent state at exactly `d`) and restores a chain of them
into a fresh cache. This module is the only place that knows how transformers lays those
tensors out; everything above it sees per-layer lists of tensors.

Findings in transformers 5.19.0 (read from cache_utils.py and the model files):

- One cache class for everything: `DynamicCache(config=model.config)` builds one layer
  object per decoder layer from `config.layer_types` (`get_layer_types_and_kwargs`):
  `full_attention` -> `DynamicLayer` (`.keys`/`.values`, `[batch, kv_heads, tokens,
  head_dim]`, grown by `torch.cat` on every update, so the tensor objects are replaced
  each forward); `linear_attention` -> `LinearAttentionLayer` (dicts `conv_states[i]`,
  `recurrent_states[i]` per state index, allocated once and updated in place with
  `copy_`, so views stay live); `hybrid` -> `LinearAttentionAndFullAttentionLayer`
  (both at once); `sliding_attention` -> `DynamicSlidingWindowLayer` (keeps only the
  window, so rows `[0, d)` are gone: unsupported here).
- Qwen3 / Llama (SmolLM2): all `DynamicLayer`. Positions come from `position_ids`, or
  from `cache.get_seq_length()` when omitted.
- Qwen3-Next and Qwen3.5 (text): `layer_types` mixes `linear_attention` (Gated DeltaNet)
  and `full_attention`. A DeltaNet layer stores conv state `[b, conv_dim, kernel]` (the
  last `linear_conv_kernel_dim` inputs of the causal conv, zero-padded on a short first
  chunk) and recurrent state `[b, v_heads, k_head_dim, v_head_dim]`. Positions as Qwen3
  (Qwen3.5 expands 2-D `position_ids` to its 4 rope rows itself).
- Mamba2: every layer `linear_attention`; conv state `[b, intermediate + 2*groups*state,
  conv_kernel]`, recurrent (SSM) state `[b, heads, head_dim, state_size]`. The forward
  takes the cache as `cache_params` (not `past_key_values`) and has no positions.
- FalconH1: every layer `hybrid` (attention and Mamba2 mixer side by side in one cache
  layer). Bamba: `linear_attention` (Mamba2) + `full_attention` layers; its model
  derives `position_ids` as `arange(chunk)` **ignoring the cache** when none are passed,
  so positions must always be passed explicitly (this module always does).
- LFM2: `conv` layers are `LinearAttentionLayer`s holding conv state only
  (`[b, hidden, conv_L_cache]`, no recurrent state), so they remember just the last
  `conv_L_cache` inputs. Jamba: Mamba-1 mixers, conv `[b, intermediate, d_conv]` and SSM
  state `[b, intermediate, d_state]`, plus `full_attention` layers.
- A linear layer consults `has_previous_state[i]` (set by its first `update_conv_state`)
  to decide whether to start from the cached state; a restored cache must set it.
- `crop()` cannot roll back recurrent state (`LinearAttentionCacheLayerMixin.crop`
  raises unless `activate_past_recording()` was called, and even then restores only
  conv state). Hence the state must be copied exactly at a chunk end: prefill is split so
  a chunk ends at every cut.
- Numerics: chunking changes float rounding, so a restore reproduces the cold run's
  logits bit for bit only when both split the prompt at the same positions (measured on
  every tiny arch and SmolLM2); greedy tokens matched in every case tested.
- `cache_position` no longer exists in 5.19; masks come from the cache's
  `get_mask_sizes` and positions from `position_ids`.

The state slab (docs/ext.md, "State slab layout"): both workers write one layout, SGLang's
Mamba pool's as its CUDA kernels keep it, so that the SGLang worker's snapshot and restore
stay plain copies on a GPU, and this worker converts (`StateSpec.slab_view`, a view, so the
slab ops copy straight from and into the cache's own tensors):

- The conv window keeps its last `kernel - 1` input columns, not transformers' `kernel`.
  The oldest column is never read again (transformers 5.19, the same in the Qwen3.5 /
  Qwen3-Next GDN, Mamba2, NemotronH, FalconH1, Bamba, LFM2 and Jamba files): a decode step's
  `causal_conv1d_update` concatenates the `kernel` stored columns with the new input and
  keeps the last output of a width-`kernel` conv, which reads the newest `kernel - 1`
  stored columns and the input; a prefill chunk over a cache (`update_conv_state` returns
  the stored columns + the chunk, `causal_conv1d_fn` pads `kernel - 1` zeros left and the
  layer keeps the last `seq_len` outputs) reads the oldest stored column only for outputs it
  drops. Both then store the last `kernel` columns, so the column is shifted out before any
  kept output reads it. A restore writes it as zeros (`test_cache_io.py` checks the logits
  bit for bit on every tiny architecture).
- A Gated DeltaNet recurrent state is `[v_heads, v_head_dim, k_head_dim]` (SGLang's
  `temporal`, `Mamba2StateShape` with head_dim = v_head_dim, state_size = k_head_dim);
  transformers keeps `[v_heads, k_head_dim, v_head_dim]`, so its last two dims are swapped.
  Mamba2 states (`[heads, head_dim, state_size]`) and the rest are as transformers keeps them.

Invariants:
- `kv_views` / `state_views` return the cache's own tensors (no copy). K/V views are
  valid until the next forward (which replaces them); state views are updated in place,
  so a snapshot must `clone()` them before the next forward.
- `cache_from_tensors` copies its inputs (the returned cache never aliases them) unless the
  caller hands them over with `adopt=True`.
- Every forward here passes explicit positions (where the model takes them) and batch 1.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
)

from anchorcache.ext.kernels import STATE_ALIGN_BYTES

OnBoundary = Callable[[int, Cache], None]


class StateKind(str, Enum):
    CONV = "conv"
    RECURRENT = "recurrent"


@dataclass(frozen=True)
class StateSpec:
    """One recurrent-model state tensor: where it lives, its shape in the cache (batch dim
    first) and how its piece of the state slab views it (module docstring)."""

    layer_idx: int
    state_idx: int
    kind: StateKind
    shape: tuple[int, ...]
    dtype: torch.dtype
    swap_last: bool = False  # a Gated DeltaNet recurrent state: [.., k, v] in the cache

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)

    @property
    def slab_shape(self) -> tuple[int, ...]:
        """Its piece of the state slab (no batch dim): conv `[channels, kernel - 1]`; a GDN
        recurrent state `[v_heads, v_head_dim, k_head_dim]`; other states as cached."""
        return tuple(self.slab_view(torch.empty((1, *self.shape[1:]), device="meta")).shape[1:])

    def slab_view(self, t: torch.Tensor) -> torch.Tensor:
        """The slab layout of cache tensor `t` (shaped `shape`), as a view of it: what the
        slab's piece is copied from at a snapshot and into at a restore."""
        if self.kind is StateKind.CONV:
            return t[..., 1:]  # the oldest column is never read again (module docstring)
        return t.transpose(-1, -2) if self.swap_last else t


@dataclass(frozen=True)
class CacheSpec:
    """What a model's cache holds, measured by a 2-token probe forward.

    `kv_layers` are decoder-layer indices holding K/V (in order; `kv_views` follows it);
    `states` lists every conv/recurrent state tensor in `state_views` order (layer index,
    then state index, conv before recurrent). A hybrid layer appears in both.
    """

    num_layers: int
    kv_layers: tuple[int, ...]
    num_kv_heads: int | None
    head_dim: int | None
    kv_dtype: torch.dtype | None
    states: tuple[StateSpec, ...]
    cache_kwarg: str

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(sorted({s.layer_idx for s in self.states}))

    @property
    def is_recurrent(self) -> bool:
        """Whether the model carries state that exists only at chunk ends."""
        return bool(self.states)

    @property
    def kv_bytes_per_token(self) -> int:
        if not self.kv_layers:
            return 0
        assert self.num_kv_heads is not None and self.head_dim is not None
        assert self.kv_dtype is not None
        per_layer = 2 * self.num_kv_heads * self.head_dim * _itemsize(self.kv_dtype)
        return per_layer * len(self.kv_layers)

    @property
    def state_bytes(self) -> int:
        """Bytes of one state slab: each piece at a 64-byte boundary, no tail padding (as
        `ops.state_slab_nbytes`)."""
        end = 0
        for s in self.states:
            start = -(-end // STATE_ALIGN_BYTES) * STATE_ALIGN_BYTES
            end = start + _numel(s.slab_shape) * _itemsize(s.dtype)
        return end

    def state_layout(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(shape, dtype) of every piece of the state slab, in slab order."""
        return tuple((s.slab_shape, s.dtype) for s in self.states)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> CacheSpec:
        """Probe `model` with a 2-token forward on a fresh cache and describe that cache.

        Raises NotImplementedError for caches this module cannot snapshot (sliding-window
        layers, K and V of different shapes, non-uniform KV layers).
        """
        cache = new_cache(model)
        probe = torch.zeros((1, 2), dtype=torch.long, device=_device(model))
        with torch.no_grad():
            _forward(model, cache, probe, 0)
        kv_layers, kv_shapes = [], set()
        for idx, layer in enumerate(cache.layers):
            if isinstance(layer, DynamicSlidingWindowLayer):
                raise NotImplementedError(
                    f"layer {idx} is a sliding-window layer: it keeps only the window, "
                    "so rows [0, d) cannot be snapshot")
            if not isinstance(layer, CacheLayerMixin):
                continue
            if type(layer) not in (DynamicLayer, LinearAttentionAndFullAttentionLayer):
                raise NotImplementedError(f"layer {idx}: unsupported cache layer {type(layer)}")
            if layer.keys is None or layer.values is None or layer.keys.shape != layer.values.shape:
                raise NotImplementedError(f"layer {idx}: K and V differ in shape")
            kv_layers.append(idx)
            kv_shapes.add((layer.keys.shape[1], layer.keys.shape[3], layer.keys.dtype))
        if len(kv_shapes) > 1:
            raise NotImplementedError(f"KV layers differ in heads/head_dim/dtype: {kv_shapes}")
        heads, head_dim, kv_dtype = next(iter(kv_shapes)) if kv_shapes else (None, None, None)
        gdn = _gated_deltanet_layers(model)
        states = tuple(
            StateSpec(layer_idx, state_idx, kind, tuple(t.shape), t.dtype,
                      swap_last=kind is StateKind.RECURRENT and layer_idx in gdn)
            for layer_idx, state_idx, kind, t in _state_entries(cache)
        )
        return cls(
            num_layers=len(cache.layers), kv_layers=tuple(kv_layers), num_kv_heads=heads,
            head_dim=head_dim, kv_dtype=kv_dtype, states=states,
            cache_kwarg=_cache_kwarg(model),
        )


@dataclass(frozen=True)
class CacheTensors:
    """Copied K/V rows `[start, depth)` of every KV layer and the states at `depth`.

    `keys[i]`/`values[i]` are `[1, kv_heads, depth - start, head_dim]` for the i-th KV
    layer; `states` follow `CacheSpec.states`. A chain segment (start > 0) still carries
    its states; only the leaf's are used when the chain is joined.
    """

    start: int
    depth: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    states: tuple[torch.Tensor, ...]


def new_cache(model: torch.nn.Module) -> Cache:
    """A fresh, empty cache of the kind `model`'s forward expects."""
    config: Any = model.config
    return DynamicCache(config=config)


def kv_views(cache: Cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The cache's live K and V tensors, one per attention layer in layer order.

    Layout `[batch, kv_heads, tokens, head_dim]`. Valid until the next forward. Raises
    ValueError when an attention layer holds no tokens yet.
    """
    keys, values = [], []
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, CacheLayerMixin):
            continue
        if (not layer.is_initialized or layer.keys is None or layer.values is None
                or layer.keys.dim() != 4):
            raise ValueError(f"attention layer {idx} holds no tokens yet")
        keys.append(layer.keys)
        values.append(layer.values)
    return keys, values


def state_views(cache: Cache) -> list[torch.Tensor]:
    """The cache's live conv/recurrent state tensors (batch dim first), in `CacheSpec.states`
    order. Updated in place by later forwards: clone to snapshot. Empty for dense models
    and for a cache that has not run a forward yet.
    """
    return [t for _, _, _, t in _state_entries(cache)]


def slab_state_views(spec: CacheSpec, states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`states` (cache layout, in `spec.states` order, batch dim first) as views in the
    state slab's layout, for `ops.snapshot_state` (read) and `ops.restore_chain` (write)."""
    if len(states) != len(spec.states):
        raise ValueError(f"model has {len(spec.states)} state tensors, got {len(states)}")
    return [s.slab_view(t) for s, t in zip(spec.states, states, strict=True)]


def check_snapshot_depth(cache: Cache, depth: int) -> None:
    """Raise ValueError unless `cache` can be snapshot at `depth`: it holds at least `depth`
    K/V rows and, when it carries recurrent state (which exists only at its end), exactly
    `depth`. A pure SSM holds no rows to check: its caller must snapshot at a chunk end."""
    stateful = bool(_state_entries(cache))
    for k in kv_views(cache)[0]:
        held = k.shape[-2]
        if held < depth or (stateful and held != depth):
            raise ValueError(f"cache holds {held} tokens; cannot snapshot depth {depth}")


def snapshot(cache: Cache, start: int, depth: int) -> CacheTensors:
    """Copy K/V rows `[start, depth)` and the current states.

    The states are those at the cache's current end, so for a recurrent model the cache
    must end exactly at `depth` (checked when the model has attention layers; a pure SSM
    cannot tell, the caller must snapshot at a chunk end). Raises ValueError otherwise.
    """
    if not 0 <= start < depth:
        raise ValueError(f"need 0 <= start < depth, got start={start} depth={depth}")
    keys, values = kv_views(cache)
    states = state_views(cache)
    check_snapshot_depth(cache, depth)
    return CacheTensors(
        start=start, depth=depth,
        keys=tuple(k[:, :, start:depth].clone() for k in keys),
        values=tuple(v[:, :, start:depth].clone() for v in values),
        states=tuple(s.clone() for s in states),
    )


def cache_from_tensors(
    model: torch.nn.Module,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    *,
    spec: CacheSpec | None = None,
    adopt: bool = False,
) -> Cache:
    """A fresh cache holding `keys`/`values` (d tokens each) and `states` (at d), such that
    a forward over the delta at positions `[d, ...)` continues exactly as if `[0, d)` had
    been prefilled. Inputs are copied, except with `adopt=True`, where plain attention layers
    take `keys`/`values` as their own storage (the caller hands them over and must not reuse
    them). `spec` (from `CacheSpec.from_model`) saves a probe.

    Raises ValueError on any count, shape or dtype mismatch with the model's cache, or
    when d == 0 (an empty prefix is a fresh cache, never a restore).
    """
    spec = spec if spec is not None else CacheSpec.from_model(model)
    if len(keys) != len(spec.kv_layers) or len(values) != len(spec.kv_layers):
        raise ValueError(
            f"model has {len(spec.kv_layers)} KV layers, got {len(keys)} K / {len(values)} V")
    if len(states) != len(spec.states):
        raise ValueError(f"model has {len(spec.states)} state tensors, got {len(states)}")
    depths = {k.shape[-2] for k in keys} | {v.shape[-2] for v in values}
    if len(depths) > 1:
        raise ValueError(f"K/V lengths differ across layers: {sorted(depths)}")
    if depths == {0}:
        raise ValueError("empty prefix: use new_cache")
    for k, v in zip(keys, values, strict=True):
        want = (1, spec.num_kv_heads, k.shape[-2], spec.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"K/V shape {tuple(k.shape)}/{tuple(v.shape)}, expected {want}")
    for s, t in zip(spec.states, states, strict=True):
        if tuple(t.shape) != s.shape:
            raise ValueError(f"state {s.kind.value} of layer {s.layer_idx}: shape "
                             f"{tuple(t.shape)}, expected {s.shape}")

    device = _device(model)
    cache = new_cache(model)
    for idx, k, v in zip(spec.kv_layers, keys, values, strict=True):
        layer: Any = cache.layers[idx]
        k = k.to(device=device, dtype=spec.kv_dtype)
        v = v.to(device=device, dtype=spec.kv_dtype)
        if adopt and type(layer) is DynamicLayer:
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        else:
            # `update` lazily initializes and concatenates onto an empty tensor: a copy.
            layer.update(k, v)
    for s, t in zip(spec.states, states, strict=True):
        layer = cache.layers[s.layer_idx]
        t = t.to(device=device, dtype=s.dtype)
        if s.kind is StateKind.CONV:
            layer.lazy_initialization(conv_states=t, state_idx=s.state_idx,
                                      conv_kernel_size=t.shape[-1])
            layer.conv_states[s.state_idx].copy_(t)
        else:
            layer.lazy_initialization(recurrent_states=t, state_idx=s.state_idx)
            layer.recurrent_states[s.state_idx].copy_(t)
        # Makes the layer continue from the state instead of starting from zeros.
        layer.has_previous_state[s.state_idx] = True
    return cache


def prefill(
    model: torch.nn.Module,
    cache: Cache,
    input_ids: torch.Tensor | Sequence[int],
    start: int,
    boundaries: Sequence[int] = (),
    *,
    on_boundary: OnBoundary | None = None,
    max_chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Feed tokens `[start, N)` of the full prompt `input_ids` into `cache` (which holds
    `[0, start)`), in chunks that end exactly at every position in `boundaries`.

    `boundaries` must be strictly increasing and inside `(start, N]`; `max_chunk_tokens`
    further splits long chunks. `on_boundary(position, cache)` runs after *every* chunk,
    with the chunk's end position (so the caller can snapshot at its cuts, or abort).
    Returns the logits of the last position, `[1, 1, vocab]`. Raises ValueError on bad
    boundaries or `start >= N`.
    """
    ids = _as_batch(input_ids, model)
    total = ids.shape[1]
    if not 0 <= start < total:
        raise ValueError(f"start {start} must be in [0, {total})")
    cuts = list(boundaries)
    if any(b <= a for a, b in itertools.pairwise(cuts)):
        raise ValueError(f"boundaries must be strictly increasing: {cuts}")
    if cuts and not (start < cuts[0] and cuts[-1] <= total):
        raise ValueError(f"boundaries {cuts} must lie in ({start}, {total}]")
    if max_chunk_tokens is not None and max_chunk_tokens < 1:
        raise ValueError("max_chunk_tokens must be >= 1")
    ends = sorted(set(cuts) | {total})
    logits = None
    with torch.no_grad():
        pos = start
        for end in ends:
            while pos < end:
                stop = end if max_chunk_tokens is None else min(end, pos + max_chunk_tokens)
                logits = _forward(model, cache, ids[:, pos:stop], pos)
                pos = stop
                if on_boundary is not None:
                    on_boundary(pos, cache)
    assert logits is not None
    return logits


def decode_step(model: torch.nn.Module, cache: Cache, token_id: int, position: int) -> torch.Tensor:
    """Feed one token at `position` (= tokens already in the cache); logits `[1, 1, vocab]`."""
    ids = torch.tensor([[int(token_id)]], dtype=torch.long, device=_device(model))
    with torch.no_grad():
        return _forward(model, cache, ids, position)


# ---- internals --------------------------------------------------------------------------


def _forward(model: torch.nn.Module, cache: Cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {_cache_kwarg(model): cache, "use_cache": True}
    if "position_ids" in params:
        kwargs["position_ids"] = torch.arange(
            start, start + ids.shape[1], dtype=torch.long, device=ids.device).unsqueeze(0)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=ids, **kwargs)
    return out.logits[:, -1:, :]


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    for name in ("past_key_values", "cache_params"):
        if name in params:
            return name
    raise NotImplementedError(f"{type(model).__name__}.forward takes no cache argument")


def _state_entries(cache: Cache) -> list[tuple[int, int, StateKind, torch.Tensor]]:
    entries = []
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        if layer.record_past:
            # Conv state would hold the whole history, not the kernel window.
            raise NotImplementedError(f"layer {idx} records past states; unsupported")
        for j in range(layer.number_of_states):
            conv, recurrent = layer.conv_states[j], layer.recurrent_states[j]
            if layer.is_conv_states_initialized[j] and conv is not None:
                entries.append((idx, j, StateKind.CONV, conv))
            if layer.is_recurrent_states_initialized[j] and recurrent is not None:
                entries.append((idx, j, StateKind.RECURRENT, recurrent))
    return entries


def _gated_deltanet_layers(model: torch.nn.Module) -> set[int]:
    """Decoder-layer indices whose linear mixer is a Gated DeltaNet (Qwen3-Next, Qwen3.5:
    a `*GatedDeltaNet` module carrying its `layer_idx`)."""
    return {int(getattr(m, "layer_idx")) for m in model.modules()  # noqa: B009
            if type(m).__name__.endswith("GatedDeltaNet") and hasattr(m, "layer_idx")}


def _as_batch(input_ids: torch.Tensor | Sequence[int], model: torch.nn.Module) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [N] or [1, N], got {tuple(ids.shape)}")
    return ids.to(_device(model))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
