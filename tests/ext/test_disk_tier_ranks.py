"""The disk tier under replicated stores (SGLang's tensor-parallel ranks, ext/store.py).

Two real processes joined by torch.distributed over gloo (as SGLang's CPU TP ranks are),
each with its own anchor store and its own shard's files (`<fp>-tp<rank>of2`), fed the same
calls. The ranks' files are written apart and can be damaged apart: here rank 1's leaf of
one chain is flipped, rank 0's root of another is gone, and a third anchor's file exists on
rank 0 only. Through `DiskRanks` both ranks restore the same chains to the same depths, pin
alike, and neither hangs; without it (each rank on its own) the ranks restore different
depths, which on a real worker is one rank attending over rows the other never put back.
"""

from __future__ import annotations

import multiprocessing
import queue
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.ext.test_disk_tier import FP, PROMPT, corrupt_flip, plan, store, write_chain

OTHER = tuple(range(300, 360))  # a second conversation
THIRD = tuple(range(500, 560))


def _rank(rank: int, root: str, agree: bool, out: Any) -> None:
    try:
        import torch.distributed as dist

        from anchorcache.ext.disk_tier import DiskTier
        from anchorcache.ext.sglang.tp import DiskRanks

        dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank,
                                world_size=2)
        group = dist.group.WORLD
        disk = Path(root) / "disk"

        def ranked() -> Any:
            s = store(disk)
            # each rank's own shard's folder, as the SGLang worker builds it
            s.disk = DiskTier(disk, FP, budget_bytes=1 << 30, tp_rank=rank, tp_size=2)
            s.disk.index()
            if agree:
                s.ranks = DiskRanks(group)
            return s

        first = ranked()
        a = write_chain(first, PROMPT, [20, 45])
        b = write_chain(first, OTHER, [20, 45])
        c = write_chain(first, THIRD, [33])
        folder = disk / f"{FP[:16]}-tp{rank}of2"
        if rank == 1:
            corrupt_flip(folder / f"{a[45].hex()}-45.slab")
            (folder / f"{c[33].hex()}-33.slab").unlink()
        else:
            (folder / f"{b[20].hex()}-20.slab").unlink()
        dist.barrier(group)

        fresh = ranked()  # a restarted worker: empty memory, its folder indexed
        seen = {
            "a": [s.depth for s in fresh.check_chain(PROMPT, plan(a, [20, 45])).chain],
            "b": [s.depth for s in fresh.check_chain(OTHER, plan(b, [20, 45])).chain],
            # nothing planned: the late lookup scans the depths the disk holds
            "c": [s.depth for s in fresh.check_chain(THIRD, plan(c, [])).chain],
            "pin_c": fresh.pin(c[33]),
            "pin_b": fresh.pin(b[45]),
            "pin_a": fresh.pin(a[20]),
            "table": sorted((e.key.hex(), e.depth) for e in fresh.table.entries()),
        }
        out.put((rank, seen))
        dist.barrier(group)
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _run(tmp_path: Path, agree: bool) -> dict[int, Any]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), agree, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < 2:
            rank, seen = out.get(timeout=120)  # a rank left waiting on the other: a hang
            assert not isinstance(seen, str), f"rank {rank}:\n{seen}"
            got[rank] = seen
    except queue.Empty:
        pytest.fail(f"the ranks did not both answer (a hang): {got}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def test_ranks_restore_and_pin_alike_whatever_each_ones_files_hold(tmp_path):
    got = _run(tmp_path, agree=True)
    assert got[0] == got[1], got
    seen = got[0]
    assert seen["a"] == [20]  # rank 1's leaf failed its checksum: no rank restores it
    assert seen["b"] == []  # rank 0's root is gone: the chain is gone on both
    assert seen["c"] == []  # only rank 0 holds it: not scanned, not restored
    assert seen["pin_c"] is False and seen["pin_a"] is True  # rank 1 has no file of c
    assert seen["pin_b"] is False  # its root's file is gone (on rank 0): it never restores


def test_without_agreement_the_ranks_part_ways(tmp_path):
    got = _run(tmp_path, agree=False)
    assert got[0]["a"] == [20, 45] and got[1]["a"] == [20]
    assert got[0]["c"] == [33] and got[1]["c"] == []
    assert got[0]["pin_c"] is True and got[1]["pin_c"] is False
    assert got[0]["table"] != got[1]["table"]
