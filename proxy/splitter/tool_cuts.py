"""Tool cuts: token positions inside the instruction prefix where a tool's schema ends.

Two toolsets that start with the same tools (agents built from the same tool classes, one
more tool added) share the prompt up to the end of the last common tool. An anchor there
lets the second toolset restore that part instead of prefilling it (the planner chooses
which cuts to snapshot: `proxy/planner.py`).

Which tools: not every one. A cut is looked for after tool `k` only where the tools'
estimated size (their JSON, at `CHARS_PER_TOKEN`) crosses the next `spacing_tokens` since
the last candidate, at most `max_renders` of them: about one candidate per anchor the planner
can write (they must be `--tool-anchor-gap` tokens apart), never one render per tool. The
estimate is a function of the tools up to `k` only, so two toolsets that share their first
tools pick the same candidates there, and their cuts agree.

How a cut is found, for any adapter that renders text:
1. Render the request's leading messages with only the first `k` tools. Its longest common
   prefix with the instruction prefix rendered with every tool ends where tool `k`'s schema
   ends (the render goes on with tool `k + 1` in one, with the end of the tool block in the
   other).
2. Encode the text between consecutive boundaries separately (one batched call). If the
   pieces' ids, concatenated, equal the prompt's own ids up to the last boundary, each
   boundary falls between two tokens and the ids before it are an encoding of the text
   before it; otherwise there is no tool cut at all (fail closed).
The result depends only on the instruction prefix's text (the tools are in it), so it is
memoized by that text's digest and the caller's scope (its tenant: another tenant's toolset
must not make this one's split faster): a toolset costs its renders and one encode once.

A cut only ever decides where an anchor may be; an anchor's key covers every token before
it, so a cut that no other prompt shares is a miss, never a wrong restore.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from anchorcache.defaults import TOOL_ANCHOR_GAP_TOKENS

log = logging.getLogger("anchorcache.splitter")

# characters of tool JSON per token, a low estimate for BPE tokenizers (3.5-4.5 seen on
# BFCL tool schemas): candidates then fall about a spacing or more apart in tokens
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class ToolCutLimits:
    """How much a split may spend on tool cuts: candidates about `spacing_tokens` apart
    (0: no tool cuts), at most `max_renders` renders, none for a prompt of more than
    `max_prompt_tokens` (it cannot be served anyway)."""

    spacing_tokens: int = TOOL_ANCHOR_GAP_TOKENS
    max_renders: int = 16
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.spacing_tokens < 0 or self.max_renders < 0:
            raise ValueError("spacing_tokens and max_renders must be >= 0")


class ToolCutMemo:
    """Bounded LRU: (scope, instruction-prefix digest) → its tool cuts. Thread-safe."""

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_compute(self, instruction_text: str, compute: Callable[[], tuple[int, ...]],
                       scope: bytes = b"") -> tuple[int, ...]:
        h = hashlib.blake2b(digest_size=16, person=b"ac.toolcuts.v2")
        h.update(len(scope).to_bytes(4, "little") + scope)
        h.update(instruction_text.encode("utf-8", "surrogatepass"))
        key = h.digest()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        cuts = compute()
        with self._lock:
            self._entries[key] = cuts
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return cuts


def candidates(tools: Sequence[dict], limits: ToolCutLimits) -> list[int]:
    """The `k`s (each in `[1, len(tools) - 1]`) after which a tool cut is looked for: where
    the first `k` tools' estimated tokens pass the last candidate's by `spacing_tokens`;
    each depends on `tools[:k]` only."""
    if not limits.spacing_tokens:
        return []
    step = limits.spacing_tokens * CHARS_PER_TOKEN
    out: list[int] = []
    size, next_at = 0, step
    for k, tool in enumerate(tools[:-1], 1):
        if len(out) >= limits.max_renders:
            break
        size += len(orjson.dumps(tool))
        if size >= next_at:
            out.append(k)
            next_at = size + step
    return out


def tool_cuts(instruction_text: str, instruction_ids: Sequence[int], ks: Sequence[int],
              render_with: Callable[[int], str],
              encode_batch: Callable[[list[str]], list[list[int]]]) -> tuple[int, ...]:
    """Token positions (strictly increasing, each inside the instruction prefix) where the
    schemas of the first `k` tools end, for each `k` of `ks` (increasing); () when any step
    fails (module docstring). `render_with(k)`: the request's leading text rendered with its
    first `k` tools."""
    if not ks:
        return ()
    bounds: list[int] = []
    for k in ks:
        try:
            text = render_with(k)
        except Exception as exc:  # a template that rejects fewer tools: no tool cuts
            log.debug("tool cuts: the render with %d tools failed: %s", k, exc)
            return ()
        end = len(os.path.commonprefix([text, instruction_text]))  # noqa: RUF071 (text, not paths)
        if end >= len(instruction_text) or (bounds and end <= bounds[-1]) or end <= 0:
            return ()  # not strictly inside the instruction prefix, or out of order
        bounds.append(end)
    pieces = encode_batch([instruction_text[a:b] for a, b in zip([0, *bounds], bounds, strict=False)])
    positions, ids = [], []
    for piece in pieces:
        ids.extend(piece)
        positions.append(len(ids))
    if positions[-1] >= len(instruction_ids) or list(instruction_ids[:len(ids)]) != ids:
        return ()
    return tuple(positions)
