"""proxy/splitter: chat-template adapters that cut prompts into verified anchors + delta and
parse model output back into OpenAI tool calls. See docs/splitter.md.

Stands alone: nothing here imports from the rest of `anchorcache.proxy`."""

from .base import Adapter, Piece, TextAdapter
from .cli import run_split
from .normalize import canonical_tools, normalize_messages, normalize_tools
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

__all__ = [
    "Adapter", "AdapterRegistry", "Cut", "CutKind", "OutputDelta", "OutputParser",
    "ParsedOutput", "Piece", "PrefixCache", "SplitError", "SplitResult", "TextAdapter",
    "ToolCall", "ToolCallDelta", "available_adapters", "canonical_tools", "default_registry",
    "get_adapter", "normalize_messages", "normalize_tools", "run_split",
]
