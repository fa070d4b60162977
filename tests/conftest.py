"""The suite's shared fixtures, and its isolation from the machine it runs on.

Every test runs under a home and a cache of its own (`anchorcache.testing.sandbox`, entered
when this file is imported, before anything imports `anchorcache.cli`): nothing reads or
writes the user's ledger (`~/.local/state/anchorcache`) or their cache, except the converted
models, which the tests read. A ledger holding two tenants sits at the sandbox's default
location; `hermetic` (session, autouse) fails the run if that ledger or the user's own
default ledger changed at all (bytes, modification times): every test gives its proxies a
state dir of its own. tests/test_hermetic.py shows that a proxy started without one would be
caught.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from anchorcache.testing import groups, sandbox

if TYPE_CHECKING:
    from anchorcache.testing.servers import Server

SANDBOX = sandbox.enter()


@pytest.fixture(scope="session", autouse=True)
def hermetic() -> Iterator[sandbox.Sandbox]:
    """The session's sandbox; at the end, neither the sandbox's default ledger nor the user's
    own has changed."""
    yield SANDBOX
    problems = SANDBOX.check()
    assert not problems, "\n".join(problems)


def pytest_unconfigure(config: pytest.Config) -> None:
    SANDBOX.remove()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs two processes (pytest-xdist): each test file whole in one of them,
    the files that start SGLang servers all in the same one (`testing.groups`). A scheduler
    of our own, as `--dist loadgroup`'s marks do not reach the scheduler under pytest 9 (it
    renames `_nodeid`, which xdist 3.8 rewrites to carry the group)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return groups.of(nodeid.split("::", 1)[0])

    return ByGroup(config, log)


def prepare_default_model() -> Path:
    from anchorcache.ext.embedded.model_store import prepare_default_model as prepare

    return prepare()


@pytest.fixture(scope="session")
def default_model_dir():
    return prepare_default_model()


@pytest.fixture(scope="session")
def worker(default_model_dir) -> Iterator[Server]:
    """The default embedded worker (SmolLM2), shared by the tests that do not break it."""
    from anchorcache.testing.servers import worker_process

    with worker_process(model=str(default_model_dir)) as server:
        yield server


@pytest.fixture(scope="session")
def proxy(worker: Server) -> Iterator[Server]:
    from anchorcache.testing.servers import proxy_process

    with proxy_process(worker.url, "--max-body-bytes", "65536") as server:
        yield server


@pytest.fixture()
def openai_client(proxy: Server):
    import openai

    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0, timeout=120)  # no key: anonymous


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    return build_tiny_model("qwen3", tiny_model_dir("qwen3"))


@pytest.fixture(scope="session")
def sglang(tiny_qwen3: Path) -> Iterator[Server]:
    """One SGLang server (tiny Qwen3, the tests' pool) for the session, shared by tests/ext/
    and tests/e2e/ (start-up is 25-70 s on CPU). Never restarted or stopped by a test: a test
    that needs a process of its own starts one."""
    from anchorcache.testing.servers import sglang_worker_process

    with sglang_worker_process(model=str(tiny_qwen3)) as server:
        yield server
