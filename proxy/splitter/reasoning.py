"""Reasoning output: a think block at the start of the output, kept apart from the answer.

Qwen3's output is `<think>\\n…\\n</think>\\n\\n` and then the answer (text, tool calls). Its
template decides where the output starts (`think_state`, read from the generation prompt):
- no think tag in the generation prompt (Qwen3 with thinking on): the model may open a
  block itself;
- the prompt opens one (`<think>\\n`, as Qwen3-Thinking/Qwen3.5 templates do): the output
  starts inside it and only `</think>` appears;
- the prompt holds a closed, empty block (`enable_thinking: false`): the output has no
  reasoning and is parsed as it is.

`ThinkParser` splits the block off and hands the rest to the adapter's own parser; harmony's
analysis channel is reasoning in `HarmonyParser` itself. `response_parser` builds the right
parser for one response. `effort_template_kwargs` turns OpenAI's `reasoning_effort` into the
template's own switch.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

from .harmony import EFFORTS as HARMONY_EFFORTS
from .parsers import OutputParser, _partial_suffix
from .types import OutputDelta, ParsedOutput

THINK_TAGS = ("<think>", "</think>")
# OpenAI's `reasoning_effort` values
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


class ThinkState(Enum):
    """Where a generation prompt leaves the think block."""

    NONE = "none"  # no tag: the model may open a block
    OPEN = "open"  # the prompt opened it: the output starts inside
    CLOSED = "closed"  # the prompt closed it (thinking off): no reasoning follows


def think_state(generation_prompt: str, tags: tuple[str, str] = THINK_TAGS) -> ThinkState:
    """The state the generation prompt's text (from the assistant header on) leaves."""
    opened, closed = generation_prompt.rfind(tags[0]), generation_prompt.rfind(tags[1])
    if opened < 0 and closed < 0:
        return ThinkState.NONE
    return ThinkState.OPEN if opened > closed else ThinkState.CLOSED


class ThinkParser(OutputParser):
    """A think block at the start of the output as reasoning, the rest parsed by `inner`.

    `opened`: the prompt opened the block (the output starts inside it). The block's text
    is reasoning without the newlines at either end, and the newlines right after the close
    tag are dropped: the template writes those (`<think>\\n` + reasoning.strip("\\n") +
    `\\n</think>\\n\\n` + content.lstrip("\\n")), so a reply sent back renders as it was
    generated. Tool calls after the block parse as `inner` parses them. A think tag later in
    the output is `inner`'s text, as the template renders it.

    Streaming: reasoning is emitted as it comes; only a possible start of the close tag and
    trailing newlines are held back (a constant amount of text per token), so no part of a
    tag ever reaches reasoning or content. Cut short inside the block (max_tokens), the
    whole output is reasoning; a close tag cut in part is dropped.
    """

    def __init__(self, inner: OutputParser, *, opened: bool = False,
                 tags: tuple[str, str] = THINK_TAGS) -> None:
        super().__init__()
        self.inner = inner
        self.open_tag, self.close_tag = tags
        self._state = "think" if opened else "start"  # start | think | after | body
        self._block_start = True  # newlines here open the block: dropped

    def _scan(self, out: list[OutputDelta], final: bool) -> None:
        while True:
            buf = self._buffer
            if self._state == "start":
                head = buf.lstrip()
                if head.startswith(self.open_tag):
                    self._buffer, self._state = head[len(self.open_tag):], "think"
                    continue
                if not final and self.open_tag.startswith(head):  # may still be the tag
                    return
                self._state = "body"
            elif self._state == "think":
                if self._block_start:
                    buf = self._buffer = buf.lstrip("\n")
                    if not buf:
                        return
                    self._block_start = False
                idx = buf.find(self.close_tag)
                if idx >= 0:
                    self._emit_reasoning(buf[:idx].rstrip("\n"), out)
                    self._buffer, self._state = buf[idx + len(self.close_tag):], "after"
                    continue
                safe = buf[: len(buf) - _partial_suffix(buf, self.close_tag)]
                text = safe.rstrip("\n")
                self._emit_reasoning(text, out)
                self._buffer = "" if final else buf[len(text):]
                return
            elif self._state == "after":
                buf = self._buffer = buf.lstrip("\n")
                if not buf:
                    return
                self._state = "body"
            else:
                self._buffer = ""
                if buf:
                    out.extend(self.inner.feed(buf))
                return

    def feed(self, text: str) -> list[OutputDelta]:
        if self._finished:
            raise RuntimeError("feed after finish")
        if self._state == "body":  # past the block: `inner`'s text, as `_scan` hands it on
            return self.inner.feed(text) if text else []
        out: list[OutputDelta] = []
        self._buffer += text
        self._scan(out, final=False)
        return out

    def flush(self, *, truncated: bool = False) -> list[OutputDelta]:
        if self._finished:
            return []
        out: list[OutputDelta] = []
        self._scan(out, final=True)
        out += self.inner.flush(truncated=truncated)
        self._finished = True
        return out

    def finish(self) -> ParsedOutput:
        self.flush()
        parsed = self.inner.finish()
        return ParsedOutput(parsed.content, parsed.tool_calls,
                            "".join(self._reasoning) or None)


def response_parser(adapter: Any, tools: list[dict] | None, *, tool_choice: Any = None,
                    prompt_ids: Sequence[int] = ()) -> OutputParser:
    """The parser for one response to `prompt_ids` (the prompt as the worker gets it):
    `adapter.output_parser`, behind a `ThinkParser` where the adapter's template has think
    blocks (`adapter.think_tags`) and the prompt leaves room for one. A forced tool-call
    prefix starts the output with the call: no block comes before it."""
    parser = adapter.output_parser(tools, tool_choice=tool_choice)
    tags = getattr(adapter, "think_tags", None)
    if tags is None or (tools and adapter.forced_prefix(tool_choice) is not None):
        return parser
    state = think_state(adapter.generation_prompt(prompt_ids), tags)
    if state is ThinkState.CLOSED:
        return parser
    return ThinkParser(parser, opened=state is ThinkState.OPEN, tags=tags)


def effort_template_kwargs(adapter: Any, effort: str) -> dict[str, Any]:
    """OpenAI's `reasoning_effort` as the template's own kwargs (an explicit
    `chat_template_kwargs` entry wins over them). harmony: gpt-oss's effort, "none" and
    "minimal" as "low" (it always reasons); templates with an `enable_thinking` switch
    (Qwen3): "none" and "minimal" turn thinking off, the others leave it on (Qwen3 has no
    effort levels); other templates: nothing."""
    if adapter.name == "harmony":
        return {"reasoning_effort": effort if effort in HARMONY_EFFORTS else "low"}
    template = getattr(adapter.tokenizer, "chat_template", None) or ""
    if effort in ("none", "minimal") and "enable_thinking" in template:
        return {"enable_thinking": False}
    return {}
