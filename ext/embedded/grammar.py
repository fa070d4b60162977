"""Grammar-constrained decoding for the embedded worker, with xgrammar (what SGLang uses).

A request's constraint (`SamplingParams.constraint`: SGLang's `json_schema`, `regex`,
`ebnf` or `structural_tag`) is compiled once, before the request is queued, so a bad
grammar is the client's 400 and never reaches the engine. Each sample then gets its own
`TokenMask` (an xgrammar `GrammarMatcher` and a bitmask): the sampler applies the mask to
the logits, then feeds the chosen token back. The compiler caches compiled grammars by
their text, so an agent loop that resends the same tools compiles them once.

The grammar ends generation: the matcher allows the request's stop tokens (its
`stop_token_ids` and the model's EOS ids, `ignore_eos` notwithstanding) only where the
grammar is complete, and nothing else there.

Text the grammar forces (markup, a function name, a property name) is spelled the way the
tokenizer spells it: the mask alone would also allow `f` for a forced `follow_user`, a
spelling the model never saw, whose probability belongs to other words starting with `f`
(with SmolLM2 it picked the wrong tool that way and then looped in its argument). The
sampler asks `TokenMask.canonical` about its choice and chooses again without a token that
starts forced text the tokenizer would begin with a longer token. Free text (a string's
content) is never restricted, so every output the mask allows before is still reachable
except for those spellings.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any

import torch
import xgrammar as xgr

from anchorcache.wire import WireError

# Compiled grammars kept for reuse (an agent's tool set compiles to a few MiB at most).
CACHE_LIMIT_BYTES = 256 << 20
# Most tokens a choice point may allow for `canonical` to look one token ahead: a choice
# among names or keys allows a few dozen; free text allows thousands and is not checked.
CHOICE_LIMIT_TOKENS = 64


class Grammars:
    """Compiles constraints for one model's vocabulary. Thread-safe.

    The vocabulary is read on the first compile (a second or two for a 150k vocabulary), so
    a worker that never sees a constraint never pays for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._compiler: xgr.GrammarCompiler | None = None
        self._spelling: Spelling | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer,
                                                          vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
                self._spelling = Spelling(self.tokenizer, info)
            return self._compiler

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        """Raises WireError (a 400) for a grammar or schema xgrammar cannot compile."""
        compiler = self.compiler
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(text)
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar reports bad input as RuntimeError/ValueError (and pydantic errors,
            # which are ValueErrors) with a readable message
            raise WireError(f"invalid {kind}: {_first_line(e)}") from None
        raise WireError(f"unknown constraint kind {kind!r}")

    def mask(self, compiled: xgr.CompiledGrammar, stop_token_ids: Iterable[int]) -> TokenMask:
        """A mask for one sample of a grammar `compile` returned (so the compiler exists)."""
        assert self._spelling is not None
        return TokenMask(compiled, sorted(set(stop_token_ids)), self.vocab_size, self._spelling)


class Spelling:
    """How the tokenizer writes text: each token's text, and the first token of a string's
    encoding. Read-only after construction (shared by all masks)."""

    def __init__(self, tokenizer: Any, info: xgr.TokenizerInfo) -> None:
        self.texts = [_utf8(b) for b in info.decoded_vocab]
        self._encode = tokenizer.encode

    def text(self, token: int) -> str | None:
        """None for a token that is not whole UTF-8 text (a byte of a character)."""
        return self.texts[token] if token < len(self.texts) else None

    def first_token(self, text: str) -> int | None:
        ids = self._encode(text, add_special_tokens=False)
        return ids[0] if ids else None


class TokenMask:
    """One sample's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int],
                 vocab_size: int, spelling: Spelling) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self.spelling = spelling
        self.stop_token_ids = frozenset(stop_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] → a float32 copy with every forbidden token at -inf."""
        out = logits.float().clone().unsqueeze(0)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(out, self.bitmask, vocab_size=self.vocab_size)
        return out[0]

    def canonical(self, token: int) -> bool:
        """False if `token` (allowed by the last `apply`) begins text the grammar forces after
        it, or every text one more token can lead to, that the tokenizer would begin with a
        longer token allowed here: `f` where `follow_user` is forced (its own first token is
        `follow`), `c` where the name is `cd` or `comment`. True where the text is free or
        cannot be judged. Does not advance the state."""
        text = self.spelling.text(token)
        if text is None or token in self.stop_token_ids:
            return True
        after = self.matcher.fork()
        after.accept_token(token)
        if after.is_terminated():
            return True
        forced = after.find_jump_forward_string()
        if forced:
            return not self._respelled(token, text, text + forced)
        if _allowed(self.bitmask, CHOICE_LIMIT_TOKENS, self.vocab_size) is None:
            return True
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        after.fill_next_token_bitmask(bitmask)
        nexts = _allowed(bitmask, CHOICE_LIMIT_TOKENS, self.vocab_size)
        if nexts is None:
            return True
        for nxt in nexts:
            nxt_text = self.spelling.text(nxt)
            if nxt_text is None or nxt in self.stop_token_ids:
                return True
            ahead = after.fork()
            ahead.accept_token(nxt)
            rest = "" if ahead.is_terminated() else ahead.find_jump_forward_string()
            if not self._respelled(token, text, text + nxt_text + rest):
                return True
        return False

    def _respelled(self, token: int, text: str, forced: str) -> bool:
        """Whether the tokenizer begins `forced` (which starts with `token`'s `text`) with a
        longer token that the last `apply` allowed."""
        first = self.spelling.first_token(forced)
        if first is None or first == token:
            return False
        first_text = self.spelling.text(first)
        return (first_text is not None and len(first_text) > len(text)
                and forced.startswith(first_text) and _allows(self.bitmask, first))

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # the mask allowed it: cannot happen
            raise RuntimeError(f"grammar rejected token {token} it had allowed")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def _allowed(bitmask: torch.Tensor, limit: int, vocab_size: int) -> list[int] | None:
    """The token ids a filled bitmask allows; None if there are more than `limit` (counted
    by 32-bit word first, so free text costs a scan of the words, not of the vocabulary)."""
    words = bitmask[0].nonzero().flatten()
    if len(words) > limit:
        return None
    ids = [int(w) * 32 + bit for w in words.tolist() for bit in range(32)
           if (int(bitmask[0, w]) >> bit) & 1]
    ids = [i for i in ids if i < vocab_size]
    return ids if len(ids) <= limit else None


def _allows(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def _utf8(data: bytes) -> str | None:
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return _LOCATION.sub("", text.splitlines()[0])[:500]
