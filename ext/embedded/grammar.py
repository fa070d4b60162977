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


class Grammars:
    """Compiles constraints for one model's vocabulary. Thread-safe.

    The vocabulary is read on the first compile (a second or two for a 150k vocabulary), so
    a worker that never sees a constraint never pays for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer,
                                                          vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
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
        return TokenMask(compiled, sorted(set(stop_token_ids)), self.vocab_size)


class TokenMask:
    """One sample's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int],
                 vocab_size: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] → a float32 copy with every forbidden token at -inf."""
        out = logits.float().clone().unsqueeze(0)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(out, self.bitmask, vocab_size=self.vocab_size)
        return out[0]

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # the mask allowed it: cannot happen
            raise RuntimeError(f"grammar rejected token {token} it had allowed")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return _LOCATION.sub("", text.splitlines()[0])[:500]
