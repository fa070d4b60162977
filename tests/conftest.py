"""The suite's shared fixtures, and its isolation from the machine it runs on.

Every test runs under a home and a cache of its own (`pytest_configure`): `HOME` and
`ANCHORCACHE_CACHE_DIR` point into a temporary folder (and no other `ANCHORCACHE_` setting
of the user's is seen), so nothing reads or writes the user's ledger (`~/.local/state/anchorcache`) or their cache;
only the converted models are read from the user's cache (`models/`, linked read-only in
spirit: `make test` prepares them). A ledger holding a tenant sits at the default location
of that home: if anything opened the default ledger, its tenant would change what an
anonymous or placeholder key gets, and `pytest_sessionfinish` fails the run if that ledger
changed at all: every test gives its proxies a state dir of its own.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from anchorcache import paths
from anchorcache.testing.servers import Server, proxy_process, sglang_worker_process, worker_process

_SANDBOX: dict[str, Any] = {}


def _ledger_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def pytest_configure(config: pytest.Config) -> None:
    real_models = paths.cache_dir() / "models"  # read before HOME moves
    root = Path(tempfile.mkdtemp(prefix="anchorcache-tests-"))
    home, cache = root / "home", root / "cache"
    cache.mkdir(parents=True)
    real_models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(real_models, target_is_directory=True)
    for name in [n for n in os.environ if n.startswith("ANCHORCACHE_")]:
        del os.environ[name]  # the user's settings are not the tests'
    os.environ.update(HOME=str(home), ANCHORCACHE_CACHE_DIR=str(cache))
    from anchorcache.state.ledger import Ledger

    sentinel = paths.default_state_dir()  # now inside the temporary home
    ledger = Ledger.open(sentinel)
    ledger.create_tenant("sentinel-tenant")
    ledger.close()
    _SANDBOX.update(root=root, sentinel=sentinel, digest=_ledger_digest(sentinel))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _SANDBOX:
        return
    changed = _ledger_digest(_SANDBOX["sentinel"]) != _SANDBOX["digest"]
    shutil.rmtree(_SANDBOX.pop("root"), ignore_errors=True)
    if changed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nFAILED: a test opened the default ledger (~/.local/state/anchorcache): "
              "every test must use a state dir of its own")


def prepare_default_model() -> Path:
    from anchorcache.ext.embedded.model_store import prepare_default_model as prepare

    return prepare()


@pytest.fixture(scope="session")
def default_model_dir():
    return prepare_default_model()


@pytest.fixture(scope="session")
def worker(default_model_dir) -> Iterator[Server]:
    """The default embedded worker (SmolLM2), shared by the tests that do not break it."""
    with worker_process(model=str(default_model_dir)) as server:
        yield server


@pytest.fixture(scope="session")
def proxy(worker: Server) -> Iterator[Server]:
    with proxy_process(worker.url, "--max-body-bytes", "65536") as server:
        yield server


@pytest.fixture()
def openai_client(proxy: Server):
    import openai

    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0, timeout=120)  # no key: anonymous


# One SGLang server per session (start-up is 25-70 s on CPU), shared by tests/ext/ and
# tests/e2e/, restarted in place by the test that checks epochs.
class SGLangHandle:
    """The session's SGLang worker; `restart()` replaces the process on the same port."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self._cm = sglang_worker_process(model=str(model))
        self.server: Server = self._cm.__enter__()

    @property
    def url(self) -> str:
        return self.server.url

    def restart(self) -> None:
        port = int(self.url.rsplit(":", 1)[1])
        self._cm.__exit__(None, None, None)
        self._cm = sglang_worker_process(model=str(self.model), port=port)
        self.server = self._cm.__enter__()

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    return build_tiny_model("qwen3", tiny_model_dir("qwen3"))


@pytest.fixture(scope="session")
def sglang(tiny_qwen3: Path) -> Iterator[SGLangHandle]:
    handle = SGLangHandle(tiny_qwen3)
    try:
        yield handle
    finally:
        handle.close()
