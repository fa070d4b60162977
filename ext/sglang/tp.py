"""Tensor parallelism for the anchor store: one decision per call, taken alike on every rank.

With `--tp N` SGLang runs N schedulers, one per rank, each with its own radix cache and its
own shard of the KV heads (`k_buffer[layer]` is `[slots, kv_heads / N, head_dim]` on each).
SGLang hands every request and every RPC to all of them in the same order (rank 0 receives,
then broadcasts), so each rank keeps its own `AnchorStore` over its own shard, and the
stores stay identical as long as nothing but the call sequence feeds their decisions:

- the slot table's LRU is a logical clock (one tick per commit or hit);
- the staged TTL reads the call's own time (`now`, stamped by the HTTP process), never the
  rank's clock (`AnchorStore.clock` reads `RpcOps.call_time`, ext/sglang/rpc_ops.py);
- the epoch is drawn once, on rank 0, and broadcast (`shared_epoch`);
- only rank 0 pushes the reply of a call (`is_reply_rank`);
- a check that reads the device (`verify`) combines every rank's shard (`all_ranks`);
- what a rank reads from its own disk tier files is agreed (`DiskRanks`, ext/store.py).

The group is what SGLang's `TreeCacheBuildContext.tp_group` holds: its `GroupCoordinator`
(or a bare torch ProcessGroup); None or a group of one is a single rank.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch


def ranks(group: Any) -> int:
    """How many ranks `group` has (1 for None)."""
    if group is None:
        return 1
    size = getattr(group, "world_size", None)
    if size is not None:
        return int(size)
    import torch.distributed as dist

    return int(dist.get_world_size(group))


def _cpu_group(group: Any) -> Any:
    return getattr(group, "cpu_group", group)


def shared_epoch(group: Any, rank: int) -> str:
    """One epoch for the worker: rank 0 draws it, every other rank receives it."""
    if ranks(group) <= 1:
        return secrets.token_hex(8)
    import torch.distributed as dist

    box: list[Any] = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(box, group=_cpu_group(group), group_src=0)
    return str(box[0])


def is_reply_rank(rank: int) -> bool:
    """Rank 0 answers each call; the others apply it and stay silent."""
    return rank == 0


def all_ranks(group: Any, mask: torch.Tensor) -> torch.Tensor:
    """`mask` (bool) true where it is true on every rank; every rank must call it in the
    same call, with a mask of the same shape."""
    if ranks(group) <= 1:
        return mask
    import torch.distributed as dist

    t = mask.to(torch.uint8).cpu()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group(group))
    return t.to(mask.device).bool()


class DiskRanks:
    """`ext/store.Ranks` over the TP group: the ranks' stores agree on what they read from
    their own disk tier files (each rank keeps its shard's files)."""

    def __init__(self, group: Any) -> None:
        self._group = _cpu_group(group)

    def same(self, value: int | None) -> bool:
        import torch.distributed as dist

        v = 0 if value is None else value  # (a 63-bit value: its negation fits too)
        t = torch.tensor([int(value is None), v, -v], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        missing, top, neg_bottom = t.tolist()
        return missing == 0 and top == -neg_bottom  # max == min: the same on every rank

    def common(self, values: list[int]) -> list[int]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, values, group=self._group)
        everywhere = set(values).intersection(*map(set, gathered))
        return [v for v in values if v in everywhere]


def disk_ranks(group: Any) -> DiskRanks | None:
    """The agreement a store of this group needs, or None at one rank."""
    return DiskRanks(group) if ranks(group) > 1 else None
