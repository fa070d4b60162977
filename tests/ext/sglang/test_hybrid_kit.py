"""Hybrid check with SGLang's own unified radix cache test kit (FULL + MAMBA, CPU tensors):
an anchor boundary inside a cached prompt matches nothing under SGLang's tracking (its
Mamba state exists only at the prompt end); after our checkpoint of the anchor (KV rows +
the state captured at the boundary) it is a full hit, with exactly the captured bytes.

The kit needs SGLang's CPU recipe at process start (the stub libcuda.so.1 on the loader
path), so it runs in a subprocess (kit_hybrid.py) with that environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anchorcache.ext.sglang import cpu

pytestmark = pytest.mark.slow


def test_an_anchor_boundary_sglang_misses_becomes_a_hit_after_our_checkpoint():
    script = Path(__file__).with_name("kit_hybrid.py")
    root = Path(__file__).resolve().parents[3]
    env = cpu.cpu_env({**os.environ, "PYTHONPATH": str(root)})
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"] == 0  # SGLang alone: no state at the boundary, no hit
    assert got["full_before"] == 100
    assert got["after"] == got["anchor"] == 60
    assert got["extended"] == 60  # a longer prompt over the anchor matches it
    assert got["full_after"] == 100  # the prompt-end state is untouched
    assert got["state_ok"] and got["kv_ok"]
