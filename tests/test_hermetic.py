"""The suite is hermetic (tests/conftest.py, `anchorcache.testing.sandbox`): the processes
the tests start see the sandbox's home, and a proxy started without a state dir of its own
would open the seeded default ledger, be told by its tenants what an unknown key gets, and
change the ledger folder, which is what the session's check compares."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import httpx
import pytest

from anchorcache import paths
from anchorcache.cli import free_port, wait_ready
from anchorcache.testing import sandbox
from anchorcache.testing.sandbox import SENTINEL_TENANTS, fingerprint


def test_a_subprocess_sees_the_sandbox_home_cache_and_no_user_settings(hermetic):
    out = subprocess.run(
        [sys.executable, "-c", "import os; from anchorcache import paths; "
         "print(paths.default_state_dir()); print(paths.cache_dir()); "
         "print(sorted(n for n in os.environ if n.startswith('ANCHORCACHE_')))"],
        capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    # and, in one of `make test`'s parallel processes, its slice of ports (cli.free_port)
    sandboxed = ["ANCHORCACHE_CACHE_DIR"] + (
        ["ANCHORCACHE_PORT_SHARD"] if os.environ.get("PYTEST_XDIST_WORKER") else [])
    assert out == [str(hermetic.default_ledger), str(hermetic.cache), str(sandboxed)]
    assert hermetic.default_ledger.is_relative_to(hermetic.home)
    assert hermetic.default_ledger != hermetic.user_ledger
    assert paths.default_state_dir() == hermetic.default_ledger  # this process too


def test_the_default_ledger_holds_the_sentinel_tenants(hermetic, tmp_path):
    copy = tmp_path / "ledger"
    shutil.copytree(hermetic.default_ledger, copy)  # (opening the original would change it)
    from anchorcache.state.ledger import Ledger

    ledger = Ledger.open(copy)
    try:
        assert {t.name for t in ledger.tenants()} >= set(SENTINEL_TENANTS)
    finally:
        ledger.close()


@pytest.mark.slow
def test_a_proxy_without_a_state_dir_is_caught(hermetic, worker, tmp_path):
    """A proxy started as the tests start theirs, less `--state-dir`, in a home seeded like
    the sandbox's: an unknown key is refused (the default ledger's tenants decide), and the
    ledger folder's fingerprint changes, so the session's check would fail the run."""
    home = tmp_path / "home"
    ledger = home / hermetic.default_ledger.relative_to(hermetic.home)
    sandbox.seed_ledger(ledger)
    before = fingerprint(ledger)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", "proxy", "--worker",
                             worker.url, "--port", str(port), "--log-level", "warning"],
                            env={**os.environ, "HOME": str(home)}, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=120)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                           headers={"Authorization": "Bearer sk-placeholder"},
                           json={"model": "default", "max_tokens": 1,
                                 "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 401, reply.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert fingerprint(ledger) != before


def test_parallel_processes_pick_ports_from_slices_of_their_own(monkeypatch):
    from anchorcache.cli import _ephemeral_floor

    floor = _ephemeral_floor()
    lo, width = floor // 2, (floor - floor // 2) // 2
    for k in (0, 1):
        monkeypatch.setenv("ANCHORCACHE_PORT_SHARD", f"{k}/2")
        ports = {free_port() for _ in range(20)}
        assert all(lo + k * width <= p < lo + (k + 1) * width for p in ports), (k, ports)


def test_a_port_is_never_handed_out_twice_nor_one_to_avoid(monkeypatch):
    """`serve` picks its worker's port while its own (chosen by whoever started it) may not
    be bound yet: it once got the same one, and its worker answered the proxy's health."""
    from anchorcache.cli import _ephemeral_floor

    floor = _ephemeral_floor()
    n = (floor - floor // 2) // 4  # slices of 4 ports
    k = random.randrange(n)
    monkeypatch.setenv("ANCHORCACHE_PORT_SHARD", f"{k}/{n}")
    lo = floor // 2 + k * ((floor - floor // 2) // n)
    avoid = {lo, lo + 1, lo + 2}
    ports = [free_port(avoid=avoid) for _ in range(3)]
    assert len(set(ports)) == 3 and not avoid & set(ports), (lo, ports)


def test_every_file_that_starts_sglang_servers_runs_in_the_sglang_process():
    """`testing.groups` puts them in one pytest-xdist process (memory): a new file that
    starts SGLang servers, or uses the session's, must be listed there."""
    import re
    from pathlib import Path

    from anchorcache.testing.groups import SGLANG_FILES

    root = Path(__file__).resolve().parents[1]
    starts = re.compile(r'sglang_worker_process\(|def \w+\([^)]*\bsglang\b[,)]'
                        r'|getfixturevalue\("sglang"\)|"--backend", "sglang"')
    found = {str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
             if starts.search(p.read_text())}
    # this file (the pattern above), and one whose `--backend sglang` stops at once: SGLang
    # is hidden from it
    found -= {"tests/test_hermetic.py", "tests/test_cli_without_sglang.py"}
    assert found and found <= SGLANG_FILES, sorted(found - SGLANG_FILES)
