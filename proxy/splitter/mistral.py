"""Mistral (`[AVAILABLE_TOOLS]` / `[TOOL_CALLS]`), rendered by `mistral-common` itself.

The tekken tokenizers shipped by `mistral-common` are instruct version v3: the system
prompt is prepended to the *last* user message and `[AVAILABLE_TOOLS]` is placed right
before it. Everything before the last user message is therefore the only prefix that
later requests reproduce, so:
- there is no instruction cut (the instructions move with the last user message);
- the conversation cut is the start of the last user message's block (its
  `[AVAILABLE_TOOLS]`, else its `[INST]`), reported only if rendering the same messages
  followed by a different user message gives the same tokens up to it (verified);
- turn cuts at the `[INST]` of each earlier user message (the same one extra render
  verifies them all: they lie before the conversation cut).

Tool-call ids are mapped to the 9-character alphanumeric ids Mistral requires, by a hash,
so the same id always renders the same.
"""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

from .base import Adapter
from .normalize import normalize_messages
from .parsers import OutputParser, call_from_object
from .types import Cut, CutKind, SplitError, SplitResult

_ALPHABET = string.ascii_letters + string.digits
TOOL_CALLS = "[TOOL_CALLS]"


def mistral_call_id(call_id: str) -> str:
    n = int.from_bytes(hashlib.blake2b(call_id.encode(), digest_size=8).digest(), "little")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ALPHABET))
        out.append(_ALPHABET[r])
    return "".join(out)


class MistralAdapter(Adapter):
    name = "mistral"

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        inner = tokenizer.tokenizer.instruct_tokenizer.tokenizer
        self._special = {name: inner.get_special_token(name)
                         for name in ("[AVAILABLE_TOOLS]", "[INST]", TOOL_CALLS)}
        self.stop_token_ids = (inner.eos_id,)

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        return type(tokenizer).__name__ == "MistralTokenizerHandle"

    def _request(self, msgs: list[dict], tools: list[dict] | None) -> Any:
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        out = []
        for m in msgs:
            m = dict(m, role="system") if m["role"] == "developer" else dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": mistral_call_id(c["id"]), "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": json.dumps(
                                                     c["function"]["arguments"],
                                                     ensure_ascii=False)}}
                                   for c in m["tool_calls"]]
            if m["role"] == "tool" and m.get("tool_call_id"):
                m["tool_call_id"] = mistral_call_id(m["tool_call_id"])
            m.pop("reasoning_content", None)
            out.append(m)
        return ChatCompletionRequest.from_openai(out, tools=tools)

    def _encode(self, msgs: list[dict], tools: list[dict] | None) -> list[int]:
        from mistral_common.exceptions import MistralCommonException

        try:
            return self.tokenizer.tokenizer.encode_chat_completion(
                self._request(msgs, tools)).tokens
        except (ValueError, TypeError, MistralCommonException) as exc:  # chat validation
            raise SplitError(f"conversation rejected by the Mistral format: {exc}",
                             "messages") from None

    def split(self, messages: list[dict], tools: list[dict] | None = None, *,
              template_kwargs: dict | None = None, canonical_tools: bool | None = None,
              scope: bytes = b"", messages_head: bytes | None = None) -> SplitResult:
        msgs, tls = normalize_messages(messages), self._tools(tools, canonical_tools)
        ids = self._encode(msgs, tls)
        return SplitResult(self.name, tuple(ids), self._cuts(msgs, tls, ids))

    def _cuts(self, msgs: list[dict], tools: list[dict] | None, ids: list[int]) -> tuple:
        last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if not last_user:
            return ()
        marker = self._special["[AVAILABLE_TOOLS]"] if tools else self._special["[INST]"]
        pos = max((p for p, t in enumerate(ids) if t == marker), default=0)
        if pos <= 1:
            return ()
        probe = [*msgs[:last_user], {"role": "user", "content": "\ue000"}]
        try:
            alt = self._encode(probe, tools)
        except SplitError:
            return ()
        if alt[:pos] != ids[:pos]:
            return ()
        inst = self._special["[INST]"]
        turns = [Cut(CutKind.TURN, p) for p, t in enumerate(ids[:pos]) if t == inst and p > 1]
        return (*turns, Cut(CutKind.CONVERSATION, pos))

    def output_parser(self, tools: list[dict] | None, *, tool_choice: Any = None
                      ) -> OutputParser:
        return MistralCallsParser(tool_choice=tool_choice if tools else "none")


class MistralCallsParser(OutputParser):
    """Content, then optionally `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}`
    that runs to the end of the response."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._in_calls = False

    def _scan(self, out: list, final: bool) -> None:
        if not self._in_calls:
            idx = self._buffer.find(TOOL_CALLS)
            if idx < 0:
                keep = 0
                if not final:
                    keep = next((n for n in range(min(len(self._buffer), len(TOOL_CALLS) - 1),
                                                  0, -1)
                                 if TOOL_CALLS.startswith(self._buffer[-n:])), 0)
                self._emit_content(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return
            self._emit_content(self._buffer[:idx], out)
            self._buffer = self._buffer[idx + len(TOOL_CALLS):]
            self._in_calls = True
        if final:
            try:
                value = json.loads(self._buffer)
            except ValueError:
                value = None
            value = [value] if isinstance(value, dict) else value
            calls = [call_from_object(v) for v in value] if isinstance(value, list) else [None]
            ok = [c for c in calls if c is not None]
            if calls and len(ok) == len(calls):
                for name, args in ok:
                    self._emit_call(name, args, out)
            elif not self._emit_cut_calls(self._buffer.lstrip().removeprefix("["), out,
                                          separators=" \t\r\n,"):
                self._emit_content(TOOL_CALLS + self._buffer, out)
            self._buffer = ""
