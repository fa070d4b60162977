"""The Responses API's conversation items: `input` (and a response's `output`) validated
into one canonical item form, and those items as the OpenAI chat messages the splitter
renders.

The canonical form (plain JSON: what a stored response keeps in the ledger) is what makes a
conversation continued with `previous_response_id` render exactly as the same conversation
sent whole: both go through `parse_items`, then `to_messages`:
- `message` items (roles user/system/developer/assistant, text as a string or
  `input_text` / `output_text` / `refusal` parts) become messages; consecutive assistant
  messages and `function_call` items are one assistant turn (content + `tool_calls`);
  `function_call_output` items become tool messages; `custom_tool_call(_output)` items
  become function calls with `{"input": ...}` arguments and their outputs;
- `reasoning` items: their text (the `reasoning_text` parts, or the text this proxy put in
  its own `encrypted_content`) becomes the `reasoning_content` of the assistant turn that
  follows them, which templates that keep reasoning render; other reasoning is dropped;
- call items of hosted tools (web search, file search, computer use, ...) are dropped:
  nothing here can have run them, and their outputs are not text the model can read.
"""

from __future__ import annotations

import base64
import binascii
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from anchorcache.defaults import CONVERSATIONS_PER_SCOPE

from .schema import DEFAULT_LIMITS, BodyLimits, bad, check_arguments, string
from .splitter.memo import ScopedEntries

Item = dict[str, Any]  # one canonical input item (see `parse_items`)

MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
# call items of tools that run on OpenAI's side (or the client's, for hosted tool types
# this proxy does not offer the model): dropped from the prompt
HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "computer_call", "computer_call_output",
    "code_interpreter_call", "image_generation_call", "local_shell_call",
    "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
    "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output",
    "compaction", "compaction_trigger"})
# our `encrypted_content`: the reasoning text itself, marked so that it can be told from
# OpenAI's (which is opaque and dropped)
ENCRYPTED_PREFIX = "anchorcache-reasoning-v1:"


def expect_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad("must be an object", param)
    return value


def _text(content: Any, param: str) -> str:
    """Text content: a string, or a list of text parts joined by newlines (as the splitter
    joins chat text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("content must be a string or a list of text parts", param)
    return "\n".join(_part_text(part, f"{param}[{j}]") for j, part in enumerate(content))


def _part_text(part: Any, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind in ("input_image", "input_file", "input_audio"):
        raise bad(f"{kind} parts are not supported: this model reads text only", f"{param}.type")
    raise bad("each content part must be a text part ({'type': 'input_text', 'text': ...})",
              param)


def _call_id(item: dict[str, Any], param: str, limits: BodyLimits) -> str:
    return string(item.get("call_id"), f"{param}.call_id", max_chars=limits.max_name_chars)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its `reasoning_text` parts, or what this proxy put in its
    `encrypted_content`; "" for reasoning only OpenAI can read (summaries are not it)."""
    content = item.get("content")
    if content is not None:
        if not isinstance(content, list):
            raise bad("reasoning content must be a list of reasoning_text parts",
                      f"{param}.content")
        if content:
            return _text(content, f"{param}.content")
    for field in ("summary", "encrypted_content"):
        if field in item and item[field] is not None \
                and not isinstance(item[field], list if field == "summary" else str):
            raise bad(f"'{field}' has the wrong type", f"{param}.{field}")
    encrypted = item.get("encrypted_content")
    if isinstance(encrypted, str) and encrypted.startswith(ENCRYPTED_PREFIX):
        try:
            return base64.b64decode(encrypted[len(ENCRYPTED_PREFIX):], validate=True
                                    ).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise bad("encrypted_content is not this proxy's", f"{param}.encrypted_content") \
                from None
    return ""


def encrypt_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode("utf-8")).decode("ascii")


def parse_item(item: Any, param: str, limits: BodyLimits) -> Item | None:
    """One input item in canonical form; None for an item dropped from the prompt."""
    item = expect_object(item, param)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad(f"role must be one of {sorted(MESSAGE_ROLES)}, not {role!r}",
                      f"{param}.role")
        return {"type": "message", "role": role,
                "content": _text(item.get("content"), f"{param}.content")}
    if kind in ("function_call", "custom_tool_call"):
        name = string(item.get("name"), f"{param}.name", max_chars=limits.max_name_chars)
        call = {"type": "function_call", "call_id": _call_id(item, param, limits), "name": name}
        if kind == "custom_tool_call":
            value = item.get("input")
            if not isinstance(value, str):
                raise bad("a custom_tool_call needs a string 'input'", f"{param}.input")
            return {**call, "arguments": orjson.dumps({"input": value}).decode()}
        arguments = item.get("arguments", "")
        if not isinstance(arguments, str):
            raise bad("'arguments' must be a JSON string", f"{param}.arguments")
        check_arguments(arguments, f"{param}.arguments", limits)
        namespace = item.get("namespace")
        if namespace is not None:
            string(namespace, f"{param}.namespace", max_chars=limits.max_name_chars)
        return {**call, "arguments": arguments}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"type": "function_call_output", "call_id": _call_id(item, param, limits),
                "output": _text(item.get("output"), f"{param}.output")}
    if kind == "reasoning":  # (the canonical form reads back as itself)
        text = _reasoning_text(item, param)
        return {"type": "reasoning",
                "content": [{"type": "reasoning_text", "text": text}] if text else []}
    if kind in HOSTED_ITEMS:
        return None
    if kind == "item_reference":
        raise bad("item references are not supported; send the items themselves, or "
                  "previous_response_id", f"{param}.type")
    raise bad(f"unsupported input item type {kind!r}", f"{param}.type")


def parse_items(value: Any, param: str = "input", limits: BodyLimits = DEFAULT_LIMITS
                ) -> tuple[Item, ...]:
    """`input` (or a response's `output`) as canonical items: a string is one user message;
    items dropped from the prompt (hosted tools' calls) are left out. Canonical items parse
    as themselves (a stored conversation is read back through here)."""
    if isinstance(value, str):
        return ({"type": "message", "role": "user", "content": value},)
    if not isinstance(value, list):
        raise bad("'input' must be a string or a list of items", param)
    if len(value) > limits.max_messages:
        raise bad(f"at most {limits.max_messages} input items are supported", param)
    return tuple(i for i in (parse_item(v, f"{param}[{n}]", limits) for n, v in enumerate(value))
                 if i is not None)


class _Conversion:
    """Items into chat messages, in order: the state `to_messages` carries from item to item
    (the assistant turn being built, reasoning for the next one, the calls' names so far),
    so that a caller's next request converts only its new items (`MessagesMemo`)."""

    def __init__(self, messages: list[dict[str, Any]], names: dict[str, str],
                 reasoning: str = "") -> None:
        self.messages = messages
        self.names = names  # call id → the function's name, of the calls so far
        self.turn: dict[str, Any] | None = None  # the assistant turn being built
        self.reasoning = reasoning

    @classmethod
    def fresh(cls, instructions: str | None) -> _Conversion:
        """A conversion from the start: the instructions a leading system message."""
        return cls([{"role": "system", "content": instructions}] if instructions else [], {})

    def _assistant(self) -> dict[str, Any]:
        if self.turn is None:
            self.turn = {"role": "assistant", "content": None}
            if self.reasoning:
                self.turn["reasoning_content"] = self.reasoning
            self.messages.append(self.turn)
            self.reasoning = ""
        return self.turn

    def add(self, items: Iterable[Item]) -> None:
        for item in items:
            kind = item["type"]
            if kind == "message" and item["role"] == "assistant":
                if self.turn is not None and "tool_calls" in self.turn:
                    self.turn = None  # text after calls: the next turn
                t = self._assistant()
                t["content"] = item["content"] if t["content"] is None \
                    else t["content"] + item["content"]
            elif kind == "function_call":
                self.names[item["call_id"]] = item["name"]
                self._assistant().setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
            elif kind == "reasoning":
                self.turn = None  # reasoning opens the next assistant turn
                self.reasoning = "".join(part["text"] for part in item["content"])
            else:
                self.turn, self.reasoning = None, ""
                if kind == "message":
                    self.messages.append({"role": item["role"], "content": item["content"]})
                else:
                    tool = {"role": "tool", "tool_call_id": item["call_id"],
                            "content": item["output"]}
                    if item["call_id"] in self.names:
                        tool["name"] = self.names[item["call_id"]]
                    self.messages.append(tool)

    def result(self) -> list[dict[str, Any]]:
        if not any(m["role"] != "system" for m in self.messages):
            raise bad("'input' must hold at least one message", "input")
        return self.messages


def to_messages(items: tuple[Item, ...], instructions: str | None = None
                ) -> list[dict[str, Any]]:
    """Canonical items as OpenAI chat messages (see the module's docstring); a tool result
    is named by the call before it with its id."""
    conv = _Conversion.fresh(instructions)
    conv.add(items)
    return conv.result()


@dataclass(frozen=True, eq=False)
class _Kept:
    """A request's items, their messages and the conversion's state after them (no turn
    open: none of these messages changes again), kept for the caller's next request."""

    instructions: str | None
    items: tuple[Item, ...]
    messages: tuple[dict[str, Any], ...]
    head: bytes  # orjson's bytes of `messages` less the closing bracket
    names: dict[str, str]  # never changed: a resumed conversion copies it
    reasoning: str

    @property
    def size(self) -> int:
        return 3 * len(self.head) + 64 * len(self.items) + 512


class MessagesMemo:
    """What spares an agent that resends its whole conversation each turn (Codex, `store:
    false`) the conversion of every item, every request: per caller scope, the last
    requests' items and messages (`CONVERSATIONS_PER_SCOPE`, `max_bytes` in all). A request
    whose items start with a kept request's very items (the items the message memo gave
    back for the bytes it had seen: the same objects, compared by identity) and with the
    same instructions converts only the items after them, and its messages' JSON (the
    splitter's key for its own memos, `Generation.messages_head`) is the kept bytes and the
    new messages'. Equal to `to_messages` and orjson's bytes of its messages, by
    construction: the conversion is a left fold resumed from its own state. Used on the
    event loop only."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self._kept: ScopedEntries[_Kept] = ScopedEntries(max_bytes, CONVERSATIONS_PER_SCOPE)
        self.hits = 0

    @property
    def size_bytes(self) -> int:
        return self._kept.size_bytes

    def convert(self, scope: bytes, items: tuple[Item, ...], instructions: str | None
                ) -> tuple[list[dict[str, Any]], bytes]:
        """`to_messages(items, instructions)` and orjson's bytes of them less the bracket."""
        kept = self._find(scope, items, instructions)
        if kept is None:
            conv = _Conversion.fresh(instructions)
            conv.add(items)
            messages = conv.result()
            head = orjson.dumps(messages)[:-1]
        else:
            self.hits += 1
            conv = _Conversion(list(kept.messages), dict(kept.names), kept.reasoning)
            conv.add(items[len(kept.items):])
            messages = conv.result()
            new = messages[len(kept.messages):]
            head = kept.head + (b"," if kept.messages and new else b"") \
                + orjson.dumps(new)[1:-1]
        if conv.turn is None:  # (in place of the one it resumed from: its conversation's last)
            self._kept.put(scope, _Kept(instructions, items, tuple(messages), head, conv.names,
                                        conv.reasoning), () if kept is None else (kept,))
        return messages, head

    def _find(self, scope: bytes, items: tuple[Item, ...], instructions: str | None
              ) -> _Kept | None:
        best = None
        for kept in self._kept.of(scope):
            n = len(kept.items)
            if (best is None or n > len(best.items)) and 0 < n <= len(items) \
                    and items[n - 1] is kept.items[-1] and kept.instructions == instructions \
                    and all(map(operator.is_, kept.items, items)):
                best = kept
        if best is not None:
            self._kept.touch(scope)
        return best
