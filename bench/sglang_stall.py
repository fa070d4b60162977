"""Do anchor copies stall other users? Inter-token latency of streaming requests while other
requests restore long anchor chains, anchors on vs off, on one SGLang worker.

One SGLang worker (tiny Qwen3 by default, CPU recipe). `--restorers` x 2 long prompts of
`--anchor-tokens` tokens each get an anchor at that depth (saved once and confirmed); the
KV pool holds about two of them, so SGLang's tree has always dropped the one a request
needs and every anchored request restores it from the host tier. Then, per mode:

- `--streams` streaming requests (short prompts, `--stream-tokens` tokens each, greedy,
  `ignore_eos`) run while the restorers cycle through their long prompts;
- mode `on`: every other long request restores its anchor (a host -> device copy of the
  whole chain, then a short prefill of the delta); the others are new long prompts that
  write an anchor at `--anchor-tokens` (a device -> host copy of that many rows);
- mode `off`: the same long requests without a plan (SGLang prefills all of them).

Reports inter-token latency p50/p99 of the streams per mode, and the scheduler's time
inside anchor work, per kind (`/anchor/stats` `scheduler_calls`: calls, mean, max):
`restore` (verify, allocate, queue the copy), `land` (insert a copied prefix) and
`snapshot` (allocate, queue the copy) are on the scheduler's loop; `copy` and
`restore_copy` are the copies' time on the copy thread, `copy_wait` what of a snapshot copy
the loop still waited for at release, `restore_wait` the rounds a restoring request was
passed over while its copy ran. Prints a table, writes bench/results/<name>.json.

    .venv/bin/python bench/sglang_stall.py [--anchor-tokens 16384] [--rounds 2]

On a GPU `bench/gpu_check.sh` runs it with a real model.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from replay_bench import model_or_tiny, spawn  # noqa: E402  (same folder: bench/ is sys.path[0])

from anchorcache import bench  # noqa: E402
from anchorcache.wire import (  # noqa: E402
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    GenerateRequest,
    Region,
    SamplingParams,
    SnapshotSpec,
)

RESULTS = REPO / "bench" / "results"
NS = bytes(range(16))


def post(client: httpx.Client, url: str, body: dict) -> dict:
    reply = client.post(url, json=body)
    reply.raise_for_status()
    return reply.json()


def save_anchor(client: httpx.Client, worker: str, ids: list[int], depth: int) -> bytes:
    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(depth, AnchorKind.CONVERSATION, Region.THICK),))
    req = GenerateRequest(tuple(ids), SamplingParams(max_new_tokens=1, temperature=0.0),
                          anchor=plan)
    anchors = post(client, worker + "/generate", req.to_json())["meta_info"]["anchors"]
    post(client, worker + "/anchor/confirm", {"slots": [w["slot"] for w in anchors["written"]]})
    (w,) = [w for w in anchors["written"] + anchors["held"] if w["depth"] == depth]
    return bytes.fromhex(w["key"])


def stream_itl(worker: str, ids: list[int], tokens: int) -> list[float]:
    """Seconds between consecutive token events of one streaming request (SGLang may put
    more than one token in an event; the gap is what a user sees)."""
    req = GenerateRequest(tuple(ids), SamplingParams(max_new_tokens=tokens, temperature=0.0,
                                                     ignore_eos=True), stream=True)
    stamps = []
    with httpx.Client(timeout=900) as client, \
            client.stream("POST", worker + "/generate", json=req.to_json()) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("output_ids"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


def run_mode(worker: str, mode: str, longs: list[tuple[list[int], bytes]], depth: int,
             streams: list[list[int]], stream_tokens: int, restorers: int,
             vocab: int) -> dict:
    rng = random.Random(mode)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1000, min(vocab, 100_000)) for _ in range(n)]

    httpx.post(worker + "/flush_cache", timeout=120).raise_for_status()
    done = threading.Event()
    long_requests = [0]

    def restorer(i: int) -> None:
        mine = longs[i::restorers]
        with httpx.Client(timeout=900) as client:
            k = 0
            while not done.is_set():
                ids, key = mine[k // 2 % len(mine)]
                plan = AnchorPlan(NS, restore=(AnchorRef(key, depth),))
                if k % 2:  # a new long prompt, whose anchor is written (and never confirmed)
                    ids = fresh(len(ids))
                    plan = AnchorPlan(NS, snapshot=(SnapshotSpec(depth, AnchorKind.CONVERSATION,
                                                                 Region.THICK),))
                plan = plan if mode == "on" else None
                req = GenerateRequest(tuple(ids), SamplingParams(max_new_tokens=1,
                                                                 temperature=0.0), anchor=plan)
                post(client, worker + "/generate", req.to_json())
                long_requests[0] += 1
                k += 1

    with cf.ThreadPoolExecutor(restorers + len(streams)) as pool:
        background = [pool.submit(restorer, i) for i in range(restorers)]
        time.sleep(0.5)  # the copies are under way before the streams start
        itl = [x for f in [pool.submit(stream_itl, worker, s, stream_tokens) for s in streams]
               for x in f.result()]
        done.set()
        for f in background:
            f.result()
    itl.sort()
    return {"itl_p50_ms": round(1e3 * statistics.median(itl), 2),
            "itl_p99_ms": round(1e3 * itl[min(len(itl) - 1, int(0.99 * len(itl)))], 2),
            "itl_max_ms": round(1e3 * itl[-1], 2), "tokens": len(itl),
            "long_requests": long_requests[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model dir (default: the tiny Qwen3)")
    ap.add_argument("--anchor-tokens", type=int, default=16384)
    ap.add_argument("--restorers", type=int, default=4)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="on/off alternations")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--name", default="sglang_stall")
    args = ap.parse_args()

    model = model_or_tiny(args.model)
    depth = args.anchor_tokens
    rng = random.Random(0)
    pool = int(2.5 * (depth + 64)) + args.streams * (256 + args.stream_tokens)
    with spawn("worker", "--backend", "sglang", "--model", model, "--anchor-bytes",
               str(8 << 30), tail=("--", "--max-total-tokens", str(pool),
                                   "--page-size", str(args.page_size))) as worker, \
            httpx.Client(timeout=900) as client:
        vocab = client.get(worker + "/model_info").json()["vocab_size"]

        def tokens(n: int) -> list[int]:
            return [rng.randrange(1000, min(vocab, 100_000)) for _ in range(n)]

        longs = []
        for _ in range(2 * args.restorers):
            ids = tokens(depth + 32)
            longs.append((ids, save_anchor(client, worker, ids, depth)))
        streams = [tokens(256) for _ in range(args.streams)]
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                runs[mode].append(run_mode(worker, mode, longs, depth, streams,
                                           args.stream_tokens, args.restorers, vocab))
                print(mode, runs[mode][-1], flush=True)
        stats = client.get(worker + "/anchor/stats").json()
    out = {mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
           for mode, rs in runs.items()}
    out["itl_p99_on_over_off"] = round(out["on"]["itl_p99_ms"] / out["off"]["itl_p99_ms"], 3)
    data = {"model": Path(model).name, "anchor_tokens": depth, "restorers": args.restorers,
            "streams": args.streams, "stream_tokens": args.stream_tokens,
            "page_size": args.page_size, "pool_tokens": pool, "summary": out, "runs": runs,
            "scheduler_calls": stats.get("scheduler_calls")}
    print(f"{'mode':>5} {'itl p50 ms':>11} {'itl p99 ms':>11} {'itl max ms':>11} {'long reqs':>10}")
    for mode in ("off", "on"):
        o = out[mode]
        print(f"{mode:>5} {o['itl_p50_ms']:>11} {o['itl_p99_ms']:>11} {o['itl_max_ms']:>11} "
              f"{o['long_requests']:>10}")
    print("p99 on/off:", out["itl_p99_on_over_off"])
    print(f"\n{'scheduler work':>14} {'calls':>6} {'mean ms':>8} {'max ms':>8}")
    for c in data["scheduler_calls"] or []:
        mean = c["total_ms"] / max(c["calls"], 1)
        print(f"{c['op']:>14} {c['calls']:>6} {mean:>8.2f} {c['max_ms']:>8.2f}")
    bench.write_json(data, RESULTS / f"{args.name}.json")


if __name__ == "__main__":
    main()
