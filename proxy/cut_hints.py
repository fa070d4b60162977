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


async def with_hint_cuts(split_fn: Splitter, split: SplitResult, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None,
                         template_kwargs: dict[str, Any] | None,
                         hints: Iterable[int]) -> SplitResult:
    """`split` plus a HINT cut after each of the first `k` messages (`k` in `hints`) that
    can be verified; `split` itself when none can. The leading messages are split with
    `split_fn` (the proxy's split thread, which owns the adapter's prefix cache)."""
    ends = [c for c in split.cuts if c.kind is CutKind.MESSAGES]
    if not ends:
        return split
    ids, end = split.input_ids, ends[0].position
    generation = ids[end:]
    floor = split.instruction_cut or 0
    # positions the planner already snapshots; a TURN cut it skips becomes the HINT
    snapshotted = {c.position for c in split.cuts if c.kind is not CutKind.TURN}
    hinted: set[int] = set()
    for k in sorted(set(hints)):
        if not 0 < k < len(messages):
            continue
        try:
            sub = await split_fn(messages[:k], tools, template_kwargs)
        except ApiError:  # fail closed: no hint cut, the request still runs
            continue
        if not sub.cuts:
            continue
        pos = sub.cuts[-1].position
        if sub.input_ids[pos:] == generation and floor < pos < end \
                and pos not in snapshotted and ids[:pos] == sub.input_ids[:pos]:
            hinted.add(pos)
    if not hinted:
        return split
    cuts = [c for c in split.cuts if c.position not in hinted]
    cuts += [Cut(CutKind.HINT, pos) for pos in hinted]
    return replace(split, cuts=tuple(sorted(cuts, key=lambda c: c.position)))
