from __future__ import annotations

from collections.abc import Iterator

import pytest

from anchorcache.ext.embedded.model_store import prepare_default_model
from tests.servers import Server, proxy_process, worker_process


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
