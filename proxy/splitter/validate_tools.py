"""The rules every function-tool list and named `tool_choice` must meet, on every API.

Each API layer first turns its own tool shape into chat form (`{"type": "function",
"function": {"name", "description", "parameters", ...}}`: Anthropic's `input_schema` and
the Responses API's flat tools and namespaces become that) and checks what only its shape
has; then it calls `check_function_tools` on the chat-form list and `check_choice_name` on a
named choice. The splitter calls the same functions on what it renders, so a rule holds
whichever way a request arrives (an API route, `anchorcache split`, a toolset warmed through
the admin API).

Names are unique because a tool call is resolved by name: with two tools of one name, the
call the model writes names both, and the grammar for a forced call cannot say which.

Every failure raises `error(message, param)`: `SplitError` by default (the splitter's 400),
the API layer's own `bad` where it calls, so the client gets a 400 in that API's error shape.
`param` is the offending field as the client wrote it (`params[i]` names tool i; the
default is the chat form's `tools[i].function`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .types import SplitError

ErrorFactory = Callable[[str, "str | None"], Exception]


def _name_of(tool: Any) -> Any:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None


def check_function_tools(tools: Sequence[Any], *, params: Sequence[str] | None = None,
                         max_name_chars: int | None = None,
                         error: ErrorFactory = SplitError) -> None:
    """Raise unless each of `tools` is a chat-form function tool with a non-empty string
    name (at most `max_name_chars` characters), an object `parameters` and a string
    `description` where present, and no two tools share a name. Mutates nothing."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = params[i] if params is not None else f"tools[{i}].function"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise error("each tool must be {'type': 'function', 'function': {'name': ...}}",
                        f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise error(f"'{where}.name' must be a non-empty string", f"{where}.name")
        if max_name_chars is not None and len(name) > max_name_chars:
            raise error(f"'{where}.name' is longer than {max_name_chars} characters",
                        f"{where}.name")
        if name in seen:
            raise error(f"tool names must be unique; {name!r} repeats", f"{where}.name")
        seen.add(name)
        if not isinstance(fn.get("parameters", {}), dict):
            raise error("'parameters' must be an object", f"{where}.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise error("'description' must be a string", f"{where}.description")


def check_choice_name(name: Any, tools: Sequence[Any], *, param: str = "tool_choice",
                      error: ErrorFactory = SplitError) -> str:
    """`name` when it names one of `tools` (chat form, already checked); raise otherwise."""
    if not isinstance(name, str) or name not in {_name_of(t) for t in tools}:
        raise error(f"tool_choice names an unknown tool {name!r}", param)
    return name
