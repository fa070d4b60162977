"""snapshot_kv / restore_chain against the pure-torch reference, on every device and dtype."""

from __future__ import annotations

import random

import pytest
import torch

from anchorcache.ext import kernels
from anchorcache.testing.ops_reference import (
    DEVICES,
    DTYPES,
    LAYOUTS,
    fresh_generator,
    make_cache,
    rand,
    ref_restore,
    ref_snapshot,
    same,
)


def _shape(rnd: random.Random) -> dict:
    return {"num_layers": rnd.randint(1, 4), "num_tokens": rnd.randint(2, 40),
            "kv_heads": rnd.randint(1, 4), "head_dim": rnd.choice([1, 3, 8, 16, 64])}


def _rows(rnd: random.Random, num_tokens: int, kind: str, device: str):
    n = rnd.randint(1, num_tokens)
    if kind == "range":
        start = rnd.randint(0, num_tokens - n)
        return (start, start + n)
    return torch.tensor(rnd.sample(range(num_tokens), n), dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["range", "index"])
def test_snapshot_matches_reference(device, dtype, layout, kind):
    gen, seed = fresh_generator()
    rnd = random.Random(seed)
    shape = _shape(rnd)
    k, v = make_cache(layout, **shape, dtype=dtype, gen=gen, device=device)
    rows = _rows(rnd, shape["num_tokens"], kind, device)
    batch_index = rnd.randint(0, 1) if layout == "bhtd" else 0

    slab = kernels.snapshot_kv(k, v, rows, layout=layout, batch_index=batch_index)

    assert slab.device.type == "cpu"
    assert slab.is_pinned() == (device == "cuda")
    assert slab.numel() * slab.element_size() == kernels.kv_slab_nbytes(k, slab.shape[2])
    assert same(slab, ref_snapshot(k, v, rows, layout, batch_index)), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_snapshot_into_out_overwrites_it(device, layout):
    gen, seed = fresh_generator()
    k, v = make_cache(layout, 3, 20, 2, 8, torch.bfloat16, gen, device)
    out = rand((3, 2, 7, 2, 8), torch.bfloat16, gen)
    got = kernels.snapshot_kv(k, v, (5, 12), layout=layout, out=out)
    assert got is out
    assert same(out, ref_snapshot(k, v, (5, 12), layout)), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("links", [1, 2, 3, 5])
def test_restore_chain_matches_reference(device, dtype, layout, links):
    """A prefix cut into `links` anchors, restored root to leaf into another cache."""
    gen, seed = fresh_generator()
    rnd = random.Random(seed)
    shape = _shape(rnd) | {"num_tokens": rnd.randint(links, 48)}
    src_k, src_v = make_cache(layout, **shape, dtype=dtype, gen=gen, device=device)
    dst_k, dst_v = make_cache(layout, **shape, dtype=dtype, gen=gen, device=device)
    depth = rnd.randint(links, shape["num_tokens"])
    cuts = [0, *sorted(rnd.sample(range(1, depth), links - 1)), depth]
    src_rows = [(cuts[j], cuts[j + 1]) for j in range(links)]
    slabs = [kernels.snapshot_kv(src_k, src_v, r, layout=layout) for r in src_rows]
    if layout == "thd":  # SGLang: the prefix goes to arbitrary free token slots
        slots = torch.randperm(shape["num_tokens"], generator=gen)[:depth].to(device)
        dst_rows = [slots[a:b] for a, b in src_rows]
    else:
        dst_rows = src_rows
    want_k, want_v = ref_restore(slabs, dst_rows, dst_k, dst_v, layout)

    kernels.restore_chain(slabs, dst_rows, dst_k, dst_v, layout=layout)

    for got, want in zip(dst_k + dst_v, want_k + want_v, strict=True):
        assert same(got, want), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_restore_chain_later_link_wins_on_overlap(device):
    gen, seed = fresh_generator()
    k, v = make_cache("thd", 2, 16, 2, 8, torch.float16, gen, device)
    first = rand((2, 2, 6, 2, 8), torch.float16, gen)
    second = rand((2, 2, 4, 2, 8), torch.float16, gen)
    rows = [(2, 8), (6, 10)]
    want_k, want_v = ref_restore([first, second], rows, k, v, "thd")
    kernels.restore_chain([first, second], rows, k, v, layout="thd")
    assert same(k[1], want_k[1]) and same(v[0], want_v[0]), f"seed {seed}"
    assert same(k[0][6:8].cpu(), second[0, 0, :2]), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_slab_moves_between_layouts(device):
    """A slab from transformers' bhtd cache restores into an SGLang-style thd pool."""
    gen, seed = fresh_generator()
    k, v = make_cache("bhtd", 2, 12, 3, 16, torch.bfloat16, gen, device, batch=3)
    pool_k, pool_v = make_cache("thd", 2, 30, 3, 16, torch.bfloat16, gen, device)
    slab = kernels.snapshot_kv(k, v, (0, 12), layout="bhtd", batch_index=2)
    slots = torch.randperm(30, generator=gen)[:12].to(device)
    kernels.restore_chain([slab], [slots], pool_k, pool_v, layout="thd")
    for layer in range(2):
        assert same(pool_k[layer][slots], k[layer][2].transpose(0, 1)), f"seed {seed}"
        assert same(pool_v[layer][slots], v[layer][2].transpose(0, 1)), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_caches_are_read_through_strides(device):
    gen, seed = fresh_generator()
    # bhtd made from a [batch, tokens, heads, dim] buffer: heads not adjacent, tokens strided.
    base_k = rand((2, 20, 4, 16), torch.float32, gen, device)
    base_v = rand((2, 20, 4, 16), torch.float32, gen, device)
    k, v = [base_k.transpose(1, 2)], [base_v.transpose(1, 2)]
    rows = torch.tensor([3, 4, 5, 11, 0], device=device)
    slab = kernels.snapshot_kv(k, v, rows, layout="bhtd", batch_index=1)
    assert same(slab, ref_snapshot(k, v, rows, "bhtd", 1)), f"seed {seed}"
    # thd pool whose head_dim was narrowed: heads are not adjacent.
    pool = rand((16, 2, 24), torch.float16, gen, device)
    k2, v2 = [pool[:, :, :8]], [pool[:, :, 8:16]]
    untouched = pool[:, :, 16:].clone()
    want_k, want_v = ref_restore([slab[:, :, :, :2, :8].half().contiguous()], [(4, 9)], k2, v2,
                                 "thd")
    kernels.restore_chain([slab[:, :, :, :2, :8].half().contiguous()], [(4, 9)], k2, v2,
                      layout="thd")
    assert same(k2[0], want_k[0]) and same(v2[0], want_v[0]), f"seed {seed}"
    assert same(pool[:, :, 16:], untouched)


@pytest.mark.parametrize("device", DEVICES)
def test_large_range_round_trip(device):
    """A whole 28-layer anchor: slab equals the cache rows and restores bit-exactly."""
    gen, seed = fresh_generator()
    k, v = make_cache("thd", 28, 300, 4, 128, torch.bfloat16, gen, device)
    slab = kernels.snapshot_kv(k, v, (10, 266), layout="thd")
    assert same(slab, ref_snapshot(k, v, (10, 266), "thd")), f"seed {seed}"
    dst_k, dst_v = make_cache("thd", 28, 300, 4, 128, torch.bfloat16, gen, device)
    tails = [a[256:].clone() for a in dst_k]
    kernels.restore_chain([slab], [(0, 256)], dst_k, dst_v, layout="thd")
    assert all(same(a[0:256], b[10:266]) for a, b in zip(dst_k + dst_v, k + v, strict=True))
    assert all(same(a[256:], t) for a, t in zip(dst_k, tails, strict=True))


def test_empty_rows_give_an_empty_slab():
    gen, _ = fresh_generator()
    k, v = make_cache("thd", 2, 8, 2, 4, torch.float32, gen)
    slab = kernels.snapshot_kv(k, v, (3, 3), layout="thd")
    assert tuple(slab.shape) == (2, 2, 0, 2, 4)
    before = [t.clone() for t in k]
    kernels.restore_chain([slab], [(3, 3)], k, v, layout="thd")
    assert all(same(a, b) for a, b in zip(k, before, strict=True))
