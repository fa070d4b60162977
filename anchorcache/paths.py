"""Filesystem locations shared by every component (imports nothing heavy)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of converted models and other derived files: $ANCHORCACHE_CACHE_DIR or ~/.cache/anchorcache."""
    return Path(os.environ.get("ANCHORCACHE_CACHE_DIR") or Path.home() / ".cache" / "anchorcache")


def default_state_dir() -> Path:
    """Where the proxy keeps its ledger unless --state-dir / $ANCHORCACHE_STATE_DIR says otherwise."""
    return Path.home() / ".local" / "state" / "anchorcache"
