from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from anchorcache.ext.embedded.model_store import prepare_default_model
from tests.servers import Server, proxy_process, sglang_worker_process, worker_process


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
