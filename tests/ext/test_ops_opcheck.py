"""torch.library.opcheck on every operator: schema (mutation/aliasing), fake impls, AOT."""

from __future__ import annotations

import pytest
import torch

from anchorcache.ext import kernels  # noqa: F401  (registers the fake implementations)
from anchorcache.testing.ops_reference import DEVICES, fresh_generator, make_cache, rand

_ops = torch.ops.anchorcache


def _samples(device):
    gen, _ = fresh_generator()
    k, v = make_cache("thd", 2, 12, 2, 8, torch.bfloat16, gen, device)
    bk, bv = make_cache("bhtd", 2, 12, 2, 8, torch.float16, gen, device)
    states = [rand((3, 4, 2), torch.float32, gen, device), rand((3, 5), torch.bfloat16, gen,
                                                                 device)]
    idx = torch.tensor([5, 0, 9], device=device)
    slab_a = rand((2, 2, 4, 2, 8), torch.bfloat16, gen)
    slab_b = rand((2, 2, 3, 2, 8), torch.bfloat16, gen)
    state_slab = _ops.snapshot_state(states, 1)
    return [
        (_ops.snapshot_kv, (k, v, None, 2, 9, "thd", 0)),
        (_ops.snapshot_kv, (k, v, idx, 0, 0, "thd", 0)),
        (_ops.snapshot_kv, (bk, bv, None, 1, 4, "bhtd", 1)),
        (_ops.snapshot_kv_out, (k, v, idx, 0, 0, "thd", 0,
                                rand((2, 2, 3, 2, 8), torch.bfloat16, gen))),
        (_ops.snapshot_state, (states, 2)),
        (_ops.snapshot_state_out, (states, 0, torch.empty_like(state_slab))),
        (_ops.restore_chain, ([slab_a, slab_b], [None, idx], [0, 0], "thd", 0, k, v,
                              state_slab, states, 0)),
        (_ops.restore_chain, ([slab_a], [None], [6], "thd", 0, k, v, None, [], 0)),
        (_ops.restore_chain, ([], [], [], "thd", 0, [], [], state_slab, states, 2)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in _samples(device):
        torch.library.opcheck(op, args)
