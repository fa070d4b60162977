"""gpt-oss harmony, rendered by `openai-harmony` at the token level.

Request → harmony messages (one function per concept, mirroring gpt-oss's own template where
the two agree, and choosing the history-stable form where they do not):
- system: harmony's default system message (model identity, knowledge cutoff, reasoning
  effort, required channels); `template_kwargs` may set `reasoning_effort`,
  `model_identity` and `conversation_start_date` (never the clock: the prefix must not
  change from one day to the next);
- developer: the leading system/developer texts as `# Instructions` plus the function tools,
  only when there is either (as gpt-oss's template does);
- user → user; a later system/developer message → a developer message;
- assistant without tool calls → `final` channel; with tool calls, its text (if any) is a
  `commentary` preamble, then one message per call: `to=functions.NAME`, `commentary`,
  `<|constrain|>json`, the arguments as JSON (a cut-short text as the client sent it: the
  message is text, so it stays what the model wrote), ending in `<|call|>`. (gpt-oss's Jinja
  template renders such text as `analysis` and drops it once a final answer follows; that
  rewrites history, so no earlier prefix would ever hit again);
- tool → author `functions.NAME` (the name of the call it answers), `to=assistant`.
`reasoning_content` is not rendered, for the same reason (harmony drops old analysis).

Cuts (same kinds and rules as `TextAdapter`): the whole prompt is rendered by the library;
the head (system + developer) is rendered as a conversation of its own and every later
message alone. The cut candidates are the ends of those renders. They are used only if their
concatenation is exactly a prefix of the whole render, followed by the generation prompt;
otherwise the split has no cuts (fail closed). Equal concatenation means each candidate is
an exact token prefix of the prompt, and since a message renders the same whatever follows
it, appending messages never moves a cut.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Adapter
from .normalize import (
    arguments_text,
    leading_system_count,
    newest_start,
    normalize_messages,
)
from .parsers import OutputParser, _partial_suffix, call_from_object
from .partial_json import close_json
from .types import Cut, CutKind, SplitError, SplitResult

FUNCTIONS = "functions."
JSON_TYPE = "<|constrain|>json"
EFFORTS = ("low", "medium", "high")


def _system(h: Any, kwargs: dict) -> Any:
    system = h.SystemContent.new()
    effort = kwargs.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise SplitError(f"reasoning_effort must be one of {', '.join(EFFORTS)}",
                             "chat_template_kwargs.reasoning_effort")
        system = system.with_reasoning_effort(h.ReasoningEffort(effort.capitalize()))
    for key, setter in (("model_identity", system.with_model_identity),
                        ("conversation_start_date", system.with_conversation_start_date)):
        value = kwargs.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise SplitError(f"{key} must be a string", f"chat_template_kwargs.{key}")
            system = setter(value)
    return h.Message.from_role_and_content(h.Role.SYSTEM, system)


def harmony_messages(msgs: list[dict], tools: list[dict] | None, template_kwargs: dict
                     ) -> tuple[list[Any], list[int]]:
    """Normalized request → (harmony messages, counts): `counts[0]` is the number of head
    messages (system, developer), `counts[i]` for i >= 1 the number of messages that request
    message `lead + i - 1` became (`lead` = leading system/developer messages)."""
    import openai_harmony as h

    lead = leading_system_count(msgs)
    out = [_system(h, template_kwargs)]
    instructions = "\n\n".join(m["content"] for m in msgs[:lead] if m["content"])
    if instructions or tools:
        dev = h.DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([h.ToolDescription.new(
                t["function"]["name"], t["function"].get("description") or "",
                parameters=t["function"].get("parameters")) for t in tools])
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, dev))
    counts = [len(out)]
    names: dict[str, str] = {}
    for m in msgs[lead:]:
        before, role = len(out), m["role"]
        if role == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
        elif role in ("system", "developer"):
            out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, m["content"]))
        elif role == "assistant" and not m.get("tool_calls"):
            out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"])
                       .with_channel("final"))
        elif role == "assistant":
            if m["content"]:
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"])
                           .with_channel("commentary"))
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
                out.append(h.Message.from_role_and_content(
                    h.Role.ASSISTANT, arguments_text(c["function"]))
                    .with_channel("commentary")
                    .with_recipient(FUNCTIONS + c["function"]["name"])
                    .with_content_type(JSON_TYPE))
        else:
            name = names.get(m.get("tool_call_id", "")) or m.get("name") or "tool"
            out.append(h.Message.from_author_and_content(
                h.Author.new(h.Role.TOOL, FUNCTIONS + name), m["content"])
                .with_channel("commentary").with_recipient("assistant"))
        counts.append(len(out) - before)
    return out, counts


class HarmonyAdapter(Adapter):
    name = "harmony"

    deviation = ("rendered by openai-harmony: assistant text before tool calls is a "
                 "commentary preamble and no reasoning is rendered, where gpt-oss's Jinja "
                 "template turns such text into analysis and drops it later (rewriting history)")

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self.stop_token_ids = tuple(tokenizer.encoding.stop_tokens_for_assistant_actions())

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        return type(tokenizer).__name__ == "HarmonyTokenizerHandle"

    def render_ids(self, messages: list[dict], tools: list[dict] | None = None, *,
                   template_kwargs: dict | None = None,
                   canonical_tools: bool | None = None) -> list[int]:
        """The whole prompt as openai-harmony renders it (generation prompt included)."""
        import openai_harmony as h

        msgs, tls = normalize_messages(messages), self._tools(tools, canonical_tools)
        hmsgs, _ = harmony_messages(msgs, tls, dict(template_kwargs or {}))
        return self._render_whole(h, hmsgs)

    def _render_whole(self, h: Any, hmsgs: list[Any]) -> list[int]:
        return list(self.tokenizer.encoding.render_conversation_for_completion(
            h.Conversation.from_messages(hmsgs), h.Role.ASSISTANT,
            h.RenderConversationConfig(auto_drop_analysis=False)))

    def split(self, messages: list[dict], tools: list[dict] | None = None, *,
              template_kwargs: dict | None = None, canonical_tools: bool | None = None,
              scope: bytes = b"", messages_head: bytes | None = None) -> SplitResult:
        import openai_harmony as h

        msgs, tls = normalize_messages(messages), self._tools(tools, canonical_tools)
        hmsgs, counts = harmony_messages(msgs, tls, dict(template_kwargs or {}))
        ids = self._render_whole(h, hmsgs)
        enc, head = self.tokenizer.encoding, counts[0]
        parts = [list(enc.render_conversation(h.Conversation.from_messages(hmsgs[:head]),
                                              h.RenderConversationConfig(
                                                  auto_drop_analysis=False)))]
        options = h.RenderOptions(conversation_has_function_tools=bool(tls))
        parts += [list(enc.render(m, options)) for m in hmsgs[head:]]
        ends, total = [], 0
        for part in parts:
            total += len(part)
            ends.append(total)
        concat = [t for part in parts for t in part]
        if len(concat) >= len(ids) or ids[: len(concat)] != concat:
            return SplitResult(self.name, tuple(ids), ())  # cannot verify: no cuts
        # boundary after request message `lead + i - 1` (i >= 1); i = 0 is the head's end
        lead = leading_system_count(msgs)
        boundaries, k = [], 0
        for i, count in enumerate(counts):
            k += count if i else 1
            if count or not i:
                boundaries.append((lead + i, ends[k - 1]))
        return SplitResult(self.name, tuple(ids), _classify(msgs, lead, boundaries))

    def output_parser(self, tools: list[dict] | None, *, tool_choice: Any = None
                      ) -> OutputParser:
        return HarmonyParser(tool_choice=tool_choice if tools else "none",
                             prefix=self.forced_prefix(tool_choice) if tools else None)

    def forced_prefix_ids(self, tool_choice: Any) -> tuple[int, ...]:
        prefix = self.forced_prefix(tool_choice)
        if prefix is None:
            return ()
        if not prefix.endswith("<|message|>"):  # `required`: markup only
            return tuple(self.tokenizer.encode(prefix))
        # named: the text between the markup tokens, with the client's name, as text
        body = prefix[len("<|channel|>"): -len(JSON_TYPE + "<|message|>")]
        enc = self.tokenizer.encoding
        return (*self.tokenizer.encode("<|channel|>"),
                *enc.encode(body, allowed_special=set(), disallowed_special=()),
                *self.tokenizer.encode(JSON_TYPE + "<|message|>"))

    def forced_prefix(self, tool_choice: Any) -> str | None:
        """After `<|start|>assistant`: a commentary header to `functions.` (required) or
        to the named function, so the model writes the call's name or arguments at once."""
        if tool_choice == "required":
            return "<|channel|>commentary to=" + FUNCTIONS
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if isinstance(name, str) and name:
                return f"<|channel|>commentary to={FUNCTIONS}{name} {JSON_TYPE}<|message|>"
        return None


def _classify(msgs: list[dict], lead: int, boundaries: list[tuple[int, int]]
              ) -> tuple[Cut, ...]:
    """(messages consumed, token position) pairs → cuts, by `TextAdapter`'s rules."""
    newest = newest_start(msgs)
    cuts: list[Cut] = []
    for consumed, pos in boundaries:
        if cuts and pos <= cuts[-1].position:
            continue
        if consumed > newest:
            if consumed == len(msgs):
                cuts.append(Cut(CutKind.MESSAGES, pos))
            continue
        kind = (CutKind.INSTRUCTION if consumed == lead else
                CutKind.CONVERSATION if consumed == newest else CutKind.TURN)
        cuts.append(Cut(kind, pos))
    return tuple(cuts)


_MARKERS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")


class HarmonyParser(OutputParser):
    """Harmony output (what follows `<|start|>assistant`), parsed message by message.

    A message is `HEADER<|message|>BODY` ending in `<|end|>`, `<|call|>`, `<|return|>` (or
    the next `<|start|>`, or the end of the output). A header with `to=functions.NAME`
    (before or after `<|channel|>`) is a call, its body the JSON arguments; a `final` or
    `commentary` body without a recipient is content and an `analysis` body reasoning (both
    streamed, holding back what could still be a marker; the bodies of several analysis
    messages joined by a newline); everything else is dropped. A call whose body is not
    a JSON object, any other recipient, and calls under `tool_choice="none"` become
    content: their body, verbatim. Channels are parsed whatever `tool_choice` is: a harmony
    output is never content as a whole.
    """

    def __init__(self, *, tool_choice: Any = None, prefix: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)  # parse_tools stays on: the channels need parsing
        self.calls_allowed = tool_choice != "none"
        self._in_body = False
        self._kind = "drop"  # of the current body: "content", "reasoning", "call" or "drop"
        self._name = ""
        self._body_start = True  # nothing of the current body emitted yet
        if prefix and self.calls_allowed:  # forced by the prompt: consumed, never emitted
            self.feed(prefix)

    def _start_body(self, header: str) -> None:
        header = header.replace("<|start|>", " ")
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        channel_name = channel.group(1) if channel else None
        self._in_body = True
        if recipient is not None:
            target = recipient.group(1)
            is_call = target.startswith(FUNCTIONS) and len(target) > len(FUNCTIONS)
            self._kind = "call" if is_call and self.calls_allowed else "content"
            self._name = target[len(FUNCTIONS):]
        else:
            self._kind = "content" if channel_name in ("final", "commentary") else \
                "reasoning" if channel_name == "analysis" else "drop"
        self._body_start = True

    def _emit_body(self, text: str, out: list) -> None:
        """Text of the current body: reasoning in analysis, else content (a call that does
        not parse included)."""
        if self._kind != "reasoning":
            self._emit_content(text, out)
        elif text:
            if self._body_start and self._reasoning:  # a later analysis message
                text = "\n" + text
            self._body_start = False
            self._emit_reasoning(text, out)

    def _end_body(self, body: str, out: list, *, cut: bool = False) -> None:
        """`cut`: the output ended inside this body (see `OutputParser.flush(truncated=)`)."""
        self._in_body = False
        if self._kind == "call":
            if cut and self._truncated and not body.strip():  # cut before its arguments
                self._emit_call(self._name, "", out, partial=True)
                return
            call = call_from_object({"name": self._name, "arguments": body})
            if call is not None:
                self._emit_call(*call, out)
                return
            if cut and self._truncated:
                # whole but for (part of) its end marker, or its arguments cut short
                body = body[: len(body) - max(_partial_suffix(body, m) for m in _MARKERS)]
                call = call_from_object({"name": self._name, "arguments": body})
                if call is not None:
                    self._emit_call(*call, out)
                    return
                if not body.strip() or isinstance(close_json(body), dict):
                    self._emit_call(self._name, body.strip(), out, partial=True)
                    return
        if self._kind != "drop":
            self._emit_body(body, out)

    def _scan(self, out: list, final: bool) -> None:
        while True:
            buf = self._buffer
            if not self._in_body:
                idx = buf.find("<|message|>")
                if idx < 0:
                    if final:  # output without any harmony header is plain content
                        if "<|" not in buf:
                            self._emit_content(buf, out)
                        self._buffer = ""
                    return
                self._start_body(buf[:idx])
                self._buffer = buf[idx + len("<|message|>"):]
                continue
            hits = [(i, m) for m in _MARKERS if (i := buf.find(m)) >= 0]
            if hits:
                idx, marker = min(hits)
                self._buffer = buf[idx + len(marker):]
                self._end_body(buf[:idx], out)
                continue
            if final:
                self._buffer = ""
                self._end_body(buf, out, cut=True)
                return
            if self._kind in ("content", "reasoning"):  # stream what cannot become a marker
                keep = max(_partial_suffix(buf, m) for m in _MARKERS)
                self._emit_body(buf[: len(buf) - keep], out)
                self._buffer = buf[len(buf) - keep:]
            return
