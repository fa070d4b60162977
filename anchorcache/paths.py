"""Filesystem locations shared by every component (imports nothing heavy)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of converted models and other derived files: $ANCHORCACHE_CACHE_DIR or ~/.cache/anchorcache."""
    return Path(os.environ.get("ANCHORCACHE_CACHE_DIR") or Path.home() / ".cache" / "anchorcache")
