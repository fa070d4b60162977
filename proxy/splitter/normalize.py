"""Request normalization: the same logical request always renders to the same tokens.

- Tools are validated and, by default, kept exactly as the client sent them (order of the
  tools and of every key), because that is what the model's own template renders and what
  the model reads. Canonical ordering is opt-in (`canonical=True`): sorted by function
  name (stable), fixed key order (`type`, `function`; `name`, `description`, `parameters`,
  then the rest sorted) and every JSON-schema object inside `parameters` key-sorted, so two
  clients sending one toolset in different orders share the instruction anchor, at the
  price of a prompt that differs from the template's (the model sees another tool order
  and argument order than the client sent, which can change its output).
- Message content becomes a plain string: `None` becomes "" and text parts are joined with
  "\\n" (what vLLM and SGLang do); non-text parts are rejected.
- Tool-call `arguments` arriving as JSON strings are parsed into objects, so templates that
  iterate or `tojson` them see an object and the rendering does not depend on the client's
  whitespace. A string that is an object's JSON cut short (a call `max_tokens` cut, which
  OpenAI and this proxy return with `finish_reason: "length"` and agent SDKs send back) is
  accepted: `arguments` is the object it describes (`partial_json.close_json`) and
  `function.arguments_text` keeps the client's text, which adapters whose template takes
  arguments as a string render as is (`arguments_text`), so the history shows what the
  model wrote. Anything else that is not an object's JSON, or a non-string non-object, is
  the client's fault: `SplitError`.

Inputs are never mutated; the output is fresh dicts.
"""

from __future__ import annotations

import json
from typing import Any

from .partial_json import close_json
from .types import SplitError
from .validate_tools import check_function_tools

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_FUNCTION_KEY_ORDER = ("name", "description", "parameters")


def _sorted_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_json(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_json(v) for v in value]
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def normalize_tools(tools: list[dict] | None, *, canonical: bool = False) -> list[dict] | None:
    """A validated copy of an OpenAI `tools` list, in the client's order (every key too)
    unless `canonical`; `None` or `[]` gives `None`."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise SplitError("tools must be a list", "tools")
    check_function_tools(tools)
    return canonical_tools(tools) if canonical else [_copy(t) for t in tools]


def canonical_tools(tools: list[dict] | None) -> list[dict] | None:
    """Canonical copy of an OpenAI `tools` list (see module docstring); `None` or `[]`
    gives `None`. Validates like `normalize_tools`."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise SplitError("tools must be a list", "tools")
    check_function_tools(tools)
    out: list[dict[str, Any]] = []
    for tool in tools:
        fn = tool["function"]
        canon_fn = {k: (_sorted_json(fn[k]) if k == "parameters" else fn[k])
                    for k in _FUNCTION_KEY_ORDER if k in fn}
        canon_fn.update({k: _sorted_json(fn[k]) for k in sorted(fn) if k not in canon_fn})
        out.append({"type": "function", "function": canon_fn})
    out.sort(key=lambda t: str(t["function"]["name"]))
    return out


def content_text(content: Any, param: str) -> str:
    """OpenAI content (str, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                texts.append(part["text"])
            else:
                raise SplitError("only text content parts are supported", f"{param}[{j}]")
        return "\n".join(texts)
    raise SplitError("content must be a string, null or a list of text parts", param)


ARGUMENTS_TEXT = "arguments_text"  # in a normalized call's `function`: see module docstring
ARGUMENTS_JSON = "arguments_json"  # the arguments object's JSON text: `with_arguments_json`


def parse_arguments(arguments: Any, param: str) -> tuple[dict, str | None]:
    """Tool-call arguments as a dict ("" means no arguments), and the client's text when it
    is an object's JSON cut short (else None)."""
    if isinstance(arguments, dict):
        return arguments, None
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}, None
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            closed = close_json(arguments)
            if isinstance(closed, dict):
                return closed, arguments
            raise SplitError(f"tool-call arguments are not valid JSON, nor an object's JSON cut "
                             f"short: {exc}", param) from None
        except RecursionError:
            raise SplitError("tool-call arguments nest too deep", param) from None
        if isinstance(value, dict):
            return value, None
    raise SplitError("tool-call arguments must be a JSON object", param)


def arguments_text(function: dict) -> str:
    """A normalized call's arguments as text, for templates that take them as a string: the
    client's own text when it was cut short, else the object's JSON."""
    text = function.get(ARGUMENTS_TEXT)
    return text if isinstance(text, str) else arguments_json(function)


def arguments_json(function: dict) -> str:
    """A normalized call's arguments object as JSON text (`json.dumps`, as templates'
    `tojson` writes it), computed once where `with_arguments_json` set it."""
    text = function.get(ARGUMENTS_JSON)
    return text if isinstance(text, str) else json.dumps(function["arguments"],
                                                         ensure_ascii=False)


def without_arguments_text(messages: list[dict]) -> list[dict]:
    """`messages` with every call's `function` in the usual shape (`name`, `arguments`), for
    templates that render calls themselves: they get the object a cut-short text describes."""
    extra = (ARGUMENTS_TEXT, ARGUMENTS_JSON)
    if not any(k in c["function"] for m in messages for c in m.get("tool_calls", ())
               for k in extra):
        return messages
    return [dict(m, tool_calls=[dict(c, function={k: v for k, v in c["function"].items()
                                                  if k not in extra})
                                for c in m["tool_calls"]]) if m.get("tool_calls") else m
            for m in messages]


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise SplitError("tool_calls must be a list", param)
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise SplitError("a tool call needs function.name", f"{p}.function.name")
        arguments, text = parse_arguments(fn.get("arguments"), f"{p}.function.arguments")
        function = {"name": fn["name"], "arguments": arguments}
        if text is not None:
            function[ARGUMENTS_TEXT] = text
        out.append({"id": call.get("id") or f"call_{j}", "type": "function",
                    "function": function})
    return out


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Validated, normalized copies of OpenAI chat messages (see module docstring)."""
    check_messages(messages)
    return [normalize_message(i, m) for i, m in enumerate(messages)]


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise SplitError("messages must be a non-empty list", "messages")


def normalize_message(i: int, msg: Any) -> dict:
    """A validated, normalized copy of `messages[i]` (see module docstring)."""
    param = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ROLES:
        raise SplitError(f"unknown role {msg.get('role') if isinstance(msg, dict) else None!r}",
                         f"{param}.role")
    role = msg["role"]
    norm: dict[str, Any] = {"role": role,
                            "content": content_text(msg.get("content"), f"{param}.content")}
    if role == "assistant":
        if msg.get("tool_calls"):
            norm["tool_calls"] = _tool_calls(msg["tool_calls"], f"{param}.tool_calls")
        reasoning = msg.get("reasoning_content")
        if isinstance(reasoning, str):
            norm["reasoning_content"] = reasoning
    elif role == "tool":
        if msg.get("tool_call_id") is not None:
            norm["tool_call_id"] = str(msg["tool_call_id"])
        if isinstance(msg.get("name"), str):
            norm["name"] = msg["name"]
    return norm


def with_arguments_json(msg: dict) -> dict:
    """`msg` (normalized, defused) with each call's `arguments_json` set: the JSON text of
    its arguments object, which templates that take arguments as a string render, computed
    once for a message the memo keeps (splitter/memo.py) rather than at every render. Sets it
    in place: `msg` is the caller's fresh copy."""
    for call in msg.get("tool_calls", ()):
        fn = call["function"]
        fn[ARGUMENTS_JSON] = json.dumps(fn["arguments"], ensure_ascii=False)
    return msg


def leading_system_count(messages: list[dict]) -> int:
    """How many messages at the start are system/developer (the instruction part)."""
    n = 0
    while n < len(messages) and messages[n]["role"] in ("system", "developer"):
        n += 1
    return n


def newest_start(messages: list[dict]) -> int:
    """Index of the first message of the trailing run of user/tool messages (the new input).

    Equals `len(messages)` when the conversation ends with an assistant (or system) message.
    """
    i = len(messages)
    while i > 0 and messages[i - 1]["role"] in ("user", "tool"):
        i -= 1
    return i
