"""Caller errors become clear RuntimeErrors (TORCH_CHECK), and a refused restore writes nothing."""

from __future__ import annotations

import pytest
import torch

from anchorcache.ext import kernels
from anchorcache.testing.ops_reference import fresh_generator, make_cache, rand, same


@pytest.fixture
def cache():
    gen, _ = fresh_generator()
    k, v = make_cache("thd", 2, 10, 2, 4, torch.float16, gen)
    return k, v, gen


def test_out_of_range_rows_are_refused(cache):
    k, v, _ = cache
    with pytest.raises(RuntimeError, match=r"rows \[4, 11\) out of range .* 10 tokens"):
        kernels.snapshot_kv(k, v, (4, 11), layout="thd")
    with pytest.raises(RuntimeError, match=r"rows \[5, 4\)"):
        kernels.snapshot_kv(k, v, (5, 4), layout="thd")
    with pytest.raises(RuntimeError, match=r"values in \[-1, 3\], out of range"):
        kernels.snapshot_kv(k, v, torch.tensor([3, -1]), layout="thd")
    with pytest.raises(RuntimeError, match=r"values in \[2, 10\], out of range"):
        kernels.snapshot_kv(k, v, torch.tensor([2, 10]), layout="thd")


def test_bad_index_dtype_and_rank(cache):
    k, v, _ = cache
    with pytest.raises(RuntimeError, match="must be int64"):
        kernels.snapshot_kv(k, v, torch.tensor([1.0, 2.0]), layout="thd")
    with pytest.raises(RuntimeError, match="must be 1-D"):
        kernels.snapshot_kv(k, v, torch.tensor([[1, 2]]), layout="thd")


def test_int32_index_is_accepted(cache):
    k, v, _ = cache
    got = kernels.snapshot_kv(k, v, torch.tensor([7, 1], dtype=torch.int32), layout="thd")
    assert same(got[1, 1], v[1][torch.tensor([7, 1])])


def test_mismatched_layers_are_refused(cache):
    k, v, gen = cache
    with pytest.raises(RuntimeError, match=r"v\[1\] has dtype Float but k\[0\] has Half"):
        kernels.snapshot_kv(k, [v[0], v[1].float()], (0, 2), layout="thd")
    with pytest.raises(RuntimeError, match=r"k\[1\] has shape \[10, 2, 8\]"):
        kernels.snapshot_kv([k[0], rand((10, 2, 8), torch.float16, gen)], v, (0, 2), layout="thd")
    with pytest.raises(RuntimeError, match="k has 2 layers but v has 1"):
        kernels.snapshot_kv(k, v[:1], (0, 2), layout="thd")
    with pytest.raises(RuntimeError, match="contiguous head_dim"):
        kernels.snapshot_kv([t.transpose(1, 2) for t in k], [t.transpose(1, 2) for t in v], (0, 2),
                        layout="thd")


def test_layout_and_batch_index_are_checked(cache):
    k, v, gen = cache
    with pytest.raises(RuntimeError, match="layout must be 'thd'"):
        kernels.snapshot_kv(k, v, (0, 2), layout="tbd")
    with pytest.raises(RuntimeError, match="needs 4-D cache tensors"):
        kernels.snapshot_kv(k, v, (0, 2), layout="bhtd")
    with pytest.raises(RuntimeError, match="batch_index must be 0"):
        kernels.snapshot_kv(k, v, (0, 2), layout="thd", batch_index=1)
    bk, bv = make_cache("bhtd", 1, 6, 2, 4, torch.float16, gen, batch=2)
    with pytest.raises(RuntimeError, match="batch_index 2 out of range for batch size 2"):
        kernels.snapshot_kv(bk, bv, (0, 2), layout="bhtd", batch_index=2)


def test_bad_out_is_refused(cache):
    k, v, gen = cache
    with pytest.raises(RuntimeError, match="out must have shape"):
        kernels.snapshot_kv(k, v, (0, 3), layout="thd", out=rand((2, 2, 3, 2, 8), torch.float16, gen))
    with pytest.raises(RuntimeError, match="out has 4 rows but 3 rows were selected"):
        kernels.snapshot_kv(k, v, (0, 3), layout="thd", out=rand((2, 2, 4, 2, 4), torch.float16, gen))
    with pytest.raises(RuntimeError, match="out has dtype BFloat16"):
        kernels.snapshot_kv(k, v, (0, 3), layout="thd", out=rand((2, 2, 3, 2, 4), torch.bfloat16, gen))


def test_a_bad_link_leaves_the_cache_untouched(cache):
    k, v, gen = cache
    before = [t.clone() for t in k + v]
    good = rand((2, 2, 3, 2, 4), torch.float16, gen)
    bad = rand((2, 2, 3, 2, 4), torch.float32, gen)
    with pytest.raises(RuntimeError, match=r"slabs\[1\] has dtype Float"):
        kernels.restore_chain([good, bad], [(0, 3), (3, 6)], k, v, layout="thd")
    with pytest.raises(RuntimeError, match=r"rows \[8, 11\) out of range"):
        kernels.restore_chain([good, good], [(0, 3), (8, 11)], k, v, layout="thd")
    with pytest.raises(RuntimeError, match="its index selects 2"):
        kernels.restore_chain([good, good], [(0, 3), torch.tensor([4, 5])], k, v, layout="thd")
    states = [rand((2, 5), torch.float32, gen)]
    with pytest.raises(RuntimeError, match="state slab has 7 bytes but the states need 20"):
        kernels.restore_chain([good], [(0, 3)], k, v, layout="thd",
                          state_slab=torch.zeros(7, dtype=torch.uint8), states=states)
    with pytest.raises(RuntimeError, match="state index 2 out of range"):
        kernels.restore_chain([good], [(0, 3)], k, v, layout="thd", state_index=2,
                          state_slab=torch.zeros(20, dtype=torch.uint8), states=states)
    assert all(same(a, b) for a, b in zip(k + v, before, strict=True))


def test_python_side_argument_errors(cache):
    k, v, gen = cache
    slab = rand((2, 2, 3, 2, 4), torch.float16, gen)
    with pytest.raises(ValueError, match="spans 4 rows but slabs"):
        kernels.restore_chain([slab], [(0, 4)], k, v, layout="thd")
    with pytest.raises(ValueError, match="1 slabs but 2 row specs"):
        kernels.restore_chain([slab], [(0, 3), (3, 6)], k, v, layout="thd")


def test_state_errors():
    gen, _ = fresh_generator()
    states = [rand((3, 4), torch.float32, gen)]
    with pytest.raises(RuntimeError, match="state index 3 out of range"):
        kernels.snapshot_state(states, 3)
    with pytest.raises(RuntimeError, match="needs a leading slot/batch dim"):
        kernels.snapshot_state([torch.tensor(1.5)], 0)
    with pytest.raises(RuntimeError, match="state slab has 8 bytes"):
        kernels.snapshot_state(states, 0, out=torch.empty(8, dtype=torch.uint8))
