"""proxy/splitter: chat-template adapters that cut prompts into verified anchors + delta and
parse model output back into OpenAI tool calls. See docs/splitter.md."""

from .base import Adapter, Piece, TextAdapter
from .normalize import canonical_tools, normalize_messages
from .parsers import OutputParser
from .prefix_cache import PrefixCache
from .registry import AdapterRegistry, available_adapters, default_registry, get_adapter
from .types import (
    Cut,
    CutKind,
    OutputDelta,
    ParsedOutput,
    SplitError,
    SplitResult,
    ToolCall,
    ToolCallDelta,
)


def run_split(model: str | None, adapter: str, request_path: str) -> dict:
    from .cli import run_split as _run_split

    return _run_split(model, adapter, request_path)


__all__ = [
    "Adapter", "AdapterRegistry", "Cut", "CutKind", "OutputDelta", "OutputParser",
    "ParsedOutput", "Piece", "PrefixCache", "SplitError", "SplitResult", "TextAdapter",
    "ToolCall", "ToolCallDelta", "available_adapters", "canonical_tools", "default_registry",
    "get_adapter", "normalize_messages", "run_split",
]
