"""Incremental detokenization that never emits a broken UTF-8 sequence.

The offsets scheme of vLLM/TGI: decode a short window that ends at the newest token and
emit only the text past what the window's prefix already produced; hold back while the
tail is an incomplete character (U+FFFD). Cost per token is O(window), not O(output).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


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
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                new = full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                self.text += new
                self.marks.append((self.count, len(self.text)))
        return self.text[start:]

    def flush(self) -> str:
        """Text held back at the end (an incomplete character is emitted as U+FFFD)."""
        full = self._decode(self.ids[self.prefix_offset:])
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        rest = full[len(prefix):]
        self.read_offset = self.prefix_offset = len(self.ids)
        self.text += rest
        self.marks.append((self.count, len(self.text)))
        return rest
