"""bench/gpu_check.sh (the GPU check, run where a GPU is lent) stays valid bash; its dry
run is what a CPU machine can run of it (`bash bench/gpu_check.sh --dry-run`, ~1-2 min)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


def test_gpu_check_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_file_the_gpu_check_runs_exists():
    """The test modules and benchmark scripts the check runs are there: a renamed or removed
    one would fail only on the GPU machine, where the time is lent (its `--help` is prose)."""
    named = set(re.findall(r"\b((?:tests|bench)/[\w/]+\.py)\b", SCRIPT.read_text()))
    assert {"tests/ext/test_ops_kv.py", "bench/sglang_replay.py"} <= named, named
    missing = sorted(f for f in named if not (SCRIPT.parents[1] / f).is_file())
    assert missing == [], missing
