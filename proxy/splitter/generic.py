"""Generic fallback for any Hugging Face chat template the other adapters do not know.

Cuts are found by rendering and comparing: for a boundary after the first `k` messages the
template renders `messages[:k]` followed by a probe message whose content cannot occur in
real text; the longest common text prefix with the full render is the part that depends only
on `messages[:k]` (and the role of the next message). It is cut back to a token boundary and
kept only if encoding that text alone gives exactly the leading ids of the full render
(verified directly, since nothing is known about the template). Templates that refuse a
probe (e.g. strict role alternation) try the other role; if both fail the cut is dropped.
Candidates are the instruction boundary and the start of every run of user/tool messages
(the conversation cut of each earlier request, so appending a turn never loses a cut). Each
costs one probe render the first time; the verified position is remembered in a bounded
LRU keyed by a digest of the messages before it (and the next message's role), and reused
only if the current ids up to it hash to the ids verified then.

A template that ignores tools (rendering with and without a probe tool gives the same text)
gets them lowered into the messages Hermes-style (schemas appended to the system message,
`<tool_call>` JSON in assistant content, results as `<tool_response>` user messages), so the
model sees them instead of having them silently dropped.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

import jinja2

from .base import Adapter
from .hermes import tool_call_text, tools_text
from .normalize import canonical_tools, leading_system_count, newest_start, normalize_messages
from .parsers import OutputParser, TagParser
from .types import Cut, CutKind, SplitError, SplitResult

_PROBE = "\ue000\ue001probe"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_\ue000", "description": "p",
                                                "parameters": {"type": "object"}}}


class GenericAdapter(Adapter):
    name = "generic"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.supports_tools = self._detect_tool_support()
        self._known: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self.max_known = 4096
        eos = tokenizer.special_tokens.get("eos_token")
        eos_id = tokenizer.token_to_id(eos) if eos else None
        self.stop_token_ids = () if eos_id is None else (eos_id,)

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        return bool(getattr(tokenizer, "chat_template", None))

    def _detect_tool_support(self) -> bool:
        msgs = [{"role": "user", "content": "x"}]
        try:
            with_tools = self.tokenizer.render(msgs, [_PROBE_TOOL], add_generation_prompt=True)
            without = self.tokenizer.render(msgs, None, add_generation_prompt=True)
        except jinja2.TemplateError:
            return False
        return with_tools != without

    @staticmethod
    def lower_tools(msgs: list[dict], tools: list[dict] | None) -> list[dict]:
        """Tools, tool calls and tool results as plain Hermes-style text."""
        out: list[dict] = []
        lead = leading_system_count(msgs)
        if tools:
            if lead:
                last = msgs[lead - 1]
                body = last["content"] + ("\n\n" if last["content"] else "") + tools_text(tools)
                out = [*msgs[: lead - 1], dict(last, content=body)]
            else:
                out = [{"role": "system", "content": tools_text(tools)}]
        else:
            out = list(msgs[:lead])
        for m in msgs[lead:]:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = "\n".join(tool_call_text(c) for c in m["tool_calls"])
                text = m["content"] + ("\n" if m["content"] else "") + calls
                out.append({"role": "assistant", "content": text})
            elif m["role"] == "tool":
                out.append({"role": "user",
                            "content": "<tool_response>\n" + m["content"] + "\n</tool_response>"})
            else:
                out.append(m)
        return out

    def _render(self, msgs: list[dict], tools: list[dict] | None, kwargs: dict,
                add_generation_prompt: bool) -> str:
        return self.tokenizer.render(msgs, tools, add_generation_prompt=add_generation_prompt,
                                     **kwargs)

    def split(self, messages: list[dict], tools: list[dict] | None = None, *,
              template_kwargs: dict | None = None) -> SplitResult:
        msgs, tls = normalize_messages(messages), canonical_tools(tools)
        lead, newest = leading_system_count(msgs), newest_start(msgs)
        if not self.supports_tools:
            lowered = self.lower_tools(msgs, tls)
            # lowering adds a system message when tools exist without one
            shift = 1 if tls and not lead else 0
            msgs, tls, lead, newest = lowered, None, lead + shift, newest + shift
        kwargs = dict(template_kwargs or {})
        try:
            text = self._render(msgs, tls, kwargs, True)
        except jinja2.TemplateError as exc:
            raise SplitError(f"the chat template rejected the conversation: {exc}",
                             "messages") from None
        enc = self.tokenizer.backend.encode(text, add_special_tokens=False)
        ids, offsets = enc.ids, enc.offsets
        cuts: list[Cut] = []
        wanted = [(lead, CutKind.INSTRUCTION)] if (lead or tls) else []
        wanted += [(k, CutKind.TURN) for k in range(lead + 1, newest)
                   if msgs[k]["role"] in ("user", "tool") and msgs[k - 1]["role"] not in
                   ("user", "tool")]
        if newest > lead:
            wanted.append((newest, CutKind.CONVERSATION))
        h = hashlib.blake2b(digest_size=16, person=b"ac.generic.v1")
        h.update(json.dumps([tls, kwargs], sort_keys=True, ensure_ascii=False).encode())
        done = 0
        for k, kind in wanted:
            for m in msgs[done:k]:
                h.update(json.dumps(m, sort_keys=True, ensure_ascii=False).encode() + b"\0")
            done = k
            key = h.copy()
            key.update(msgs[k]["role"].encode() if k < len(msgs) else b"")
            pos = self._cached_cut(key.digest(), ids)
            if pos is None:
                pos = self._verified_cut(msgs, tls, kwargs, k, text, ids, offsets)
                if pos is not None:
                    self._remember(key.digest(), pos, ids)
            if pos is not None and (not cuts or pos > cuts[-1].position):
                cuts.append(Cut(kind, pos))
        return SplitResult(self.name, tuple(ids), tuple(cuts))

    @staticmethod
    def _ids_digest(ids: list[int]) -> bytes:
        return hashlib.blake2b(b"".join(i.to_bytes(4, "little") for i in ids),
                               digest_size=16).digest()

    def _cached_cut(self, key: bytes, ids: list[int]) -> int | None:
        hit = self._known.get(key)
        if hit is None or hit[0] > len(ids) or self._ids_digest(ids[: hit[0]]) != hit[1]:
            return None
        self._known.move_to_end(key)
        return hit[0]

    def _remember(self, key: bytes, pos: int, ids: list[int]) -> None:
        self._known[key] = (pos, self._ids_digest(ids[:pos]))
        while len(self._known) > self.max_known:
            self._known.popitem(last=False)

    def _verified_cut(self, msgs: list[dict], tools: list[dict] | None, kwargs: dict, k: int,
                      text: str, ids: list[int], offsets: list) -> int | None:
        common = None
        for role in ("user", "assistant"):  # the shortest agreement over both probe roles
            try:
                alt = self._render([*msgs[:k], {"role": role, "content": _PROBE}], tools, kwargs,
                                   False)
            except jinja2.TemplateError:
                continue
            n = 0
            limit = min(len(alt), len(text), len(text) if common is None else common)
            while n < limit and alt[n] == text[n]:
                n += 1
            common = n
        if not common:
            return None
        # a turn header starts with a special token: cut before it, at the end of the turn
        for special in self.tokenizer.atomic_specials:
            if text.endswith(special, 0, common) and common > len(special):
                common -= len(special)
                break
        # the deepest token that ends inside the common text; back off while unverified
        pos = sum(1 for _, end in offsets if end <= common)
        for _ in range(4):
            if pos <= 0:
                return None
            prefix_text = text[: offsets[pos - 1][1]]
            if self.tokenizer.encode(prefix_text) == ids[:pos]:
                return pos
            pos -= 1
        return None

    def output_parser(self, tools: list[dict] | None, *, tool_choice: Any = None
                      ) -> OutputParser:
        if not tools:
            return OutputParser(tool_choice="none")
        return TagParser(tool_choice=tool_choice)
