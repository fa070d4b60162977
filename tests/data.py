"""The shared agent conversations (../shared/data beside the repository)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO.parent / "shared" / "data"


@functools.cache
def conversations(name: str = "base") -> list[dict[str, Any]]:
    return json.loads((DATA_DIR / f"bfcl_multi_turn_{name}.conversations.json").read_text())


def turn_requests(conversation: dict[str, Any], max_turns: int | None = None) -> list[list[dict]]:
    """Each turn's request: the messages up to (not including) each assistant message."""
    msgs = conversation["messages"]
    out = [msgs[:i] for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0]
    return out[:max_turns] if max_turns else out
