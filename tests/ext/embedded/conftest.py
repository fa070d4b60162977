"""Fixtures for the embedded worker's model-facing tests: tiny random models (built once
and kept under the anchorcache cache dir, keyed by arch, seed and recipe version), the
real Qwen3 tokenizer, and real BFCL agent prompts rendered with its chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from anchorcache.testing.data import conversations


@pytest.fixture(scope="session")
def bfcl_conversations() -> list[dict[str, Any]]:
    return conversations("base")


def _render(tokenizer: Any, conversation: dict[str, Any], num_messages: int,
            num_tools: int) -> str:
    # Tools are trimmed so the prompt stays a few hundred tokens (all ~28 are ~4k).
    return tokenizer.apply_chat_template(
        conversation["messages"][:num_messages], tools=conversation["tools"][:num_tools],
        tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="session")
def agent_prompt_texts(qwen3_tokenizer: Any, bfcl_conversations: list[dict[str, Any]]
                       ) -> list[str]:
    """Two real agent prompts (system + 2 tool schemas, a user turn, an assistant turn
    with tool calls, tool results, then the generation prompt), rendered as text by the
    Qwen3 chat template; each is a few hundred tokens."""
    return [_render(qwen3_tokenizer, bfcl_conversations[i], num_messages=5, num_tools=2)
            for i in (0, 1)]


@pytest.fixture(scope="session")
def tiny_model_path():
    """arch -> built model dir (seed 0), built at most once per machine."""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    def get(arch: str, seed: int = 0) -> Path:
        return build_tiny_model(arch, tiny_model_dir(arch, seed), seed=seed)

    return get


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted default model (`make test` prepares it; converted here otherwise)."""
    from anchorcache.ext.embedded.model_store import prepare_default_model

    return prepare_default_model()
