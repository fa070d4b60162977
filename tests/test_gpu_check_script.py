"""bench/gpu_check.sh (the GPU check, run where a GPU is lent) stays valid bash; its dry
run is what a CPU machine can run of it (`bash bench/gpu_check.sh --dry-run`, ~1-2 min)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_check_help_names_every_step():
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for step in ("make setup", "CUDA tests", "page-size 1 and 16", "sglang_replay.py",
                 "ext_snapshot_cuda.py", "granite_swa", "--dry-run", "--offline"):
        assert step in proc.stdout, step
