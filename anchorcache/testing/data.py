"""The agent conversations the tests and benchmarks replay, kept in the repository.

`data/bfcl_multi_turn_{base,long_context}.conversations.json.xz`: 200 conversations each
(OpenAI form: `tools`, `messages` with tool calls and tool results), built from `bfcl-eval`
2026.3.23 (Apache-2.0) by replaying its ground-truth calls against its executable backends;
xz-compressed (190 KB for both). `anchorcache bench` reads the same format.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from anchorcache.bench import load_conversations, turn_requests

__all__ = ["DATASETS", "DATA_DIR", "conversations", "dataset_path", "turn_requests",
           "two_turn_prompts"]

DATA_DIR = Path(__file__).resolve().parent / "data"
DATASETS = ("base", "long_context")


def dataset_path(name: str = "base") -> Path:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
    return DATA_DIR / f"bfcl_multi_turn_{name}.conversations.json.xz"


@functools.cache
def _cached(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(load_conversations(dataset_path(name)))


def conversations(name: str = "base") -> list[dict[str, Any]]:
    """The dataset's conversations, in its order (a new list; the conversations are shared:
    do not mutate them)."""
    return list(_cached(name))


def two_turn_prompts(tokenizer: Any, n: int, *, num_tools: int = 2
                     ) -> list[tuple[int, int, list[int], list[int]]]:
    """The first `n` base conversations as token ids under `tokenizer`'s chat template:
    (tool anchor depth, conversation anchor depth, turn-1 prompt, turn-2 prompt). The tool
    anchor ends after the system block (tools), turn 1 is system + first user message,
    turn 2 appends the assistant's tool calls and the tool results; the conversation anchor
    is where the two turns' renderings part."""
    def ids(conv: dict[str, Any], k: int, gen: bool) -> list[int]:
        text = tokenizer.apply_chat_template(conv["messages"][:k], tools=conv["tools"][:num_tools],
                                             tokenize=False, add_generation_prompt=gen)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    out = []
    for conv in conversations("base")[:n]:
        system, p1, p2 = ids(conv, 1, False), ids(conv, 2, True), ids(conv, 5, True)
        tool_depth = len(system)
        conv_depth = next(i for i, (a, b) in enumerate(zip(p1, p2, strict=False)) if a != b)
        assert p1[:tool_depth] == system and tool_depth < conv_depth < len(p1)
        out.append((tool_depth, conv_depth, p1, p2))
    return out
