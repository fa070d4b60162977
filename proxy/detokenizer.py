"""Incremental detokenization that never emits a broken UTF-8 sequence.

The offsets scheme of vLLM/TGI: decode a short window that ends at the newest token and
emit only the text past what the window's prefix already produced; hold back while the
tail is an incomplete character (U+FFFD). Cost per token is O(window), not O(output).
A Hugging Face `tokenizers` tokenizer runs the same scheme in Rust (its `DecodeStream`: one
call a token, where this module's own steps decode the window and its prefix from Python);
the others (mistral-common, harmony) run it here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenizers.decoders import DecodeStream

from .splitter.tokenizers import HFTokenizer


class IncrementalDetokenizer:
    """`tokenizer`: anything with `decode(ids) -> str` (special tokens kept)."""

    def __init__(self, tokenizer: Any, *, skip_token_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip = frozenset(skip_token_ids)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.count = 0  # tokens added, skipped ones included
        self.marks: list[tuple[int, int]] = []  # (tokens, len(text)) at each emission
        # the Rust steps keep the same offsets as `_step` (emitting moves the window to
        # start where it read up to): `flush`, and `_step` after a failed Rust step, use them
        self._stream = DecodeStream(skip_special_tokens=False) \
            if isinstance(tokenizer, HFTokenizer) else None

    def tokens_before(self, chars: int) -> int:
        """How many leading tokens produced text that ends at or before `chars`: their
        text is exactly a prefix of `text[:chars]`."""
        return max((n for n, c in self.marks if c <= chars), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        start = len(self.text)
        for t in token_ids:
            self.count += 1
            if t in self.skip:
                continue
            self.ids.append(t)
            new = self._step(t)
            if new:
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                self.text += new
                self.marks.append((self.count, len(self.text)))
        return self.text[start:]

    def _step(self, t: int) -> str | None:
        """The text that token `t` (the last of `ids`) completes, if it completes any."""
        if self._stream is not None:
            try:
                return self._stream.step(self.tokenizer.backend, t)
            except Exception:  # (its check that the window's text extends the prefix's)
                self._stream = None  # this module's steps from here on, at the same offsets
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return full[len(prefix):]
        return None

    def flush(self) -> str:
        """Text held back at the end (an incomplete character is emitted as U+FFFD)."""
        full = self._decode(self.ids[self.prefix_offset:])
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        rest = full[len(prefix):]
        self.read_offset = self.prefix_offset = len(self.ids)
        if self._stream is not None:  # an empty window, as the offsets now say
            self._stream = DecodeStream(skip_special_tokens=False)
        self.text += rest
        self.marks.append((self.count, len(self.text)))
        return rest
