"""snapshot_state / restore_chain with state, against the reference packing."""

from __future__ import annotations

import random

import pytest
import torch

from anchorcache.ext import kernels
from anchorcache.testing.ops_reference import (
    DEVICES,
    fresh_generator,
    make_cache,
    rand,
    ref_restore,
    ref_snapshot,
    ref_state_pieces,
    same,
)


def _hybrid_states(gen, device, num_slots=4):
    """Per-layer conv and recurrent states as transformers' hybrid caches hold them."""
    rnd = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    shapes = [(num_slots, rnd.randint(1, 9), rnd.randint(2, 4)),             # conv state
              (num_slots, rnd.randint(1, 3), rnd.randint(2, 8), 5),          # recurrent state
              (num_slots, 7)]
    dtypes = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
    return [rand(s, d, gen, device) for s, d in zip(shapes, dtypes, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
def test_state_slab_packs_each_piece_at_its_aligned_offset(device):
    gen, seed = fresh_generator()
    states = _hybrid_states(gen, device)
    slab = kernels.snapshot_state(states, 2)
    pieces, total = ref_state_pieces(states, 2)
    assert slab.dtype == torch.uint8 and slab.numel() == total == kernels.state_slab_nbytes(states)
    assert slab.is_pinned() == (device == "cuda")
    for offset, piece in pieces:
        assert torch.equal(slab[offset:offset + piece.numel()], piece), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_state_round_trip_touches_only_the_target_slot(device):
    gen, seed = fresh_generator()
    states = _hybrid_states(gen, device)
    target = [rand(tuple(s.shape), s.dtype, gen, device) for s in states]
    before = [t.clone() for t in target]
    slab = kernels.snapshot_state(states, 1)
    # State-only restore: no links and no cache tensors.
    kernels.restore_chain([], [], [], [], layout="thd", state_slab=slab, states=target,
                      state_index=3)
    for got, src, old in zip(target, states, before, strict=True):
        assert same(got[3], src[1]), f"seed {seed}"
        assert same(got[:3], old[:3]), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_state_into_out_and_from_non_contiguous_states(device):
    gen, seed = fresh_generator()
    wide = rand((3, 6, 8), torch.float16, gen, device)
    states = [wide[:, :, ::2], rand((3, 5), torch.float32, gen, device)]  # first is strided
    out = torch.randint(1, 255, (kernels.state_slab_nbytes(states),), dtype=torch.uint8)
    assert kernels.snapshot_state(states, 0, out=out) is out
    pieces, _ = ref_state_pieces(states, 0)
    for offset, piece in pieces:
        assert torch.equal(out[offset:offset + piece.numel()], piece), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["thd", "bhtd"])
def test_chain_restore_with_leaf_state(device, layout):
    gen, seed = fresh_generator()
    k, v = make_cache(layout, 3, 24, 2, 8, torch.bfloat16, gen, device)
    states = _hybrid_states(gen, device)
    thin = kernels.snapshot_kv(k, v, (0, 10), layout=layout)
    kv = kernels.snapshot_kv(k, v, (10, 17), layout=layout)
    state = kernels.snapshot_state(states, 2)
    assert same(kv, ref_snapshot(k, v, (10, 17), layout)), f"seed {seed}"

    dst_k, dst_v = make_cache(layout, 3, 24, 2, 8, torch.bfloat16, gen, device)
    dst_states = [rand(tuple(s.shape), s.dtype, gen, device) for s in states]
    want_k, want_v = ref_restore([thin, kv], [(0, 10), (10, 17)], dst_k, dst_v, layout)
    kernels.restore_chain([thin, kv], [(0, 10), (10, 17)], dst_k, dst_v, layout=layout,
                      state_slab=state, states=dst_states, state_index=0)
    assert all(same(a, b) for a, b in zip(dst_k + dst_v, want_k + want_v, strict=True))
    assert all(same(a[0], b[2]) for a, b in zip(dst_states, states, strict=True)), f"seed {seed}"


def test_no_states_give_an_empty_slab():
    assert kernels.snapshot_state([], 0).numel() == 0
    assert kernels.state_slab_nbytes([]) == 0
