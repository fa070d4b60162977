"""Probe conversations that prove a Python mirror renders what the chat template renders.

`auto` uses a mirror (qwen3, chatml, llama3) for a tokenizer with a chat template only if
the mirror's text equals the template's on every probe: tools (order and keys not sorted),
tool calls (several, arguments as objects and as JSON strings), consecutive tool results,
system, multi-turn, thinking switched off. Otherwise it falls back to `generic` (the
template itself) and logs why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .normalize import normalize_messages, normalize_tools

_TOOLS = [
    {"type": "function", "function": {
        "name": "zeta_search", "description": "Search <b>docs</b> & \"files\"",
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "description": "what to find"},
            "limit": {"type": "integer"}, "after": {"type": "string", "format": "date"}}}}},
    {"function": {"parameters": {"properties": {"path": {"type": "string"}},
                                 "type": "object"},
                  "name": "alpha_open", "description": "Open a file, ünïcode 你好"},
     "type": "function"},
]
_CALLS = [{"id": "call_a", "type": "function",
           "function": {"name": "zeta_search", "arguments": '{"query": "x",  "limit": 2}'}},
          {"id": "call_b", "type": "function",
           "function": {"name": "alpha_open", "arguments": {"path": "/tmp/a b"}}}]

PROBES: list[tuple[list[dict], list[dict] | None, dict]] = [
    ([{"role": "user", "content": "Hi there"}], None, {}),
    ([{"role": "system", "content": "You are terse.\n"}, {"role": "user", "content": " Q1 "},
      {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}], None, {}),
    ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "find x"},
      {"role": "assistant", "content": "Looking.", "tool_calls": _CALLS},
      {"role": "tool", "tool_call_id": "call_a", "content": "{\"hits\": 3}"},
      {"role": "tool", "tool_call_id": "call_b", "content": "file body"},
      {"role": "assistant", "content": "Found 3."}, {"role": "user", "content": "more"}],
     _TOOLS, {}),
    ([{"role": "user", "content": "open it"},
      {"role": "assistant", "content": None, "tool_calls": _CALLS[1:]},
      {"role": "tool", "tool_call_id": "call_b", "content": "ok"}], _TOOLS, {}),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
      {"role": "user", "content": "q2"}], _TOOLS, {"enable_thinking": False}),
]


def first_mismatch(mirror: Callable[[list[dict], list[dict] | None, dict], str],
                   reference: Callable[[list[dict], list[dict] | None, dict], str],
                   extra_kwargs: dict | None = None) -> str | None:
    """The first probe on which `mirror` and `reference` (both given normalized messages,
    client-order tools and template kwargs) render different text, described; or None."""
    for n, (messages, tools, kwargs) in enumerate(PROBES):
        msgs, tls = normalize_messages(messages), normalize_tools(tools)
        kw = {**(extra_kwargs or {}), **kwargs}
        try:
            ours = mirror(msgs, tls, kw)
            theirs = reference(msgs, tls, kw)
        except Exception as exc:  # a template that refuses a probe is not proven equal
            return f"probe {n} failed to render: {exc}"
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
                       if a != b),
                      min(len(ours), len(theirs)))
            return (f"probe {n} differs at character {at}: mirror {ours[at:at + 40]!r}, "
                    f"template {theirs[at:at + 40]!r}")
    return None


def ignores_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders the same with and without tools."""
    msgs = [{"role": "user", "content": "x"}]
    try:
        return tokenizer.render(msgs, _TOOLS, add_generation_prompt=True) == \
            tokenizer.render(msgs, None, add_generation_prompt=True)
    except Exception:
        return False
