"""Agent conversations through the proxy in front of SGLang: SGLang alone vs with anchors.

Starts one SGLang worker (tiny Qwen3 with the real Qwen3 tokenizer by default, CPU recipe)
whose KV pool (`--max-total-tokens`) is about 1.2x the longest request, and two proxies in
front of it: `--no-anchors` (SGLang's own radix cache is all there is) and `--anchors`
(plus the host tier). The conversations are interleaved round-robin (turn 1 of every
conversation, then turn 2, ...), as concurrent agents would send them, so SGLang's small
pool evicts one conversation's prefix while the others run. Each side replays everything
from an empty device tree (`/flush_cache` before it). Per turn: prompt tokens, tokens
prefilled on each side, the ideal (tokens no earlier request presented) and TTFT, via
`anchorcache.bench` (`ask`, `lcp`, `report`, `plot`). With `--page-size N` the summary also
has `ideal_paged`: what an engine that reuses whole pages only could skip at best (the
shared prefix rounded down to a page). Prints a table, writes bench/results/<name>.json
and .png.

    .venv/bin/python bench/sglang_replay.py [--conversations 6] [--turns 5] [--concurrent 8]

A hybrid model (`--model qwen3_5`: the tiny Gated DeltaNet Qwen3.5; the CPU recipe serves it
with SGLang's `no_buffer` Mamba strategy) is run with its conv window in float32
(`SGLANG_MAMBA_CONV_DTYPE`, unless set: SGLang's default bfloat16 rounds a float32 model's
state at every chunk end, docs/sglang.md "Numerics").

With `--concurrent N` (default 8) it then measures the proxy's overhead: a second SGLang
worker with a pool large enough for every conversation (so eviction plays no part), and N
conversations at once (each its turns in order, every side from an empty device tree)
sent three ways: straight to SGLang's own `/v1/completions` as the token ids the proxy
renders (the same prompts, nothing in front of SGLang), through a `--no-anchors` proxy,
and through an `--anchors` proxy. The sides alternate over `--rounds` rounds;
requests/s and TTFT per side are the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from replay_bench import model_or_tiny, spawn  # noqa: E402  (same folder: bench/ is sys.path[0])

from anchorcache import bench  # noqa: E402
from anchorcache.proxy.splitter import get_adapter  # noqa: E402
from anchorcache.proxy.splitter.tokenizers import load_tokenizer  # noqa: E402
from anchorcache.testing.data import conversations, turn_requests  # noqa: E402

RESULTS = REPO / "bench" / "results"


def pick(n: int, turns: int) -> list[dict]:
    """The first n conversations with at least `turns` turns."""
    return [c for c in conversations("base") if len(turn_requests(c, turns)) == turns][:n]


def run_pass(client: httpx.Client, target: bench.BenchTarget, worker: str, convs, turns: int,
             max_tokens: int) -> dict[tuple[int, int], bench.Reply]:
    """Every turn, round-robin over the conversations, from an empty device tree."""
    httpx.post(worker + "/flush_cache", timeout=60).raise_for_status()
    out = {}
    for t in range(turns):
        for c, conv in enumerate(convs):
            messages = turn_requests(conv, turns)[t]
            out[c, t] = bench.ask(client, target, messages, conv["tools"], max_tokens)
    return out


def concurrent(url: str, convs, turns: int, max_tokens: int, worker: str,
               tokenize=None, ttfts: bool = False) -> dict:
    """Every conversation in its own thread (its turns in order): requests/s and TTFT.
    With `tokenize`, the prompts go as token ids to `/v1/completions` (SGLang's own
    server, nothing rendered in front of it), else as chats to `/v1/chat/completions`.
    With `ttfts`, every request's TTFT too (`ttfts`)."""
    import concurrent.futures as cf
    import time

    httpx.post(worker + "/flush_cache", timeout=60).raise_for_status()

    def one(conv) -> list[bench.Reply]:
        target = bench.BenchTarget(url)
        with httpx.Client(timeout=900) as client:
            if tokenize is not None:
                return [bench.ask_tokens(client, target, list(tokenize(m, conv["tools"])),
                                         max_tokens) for m in turn_requests(conv, turns)]
            return [bench.ask(client, target, m, conv["tools"], max_tokens)
                    for m in turn_requests(conv, turns)]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(convs)) as pool:
        replies = [r for rs in pool.map(one, convs) for r in rs]
    wall = time.perf_counter() - t0
    times = [r.ttft_s for r in replies]
    return {**({"ttfts": times} if ttfts else {}), "requests": len(replies),
            "wall_s": round(wall, 2),
            "requests_per_s": round(len(replies) / wall, 3),
            "ttft_median_s": round(statistics.median(times), 3),
            "ttft_max_s": round(max(times), 3),
            "prompt_tokens": sum(r.usage["prompt_tokens"] for r in replies),
            "completion_tokens": sum(r.usage["completion_tokens"] for r in replies)}


def overhead(model: str, convs, turns: int, max_tokens: int, longest: int, rounds: int,
             anchor_bytes: int, tokenize, page_size: int = 1) -> dict:
    """Proxy (anchors off, on) vs SGLang directly, N conversations at once, on one worker
    whose pool holds them all; sides alternate, medians over the rounds. SGLang directly
    gets the very token ids the proxy renders, through its own `/v1/completions`."""
    pool = math.ceil(1.2 * longest * len(convs))
    sides: dict[str, list[dict]] = {"sglang_direct": [], "proxy_no_anchors": [],
                                    "proxy_anchors": []}
    with ExitStack() as stack:
        state = stack.enter_context(tempfile.TemporaryDirectory(prefix="anchorcache-bench-"))
        worker = stack.enter_context(spawn(
            "worker", "--backend", "sglang", "--model", model, "--anchor-bytes",
            str(anchor_bytes), tail=("--", "--max-total-tokens", str(pool),
                                     "--page-size", str(page_size))))
        urls = {"sglang_direct": worker,
                "proxy_no_anchors": stack.enter_context(spawn(
                    "proxy", "--worker", worker, "--no-anchors", "--state-dir", state + "/off")),
                "proxy_anchors": stack.enter_context(spawn(
                    "proxy", "--worker", worker, "--anchors", "--state-dir", state + "/on"))}
        for r in range(rounds):
            names = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in names:
                if name == "proxy_anchors":  # every round from an empty host tier too
                    httpx.post(worker + "/anchor/flush", timeout=60).raise_for_status()
                sides[name].append(concurrent(urls[name], convs, turns, max_tokens, worker,
                                              tokenize if name == "sglang_direct" else None))
                print(name, json.dumps(sides[name][-1]), flush=True)
    out: dict = {"conversations": len(convs), "turns": turns, "rounds": rounds,
                 "sglang_max_total_tokens": pool}
    for name, runs in sides.items():
        out[name] = {"requests_per_s": statistics.median(x["requests_per_s"] for x in runs),
                     "ttft_median_s": statistics.median(x["ttft_median_s"] for x in runs),
                     "prompt_tokens": runs[0]["prompt_tokens"],
                     "completion_tokens": runs[0]["completion_tokens"], "runs": runs}
    direct = out["sglang_direct"]
    for name in ("proxy_no_anchors", "proxy_anchors"):
        out[name]["throughput_vs_direct"] = round(
            out[name]["requests_per_s"] / direct["requests_per_s"], 3)
        out[name]["ttft_vs_direct"] = round(out[name]["ttft_median_s"] / direct["ttft_median_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None,
                    help="model dir, or a tiny arch (qwen3_5, granite_swa); default: the tiny "
                         "Qwen3")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pool-factor", type=float, default=1.2,
                    help="SGLang's --max-total-tokens over the longest request")
    ap.add_argument("--anchor-gib", type=float, default=2.0, help="host tier size")
    ap.add_argument("--concurrent", type=int, default=8,
                    help="then N conversations at once: SGLang's own /v1/chat/completions "
                         "vs the proxy, anchors off and on (0: skip)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the overhead check")
    ap.add_argument("--page-size", type=int, default=1,
                    help="SGLang's --page-size (paged KV: restores put back whole pages)")
    ap.add_argument("--name", default="sglang_replay_tiny_qwen3")
    args = ap.parse_args()

    model = model_or_tiny(args.model)
    os.environ.setdefault("SGLANG_MAMBA_CONV_DTYPE", "float32")  # (dense models: unused)
    adapter = get_adapter("auto", load_tokenizer(model))

    def tokenize(messages, tools):
        return adapter.split(messages, tools or None).input_ids

    convs = pick(args.conversations, args.turns)
    ids = {(c, t): tokenize(turn_requests(conv, args.turns)[t], conv["tools"])
           for c, conv in enumerate(convs) for t in range(args.turns)}
    longest = max(len(v) for v in ids.values()) + args.max_tokens
    pool = math.ceil(args.pool_factor * longest)
    order = [(c, t) for t in range(args.turns) for c in range(len(convs))]
    seen: list = []
    ideal, ideal_paged = {}, {}
    for key in order:
        shared = max((bench.lcp(ids[key], s) for s in seen), default=0)
        ideal[key] = len(ids[key]) - shared
        # what an engine with this page size could skip at best: whole pages of it
        ideal_paged[key] = len(ids[key]) - shared // args.page_size * args.page_size
        seen.append(ids[key])
    print(f"{len(convs)} conversations x {args.turns} turns, longest request {longest} tokens, "
          f"SGLang pool {pool} tokens", flush=True)

    with ExitStack() as stack, httpx.Client(timeout=900) as client:
        state = stack.enter_context(tempfile.TemporaryDirectory(prefix="anchorcache-bench-"))
        worker = stack.enter_context(spawn(
            "worker", "--backend", "sglang", "--model", model,
            "--anchor-bytes", str(int(args.anchor_gib * (1 << 30))),
            tail=("--", "--max-total-tokens", str(pool), "--page-size", str(args.page_size))))
        on = stack.enter_context(spawn("proxy", "--worker", worker, "--anchors",
                                       "--state-dir", state + "/on"))
        off = stack.enter_context(spawn("proxy", "--worker", worker, "--no-anchors",
                                        "--state-dir", state + "/off"))
        replies_off = run_pass(client, bench.BenchTarget(off), worker, convs, args.turns,
                               args.max_tokens)
        replies_on = run_pass(client, bench.BenchTarget(on), worker, convs, args.turns,
                              args.max_tokens)
        info = httpx.get(worker + "/model_info").json()
        stats = httpx.get(worker + "/anchor/stats").json()
    load = {}
    if args.concurrent:
        cconvs = pick(args.concurrent, args.turns)
        clongest = max(len(tokenize(m, c["tools"])) for c in cconvs
                       for m in turn_requests(c, args.turns)) + args.max_tokens
        load = overhead(model, cconvs, args.turns, args.max_tokens, clongest, args.rounds,
                        int(args.anchor_gib * (1 << 30)), tokenize, args.page_size)
        print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"}
                          if isinstance(v, dict) else v for k, v in load.items()}, indent=1),
              flush=True)

    rows = []
    for c, t in order:
        r_on, r_off = replies_on[c, t], replies_off[c, t]
        u = r_on.usage
        if u["prompt_tokens"] != len(ids[c, t]):
            raise SystemExit(f"the proxy counted {u['prompt_tokens']} prompt tokens, the "
                             f"local tokenizer {len(ids[c, t])}")
        rows.append(bench.TurnResult.from_replies(str(convs[c]["id"]), t + 1, ideal[c, t],
                                                  r_on, r_off))

    print()
    print(" ".join(f"{c:>12}" for c in bench.TABLE_COLUMNS))
    for row in bench.table_rows(rows):
        print(" ".join(f"{v[-12:]:>12}" for v in row))
    meta = {"backend": "sglang", "sglang_max_total_tokens": pool, "longest_request": longest,
            "pool_factor": args.pool_factor, "anchor_bytes": int(args.anchor_gib * (1 << 30)),
            "order": "round-robin", "max_tokens": args.max_tokens, "page_size": args.page_size,
            "hybrid": info.get("hybrid", False),
            "sglang_mamba_conv_dtype": os.environ["SGLANG_MAMBA_CONV_DTYPE"],
            "off": "proxy --no-anchors (SGLang's radix cache only)",
            "on": "proxy --anchors (SGLang's radix cache + host tier)",
            "anchor_stats_end": stats, "concurrent": load}
    data = bench.report(rows, model=info["model_id"], meta=meta)
    paged = sum(ideal_paged.values())
    data["summary"]["ideal_paged"] = paged
    data["summary"]["prefill_over_ideal_paged"] = round(data["summary"]["prefilled_on"] / paged, 4)
    print(json.dumps(data["summary"], indent=1))
    bench.write_json(data, RESULTS / f"{args.name}.json")
    bench.plot(rows, RESULTS / f"{args.name}.png",
               f"{info['model_id']} on SGLang (pool {pool} tokens, page {args.page_size}), {len(convs)} BFCL "
               f"conversations round-robin")


if __name__ == "__main__":
    main()
