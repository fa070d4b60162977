"""Anchor hints: extra cuts a client asks for at message boundaries (Anthropic's
`cache_control`), verified like every cut.

The splitter reports cuts at the boundaries the planner uses (instruction, conversation,
end of messages); a hint asks for one more, after the first `k` messages. It is found
through the splitter's public interface only: the first `k` messages are split on their own,
and the end of that render's messages (its last cut, which the splitter verified) becomes a
HINT cut of the whole prompt when
1. the sub-render's ids after that cut equal the whole prompt's ids after its MESSAGES cut
   (the same generation prompt: the cut really is the end of message `k`), and
2. the whole prompt's ids up to the cut equal the sub-render's (the template renders the
   first `k` messages the same whatever follows them).
Otherwise no cut is made (fail closed: adapters without a MESSAGES cut get no hint cuts).
Correctness never depends on this: anchors are keyed by the token prefix they hold, so a
cut only decides which prefixes are saved for reuse.

`hint_positions` verifies the hints, `add_hint_cuts` adds the cuts. A hint that lands on a
cut the planner snapshots anyway (the instruction cut, for a mark on the system part; the
end of the messages, for one on the last message) adds no cut, but its position still says
which anchor the mark's `ttl` keeps (`leases.py`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

from .errors import ApiError
from .splitter.types import Cut, CutKind, SplitResult

# (messages, tools, template_kwargs) → their split; raises ApiError for a bad chat or when
# the split thread is overloaded (SplitPool.split)
Splitter = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any] | None],
                    Awaitable[SplitResult]]


async def hint_positions(split_fn: Splitter, split: SplitResult, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None,
                         template_kwargs: dict[str, Any] | None,
                         hints: Iterable[int]) -> dict[int, int]:
    """For each hint `k` (in `hints`) whose boundary verifies, the position in `split`'s
    prompt where the first `k` messages end: the instruction cut for a hint on the system
    part (or `k` 0, the tools without system text), the MESSAGES cut for one on the last
    message, a position in between otherwise.
    The leading messages are split with `split_fn` (the proxy's split thread, which owns
    the adapter's prefix cache)."""
    ends = [c for c in split.cuts if c.kind is CutKind.MESSAGES]
    if not ends:
        return {}
    ids, end = split.input_ids, ends[0].position
    generation = ids[end:]
    floor = split.instruction_cut or 0
    out: dict[int, int] = {}
    for k in sorted(set(hints)):
        if k == 0 and floor:  # no message: the instruction prefix (tools only)
            out[k] = floor
            continue
        if k == len(messages):  # the last message: the end of the messages
            out[k] = end
            continue
        if not 0 < k < len(messages):
            continue
        try:
            sub = await split_fn(messages[:k], tools, template_kwargs)
        except ApiError:  # fail closed: no hint cut, the request still runs
            continue
        if not sub.cuts:
            continue
        pos = sub.cuts[-1].position
        if sub.input_ids[pos:] == generation and floor <= pos < end \
                and ids[:pos] == sub.input_ids[:pos]:
            out[k] = pos
    return out


def add_hint_cuts(split: SplitResult, positions: Iterable[int]) -> SplitResult:
    """`split` plus a HINT cut at each of `positions` (verified by `hint_positions`) the
    planner does not snapshot already (a TURN cut there becomes the HINT); `split` itself
    when there is none."""
    ends = [c.position for c in split.cuts if c.kind is CutKind.MESSAGES]
    floor = split.instruction_cut or 0
    # positions the planner already snapshots; a TURN cut it skips becomes the HINT
    snapshotted = {c.position for c in split.cuts if c.kind is not CutKind.TURN}
    hinted = {pos for pos in positions
              if ends and floor < pos < ends[0] and pos not in snapshotted}
    if not hinted:
        return split
    cuts = [c for c in split.cuts if c.position not in hinted]
    cuts += [Cut(CutKind.HINT, pos) for pos in hinted]
    return replace(split, cuts=tuple(sorted(cuts, key=lambda c: c.position)))


async def with_hint_cuts(split_fn: Splitter, split: SplitResult, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None,
                         template_kwargs: dict[str, Any] | None,
                         hints: Iterable[int]) -> SplitResult:
    """`split` plus a HINT cut after each of the first `k` messages (`k` in `hints`) that
    can be verified; `split` itself when none can."""
    found = await hint_positions(split_fn, split, messages, tools, template_kwargs, hints)
    return add_hint_cuts(split, found.values())
