"""gpt-oss harmony, rendered by `openai-harmony` at the token level.

Messages: a default system message, a developer message holding the leading
system/developer text as instructions plus the function tools (the instruction part), then
user, assistant (tool calls on the `commentary` channel to `functions.NAME`, JSON), and tool
results from `functions.NAME`. Each message is rendered on its own; the cuts are the message
ends, kept only if the concatenation equals the library's whole-conversation render
(otherwise no cuts: fail closed).

Needs the o200k encoding file (`TIKTOKEN_ENCODINGS_BASE`); without it the tokenizer fails
to load and this adapter is never chosen.
"""

from __future__ import annotations

import json
from typing import Any

from .base import Adapter
from .normalize import canonical_tools, leading_system_count, newest_start, normalize_messages
from .parsers import OutputParser, call_from_object
from .types import Cut, CutKind, SplitResult


class HarmonyAdapter(Adapter):
    name = "harmony"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.stop_token_ids = tuple(tokenizer.encoding.stop_tokens_for_assistant_actions())

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        return type(tokenizer).__name__ == "HarmonyTokenizerHandle"

    def _messages(self, msgs: list[dict], tools: list[dict] | None) -> tuple[list, int]:
        import openai_harmony as h

        lead = leading_system_count(msgs)
        dev = h.DeveloperContent.new()
        instructions = "\n\n".join(m["content"] for m in msgs[:lead] if m["content"])
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([h.ToolDescription.new(
                t["function"]["name"], t["function"].get("description", ""),
                parameters=t["function"].get("parameters")) for t in tools])
        out = [h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new()),
               h.Message.from_role_and_content(h.Role.DEVELOPER, dev)]
        names: dict[str, str] = {}
        for m in msgs[lead:]:
            role = m["role"]
            if role in ("user", "system", "developer"):
                out.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
            elif role == "assistant":
                if m["content"]:
                    out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"])
                               .with_channel("final"))
                for c in m.get("tool_calls") or []:
                    names[c["id"]] = c["function"]["name"]
                    out.append(h.Message.from_role_and_content(
                        h.Role.ASSISTANT, json.dumps(c["function"]["arguments"],
                                                     ensure_ascii=False))
                        .with_channel("commentary")
                        .with_recipient("functions." + c["function"]["name"])
                        .with_content_type("<|constrain|>json"))
            else:
                name = names.get(m.get("tool_call_id", ""), m.get("name", "tool"))
                out.append(h.Message.from_author_and_content(
                    h.Author.new(h.Role.TOOL, "functions." + name), m["content"])
                    .with_channel("commentary").with_recipient("assistant"))
        return out, lead

    def split(self, messages: list[dict], tools: list[dict] | None = None, *,
              template_kwargs: dict | None = None) -> SplitResult:
        import openai_harmony as h

        msgs, tls = normalize_messages(messages), canonical_tools(tools)
        hmsgs, lead = self._messages(msgs, tls)
        enc = self.tokenizer.encoding
        ids = list(enc.render_conversation_for_completion(
            h.Conversation.from_messages(hmsgs), h.Role.ASSISTANT))
        # message ends, in harmony-message units; map request messages to them
        ends, total = [], 0
        for m in hmsgs:
            total += len(enc.render(m))
            ends.append(total)
        concat = [t for m in hmsgs for t in enc.render(m)]
        if ids[: len(concat)] != concat:
            return SplitResult(self.name, tuple(ids), ())
        cuts = [Cut(CutKind.INSTRUCTION, ends[1])]
        newest = newest_start(msgs)
        per_msg = self._harmony_counts(msgs[lead:])
        idx = 1
        for offset, count in enumerate(per_msg):
            idx += count
            consumed = lead + offset + 1
            if consumed > newest or idx < 2:
                continue
            kind = CutKind.CONVERSATION if consumed == newest else CutKind.TURN
            if ends[idx] > cuts[-1].position:
                cuts.append(Cut(kind, ends[idx]))
        return SplitResult(self.name, tuple(ids), tuple(cuts))

    @staticmethod
    def _harmony_counts(msgs: list[dict]) -> list[int]:
        return [(1 if m["content"] else 0) + len(m.get("tool_calls") or [])
                if m["role"] == "assistant" else 1 for m in msgs]

    def output_parser(self, tools: list[dict] | None, *, tool_choice: Any = None
                      ) -> OutputParser:
        return HarmonyParser(tool_choice=tool_choice if tools else "none")


class HarmonyParser(OutputParser):
    """Harmony text: `<|channel|>commentary to=functions.NAME ... <|message|>{json}<|call|>`
    is a call; the `final` channel's text is content; analysis text is dropped. Held whole
    until the end of the response (channels are only known once a header is complete)."""

    def _scan(self, out: list, final: bool) -> None:
        if not final:
            return
        for block in self._buffer.replace("<|start|>assistant", "").split("<|channel|>"):
            header, sep, body = block.partition("<|message|>")
            if not sep:
                continue
            body = body.split("<|end|>")[0].split("<|call|>")[0].split("<|return|>")[0]
            if " to=functions." in header:
                name = header.split(" to=functions.", 1)[1].split()[0].split("<|")[0]
                call = call_from_object({"name": name, "arguments": body})
                if call is not None:
                    self._emit_call(*call, out)
                    continue
            if header.startswith("final"):
                self._emit_content(body, out)
        self._buffer = ""
