"""Tool cuts: the token positions inside the instruction prefix where each tool's schema ends.

Two toolsets that start with the same tools (agents built from the same tool classes, one
more tool added) share the prompt up to the end of the last common tool. An anchor there
lets the second toolset restore that part instead of prefilling it (the planner chooses
which cuts to snapshot: `proxy/planner.py`).

How a tool cut is found, for any adapter that renders text:
1. Render the request with only the first `k` tools. Its longest common prefix with the
   instruction prefix rendered with every tool ends where tool `k`'s schema ends (the
   render goes on with tool `k + 1` in one, with the end of the tool block in the other).
2. Encode the text between consecutive boundaries separately (one batched call). If the
   pieces' ids, concatenated, equal the prompt's own ids up to the last boundary, each
   boundary falls between two tokens and the ids before it are an encoding of the text
   before it; otherwise there is no tool cut at all (fail closed).
The result depends only on the instruction prefix's text (the tools are in it), so it is
memoized by that text's digest: a toolset costs its renders and one encode once.

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

log = logging.getLogger("anchorcache.splitter")


class ToolCutMemo:
    """Bounded LRU: instruction-prefix digest → its tool cuts. Thread-safe."""

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_compute(self, instruction_text: str,
                       compute: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
        key = hashlib.blake2b(instruction_text.encode("utf-8", "surrogatepass"),
                              digest_size=16, person=b"ac.toolcuts.v1").digest()
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


def tool_cuts(instruction_text: str, instruction_ids: Sequence[int], num_tools: int,
              render_with: Callable[[int], str],
              encode_batch: Callable[[list[str]], list[list[int]]]) -> tuple[int, ...]:
    """Token positions (strictly increasing, each inside the instruction prefix) where each
    of the first `num_tools - 1` tools' schema ends; () when any step fails (module
    docstring). `render_with(k)`: the request's text rendered with its first `k` tools."""
    if num_tools < 2:
        return ()
    bounds: list[int] = []
    for k in range(1, num_tools):
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
