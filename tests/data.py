"""The shared agent conversations (../shared/data beside the repository)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from anchorcache.bench import load_conversations, turn_requests

__all__ = ["DATA_DIR", "conversations", "turn_requests"]

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO.parent / "shared" / "data"


@functools.cache
def conversations(name: str = "base") -> list[dict[str, Any]]:
    return load_conversations(DATA_DIR / f"bfcl_multi_turn_{name}.conversations.json")
