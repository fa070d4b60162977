"""Snapshot / restore throughput of the anchorcache kernels against torch baselines (CPU).

For a 28-layer, 4-kv-head, head_dim-128, bf16 model shape (Qwen-7B-like) and anchors of 1k,
8k and 32k tokens, times three ways of moving the same bytes between the KV cache (SGLang's
``thd`` pool layout) and one slab:

- ``ours``:  one ``kernels.snapshot_kv`` / ``kernels.restore_chain`` call for all layers;
- ``loop``:  a per-layer torch loop (``index_select`` / ``index_copy_`` per layer and K/V);
- ``bound``: one large ``copy_`` of the same number of bytes (the memory bound).

Rows are either a token range or a random index of token slots (SGLang's ``out_cache_loc``).
Prints a table and writes bench/results/ext_snapshot_<device>.json. Usage:
``python bench/ext_snapshot.py [--tokens 1024 8192 32768] [--repeats 5] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from anchorcache.ext import kernels

NUM_LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 28, 4, 128, torch.bfloat16
RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """Best-of-``repeats`` seconds of ``fn`` after one warm-up call.

    The minimum, not the median: on a shared machine other processes only ever add time, and
    a parallel copy that loses a core mid-run can slow down by 10x or more.
    """
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_one(num_tokens: int, rows_kind: str, device: str, repeats: int) -> list[dict]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    pin = device == "cuda"
    k = [torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device=device).to(DTYPE)
         for _ in range(NUM_LAYERS)]
    v = [torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device=device).to(DTYPE)
         for _ in range(NUM_LAYERS)]
    if rows_kind == "range":
        rows: kernels.Rows = (0, num_tokens)
        index = torch.arange(num_tokens, device=device)
    else:
        index = torch.randperm(num_tokens, device=device)
        rows = index
    nbytes = kernels.kv_slab_nbytes(k, num_tokens)
    slab = torch.empty((NUM_LAYERS, 2, num_tokens, KV_HEADS, HEAD_DIM), dtype=DTYPE,
                       pin_memory=pin)
    bound_src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    bound_dst = slab.view(-1).view(torch.uint8)

    def loop_snapshot() -> None:
        for layer in range(NUM_LAYERS):
            for side, cache in ((0, k[layer]), (1, v[layer])):
                if device == "cpu":
                    torch.index_select(cache, 0, index, out=slab[layer, side])
                else:
                    slab[layer, side].copy_(cache.index_select(0, index), non_blocking=True)

    def loop_restore() -> None:
        for layer in range(NUM_LAYERS):
            for side, cache in ((0, k[layer]), (1, v[layer])):
                cache.index_copy_(0, index, slab[layer, side].to(device, non_blocking=True))

    cases = {
        "snapshot": {
            "ours": lambda: kernels.snapshot_kv(k, v, rows, layout="thd", out=slab),
            "loop": loop_snapshot,
            "bound": lambda: bound_dst.copy_(bound_src, non_blocking=True),
        },
        "restore": {
            "ours": lambda: kernels.restore_chain([slab], [rows], k, v, layout="thd"),
            "loop": loop_restore,
            "bound": lambda: bound_src.copy_(bound_dst, non_blocking=True),
        },
    }
    out = []
    for op, fns in cases.items():
        secs = {name: timed(fn, repeats, sync) for name, fn in fns.items()}
        out.append({
            "op": op, "rows": rows_kind, "num_tokens": num_tokens, "bytes": nbytes,
            **{f"{name}_ms": s * 1e3 for name, s in secs.items()},
            **{f"{name}_gbps": nbytes / s / 1e9 for name, s in secs.items()},
            "ours_over_bound_time": secs["ours"] / secs["bound"],
            "loop_over_ours_time": secs["loop"] / secs["ours"],
        })
    return out


def run(device: str, tokens: list[int], repeats: int) -> list[dict]:
    rows = []
    for n in tokens:
        for kind in ("range", "index"):
            rows += bench_one(n, kind, device, repeats)
    header = (f"{'op':9} {'rows':6} {'tokens':>7} {'MiB':>7} {'ours GB/s':>10} "
              f"{'loop GB/s':>10} {'bound GB/s':>11} {'ours/bound':>11} {'loop/ours':>10}")
    print(f"device={device} threads={torch.get_num_threads()} shape: {NUM_LAYERS} layers x "
          f"{KV_HEADS} kv heads x {HEAD_DIM} head_dim, {DTYPE}")
    print(header)
    for r in rows:
        print(f"{r['op']:9} {r['rows']:6} {r['num_tokens']:>7} {r['bytes'] / 2**20:>7.0f} "
              f"{r['ours_gbps']:>10.2f} {r['loop_gbps']:>10.2f} {r['bound_gbps']:>11.2f} "
              f"{r['ours_over_bound_time']:>10.2f}x {r['loop_over_ours_time']:>9.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"ext_snapshot_{device}.json"
    meta = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "machine": platform.machine(), "repeats": repeats,
            "shape": {"num_layers": NUM_LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "dtype": str(DTYPE)}}
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {path}")
    return rows


def main(device: str = "cpu") -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for all three methods (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    run(device, args.tokens, args.repeats)


if __name__ == "__main__":
    main("cpu")
