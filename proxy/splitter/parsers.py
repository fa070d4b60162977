"""Incremental parsing of model output into OpenAI content and `tool_calls`.

`OutputParser` is fed decoded text as it streams and returns deltas; `finish` returns the
whole result. Invariants shared by every parser:
- text that might still become part of a tool-call marker is held back, so a partial
  `<tool_call>` (or `[TOOL_CALLS]`, ...) is never emitted as content;
- a tool call is emitted once, whole, when its end is seen (or at `finish`);
- a call whose body is not valid JSON is returned as content, verbatim;
- trailing whitespace is held back until more content follows; whitespace right before a
  tool call, and at the end of a response with tool calls, is dropped;
- `tool_choice="none"` parses no calls: everything is content (or reasoning, below);
- reasoning (a think block, harmony's analysis channel) comes out as `OutputDelta.reasoning`,
  never as content; `ParsedOutput.reasoning` is the reasoning deltas' text joined
  (`reasoning.py` for think blocks);
- a call cut short by `max_tokens` (`flush(truncated=True)`) whose name was written whole is
  returned as a call: *partial* (`ToolCall.partial`) with the arguments' JSON text written
  so far (OpenAI's behaviour; `partial_json.close_json` reads what it says), or whole when
  only its closing markup was cut. Without `truncated` it stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from .types import OutputDelta, ParsedOutput, ToolCall, ToolCallDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_json(value: Any) -> str | None:
    """Arguments (an object or a JSON string of one) as JSON text; None if not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
    if value is None:
        value = {}
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def call_from_object(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
                     ) -> tuple[str, str] | None:
    """`{"name": ..., "arguments": {...}}` → (name, arguments JSON); None if malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw: Any = next((obj[k] for k in args_keys if k in obj), {})
    args = arguments_json(raw)
    return None if args is None else (obj["name"], args)


_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(?:,\s*"(\w+)"\s*:\s*)?')


def cut_call(text: str, args_keys: tuple[str, ...] = ("arguments", "parameters")
             ) -> tuple[str, str, bool] | None:
    """A call object cut short (`{"name": "f", "arguments": {"city": "Par`) → (name,
    arguments, partial): the arguments' JSON text so far, and whether it is unfinished (the
    arguments may be whole and only the object's end missing). Only a name written whole
    counts (a cut name is no function), and only name-first objects, the order every
    family's grammar writes. None if `text` is not such a start."""
    m = _NAME_FIRST.match(text)
    if m is None or (m.group(2) is not None and m.group(2) not in args_keys):
        return None
    try:
        name = json.loads(m.group(1))
    except ValueError:  # a bad escape: no name
        return None
    if not isinstance(name, str) or not name:
        return None
    raw = text[m.end():] if m.group(2) is not None else ""
    try:  # written whole (more keys may follow it)
        value, _ = json.JSONDecoder().raw_decode(raw)
    except (ValueError, RecursionError):
        return name, raw, True
    args = arguments_json(value)
    return None if args is None else (name, args, False)


class OutputParser:
    """Base parser: all text is content. Subclasses override `_scan`."""

    def __init__(self, *, tool_choice: Any = None,
                 id_factory: Callable[[], str] = new_call_id) -> None:
        self.parse_tools = tool_choice != "none"
        self._id_factory = id_factory
        self._buffer = ""
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._pending_ws = ""
        self._calls: list[ToolCall] = []
        self._finished = False
        self._truncated = False  # the output was cut short (max_tokens): see `flush`

    # -- helpers for subclasses --------------------------------------------------------

    def _emit_content(self, text: str, out: list[OutputDelta]) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        text, self._pending_ws = self._pending_ws + body, text[len(body):]
        self._content.append(text)
        out.append(OutputDelta(content=text))

    def _emit_reasoning(self, text: str, out: list[OutputDelta]) -> None:
        if text:
            self._reasoning.append(text)
            out.append(OutputDelta(reasoning=text))

    def _emit_call(self, name: str, arguments: str, out: list[OutputDelta], *,
                   partial: bool = False) -> None:
        self._pending_ws = ""  # whitespace just before a call is formatting, not content
        call = ToolCall(self._id_factory(), name, arguments, partial=partial)
        out.append(OutputDelta(tool_call=ToolCallDelta(len(self._calls), call.id, name,
                                                       arguments, partial=partial)))
        self._calls.append(call)

    def _emit_cut_call(self, text: str, out: list[OutputDelta],
                       args_keys: tuple[str, ...] = ("arguments", "parameters")) -> bool:
        """At the end of an output cut short (`flush(truncated=True)`): `text`, one
        unfinished call object, as a call (`cut_call`). False (nothing emitted) if it is not
        one or the output was not cut short."""
        call = cut_call(text, args_keys) if self._truncated else None
        if call is None:
            return False
        name, args, partial = call
        self._emit_call(name, args, out, partial=partial)
        return True

    def _emit_cut_calls(self, text: str, out: list[OutputDelta], *, separators: str,
                        args_keys: tuple[str, ...] = ("arguments", "parameters")) -> bool:
        """At the end of an output cut short: `text`, a run of call objects (apart by
        `separators`, a list's brackets included) whose last one may be unfinished, as
        calls. False (nothing emitted) if it is not that or the output was not cut short."""
        if not self._truncated:
            return False
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while True:
            while pos < len(text) and text[pos] in separators:
                pos += 1
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                break
            call = call_from_object(obj, args_keys)
            if call is None:
                return False
            calls.append((*call, False))
        if text[pos:].strip(separators + "]"):
            last = cut_call(text[pos:], args_keys)
            if last is None:
                return False
            calls.append(last)
        for name, args, partial in calls:
            self._emit_call(name, args, out, partial=partial)
        return bool(calls)

    def _scan(self, out: list[OutputDelta], final: bool) -> None:
        """Consume `self._buffer` as far as is safe; at `final`, consume all of it."""
        self._emit_content(self._buffer, out)
        self._buffer = ""

    # -- public ------------------------------------------------------------------------

    def feed(self, text: str) -> list[OutputDelta]:
        if self._finished:
            raise RuntimeError("feed after finish")
        out: list[OutputDelta] = []
        self._buffer += text
        if self.parse_tools:
            self._scan(out, final=False)
        else:
            OutputParser._scan(self, out, final=False)
        return out

    def flush(self, *, truncated: bool = False) -> list[OutputDelta]:
        """End of stream: the deltas still held back (call once, then `finish`).
        `truncated`: the output was cut short (max_tokens), so an unfinished call is
        returned as a partial call rather than as content."""
        if self._finished:
            return []
        self._truncated = truncated
        out: list[OutputDelta] = []
        if self.parse_tools:
            self._scan(out, final=True)
        else:
            OutputParser._scan(self, out, final=True)
        if self._pending_ws and not self._calls:
            self._content.append(self._pending_ws)
            out.append(OutputDelta(content=self._pending_ws))
        self._pending_ws = ""
        self._finished = True
        return out

    def finish(self) -> ParsedOutput:
        self.flush()
        content = "".join(self._content)
        return ParsedOutput(content=content or None, tool_calls=tuple(self._calls),
                            reasoning="".join(self._reasoning) or None)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (such a
    suffix starts with the marker's first character: only those places are tried, the
    leftmost first; a token's text seldom has one)."""
    i = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while i >= 0:
        if marker.startswith(text[i:]):
            return len(text) - i
        i = text.find(marker[0], i + 1)
    return 0


class TagParser(OutputParser):
    """Calls wrapped in `open_tag ... close_tag`, each body one JSON object
    (Hermes/Qwen3/ChatML: `<tool_call>{"name", "arguments"}</tool_call>`)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, *, prefix: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._in_call = False
        if prefix and self.parse_tools:  # forced by the prompt: consumed, never emitted
            self.feed(prefix)

    def _parse_body(self, body: str) -> tuple[str, str] | None:
        try:
            return call_from_object(json.loads(body))
        except ValueError:
            return None

    def _call_end(self) -> int:
        """Index of the close tag that ends a valid call body, or -1 (wait for more text).

        The first close tag is not always the end: an argument string may contain it.
        """
        idx = self._buffer.find(self.close_tag)
        while idx >= 0 and self._parse_body(self._buffer[:idx]) is None:
            idx = self._buffer.find(self.close_tag, idx + 1)
        return idx

    def _emit_cut_call(self, text: str, out: list[OutputDelta],
                       args_keys: tuple[str, ...] = ("arguments", "parameters")) -> bool:
        if not self._truncated:
            return False
        body = text[: len(text) - _partial_suffix(text, self.close_tag)]
        call = self._parse_body(body)  # whole but for (part of) its close tag
        if call is not None:
            self._emit_call(*call, out)
            return True
        return super()._emit_cut_call(body, out, args_keys)

    def _close(self, body: str, out: list[OutputDelta], closed: bool) -> None:
        call = self._parse_body(body)
        if call is not None:
            self._emit_call(*call, out)
        else:
            self._emit_content(self.open_tag + body + (self.close_tag if closed else ""), out)

    def _scan(self, out: list[OutputDelta], final: bool) -> None:
        while True:
            if not self._in_call:
                idx = self._buffer.find(self.open_tag)
                if idx < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, self.open_tag)
                    self._emit_content(self._buffer[: len(self._buffer) - keep], out)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                self._emit_content(self._buffer[:idx], out)
                self._buffer = self._buffer[idx + len(self.open_tag):]
                self._in_call = True
            idx = self._call_end()
            if idx < 0:
                if not final:
                    return
                idx = self._buffer.find(self.close_tag)  # no valid call: the first tag ends it
                if idx < 0:
                    if not self._emit_cut_call(self._buffer, out):
                        self._close(self._buffer, out, closed=False)
                    self._buffer, self._in_call = "", False
                    return
            body, self._buffer = self._buffer[:idx], self._buffer[idx + len(self.close_tag):]
            self._in_call = False
            self._close(body, out, closed=True)
