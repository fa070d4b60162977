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
gets them lowered into the messages Hermes-style (`hermes.lower_tools`: schemas appended to
the system message, `<tool_call>` JSON in assistant content, results as `<tool_response>`
user messages), so the model sees them instead of having them silently dropped.

Message text is tokenized as text (specials.py): the request is defused before the template
renders it. The cache of verified cuts is locked (splits may run in executor threads).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

import jinja2

from .base import Adapter
from .hermes import lower_tools
from .normalize import (
    leading_system_count,
    newest_start,
    without_arguments_text,
)
from .parsers import OutputParser, TagParser
from .specials import SpecialGuard
from .types import Cut, CutKind, SplitError, SplitResult

_PROBE = "\ue000\ue001probe"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_\ue000", "description": "p",
                                                "parameters": {"type": "object"}}}


class GenericAdapter(Adapter):
    name = "generic"

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self.supports_tools = self._detect_tool_support()
        if not self.supports_tools:
            self.deviation = ("the chat template ignores tools: tools, tool calls and tool "
                              "results are rendered Hermes-style into the messages")
        self.guard = SpecialGuard(tokenizer)
        self._known: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()
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
        """Tools, tool calls and tool results as plain Hermes-style text (`hermes.lower_tools`)."""
        return lower_tools(msgs, tools)

    def _render(self, msgs: list[dict], tools: list[dict] | None, kwargs: dict,
                add_generation_prompt: bool) -> str:
        return self.tokenizer.render(msgs, tools, add_generation_prompt=add_generation_prompt,
                                     **kwargs)

    def split(self, messages: list[dict], tools: list[dict] | None = None, *,
              template_kwargs: dict | None = None, canonical_tools: bool | None = None,
              scope: bytes = b"", messages_head: bytes | None = None) -> SplitResult:
        msgs = self._messages(messages, scope)[1]
        tls = self.guard.defuse(self._tools(tools, canonical_tools))
        if not self.supports_tools:
            msgs, tls = lower_tools(msgs, tls), None
        else:  # the template renders calls itself: the object a cut-short text describes
            msgs = without_arguments_text(msgs)
        lead, newest = leading_system_count(msgs), newest_start(msgs)
        kwargs = dict(template_kwargs or {})
        try:
            text = self._render(msgs, tls, kwargs, True)
        except jinja2.TemplateError as exc:
            raise SplitError(f"the chat template rejected the conversation: {exc}",
                             "messages") from None
        ids, ends = self.guard.encode_with_ends(text)
        cuts: list[Cut] = []
        wanted = [(lead, CutKind.INSTRUCTION)] if (lead or tls) else []
        wanted += [(k, CutKind.TURN) for k in range(lead + 1, newest)
                   if msgs[k]["role"] in ("user", "tool") and msgs[k - 1]["role"] not in
                   ("user", "tool")]
        if newest > lead:
            wanted.append((newest, CutKind.CONVERSATION))
        h = hashlib.blake2b(digest_size=16, person=b"ac.generic.v1")
        h.update(len(scope).to_bytes(4, "little") + scope)  # verified cuts are per scope
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
                pos = self._verified_cut(msgs, tls, kwargs, k, text, ids, ends)
                if pos is not None:
                    self._remember(key.digest(), pos, ids)
            if pos is not None and (not cuts or pos > cuts[-1].position):
                cuts.append(Cut(kind, pos))
        head = msgs[:lead + 1]  # what renders before the tools end
        return self._with_tool_cuts(
            SplitResult(self.name, tuple(ids), tuple(cuts)), tls,
            lambda pos: text[: ends[pos - 1]],
            lambda k: self._render(head, (tls or [])[:k], kwargs, True), self.guard.encode_batch,
            scope)

    @staticmethod
    def _ids_digest(ids: list[int]) -> bytes:
        return hashlib.blake2b(b"".join(i.to_bytes(4, "little") for i in ids),
                               digest_size=16).digest()

    def _cached_cut(self, key: bytes, ids: list[int]) -> int | None:
        with self._lock:
            hit = self._known.get(key)
            if hit is not None:
                self._known.move_to_end(key)
        if hit is None or hit[0] > len(ids) or self._ids_digest(ids[: hit[0]]) != hit[1]:
            return None
        return hit[0]

    def _remember(self, key: bytes, pos: int, ids: list[int]) -> None:
        entry = (pos, self._ids_digest(ids[:pos]))
        with self._lock:
            self._known[key] = entry
            while len(self._known) > self.max_known:
                self._known.popitem(last=False)

    def _verified_cut(self, msgs: list[dict], tools: list[dict] | None, kwargs: dict, k: int,
                      text: str, ids: list[int], ends: list[int]) -> int | None:
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
        pos = sum(1 for end in ends if end <= common)
        for _ in range(4):
            if pos <= 0:
                return None
            prefix_text = text[: ends[pos - 1]]
            if self.guard.encode(prefix_text) == ids[:pos]:
                return pos
            pos -= 1
        return None

    def output_parser(self, tools: list[dict] | None, *, tool_choice: Any = None
                      ) -> OutputParser:
        if not tools:
            return OutputParser(tool_choice="none")
        return TagParser(tool_choice=tool_choice)
