"""The test suite's isolation from the machine it runs on (tests/conftest.py enters it).

`enter()` gives the process, and every process it starts, a home and a cache of its own:
`HOME` and `ANCHORCACHE_CACHE_DIR` point into a fresh temporary folder, and none of the
user's `ANCHORCACHE_` settings is seen. Under pytest-xdist (`make test` runs two processes)
each process picks the ports of the servers it starts from a slice of its own
(`cli.free_port`), and its models a share of the cores (`OMP_NUM_THREADS`). Only the
converted models are shared with the user's cache (`models/`, linked: `make test` prepares
them; tests read them). The default ledger location of that home
(`anchorcache.paths.default_state_dir`) holds a ledger with two tenants: anything that
opened it instead of a state dir of its own would see them (an unknown key is refused once
a tenant exists), and would change the ledger folder, which `Sandbox.check` compares, with
the user's own default ledger, to what it was at the start.

Imports nothing but `anchorcache.paths` at module level: it must run before anything
imports `anchorcache.cli`, whose options take their defaults from the home at import.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from anchorcache import paths

SENTINEL_TENANTS = ("sentinel-a", "sentinel-b")


@dataclass(frozen=True)
class Fingerprint:
    """A ledger folder as found: its files' bytes (hashed) and modification times, and the
    folder's own (SQLite creates and removes its -wal and -shm files beside the ledger on
    every open, so even a read-only open moves it)."""

    digest: str
    mtimes_ns: tuple[tuple[str, int], ...]
    folder_mtime_ns: int


def fingerprint(folder: Path) -> Fingerprint | None:
    """`folder`'s fingerprint; None if there is no such folder."""
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    mtimes = []
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            digest.update(str(f.relative_to(folder)).encode() + b"\0" + f.read_bytes() + b"\0")
            mtimes.append((str(f.relative_to(folder)), f.stat().st_mtime_ns))
    return Fingerprint(digest.hexdigest(), tuple(mtimes), folder.stat().st_mtime_ns)


def seed_ledger(folder: Path, tenants: tuple[str, ...] = SENTINEL_TENANTS) -> None:
    """A ledger in `folder` holding `tenants` (closed again: nothing left open)."""
    from anchorcache.state.ledger import Ledger

    ledger = Ledger.open(folder)
    try:
        for name in tenants:
            ledger.create_tenant(name)
    finally:
        ledger.close()


@dataclass(frozen=True)
class Sandbox:
    root: Path
    home: Path
    cache: Path
    default_ledger: Path  # the default state dir inside `home`, seeded
    user_ledger: Path  # the user's own default state dir (it may not exist)
    default_before: Fingerprint | None
    user_before: Fingerprint | None

    def check(self) -> list[str]:
        """What changed in either ledger folder since `enter` (empty: nothing)."""
        problems = []
        if fingerprint(self.default_ledger) != self.default_before:
            problems.append(f"the sandbox's default ledger ({self.default_ledger}) changed: "
                            "something started a proxy without a state dir of its own")
        if fingerprint(self.user_ledger) != self.user_before:
            problems.append(f"the user's own default ledger ({self.user_ledger}) changed "
                            "during the run (bytes or modification times)")
        return problems

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def enter() -> Sandbox:
    """Point this process's environment (and so every process it starts) at a new sandbox;
    the user's default ledger is fingerprinted first."""
    if "anchorcache.cli" in sys.modules:
        raise RuntimeError("anchorcache.cli was imported before the sandbox: its defaults "
                           "(the state dir) point at the user's home")
    user_ledger = paths.default_state_dir()
    real_models = paths.cache_dir() / "models"
    root = Path(tempfile.mkdtemp(prefix="anchorcache-tests-"))
    home, cache = root / "home", root / "cache"
    cache.mkdir(parents=True)
    real_models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(real_models, target_is_directory=True)
    for name in [n for n in os.environ if n.startswith("ANCHORCACHE_")]:
        del os.environ[name]  # the user's settings are not the tests'
    os.environ.update(HOME=str(home), ANCHORCACHE_CACHE_DIR=str(cache))
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT")
    if worker.startswith("gw") and workers:  # one of `make test`'s parallel processes
        os.environ["ANCHORCACHE_PORT_SHARD"] = f"{int(worker[2:])}/{workers}"  # cli.free_port
        # torch's threads (OpenMP's, in this process and the model servers it starts): the
        # processes share the cores. Two per process on a 2-core machine made each parallel
        # op wait on a thread the other process's model had pushed off a core: decode 2.3x
        # and prefill 1.8x slower than one thread each while both ran a model, the whole
        # suite 22 min 48 s against 20 min 21 s (docs/benchmarks.md)
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                         // int(workers))))
    default_ledger = paths.default_state_dir()
    assert default_ledger.is_relative_to(home), default_ledger
    seed_ledger(default_ledger)
    return Sandbox(root, home, cache, default_ledger, user_ledger,
                   fingerprint(default_ledger), fingerprint(user_ledger))
