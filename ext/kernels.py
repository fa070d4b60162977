"""Snapshot and restore of KV rows and recurrent state: the only caller of torch.ops.anchorcache.

A KV slab is one contiguous tensor ``[num_layers, 2, n_rows, kv_heads, head_dim]`` (index 0 of
dim 1 is K, 1 is V) in the cache dtype, independent of the cache layout: a slab taken from
transformers' ``bhtd`` cache restores into SGLang's ``thd`` pool and back. A state slab is a
flat uint8 tensor holding ``states[i][index]`` of every state tensor, each piece starting at a
64-byte boundary (see :func:`state_slab_nbytes`).

Device dispatch happens in C++ (CPU and CUDA kernels registered on one schema): a CUDA cache
snapshots into a pinned host slab, a CPU cache into ordinary memory. Every op returns when its
data is in place. Rows are a ``(start, end)`` token range or a 1-D int64 tensor of token slots
(SGLang's ``out_cache_loc``); an index must not repeat a slot within one restore link.
Sources may be non-contiguous as long as head_dim has stride 1 (they are read through their
strides, never copied); anything else is refused with a RuntimeError naming the argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

try:
    from anchorcache.ext import _C  # noqa: F401  (loading registers the operators)
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "anchorcache.ext._C is not built; run `pip install --no-build-isolation -e .` "
        "from the repository root (see docs/ext.md)"
    ) from exc

Rows = tuple[int, int] | Tensor
Layout = Literal["thd", "bhtd"]

STATE_ALIGN_BYTES = 64  # must match kStateAlignBytes in ext/csrc/kv_plan.h

_ops = torch.ops.anchorcache


def _split_rows(rows: Rows) -> tuple[Tensor | None, int, int]:
    if isinstance(rows, Tensor):
        return rows, 0, 0
    start, end = rows
    return None, int(start), int(end)


def _geometry(t: Tensor) -> tuple[int, int]:
    """(kv_heads, head_dim) of a cache tensor; thd is 3-D, bhtd is 4-D."""
    if t.dim() not in (3, 4):
        raise ValueError(f"a cache tensor is [tokens, kv_heads, head_dim] or "
                         f"[batch, kv_heads, tokens, head_dim], got shape {tuple(t.shape)}")
    return int(t.shape[1]), int(t.shape[-1])


def kv_slab_nbytes(k: Sequence[Tensor], n_rows: int) -> int:
    """Bytes of a KV slab of n_rows rows for the cache whose per-layer K tensors are ``k``."""
    kv_heads, head_dim = _geometry(k[0])
    return len(k) * 2 * n_rows * kv_heads * head_dim * k[0].element_size()


def state_slab_nbytes(states: Sequence[Tensor]) -> int:
    """Bytes of the state slab of one slot: pieces packed at 64-byte boundaries, no tail pad."""
    end = 0
    for s in states:
        start = -(-end // STATE_ALIGN_BYTES) * STATE_ALIGN_BYTES
        end = start + (s.numel() // s.shape[0]) * s.element_size()
    return end


def snapshot_kv(k: Sequence[Tensor], v: Sequence[Tensor], rows: Rows, *, layout: Layout,
                batch_index: int = 0, out: Tensor | None = None) -> Tensor:
    """Thin snapshot: rows of every layer's K and V in one slab (pinned when k is on CUDA).

    With ``out`` the rows are written into it (shape, dtype checked) and ``out`` is returned.
    """
    index, start, end = _split_rows(rows)
    if out is None:
        return _ops.snapshot_kv(list(k), list(v), index, start, end, layout, batch_index)
    _ops.snapshot_kv_out(list(k), list(v), index, start, end, layout, batch_index, out)
    return out


def snapshot_state(states: Sequence[Tensor], index: int, *, out: Tensor | None = None) -> Tensor:
    """Copies ``states[i][index]`` of every state tensor into one flat uint8 host slab."""
    if not states:  # nothing to dispatch on; an empty slab restores to nothing
        return out if out is not None else torch.empty(0, dtype=torch.uint8)
    if out is None:
        return _ops.snapshot_state(list(states), index)
    _ops.snapshot_state_out(list(states), index, out)
    return out


def restore_chain(slabs: Sequence[Tensor], rows: Sequence[Rows], k: Sequence[Tensor],
                  v: Sequence[Tensor], *, layout: Layout, batch_index: int = 0,
                  state_slab: Tensor | None = None, states: Sequence[Tensor] | None = None,
                  state_index: int = 0) -> None:
    """Writes slab j into rows[j] of every layer, root to leaf, then the leaf's state. In place.

    Every link and the state slab are validated before anything is written, so a bad chain
    leaves the cache untouched. A later link wins where links overlap. With no slabs, ``k`` and
    ``v`` may be empty (a state-only restore).
    """
    if not slabs and state_slab is None and not states:
        return  # nothing to write, and no tensor to dispatch on
    if len(slabs) != len(rows):
        raise ValueError(f"restore_chain got {len(slabs)} slabs but {len(rows)} row specs")
    indices: list[Tensor | None] = []
    starts: list[int] = []
    for j, (slab, r) in enumerate(zip(slabs, rows, strict=True)):
        index, start, end = _split_rows(r)
        if index is None and slab.dim() == 5 and end - start != slab.shape[2]:
            raise ValueError(f"rows[{j}] = ({start}, {end}) spans {end - start} rows but "
                             f"slabs[{j}] holds {slab.shape[2]}")
        indices.append(index)
        starts.append(start)
    _ops.restore_chain(list(slabs), indices, starts, layout, batch_index, list(k), list(v),
                       state_slab, list(states or ()), state_index)


# ---- fake (meta) implementations: shapes only, for torch.compile and opcheck ----

def _fake_kv_slab(k: Sequence[Tensor], n_rows: int) -> Tensor:
    kv_heads, head_dim = _geometry(k[0])
    return torch.empty((len(k), 2, n_rows, kv_heads, head_dim), dtype=k[0].dtype, device="cpu")


@torch.library.register_fake("anchorcache::snapshot_kv")
def _(k, v, index, start, end, layout, batch_index):
    return _fake_kv_slab(k, int(index.numel()) if index is not None else end - start)


@torch.library.register_fake("anchorcache::snapshot_kv_out")
def _(k, v, index, start, end, layout, batch_index, out):
    return None


@torch.library.register_fake("anchorcache::snapshot_state")
def _(states, index):
    return torch.empty(state_slab_nbytes(states), dtype=torch.uint8, device="cpu")


@torch.library.register_fake("anchorcache::snapshot_state_out")
def _(states, index, out):
    return None


@torch.library.register_fake("anchorcache::restore_chain")
def _(slabs, indices, starts, layout, batch_index, k, v, state_slab, states, state_index):
    return None
