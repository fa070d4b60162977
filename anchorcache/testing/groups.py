"""Which test files share a pytest-xdist process (`make test` runs two; the scheduler in
tests/conftest.py sends each group whole to one process).

Each file is a group of its own, so its module fixtures start once, except the files that
start SGLang servers: one group, so that one process alone holds SGLang servers (3-4 GB of
host memory each, the session's shared `sglang` server among them) while the other runs
everything else beside it. tests/test_hermetic.py checks that every file starting SGLang
servers is listed here.
"""

from __future__ import annotations

SGLANG = "sglang"
SGLANG_FILES = frozenset({
    "tests/e2e/test_disk_restart.py",
    "tests/e2e/test_sglang_default_model.py",
    "tests/e2e/test_sglang_proxy.py",
    "tests/ext/sglang/test_sglang_dp.py",
    "tests/ext/sglang/test_sglang_hybrid_archs_cpu.py",
    "tests/ext/sglang/test_sglang_hybrid_cpu.py",
    "tests/ext/sglang/test_sglang_swa_cpu.py",
    "tests/ext/sglang/test_sglang_worker.py",
    "tests/ext/sglang/test_tp_sglang.py",
    "tests/ext/test_worker_contract.py",
    "tests/test_serve_hang.py",
})


def of(path: str) -> str:
    """The group of the test file at `path` (relative to the repository, as in node ids)."""
    return SGLANG if path in SGLANG_FILES else path
