"""Message text is tokenized as text: a special-token string inside content never becomes a
control token; the template's own markup is the only source of them.

How, for every adapter that renders text (Python mirrors and Jinja templates alike):
1. `defuse` replaces, in every string of the request (content, names, arguments, tool
   schemas, dict keys too), each special-token string by a placeholder: `ESC` plus one
   private-use character naming the token; a literal `ESC` becomes `ESC ESC`, so the mapping
   is injective. The template renders as usual, so every special token left in the
   rendered text is markup.
2. `encode` turns the rendered text into ids. Text without any placeholder (every normal
   prompt) is encoded whole by the tokenizer, exactly as the model's own template +
   tokenizer would. Text with placeholders is split at its (markup) special tokens
   (leftmost-longest, as the tokenizer's added-token matcher does), each becomes its id,
   and each gap between them is encoded on its own: tokenizers split added tokens out of
   the text before normalizing or pre-tokenizing, so this equals whole-text encoding;
   gaps with placeholders are restored to the client's text and encoded with
   `encode_text` (special-token strings stay text, the `tokenizers` library's
   `encode_special_tokens`, which is transformers' `split_special_tokens`).

`SpecialGuard` is immutable after construction and safe to share between threads.
Libraries that render tokens themselves (openai-harmony, mistral-common) already encode
message text without special tokens; their adapters do not need this (tests check both).
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

ESC = "\U000f0000"  # Supplementary Private Use Area-A: no tokenizer gives it a meaning
_FIRST_NAME = 0xF0001


def _json_text(value: Any) -> str:
    """`value` as JSON text with every string verbatim (what `defuse` scans): orjson, in C;
    json for what orjson refuses (integer keys, integers past 64 bits, lone surrogates)."""
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(value, ensure_ascii=False, check_circular=False)


class SpecialGuard:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        specials = sorted(getattr(tokenizer, "specials", ()), key=lambda t: (-len(t), t))
        if len(specials) > 0xFFFD - 1:
            raise ValueError(f"tokenizer {tokenizer.name} has too many special tokens")
        self._names = {t: ESC + chr(_FIRST_NAME + i) for i, t in enumerate(specials)}
        self._originals = {v[1]: k for k, v in self._names.items()} | {ESC: ESC}
        self._special_rx = re.compile("|".join(map(re.escape, specials))) if specials else None
        # cheap pre-check before the regex: the two-character starts of every special token
        self._starts = tuple({t[:2] for t in specials} | {ESC})
        # JSON text holds every string verbatim unless it needs escaping
        self._json_check = not any(c in t for t in specials for c in '"\\/') and all(
            c >= " " for t in specials for c in t)
        self._ids = {t: tokenizer.token_to_id(t) for t in specials}
        strip = {t.content: (t.lstrip, t.rstrip)
                 for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special} \
            if hasattr(tokenizer, "backend") else {}
        self._strip = {t: s for t, s in strip.items() if any(s)}

    # -- 1. before rendering -------------------------------------------------------------

    def defuse_text(self, text: str) -> str:
        if not any(s in text for s in self._starts):
            return text
        text = text.replace(ESC, ESC + ESC)
        if self._special_rx is None:
            return text
        return self._special_rx.sub(lambda m: self._names[m.group(0)], text)

    def defuse(self, value: Any) -> Any:
        """`value` (normalized messages or tools) with every string defused: a copy, or
        `value` itself when no string needs it (checked on its JSON text, in C)."""
        if self._json_check and value is not None and not isinstance(value, str):
            text = _json_text(value)
            if not any(s in text for s in self._starts) or not (
                    (self._special_rx is not None and self._special_rx.search(text))
                    or ESC in text):
                return value
        return self._defuse(value)

    def _defuse(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.defuse_text(value)
        if isinstance(value, dict):
            return {(self.defuse_text(k) if isinstance(k, str) else k): self._defuse(v)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [self._defuse(v) for v in value]
        return value

    def restore(self, text: str) -> str:
        """The client's text back from a rendered (defused) text."""
        if ESC not in text:
            return text
        out, i = [], 0
        while True:
            j = text.find(ESC, i)
            if j < 0 or j + 1 >= len(text):
                out.append(text[i:])
                return "".join(out)
            out.append(text[i:j])
            out.append(self._originals.get(text[j + 1], text[j: j + 2]))
            i = j + 2

    # -- 2. after rendering --------------------------------------------------------------

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Rendered texts → ids (see module docstring); one batched call for plain texts."""
        plain = [i for i, t in enumerate(texts) if ESC not in t]
        out: list[list[int]] = [[] for _ in texts]
        for i, ids in zip(plain, self.tokenizer.encode_batch([texts[i] for i in plain]),
                          strict=True):
            out[i] = ids
        for i, t in enumerate(texts):
            if ESC in t:
                out[i] = self.encode_with_ends(t)[0]
        return out

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """Ids and, per token, the end offset in `text` (the rendered, defused text) of the
        characters it covers (a token inside a restored placeholder ends at its end)."""
        backend = self.tokenizer.backend
        if ESC not in text:  # encode_batch releases the GIL (encode does not): see tokenizers.py
            enc = backend.encode_batch([text], add_special_tokens=False)[0]
            return list(enc.ids), [end for _, end in enc.offsets]
        ids: list[int] = []
        ends: list[int] = []
        pos = 0
        matches = list(self._special_rx.finditer(text)) if self._special_rx else []
        for k, m in enumerate(matches + [None]):
            start = len(text) if m is None else m.start()
            gap_start, gap_end = pos, start
            if k and matches[k - 1].group(0) in self._strip and self._strip[
                    matches[k - 1].group(0)][1]:
                while gap_start < gap_end and text[gap_start].isspace():
                    gap_start += 1
            if m is not None and self._strip.get(m.group(0), (False, False))[0]:
                while gap_end > gap_start and text[gap_end - 1].isspace():
                    gap_end -= 1
            if gap_end > gap_start:
                self._encode_gap(text, gap_start, gap_end, ids, ends)
            if m is not None:
                ids.append(self._ids[m.group(0)])
                ends.append(m.end())
                pos = m.end()
        return ids, ends

    def _encode_gap(self, text: str, start: int, end: int, ids: list[int],
                    ends: list[int]) -> None:
        gap = text[start:end]
        if ESC not in gap:
            enc = self.tokenizer.backend.encode_batch([gap], add_special_tokens=False)[0]
            ids.extend(enc.ids)
            ends.extend(start + e for _, e in enc.offsets)
            return
        # restore, remembering for each restored character where it came from
        restored: list[str] = []
        origin: list[int] = []  # per restored char: end offset in `text` it maps to
        i = 0
        while i < len(gap):
            if gap[i] == ESC and i + 1 < len(gap):
                piece = self._originals.get(gap[i + 1], gap[i: i + 2])
                restored.append(piece)
                origin.extend([start + i + 2] * len(piece))
                i += 2
            else:
                restored.append(gap[i])
                origin.append(start + i + 1)
                i += 1
        enc = self.tokenizer.text_backend.encode_batch(["".join(restored)],
                                                       add_special_tokens=False)[0]
        ids.extend(enc.ids)
        ends.extend(origin[e - 1] if e > 0 else start for _, e in enc.offsets)
