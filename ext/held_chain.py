"""Late anchor lookup: the deepest chain a worker holds for a prompt, found when the request
starts executing rather than when the proxy planned it.

Sixteen identical new requests are all planned before any of them ran, so none of their
plans names an anchor; the first one to execute writes them. Each request's plan still
lists the depths it wants snapshotted, and the worker can key those depths itself, so a
request that waited in the queue looks them up again when its turn comes and restores the
deepest chain it finds.

Pure bookkeeping (no torch, no backend): `held(key, depth)` is the store's own lookup and
returns a link (anything with `key`, `depth`, `start`, `parent`) or None. Safety is the same
as for a planned restore: every link's key is recomputed here over the prompt being served
(equal key ⇒ equal prefix, namespace and model included), and links must continue each
other down to a root at depth 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from anchorcache.wire import anchor_keys


class Link(Protocol):
    @property
    def key(self) -> bytes: ...
    @property
    def depth(self) -> int: ...
    @property
    def start(self) -> int: ...  # the parent's depth; 0 for a root
    @property
    def parent(self) -> bytes | None: ...


L = TypeVar("L", bound=Link)


def deepest_held_chain(namespace: bytes, model_id: str, ids: Sequence[int],
                       depths: Iterable[int], held: Callable[[bytes, int], L | None]
                       ) -> list[L]:
    """Root→leaf chain ending at the deepest of `depths` (< len(ids)) that `held` has and
    whose every link is a verified prefix of `ids`; [] if none.

    Depths at or past the prompt's end are skipped: the last token must be prefilled to
    produce logits. Does not mutate anything; `held` may count hits as it likes.
    """
    n = len(ids)
    wanted = sorted({d for d in depths if 0 < d < n}, reverse=True)
    if not wanted:
        return []
    keys = anchor_keys(namespace, model_id, ids, wanted)
    for depth in wanted:
        leaf = held(keys[depth], depth)
        if leaf is None or leaf.key != keys[depth] or leaf.depth != depth:
            continue
        chain = _walk_to_root(leaf, held)
        if chain and _verified(namespace, model_id, ids, chain):
            return chain
    return []


def _walk_to_root(leaf: L, held: Callable[[bytes, int], L | None]) -> list[L]:
    chain = [leaf]
    while (link := chain[-1]).parent is not None:
        parent = held(link.parent, link.start)
        if parent is None or parent.key != link.parent or parent.depth != link.start \
                or not parent.depth < link.depth:
            return []  # a link is gone or does not continue: no chain through this leaf
        chain.append(parent)
    if chain[-1].start != 0:
        return []
    chain.reverse()
    return chain


def _verified(namespace: bytes, model_id: str, ids: Sequence[int], chain: list[L]) -> bool:
    keys = anchor_keys(namespace, model_id, ids, [link.depth for link in chain])
    return all(keys[link.depth] == link.key for link in chain)
