"""A hybrid model under concurrency (issue 38): do anchors cost throughput?

N agent conversations at once (each its turns in order, `sglang_replay.concurrent`), sent
four ways to an SGLang worker on a hybrid model (tiny Qwen3.5 by default, CPU recipe):
SGLang directly (the token ids the proxy renders, to its own `/v1/completions`), a
`--no-anchors` proxy, an `--anchors` proxy over a worker that captures anchor states inside
the forward (ext/sglang/capture.py), and an `--anchors` proxy over a worker that ends
prefill chunks at anchor depths instead (`ANCHORCACHE_SGLANG_HYBRID_CUTS=1`, the path
before). Per N, per pool (`all`: the worker's KV pool holds every conversation; `1.2x`:
1.2x the longest request) and per host tier (`cold`: the anchor tier flushed before the
run; `steady`: the same run once before, unmeasured, so the anchors are written): requests/s
and TTFT p50/p99. Every run starts from an empty device tree (`/flush_cache`). Prints a
table, writes bench/results/<name>.json and .png.

    .venv/bin/python bench/hybrid_concurrency.py [--concurrent 1,4,8,16] [--pools all,1.2x]
        [--tiers cold,steady] [--turns 4] [--model qwen3_5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from replay_bench import model_or_tiny, spawn  # noqa: E402  (bench/ is sys.path[0])
from sglang_replay import concurrent, pick  # noqa: E402

from anchorcache import bench  # noqa: E402
from anchorcache.ext.sglang.config import CUTS_ENV  # noqa: E402
from anchorcache.proxy.splitter import get_adapter  # noqa: E402
from anchorcache.proxy.splitter.tokenizers import load_tokenizer  # noqa: E402
from anchorcache.testing.data import turn_requests  # noqa: E402

RESULTS = REPO / "bench" / "results"
SIDES = ("sglang_direct", "proxy_no_anchors", "proxy_anchors", "proxy_anchors_cuts")


@contextmanager
def env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def scheduler_ms(worker: str) -> dict[str, float]:
    """The worker's cumulative time in anchor work, ms by kind (`/anchor/stats`
    `scheduler_calls`)."""
    calls = httpx.get(worker + "/anchor/stats", timeout=60).json().get("scheduler_calls", [])
    return {c["op"]: c["total_ms"] for c in calls}


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


def stacks(stack: ExitStack, model: str, pool: int, anchor_bytes: int) -> dict[str, tuple]:
    """(url, worker url) of each side: two workers (captures, cuts) with this pool."""
    state = stack.enter_context(tempfile.TemporaryDirectory(prefix="anchorcache-bench-"))
    tail = ("--", "--max-total-tokens", str(pool))
    worker = stack.enter_context(spawn("worker", "--backend", "sglang", "--model", model,
                                       "--anchor-bytes", str(anchor_bytes), tail=tail))
    with env(**{CUTS_ENV: "1"}):
        cuts = stack.enter_context(spawn("worker", "--backend", "sglang", "--model", model,
                                         "--anchor-bytes", str(anchor_bytes), tail=tail))
    proxy = {name: stack.enter_context(spawn("proxy", "--worker", w, flag,
                                             "--state-dir", f"{state}/{name}"))
             for name, w, flag in (("off", worker, "--no-anchors"), ("on", worker, "--anchors"),
                                   ("cuts", cuts, "--anchors"))}
    return {"sglang_direct": (worker, worker), "proxy_no_anchors": (proxy["off"], worker),
            "proxy_anchors": (proxy["on"], worker), "proxy_anchors_cuts": (proxy["cuts"], cuts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_5", help="model dir or tiny arch")
    ap.add_argument("--concurrent", default="1,4,8,16")
    ap.add_argument("--pools", default="all,1.2x")
    ap.add_argument("--tiers", default="cold,steady")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--anchor-gib", type=float, default=2.0)
    ap.add_argument("--name", default="hybrid_concurrency_tiny_qwen3_5")
    args = ap.parse_args()

    model = model_or_tiny(args.model)
    os.environ.setdefault("SGLANG_MAMBA_CONV_DTYPE", "float32")
    adapter = get_adapter("auto", load_tokenizer(model))

    def tokenize(messages, tools):
        return adapter.split(messages, tools or None).input_ids

    ns = [int(n) for n in args.concurrent.split(",")]
    convs = pick(max(ns), args.turns)
    if len(convs) < max(ns):
        raise SystemExit(f"only {len(convs)} conversations have {args.turns} turns")
    lengths = {c["id"]: max(len(tokenize(m, c["tools"])) for m in turn_requests(c, args.turns))
               for c in convs}
    anchor_bytes = int(args.anchor_gib * (1 << 30))
    cells = []
    for pool_kind in args.pools.split(","):
        longest = max(lengths.values()) + args.max_tokens
        pool = (math.ceil(1.2 * longest * max(ns)) if pool_kind == "all"
                else math.ceil(1.2 * longest))
        with ExitStack() as stack:
            sides = stacks(stack, model, pool, anchor_bytes)
            for url, worker in sides.values():  # warm-up, unmeasured: a fresh server's
                # first forwards cost several times a warm one's
                concurrent(url, convs[:2], 2, args.max_tokens, worker,
                           tokenize if url == worker else None)
            for n in ns:
                for tier in args.tiers.split(","):
                    for side in SIDES:
                        url, worker = sides[side]
                        direct = tokenize if side == "sglang_direct" else None
                        anchored = side.startswith("proxy_anchors")
                        if anchored:
                            httpx.post(worker + "/anchor/flush", timeout=60).raise_for_status()
                        if anchored and tier == "steady":  # the anchors written, unmeasured
                            concurrent(url, convs[:n], args.turns, args.max_tokens, worker)
                        before = scheduler_ms(worker)
                        got = concurrent(url, convs[:n], args.turns, args.max_tokens, worker,
                                         direct, ttfts=True)
                        after = scheduler_ms(worker)
                        ttfts = got.pop("ttfts")
                        cell = {"pool": pool_kind, "pool_tokens": pool, "conversations": n,
                                "tier": tier, "side": side, **got,
                                "ttft_p50_s": round(statistics.median(ttfts), 3),
                                "ttft_p99_s": round(p99(ttfts), 3),
                                # the worker's own time in anchor work during the run, by
                                # kind (scheduler loop and copy thread; docs/worker-protocol)
                                "anchor_work_ms": {op: round(ms - before.get(op, 0.0), 1)
                                                   for op, ms in after.items()
                                                   if ms - before.get(op, 0.0) >= 0.05}}
                        cells.append(cell)
                        print(json.dumps(cell), flush=True)
    for cell in cells:
        base = next(c for c in cells if c["side"] == "sglang_direct" and all(
            c[k] == cell[k] for k in ("pool", "conversations", "tier")))
        cell["vs_direct"] = round(cell["requests_per_s"] / base["requests_per_s"], 3)
    print()
    cols = ("pool", "conversations", "tier", "side", "requests_per_s", "vs_direct",
            "ttft_p50_s", "ttft_p99_s")
    print(" ".join(f"{c[:14]:>14}" for c in cols))
    for cell in cells:
        print(" ".join(f"{str(cell[c])[:14]:>14}" for c in cols))
    import torch

    device = "GPU" if torch.cuda.is_available() else "CPU"
    data = {"model": Path(model).name, "device": device, "turns": args.turns,
            "max_tokens": args.max_tokens,
            "conversations": [c["id"] for c in convs], "cells": cells,
            "sides": {"sglang_direct": "SGLang's /v1/completions, the proxy's token ids",
                      "proxy_no_anchors": "proxy --no-anchors",
                      "proxy_anchors": "proxy --anchors, states captured inside the forward "
                                       "(CPU: by the kernels; GPU: a second pass of each "
                                       "GDN layer's)",
                      "proxy_anchors_cuts": "proxy --anchors, prefill chunks end at anchors "
                                            f"({CUTS_ENV}=1)"}}
    bench.write_json(data, RESULTS / f"{args.name}.json")
    plot(cells, RESULTS / f"{args.name}.png", f"{data['model']} on SGLang ({device}), "
         f"{args.turns} turns per conversation")


def plot(cells: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["pool"], c["tier"]) for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (pool, tier) in zip(axes[0], panels, strict=True):
        for side in SIDES:
            pts = sorted((c["conversations"], c["requests_per_s"]) for c in cells
                         if c["pool"] == pool and c["tier"] == tier and c["side"] == side)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=side)
        ax.set_title(f"pool {pool}, host tier {tier}")
        ax.set_xlabel("conversations at once")
        ax.set_ylabel("requests/s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
