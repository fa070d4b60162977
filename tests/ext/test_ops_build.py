"""The built extension registers a kernel per built device for every op of the schema."""

from __future__ import annotations

import os

import pytest
import torch

from anchorcache.ext import _C, kernels  # noqa: F401  (kernels: loads the schema and fakes)

OPS = ["snapshot_kv", "snapshot_kv_out", "snapshot_state", "snapshot_state_out",
       "restore_chain"]


@pytest.mark.parametrize("name", OPS)
def test_every_op_has_a_kernel_for_each_built_device(name):
    qualified = f"anchorcache::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA") == _C.with_cuda


@pytest.mark.skipif(os.environ.get("ANCHORCACHE_BUILD_CUDA") != "1",
                    reason="CI sets ANCHORCACHE_BUILD_CUDA=1 where the CUDA build is required")
def test_cuda_sources_were_compiled_and_linked():
    assert _C.with_cuda
