"""Anthropic `messages` (and `system`) as the splitter's chat: OpenAI-style messages, and
the message boundaries the client's `cache_control` marks ask anchors for.

The mapping (consecutive messages of one role are one turn, as in Anthropic's API):
- `system` (a string or text blocks) becomes one leading system message;
- a `role: "system"` message inside `messages` (a string or text blocks) becomes a system
  message in its place, which the template renders where it stands (Qwen3, ChatML, Llama 3:
  a system turn; harmony: a developer message); a template that refuses one there gets the
  conversation from `fold_system_messages` instead (the API layer retries with it);
- a user message's text blocks become a user message, each `tool_result` block a tool
  message (`tool_call_id` = its `tool_use_id`, `name` = the matching tool's name), in the
  order of the blocks;
- an assistant message's text blocks become its content, its `tool_use` blocks its
  `tool_calls` (`arguments` = the `input` object), its `thinking` blocks its
  `reasoning_content` (the template decides whether to render it; `redacted_thinking` has
  no text and renders nothing).

Like Anthropic's API, every `tool_use` must be answered by a `tool_result` in the next
message and every `tool_result` must answer a `tool_use` of the message before it.

`cache_control: {"type": "ephemeral"}` marks an anchor hint: the end of the rendered message
holding the marked block (for `system` and `tools`: the end of the system part) becomes a
cut, verified by the splitter like every cut. A block inside a message that the template
merges with its neighbours (say, one of several tool results) hints at a boundary the
splitter cannot verify, and no cut is made there. The mark's `ttl` (`5m` when it has none)
is how long the anchor there is kept at least (`leases.py`); a boundary marked twice keeps
the longer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson

from .leases import CACHE_TTL_S, DEFAULT_CACHE_TTL
from .pipeline import Generation
from .schema import BodyLimits, bad, string

MAX_CACHE_BREAKPOINTS = 4  # what Anthropic's API accepts per request
CLEAR_AT = frozenset({"never", "next_user_message"})  # a system message's `clear_at`


def as_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad("must be an object", param)
    return value


def _cache_control(block: dict[str, Any], param: str) -> float | None:
    """The TTL in seconds of `block`'s (valid) cache_control marker; None without one."""
    cc = block.get("cache_control")
    if cc is None:
        return None
    at = f"{param}.cache_control" if param else "cache_control"
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise bad("cache_control must be {'type': 'ephemeral'}", at)
    ttl = cc.get("ttl", DEFAULT_CACHE_TTL)
    if ttl not in CACHE_TTL_S:
        raise bad(f"cache_control.ttl must be one of {sorted(CACHE_TTL_S)}", f"{at}.ttl")
    if set(cc) - {"type", "ttl"}:
        raise bad(f"unknown cache_control fields {sorted(set(cc) - {'type', 'ttl'})}", at)
    return CACHE_TTL_S[ttl]


def longest(a: float | None, b: float | None) -> float | None:
    """The longer of two marks' TTLs (None: no mark)."""
    return b if a is None else a if b is None else max(a, b)


def _blocks(content: Any, param: str, *, allow_string: bool = True) -> list[dict[str, Any]]:
    """Content as a list of block objects (a string is one text block)."""
    if isinstance(content, str) and allow_string:
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad("content must be a string or a list of content blocks", param)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad("each content block must be an object with a 'type'", f"{param}.{j}")
    return content


def _join(texts: list[str]) -> str:
    """Text blocks of one message as one string, joined as the splitter joins text parts."""
    return "\n".join(texts)


def _string_field(block: dict[str, Any], name: str, param: str, *,
                  required: bool = True) -> str:
    value = block.get(name)
    if not isinstance(value, str) and (required or value is not None):
        raise bad(f"a {block['type']} block needs a string {name!r}", f"{param}.{name}")
    return value or ""


@dataclass(frozen=True)
class Resume:
    """A conversion's state before a turn (`Conversion.state`): what a later request whose
    messages start with the same ones, tools and system alike, resumes from
    (`Conversion.resume`). Shared between requests: never changed."""

    messages: tuple[dict[str, Any], ...]
    hints: tuple[tuple[int, float], ...]
    breakpoints: int
    seen_ids: frozenset[str]
    pending: tuple[tuple[str, str], ...]
    role: str  # the role of the turn before it: a resumed turn must not continue it
    head: bytes  # orjson's bytes of `messages` less the closing bracket


class Conversion:
    """Walks the messages once, building OpenAI-style messages and the hinted cuts."""

    def __init__(self, limits: BodyLimits) -> None:
        self.limits = limits
        self.messages: list[dict[str, Any]] = []
        self.hints: dict[int, float] = {}  # k → the TTL of a mark at the end of message k
        self.breakpoints = 0
        self.seen_ids: set[str] = set()
        self.pending: dict[str, str] = {}  # tool_use id → tool name, awaiting a tool_result
        self.tools_hinted: float | None = None  # the TTL of a mark on a tool
        self._known = (0, b"[")  # (k, orjson's bytes of the first k messages less "]")

    def head(self) -> bytes:
        """orjson's bytes of the messages so far less the closing bracket (the splitter's
        key for them, `Generation.messages_head`): those known, and the newer ones dumped.
        (A message is never changed once appended: the bytes stay its own.)"""
        count, known = self._known
        new = self.messages[count:]
        if new:
            known += (b"," if count else b"") + orjson.dumps(new)[1:-1]
            self._known = (len(self.messages), known)
        return known

    def state(self, role: str) -> Resume:
        """What the conversion holds now, between a turn of `role` and the next."""
        return Resume(tuple(self.messages), tuple(self.hints.items()), self.breakpoints,
                      frozenset(self.seen_ids), tuple(self.pending.items()), role, self.head())

    def resume(self, state: Resume) -> None:
        """Continue from `state` (the system part and the turns before it converted)."""
        self.messages = list(state.messages)
        self._known = (len(state.messages), state.head)
        self.hints = dict(state.hints)
        self.breakpoints = state.breakpoints
        self.seen_ids = set(state.seen_ids)
        self.pending = dict(state.pending)

    def mark(self, block: dict[str, Any], param: str) -> float | None:
        """The TTL of `block`'s mark (None: unmarked), counted against the breakpoints."""
        ttl = _cache_control(block, param)
        if ttl is None:
            return None
        self.breakpoints += 1
        if self.breakpoints > MAX_CACHE_BREAKPOINTS:
            raise bad(f"at most {MAX_CACHE_BREAKPOINTS} blocks may carry cache_control",
                       param or "cache_control")
        return ttl

    def hint(self, k: int, ttl: float | None) -> None:
        """A mark (of `ttl`; None: none) at the end of the first `k` messages."""
        if ttl is not None:
            self.hints[k] = max(ttl, self.hints.get(k, 0.0))

    def system(self, system: Any) -> None:
        """The system part; a marked tool or system block hints at its end (the tools render
        there or before it). Without system text there is no message to end: a marked tool
        hints after 0 messages, the instruction prefix (the splitter's instruction cut
        covers the tools on its own)."""
        hinted: float | None = None
        parts: list[str] = []
        if isinstance(system, str):
            parts = [system] if system else []
        elif system is not None:
            blocks = _blocks(system, "system", allow_string=False)
            parts, hinted = self._system_texts([(b, f"system.{j}") for j, b in enumerate(blocks)])
        if not parts:
            self.hint(0, self.tools_hinted)
            return
        self._append({"role": "system", "content": _join(parts)},
                     longest(hinted, self.tools_hinted))

    def _system_texts(self, blocks: list[tuple[dict[str, Any], str]]
                      ) -> tuple[list[str], float | None]:
        """The texts of system blocks, and the longest TTL of their marks."""
        parts: list[str] = []
        hinted: float | None = None
        for block, p in blocks:
            if block["type"] != "text":
                raise bad(f"system blocks must be text blocks, not {block['type']!r}", p)
            parts.append(_string_field(block, "text", p))
            hinted = longest(hinted, self.mark(block, p))
        return parts, hinted

    def _append(self, message: dict[str, Any], hinted: float | None) -> None:
        self.messages.append(message)
        self.hint(len(self.messages), hinted)

    def turn(self, role: str, blocks: list[tuple[dict[str, Any], str]]) -> None:
        """One turn: the blocks of consecutive messages of one role, with their params. A
        system message may stand between a tool_use and its tool_result."""
        if self.pending and role == "assistant":
            raise bad(self.unanswered(), blocks[0][1].rsplit(".content", 1)[0])
        if role == "user":
            self._user(blocks)
        elif role == "system":
            parts, hinted = self._system_texts(blocks)
            self._append({"role": "system", "content": _join(parts)}, hinted)
        else:
            self._assistant(blocks)

    def unanswered(self) -> str:
        return ("tool_use ids were found without tool_result blocks immediately after: "
                + ", ".join(sorted(self.pending)))

    def _user(self, blocks: list[tuple[dict[str, Any], str]]) -> None:
        expected, self.pending = self.pending, {}
        answered: set[str] = set()
        texts: list[str] = []
        hint_text: float | None = None

        def flush_text() -> None:
            nonlocal texts, hint_text
            if texts:
                self._append({"role": "user", "content": _join(texts)}, hint_text)
            texts, hint_text = [], None

        for block, p in blocks:
            kind = block["type"]
            if kind == "text":
                texts.append(_string_field(block, "text", p))
                hint_text = longest(hint_text, self.mark(block, p))
            elif kind == "tool_result":
                flush_text()
                use_id = string(block.get("tool_use_id"), f"{p}.tool_use_id",
                                max_chars=self.limits.max_name_chars)
                if use_id not in expected:
                    raise bad(f"tool_result block with tool_use_id {use_id!r} has no matching "
                               "tool_use block in the previous message", f"{p}.tool_use_id")
                if use_id in answered:
                    raise bad(f"more than one tool_result for tool_use_id {use_id!r}",
                               f"{p}.tool_use_id")
                answered.add(use_id)
                is_error = block.get("is_error")
                if is_error is not None and not isinstance(is_error, bool):
                    raise bad("'is_error' must be a boolean", f"{p}.is_error")
                hinted = self.mark(block, p)
                parts, inner_hinted = self._result_parts(block, p)
                self._append({"role": "tool", "tool_call_id": use_id, "name": expected[use_id],
                              "content": _join(parts)}, longest(hinted, inner_hinted))
            elif kind == "tool_use":
                raise bad("tool_use blocks belong in assistant messages", f"{p}.type")
            else:
                raise bad(f"unsupported content block type {kind!r} in a user message "
                           "(supported: 'text', 'tool_result')", f"{p}.type")
        flush_text()
        if set(expected) - answered:
            self.pending = {k: v for k, v in expected.items() if k not in answered}
            raise bad(self.unanswered(), blocks[0][1].rsplit(".content", 1)[0])

    def _result_parts(self, block: dict[str, Any], param: str
                      ) -> tuple[list[str], float | None]:
        """A tool_result's content as texts, and the longest TTL of its inner blocks' marks."""
        content = block.get("content", "")
        if isinstance(content, str):
            return [content], None
        parts: list[str] = []
        hinted: float | None = None
        for k, inner in enumerate(_blocks(content, f"{param}.content", allow_string=False)):
            p = f"{param}.content.{k}"
            if inner["type"] != "text":
                raise bad(f"unsupported tool_result content block type {inner['type']!r} "
                           "(supported: 'text')", f"{p}.type")
            parts.append(_string_field(inner, "text", p))
            hinted = longest(hinted, self.mark(inner, p))
        return parts, hinted

    def _assistant(self, blocks: list[tuple[dict[str, Any], str]]) -> None:
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        hinted: float | None = None
        for block, p in blocks:
            kind = block["type"]
            if kind == "text":
                texts.append(_string_field(block, "text", p))
            elif kind == "thinking":
                thoughts.append(_string_field(block, "thinking", p))
                _string_field(block, "signature", p, required=False)
            elif kind == "redacted_thinking":
                _string_field(block, "data", p, required=False)
            elif kind == "tool_use":
                use_id = string(block.get("id"), f"{p}.id", max_chars=self.limits.max_name_chars)
                name = string(block.get("name"), f"{p}.name",
                              max_chars=self.limits.max_name_chars)
                args = block.get("input")
                if use_id in self.seen_ids:
                    raise bad(f"tool_use ids must be unique; {use_id!r} repeats", f"{p}.id")
                if not isinstance(args, dict):
                    raise bad("a tool_use block needs an object 'input'", f"{p}.input")
                self.seen_ids.add(use_id)
                self.pending[use_id] = name
                calls.append({"id": use_id, "type": "function",
                              "function": {"name": name, "arguments": args}})
            elif kind == "tool_result":
                raise bad("tool_result blocks belong in user messages", f"{p}.type")
            else:
                raise bad(f"unsupported content block type {kind!r} in an assistant message "
                           "(supported: 'text', 'tool_use', 'thinking', 'redacted_thinking')",
                          f"{p}.type")
            hinted = longest(hinted, self.mark(block, p))
        out: dict[str, Any] = {"role": "assistant", "content": _join(texts) if texts else None}
        if thoughts:
            out["reasoning_content"] = _join(thoughts)
        if calls:
            out["tool_calls"] = calls
        self._append(out, hinted)


Turn = tuple[str, list[tuple[dict[str, Any], str]], int]  # role, (block, param)s, first message


def message_turns(messages: Any, limits: BodyLimits, start: int = 0, *,
                  base: int = 0) -> list[Turn]:
    """Messages (from `start`) as turns: consecutive messages of one role are one turn (as
    in Anthropic's API), each block paired with its param (`messages.3.content.1`), and
    the index of the turn's first message. `base`: the index of `messages[0]` in the
    request's messages (the ones before it read before: `MessageMemo.read`)."""
    if not isinstance(messages, list) or not base + len(messages):
        raise bad("'messages' must be a non-empty list", "messages")
    if base + len(messages) > limits.max_messages:
        raise bad(f"at most {limits.max_messages} messages are supported", "messages")
    turns: list[Turn] = []
    end = base + len(messages)
    last_user = max((i for i in range(start, end)
                     if isinstance(m := messages[i - base], dict) and m.get("role") == "user"),
                    default=-1)
    for i in range(start, end):
        msg, param = messages[i - base], f"messages.{i}"
        msg = as_object(msg, param)
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad(f"role must be 'user', 'assistant' or 'system', not {role!r}",
                      f"{param}.role")
        content = msg.get("content")
        if role == "system" and not _shown(msg, param, later_user=last_user > i):
            continue
        if content is None or content == "" or content == []:
            if role == "system":  # only an output_config (per-turn effort): nothing to render
                continue
            raise bad("every message needs non-empty content", f"{param}.content")
        blocks = [(b, f"{param}.content.{j}")
                  for j, b in enumerate(_blocks(content, f"{param}.content"))]
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks, i))
    if not turns and not start:
        raise bad("'messages' has no message to render", "messages")
    return turns


def _shown(msg: dict[str, Any], param: str, *, later_user: bool) -> bool:
    """Whether a system message renders: `clear_at: "next_user_message"` shows it only
    until a user message follows it. Checks its `output_config` (per-turn settings that
    have no meaning here)."""
    config = msg.get("output_config")
    if config is not None:
        as_object(config, f"{param}.output_config")
    clear_at = msg.get("clear_at")
    if clear_at is not None and clear_at not in CLEAR_AT:
        raise bad(f"clear_at must be one of {sorted(CLEAR_AT)}", f"{param}.clear_at")
    return not (clear_at == "next_user_message" and later_user)


def fold_system_messages(gen: Generation) -> Generation | None:
    """`gen` for a template that refuses a system message after the first message (Mistral's
    format, some Hugging Face templates); None if `gen` has none. Each such message joins
    the first user message after it and before the next assistant message, as its first
    text block (joined as text blocks are); where that turn has none (only tool results, or
    no turn follows), it becomes a user message at the end of the turn. Hints move to the
    end of the last folded message the first `k` messages still hold whole."""
    msgs = gen.messages
    if not any(m["role"] == "system" for m in msgs[1:]):
        return None
    out: list[dict[str, Any]] = []
    last_source: list[int] = []  # per folded message: the last message of `gen` it holds
    held: list[str] = []  # system texts waiting for a user message
    for i, m in enumerate(msgs):
        if m["role"] == "system" and i > 0:
            held.append(m["content"])
            continue
        if held and m["role"] == "assistant":
            out.append({"role": "user", "content": _join(held)})
            last_source.append(i - 1)
            held = []
        if held and m["role"] == "user":
            m = {**m, "content": _join([*held, m["content"]])}
            held = []
        out.append(m)
        last_source.append(i)
    if held:
        out.append({"role": "user", "content": _join(held)})
        last_source.append(len(msgs) - 1)
    def moved(k: int) -> int:  # the folded messages the first `k` messages still hold whole
        return sum(1 for s in last_source if s < k)

    hints = {moved(k) for k in gen.cut_after}
    ttls: dict[int, float] = {}
    for k, ttl in gen.cut_ttl_s.items():
        if moved(k) in hints:
            ttls[moved(k)] = max(ttl, ttls.get(moved(k), 0.0))
    return replace(gen, messages=tuple(out), messages_head=None, cut_after=tuple(sorted(hints)),
                   cut_ttl_s=ttls)
