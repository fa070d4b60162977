"""Pure-torch reference for the anchorcache ops and random inputs for their tests
(tests/ext/test_ops_*.py). Inputs are random and fresh per call (never zeros); every
comparison is bitwise (through a uint8 view), so fp8 and NaN-free floats compare alike.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
LAYOUTS = ["thd", "bhtd"]


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
         device: str = "cpu") -> Tensor:
    """Random values of ``dtype`` with no exact zeros (a zero-filled copy would not be caught)."""
    x = torch.randn(shape, generator=gen) * 4
    x = torch.where(x.abs() < 0.25, torch.full_like(x, 0.5), x)
    return x.to(dtype).to(device)


def bits(t: Tensor) -> Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def make_cache(layout: str, num_layers: int, num_tokens: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, gen: torch.Generator, device: str = "cpu",
               batch: int = 2) -> tuple[list[Tensor], list[Tensor]]:
    shape = ((num_tokens, kv_heads, head_dim) if layout == "thd"
             else (batch, kv_heads, num_tokens, head_dim))
    k = [rand(shape, dtype, gen, device) for _ in range(num_layers)]
    v = [rand(shape, dtype, gen, device) for _ in range(num_layers)]
    return k, v


def rows_of(rows: tuple[int, int] | Tensor) -> Tensor:
    if isinstance(rows, Tensor):
        return rows.cpu().long()
    return torch.arange(rows[0], rows[1])


def _layer_rows(t: Tensor, layout: str, idx: Tensor, batch_index: int) -> Tensor:
    """[n, kv_heads, head_dim] rows of one cache tensor (as a copy)."""
    t = t.cpu()
    if layout == "thd":
        return t[idx]
    return t[batch_index, :, idx, :].transpose(0, 1)


def ref_snapshot(k: list[Tensor], v: list[Tensor], rows, layout: str,
                 batch_index: int = 0) -> Tensor:
    idx = rows_of(rows)
    per_layer = [torch.stack([_layer_rows(a, layout, idx, batch_index),
                              _layer_rows(b, layout, idx, batch_index)])
                 for a, b in zip(k, v, strict=True)]
    return torch.stack(per_layer).contiguous()


def ref_restore(slabs: list[Tensor], rows: list, k: list[Tensor], v: list[Tensor], layout: str,
                batch_index: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    """Expected caches after restoring ``slabs`` (root to leaf) into copies of k, v (on CPU)."""
    k2 = [t.cpu().clone() for t in k]
    v2 = [t.cpu().clone() for t in v]
    for slab, r in zip(slabs, rows, strict=True):
        idx = rows_of(r)
        slab = slab.cpu()
        for layer in range(len(k2)):
            for side, cache in ((0, k2[layer]), (1, v2[layer])):
                if layout == "thd":
                    cache[idx] = slab[layer, side]
                else:
                    cache[batch_index, :, idx, :] = slab[layer, side].transpose(0, 1)
    return k2, v2


def ref_state_pieces(states: list[Tensor], index: int,
                     align: int = 64) -> tuple[list[tuple[int, Tensor]], int]:
    """(byte offset, bytes) of each ``states[i][index]`` in a state slab, and the slab size."""
    pieces = []
    end = 0
    for s in states:
        start = -(-end // align) * align
        piece = bits(s[index])
        pieces.append((start, piece))
        end = start + piece.numel()
    return pieces, end
