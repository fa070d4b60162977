"""The adapter interface, and `TextAdapter`: the shared split machinery for templates that
render to text.

How a `TextAdapter` splits (the invariant that makes every cut exact):
1. `render_pieces` renders the normalized request as consecutive text pieces; a piece that
   ends after a whole turn says how many messages are rendered by then (`consumed`). The
   concatenation is the full prompt text, generation prompt included.
2. A piece end is a cut candidate only if the next piece starts with an *atomic* special
   token (special, no lstrip/rstrip, not normalized) and no added token spans the boundary.
   Tokenizers split added tokens out of the raw text before normalizing or pre-tokenizing,
   so then `encode(a + b) == encode(a) + encode(b)`: the tokens up to the boundary do not
   depend on anything after it. Candidates failing the check are dropped (fail closed).
   At construction the adapter also checks, on a probe conversation, that chunked encoding
   equals whole encoding for this tokenizer; if not, it encodes whole and verifies each cut
   by encoding its prefix on its own.
3. Chunks between candidates are encoded separately (one batched call); a cut's position is
   the running token count. The ids of a prefix already seen are taken from the
   `PrefixCache` (keyed by a digest of the prefix text), so a long agent prompt is not
   re-tokenized whole on every turn; only the text after the deepest cached prefix is encoded.
4. Message text is tokenized as text (see specials.py): every string of the request is
   defused before rendering, so special tokens in the render come from the markup only.
5. Cut kinds: INSTRUCTION at the end of the leading system/developer messages and tools,
   CONVERSATION at the start of the trailing run of user/tool messages (when that is past
   the instruction cut), TURN at the candidates in between, MESSAGES at the end of the last
   message (before the generation prompt). Boundaries inside the newest messages are not
   reported.
"""

from __future__ import annotations

import bisect
import hashlib
import operator
import re
import threading
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar, NamedTuple, cast

import cachetools
import orjson

from anchorcache.wire import TokenIds

from .memo import MessageMemo
from .normalize import (
    check_messages,
    leading_system_count,
    newest_start,
    normalize_message,
    normalize_messages,
    normalize_tools,
    with_arguments_json,
)
from .parsers import OutputParser
from .prefix_cache import CachedPrefix, PrefixCache
from .specials import SpecialGuard
from .tool_cuts import ToolCutLimits, ToolCutMemo, candidates, tool_cuts
from .turns import Turn, extend_json, json_ends, turns_memo
from .types import Cut, CutKind, SplitResult

_first, _second = operator.itemgetter(0), operator.itemgetter(1)

TOOLS_MEMO_BYTES = 32 << 20  # `TextAdapter._tool_memo`: the tools' JSON bytes, about


class _ToolsEntry(NamedTuple):
    safe: list[dict] | None  # the tools normalized, then defused
    json_bytes: int

    def size(self) -> int:
        return 2 * self.json_bytes + 256  # as Python objects, roughly


class Adapter(ABC):
    """One chat-template family: renders requests, finds verified cuts, parses output.

    `split` raises `SplitError` for bad request content (a 400) and never returns an
    unverified cut. Adapters hold per-model state (tokenizer, prefix cache) and are created
    once per served model. `split`, `output_parser` and `forced_prefix` may be called from
    several threads at once (caches are locked; everything else is read-only after
    construction); a parser belongs to one response.

    Tools render in the client's order unless `canonical_tools` (the adapter's default, or
    per call): see normalize.py for the trade-off. `deviation` says, in one sentence, where
    the render deliberately differs from the model's own chat template (None: it does not).
    """

    name: ClassVar[str]
    stop_token_ids: tuple[int, ...] = ()
    deviation: str | None = None
    guard: SpecialGuard

    def __init__(self, tokenizer: Any, *, canonical_tools: bool = False) -> None:
        self.tokenizer = tokenizer
        self.canonical_tools = canonical_tools
        self.tool_cut_memo = ToolCutMemo()
        self.tool_cut_limits = ToolCutLimits()  # the proxy sets its own (gap, context)
        self.message_memo = MessageMemo()

    def _messages(self, messages: list[dict], scope: bytes, head: bytes | None = None
                  ) -> tuple[list[dict], list[dict]]:
        """`messages` normalized, and normalized then defused (with each call's arguments
        JSON: `with_arguments_json`), each message's pair from `scope`'s memo where the same
        message was seen (memo.py; `head`: `messages`' JSON bytes less the closing bracket,
        or what stands for them: `split`'s `messages_head`). The pairs are shared: never mutated."""
        check_messages(messages)
        pairs = self.message_memo.map(scope, messages, self._message_pair, head=head)
        return list(map(_first, pairs)), list(map(_second, pairs))

    def _message_pair(self, i: int, message: Any) -> tuple[dict, dict]:
        norm = normalize_message(i, message)
        return norm, with_arguments_json(self.guard.defuse(norm))

    def _with_tool_cuts(self, split: SplitResult, tools: list[dict] | None,
                        instruction_text: Callable[[int], str],
                        render_with: Callable[[int], str],
                        encode_batch: Callable[[list[str]], list[list[int]]],
                        scope: bytes) -> SplitResult:
        """`split` with its tool cuts (tool_cuts.py, within `tool_cut_limits`), memoized by
        the instruction prefix's text, `instruction_text(instruction cut)`, in `scope`;
        `render_with(k)`: the request's leading messages' text with its first `k` tools."""
        pos, limits = split.instruction_cut, self.tool_cut_limits
        if pos is None or not tools or len(tools) < 2 or (
                limits.max_prompt_tokens is not None
                and len(split.input_ids) > limits.max_prompt_tokens):
            return split
        ks = candidates(tools, limits)
        if not ks:
            return split
        text = instruction_text(pos)
        found = self.tool_cut_memo.get_or_compute(text, lambda: tool_cuts(
            text, split.input_ids[:pos], ks, render_with, encode_batch), scope)
        return replace(split, tool_cuts=found)

    def _tools(self, tools: list[dict] | None, canonical: bool | None) -> list[dict] | None:
        return normalize_tools(tools, canonical=self.canonical_tools if canonical is None
                               else canonical)

    def template_mismatch(self) -> str | None:
        """Why this adapter does not reproduce the tokenizer's chat template on the probe
        conversations (`auto` then falls back to `generic`), or None. Adapters that render
        with the template or the model's own library never mismatch."""
        return None

    @classmethod
    @abstractmethod
    def matches(cls, tokenizer: Any) -> bool:
        """Whether `auto` should pick this adapter for `tokenizer`."""

    @abstractmethod
    def split(self, messages: list[dict], tools: list[dict] | None = None, *,
              template_kwargs: dict | None = None, canonical_tools: bool | None = None,
              scope: bytes = b"", messages_head: bytes | None = None) -> SplitResult:
        """Render with the generation prompt and return the ids and verified cuts. `scope`
        keys every memo the split reads or fills (the caller's tenant namespace), so a
        split is never faster for what another scope sent. `messages_head`: bytes that stand for
        `messages` in those memos as `orjson.dumps(messages)` less its closing bracket
        would, where the caller has them (a chat body's own bytes up to the end of its
        messages, `MessageMemo.read`): equal bytes are equal messages, and bytes that
        extend them at a comma are the same messages and more."""

    @abstractmethod
    def output_parser(self, tools: list[dict] | None, *,
                      tool_choice: Any = None) -> OutputParser:
        """A fresh incremental parser for one response."""

    def forced_prefix(self, tool_choice: Any) -> str | None:
        """Text to append after the generation prompt to force a tool call
        (`required` or a named function), or None when the adapter cannot force one."""
        return None

    def forced_prefix_ids(self, tool_choice: Any) -> tuple[int, ...]:
        """The ids of `forced_prefix` (empty when None): its markup as special tokens, the
        client's function name as text (a special-token string in it stays text)."""
        guard = getattr(self, "guard", None)
        if guard is None:
            prefix = self.forced_prefix(tool_choice)
            return tuple(self.tokenizer.encode(prefix)) if prefix else ()
        prefix = self.forced_prefix(guard.defuse(tool_choice))
        return tuple(guard.encode(prefix)) if prefix else ()


class Piece(NamedTuple):
    text: str
    consumed: int | None  # messages fully rendered at the end of this piece; None: no boundary


class TextAdapter(Adapter):
    """Adapters whose templates render text for an `HFTokenizer` (see module docstring)."""

    # see SplitResult.stable_tail: True where the family renders a user or tool message the
    # same wherever it stands (checked on the BFCL data: tests/proxy/splitter/test_split_data)
    stable_tail: ClassVar[bool] = False

    probe_messages: ClassVar[list[dict]] = [
        {"role": "system", "content": "Probe  system\n"},
        {"role": "user", "content": " héllo wörld 你好 "},
        {"role": "assistant", "content": "\n ok \n"},
        {"role": "user", "content": "  again"},
    ]

    def __init__(self, tokenizer: Any, cache: PrefixCache | None = None, *,
                 canonical_tools: bool = False) -> None:
        super().__init__(tokenizer, canonical_tools=canonical_tools)
        self.cache = cache if cache is not None else PrefixCache()
        self.guard = SpecialGuard(tokenizer)
        specials = sorted(tokenizer.atomic_specials, key=len, reverse=True)
        added = sorted(tokenizer.added_tokens, key=len, reverse=True)
        self._special_rx = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._added_rx = re.compile("|".join(map(re.escape, added))) if added else None
        self._added_first_chars = frozenset(t[0] for t in added if t)
        self._added_max_len = max((len(t) for t in added), default=1)
        # what `_safe_boundary` reads of the text before and after a boundary
        self._tail_chars = self._added_max_len - 1
        self._head_chars = max([self._added_max_len] + [len(t) for t in specials])
        self._boundaries: dict[tuple[str, str], bool] = {}
        self.chunking_ok = self._probe_chunking()
        self.turns = turns_memo()  # the last turns' splits, per scope (turns.py)
        # (scope, digest of the tools' JSON) → the tools normalized and defused: agents
        # resend the same tools every turn; weighed by that JSON's length
        self._tool_memo: cachetools.LRUCache[tuple[bytes, bytes], _ToolsEntry] = \
            cachetools.LRUCache(TOOLS_MEMO_BYTES, getsizeof=_ToolsEntry.size)
        self._tool_lock = threading.Lock()

    @abstractmethod
    def render_pieces(self, messages: list[dict], tools: list[dict] | None,
                      template_kwargs: dict, start: int = 0,
                      kept: Turn | None = None) -> list[Piece]:
        """Normalized request → text pieces (module docstring, step 1). `start` > 0: only
        the pieces after the boundary where the first `start` messages are rendered (one the
        whole render has), exactly as the whole render has them; `kept`: a turn whose
        messages are the first `kept.count` (its `facts` spare a walk over them)."""

    def stable_messages(self, messages: list[dict], kept: Turn) -> int:
        """How many leading messages of `messages` render (with every piece before them)
        exactly as they did in the render of its first `kept.count` messages alone (`kept`:
        that render's turn): what a split may reuse of the last turn's (turns.py). 0,
        nothing, unless the adapter knows."""
        return 0

    def _turn_facts(self, safe_msgs: list[dict], kept: Turn | None) -> Any:
        """`Turn.facts` of a render of `safe_msgs` (`kept`: a turn whose messages are their
        first `kept.count`, when the split extends one): None unless the adapter keeps any."""
        return None

    def render_text(self, messages: list[dict], tools: list[dict] | None = None, *,
                    template_kwargs: dict | None = None,
                    canonical_tools: bool | None = None) -> str:
        """The full prompt text this adapter renders for a request."""
        msgs, tls = normalize_messages(messages), self._tools(tools, canonical_tools)
        return "".join(p.text for p in self.render_pieces(msgs, tls, dict(template_kwargs or {})))

    # -- splitting ---------------------------------------------------------------------

    def split(self, messages: list[dict], tools: list[dict] | None = None, *,
              template_kwargs: dict | None = None, canonical_tools: bool | None = None,
              scope: bytes = b"", messages_head: bytes | None = None,
              use_cache: bool = True) -> SplitResult:
        blob = context = None  # `messages_head`, or the messages' JSON less the bracket
        if use_cache and self.chunking_ok:
            try:
                blob = messages_head if messages_head is not None else \
                    orjson.dumps(messages)[:-1]
                context = orjson.dumps([tools, template_kwargs, canonical_tools])
            except (TypeError, orjson.JSONEncodeError):
                blob = context = None
        msgs, safe_msgs = self._messages(messages, scope, blob)
        safe_tls = self._safe_tools(tools, canonical_tools, scope, context)
        kwargs = dict(template_kwargs or {})
        turn = prior = None
        if blob is not None and context is not None:
            kept = self.turns.find(scope, context, blob)
            if kept is not None:
                prior = kept[1].ids.buf
                turn = self._extend(kept[1], msgs, safe_msgs, safe_tls, kwargs)
        if turn is None:
            pieces = self.render_pieces(safe_msgs, safe_tls, kwargs)
            chunks, consumed = self._chunks(pieces)
            if self.chunking_ok:
                ids, ends, hashes = self._encode_chunks(chunks, consumed, use_cache,
                                                        self._wanted(msgs), scope)
            else:
                (ids, ends), hashes = self._encode_whole_verified(chunks), []
            text = orjson.dumps(ids)  # (an unverified chunk end is -1: such turns never extend)
            turn = self._turn(msgs, safe_msgs, chunks, consumed, ends, hashes,
                              TokenIds(array("q", ids).tobytes(), text),
                              json_ends(text, ends) if self.chunking_ok else [])
        if blob is not None and context is not None:
            # (the memo counts the head and context bytes, the turn the rest)
            self.turns.keep(scope, context, blob, turn.count, turn,
                            turn.size + 3 * (len(blob) + len(context)))
        chunks, ends = turn.chunks, turn.ends
        split = SplitResult(self.name, turn.ids, turn.cuts, stable_tail=self.stable_tail,
                            prior_token_bytes=prior,
                            given_anchor_cuts=(turn.cuts, turn.anchor_cuts))
        head = safe_msgs[:leading_system_count(msgs) + 1]  # what renders before the tools end
        return self._with_tool_cuts(
            split, safe_tls, lambda pos: "".join(chunks[: ends.index(pos) + 1]),
            lambda k: "".join(p.text for p in self.render_pieces(head, (safe_tls or [])[:k], kwargs)),
            self.guard.encode_batch, scope)

    def _safe_tools(self, tools: list[dict] | None, canonical: bool | None, scope: bytes,
                    context: bytes | None) -> list[dict] | None:
        """The tools normalized (validated), then defused; from `scope`'s memo where its
        requests sent the same `context` before (`split`'s JSON of the tools and what the
        render reads with them). The list is shared: never mutated."""
        if context is None or not tools:
            return self.guard.defuse(self._tools(tools, canonical))
        key = (scope, hashlib.blake2b(context, digest_size=16).digest())
        with self._tool_lock:
            kept = self._tool_memo.get(key)
        if kept is None:  # (a bad list raises here, every time: never kept)
            kept = _ToolsEntry(self.guard.defuse(self._tools(tools, canonical)), len(context))
            with self._tool_lock:
                if kept.size() <= TOOLS_MEMO_BYTES:
                    self._tool_memo[key] = kept
        return kept.safe

    def _turn(self, msgs: list[dict], safe_msgs: list[dict], chunks: list[str],
              consumed: list[int | None], ends: list[int], hashes: list[Any],
              ids: TokenIds, ids_ends: list[int], kept: Turn | None = None,
              reused: int = 0) -> Turn:
        """The split's turn (turns.py) with its cuts: `_classify`'s, and where the chunks
        are `kept`'s first `reused` ones and more, `kept`'s cuts before the newest messages
        of either (a cut there depends on nothing after it), then the rest classified."""
        lead, newest = leading_system_count(msgs), newest_start(msgs)
        cuts: list[Cut] = []
        at: list[int] = []
        anchor_cuts: list[Cut] = []
        start = 0
        if kept is not None and kept.lead == lead:
            limit = min(newest, kept.newest, (kept.consumed[reused - 1] or 0) + 1)
            k = bisect.bisect_left(kept.cut_msgs, limit)
            cuts, at = list(kept.cuts[:k]), list(kept.cut_msgs[:k])
            if k:  # (positions strictly increase)
                last = cuts[-1].position
                anchor_cuts = [c for c in kept.anchor_cuts if c.position <= last]
            ended = cast("list[int]", consumed)  # every chunk but the last ends a message
            start = bisect.bisect_left(ended, limit, hi=len(ended) - 1)
        classified = len(cuts)
        self._classify(len(msgs), lead, newest, consumed, ends, start, cuts, at)
        anchor_cuts += (c for c in cuts[classified:] if c.kind is not CutKind.TURN)
        return Turn(len(msgs), chunks, consumed, ends, hashes, ids, ids_ends,
                    tuple(cuts), tuple(at), tuple(anchor_cuts), lead, newest,
                    self._turn_facts(safe_msgs, kept))

    def _extend(self, kept: Turn, msgs: list[dict], safe_msgs: list[dict],
                safe_tls: list[dict] | None, kwargs: dict) -> Turn | None:
        """The split of a request whose messages extend `kept`'s (turns.py): `kept`'s chunks
        up to the last that ends where the render cannot have changed, then the rest
        rendered, chunked and encoded; None where no chunk can be kept."""
        stable = self.stable_messages(safe_msgs, kept)  # what render_pieces sees
        # chunks end after strictly more messages each (the last chunk, the generation
        # prompt, ends none): keep those ending after at most `stable` messages
        ended = cast("list[int]", kept.consumed)  # every chunk but the last ends a message
        c = bisect.bisect_right(ended, stable, hi=len(ended) - 1) - 1
        if c < 0 or not ended[c]:
            return None
        tail = self.render_pieces(safe_msgs, safe_tls, kwargs, start=ended[c], kept=kept)
        if not self._safe_boundary(kept.chunks[c], tail[0].text):
            return None  # the whole render would not end a chunk there either
        new_chunks, new_consumed = self._chunks(tail)
        chunks, consumed = kept.chunks[:c + 1] + new_chunks, kept.consumed[:c + 1] + new_consumed
        base = kept.ends[c]
        encoded = self.guard.encode_batch(new_chunks)
        new_ids = [t for enc in encoded for t in enc]
        ends, hashes, total, h = kept.ends[:c + 1], kept.hashes[:c + 1], base, kept.hashes[c]
        wanted = self._wanted(msgs)
        kept_prefixes: list[tuple[bytes, int]] = []  # (digest, chunks) of those cached
        for i, enc in enumerate(encoded, c + 1):
            total += len(enc)
            ends.append(total)
            if i < len(chunks) - 1:  # the hash state after it, as `_encode_chunks` keys it
                h = h.copy()
                h.update(chunks[i].encode("utf-8", "surrogatepass"))
                hashes.append(h)
                if consumed[i] in wanted:
                    kept_prefixes.append((h.digest(), i + 1))
        ids, ids_ends = self._extend_ids(kept, c, new_ids, ends)
        if kept_prefixes:
            shared = tuple(ends)
            for digest, count in kept_prefixes:
                self.cache.put(digest, CachedPrefix(ids, shared, count))
        return self._turn(msgs, safe_msgs, chunks, consumed, ends, hashes, ids, ids_ends,
                          kept, c + 1)

    @staticmethod
    def _extend_ids(kept: Turn, c: int, new_ids: list[int], ends: list[int]
                    ) -> tuple[TokenIds, list[int]]:
        """`kept`'s ids to the end of its chunk `c`, then `new_ids`: their bytes and JSON
        text (each the kept one's prefix and the new ids': one copy, no tuple of ints, no
        JSON of the whole), and where the text is at each of `ends` (the chunks' ends)."""
        base = kept.ends[c]
        assert kept.ids.json is not None  # (a turn's ids always carry it)
        text, new_ends = extend_json(kept.ids.json, kept.json_ends[c], base, new_ids,
                                     ends[c + 1:])
        buf = b"".join((memoryview(kept.ids.buf)[:8 * base], array("q", new_ids)))
        return TokenIds(buf, text), kept.json_ends[:c + 1] + new_ends

    def _safe_boundary(self, before: str, after: str) -> bool:
        """Whether a chunk may end between `before` and `after` (module docstring, step 2).
        Depends on `before`'s last and `after`'s first few characters only, which repeat
        from turn to turn: memoized by them."""
        tail = before[-self._tail_chars:] if self._tail_chars else ""
        key = (tail, after[:self._head_chars])
        safe = self._boundaries.get(key)
        if safe is None:
            if len(self._boundaries) >= 4096:
                self._boundaries.clear()
            safe = self._boundaries[key] = self._check_boundary(*key)
        return safe

    def _check_boundary(self, tail: str, after: str) -> bool:
        if self._special_rx is None or not self._special_rx.match(after):
            return False
        if self._added_rx is None:
            return True
        window = tail + after[: self._added_max_len]
        for p, ch in enumerate(tail):
            if ch in self._added_first_chars:
                m = self._added_rx.match(window, p)
                if m and m.end() > len(tail):
                    return False
        return True

    def _chunks(self, pieces: list[Piece]) -> tuple[list[str], list[int | None]]:
        """Merge pieces into chunks that end at safe boundaries; `consumed[i]` belongs to the
        end of chunk i (None for the last chunk unless it ends a turn)."""
        chunks: list[str] = []
        consumed: list[int | None] = []
        buf: list[str] = []
        for i, piece in enumerate(pieces):
            buf.append(piece.text)
            nxt = pieces[i + 1].text if i + 1 < len(pieces) else None
            if piece.consumed is None or nxt is None:
                continue
            text = "".join(buf)
            if text and self._safe_boundary(text, nxt):
                chunks.append(text)
                consumed.append(piece.consumed)
                buf = []
        chunks.append("".join(buf))
        consumed.append(None)
        return chunks, consumed

    @staticmethod
    def _wanted(msgs: list[dict]) -> set[int]:
        """How many messages a chunk ends after when its prefix ids are worth caching: the
        instruction, conversation and messages ends (the next turn's history ends there)."""
        return {leading_system_count(msgs), newest_start(msgs), len(msgs)}

    def _encode_chunks(self, chunks: list[str], consumed: list[int | None], use_cache: bool,
                       wanted: set[int], scope: bytes = b"") -> tuple[list[int], list[int], list[Any]]:
        """The ids of `chunks`, the token count at each chunk's end, and the prefix hash
        state after each chunk but the last (its digest keys the prefix cache, which keeps
        the chunks ending after a count of messages in `wanted`)."""
        h = hashlib.blake2b(digest_size=16, person=b"ac.split.v1")
        h.update(len(scope).to_bytes(4, "little") + scope)  # the cache is per scope
        hashes = []
        for chunk in chunks[:-1]:
            h.update(chunk.encode("utf-8", "surrogatepass"))
            hashes.append(h.copy())
        keys = [state.digest() for state in hashes]
        start, ids, ends = 0, [], []
        hit = self.cache.deepest(keys) if use_cache else None
        if hit is not None:
            entry = hit[1]
            start = hit[0] + 1
            ids, ends = list(entry.ids[:entry.tokens]), list(entry.chunk_ends[:entry.chunks])
        cached: list[int] = []  # the chunks whose prefixes are cached
        for i, enc in enumerate(self.guard.encode_batch(chunks[start:]), start):
            ids.extend(enc)
            ends.append(len(ids))
            if use_cache and i < len(keys) and consumed[i] in wanted:
                cached.append(i)
        if cached:
            shared = tuple(ids), tuple(ends)
            for i in cached:
                self.cache.put(keys[i], CachedPrefix(*shared, i + 1))
        return ids, ends, hashes

    def _encode_whole_verified(self, chunks: list[str]) -> tuple[list[int], list[int]]:
        """Slow path for tokenizers that fail the chunking probe: encode the whole text, and
        keep a boundary only if encoding its prefix alone gives exactly the leading ids."""
        text = "".join(chunks)
        ids = self.guard.encode(text)
        ends, offset = [], 0
        for chunk in chunks[:-1]:
            offset += len(chunk)
            prefix = self.guard.encode(text[:offset])
            ends.append(len(prefix) if ids[: len(prefix)] == prefix else -1)
        ends.append(len(ids))
        return ids, ends

    @staticmethod
    def _classify(count: int, lead: int, newest: int, consumed: list[int | None],
                  ends: list[int], start: int, cuts: list[Cut], at: list[int]) -> None:
        """Append to `cuts` the cuts at the ends of chunks `start`.. of a request of `count`
        messages (the first `lead` the instruction part, its newest ones from `newest` on),
        and to `at` how many messages each ends after."""
        for c, pos in zip(consumed[start:], ends[start:], strict=True):
            if c is None or pos <= 0:
                continue
            if c > newest:
                if c == count and (not cuts or pos > cuts[-1].position):
                    cuts.append(Cut(CutKind.MESSAGES, pos))
                    at.append(c)
                continue
            if c == lead:
                kind = CutKind.INSTRUCTION
            elif c < lead:
                continue  # inside the instruction part
            elif c == newest:
                kind = CutKind.CONVERSATION
            else:
                kind = CutKind.TURN
            if cuts and pos <= cuts[-1].position:
                continue
            cuts.append(Cut(kind, pos))
            at.append(c)


    def _probe_chunking(self) -> bool:
        try:
            pieces = self.render_pieces(normalize_messages(self.probe_messages), None, {})
        except Exception:  # a template that rejects the probe: take the verified slow path
            return False
        chunks, _ = self._chunks(pieces)
        chunked = [t for ids in self.guard.encode_batch(chunks) for t in ids]
        return chunked == self.guard.encode("".join(chunks))
