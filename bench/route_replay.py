"""Agent traffic through one proxy in front of two workers: affinity routing against
round-robin and least-load, and a worker killed halfway.

Starts two workers (SGLang with the CPU recipe by default, each with a KV pool about 1.2x
the longest request; `--backend embedded` for the embedded worker) on the tiny Qwen3 (the
real Qwen3 tokenizer) unless `--model`, then for each routing policy a fresh proxy (its own
ledger) in front of both, the workers' anchors and device caches flushed first. `--conversations`
BFCL conversations over `--toolsets` toolsets run `--concurrent` at a time, each its turns
in order, as agents would. Per policy: prompt tokens prefilled against the ideal (tokens
that no earlier request presented), TTFT p50/p99 per turn, requests/s, and the proxy's
CPU milliseconds per request (user + system time of its process over the run). Then the
affinity run again with the second worker SIGKILLed halfway and a replacement started on
its port, as a supervisor restarts it (the second half of the requests sent once it is back),
three times: a replacement that starts empty
(`affinity_killed_halfway`), and one on the same disk-tier directory as the worker it
replaces (`affinity_killed_halfway_disk`: it indexes the slab files, the proxy's reconcile
recovers them, docs/disk-tier.md), and with both workers on one directory
(`affinity_killed_halfway_shared`, shared storage: a request retried on the survivor finds
the killed worker's files at its cuts). Per kill run: failed requests (only those streaming on
the worker when it died may fail, with an error event; the agent retries them once), and
the prefill it cost. Prints a table, writes bench/results/<name>.json and .png.
`--kill-only`: the kill runs alone (the routing policies' runs skipped).

`--dp`: one SGLang server with `--dp-size 2` instead of two servers (each rank a target,
`/dp/0` and `/dp/1`; same pool per rank). No kill run then: a rank cannot be killed alone.

    .venv/bin/python bench/route_replay.py [--backend sglang] [--dp] [--conversations 16]
        [--concurrent 4] [--turns 4] [--kill-only]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from replay_bench import model_or_tiny, spawn  # noqa: E402  (same folder: bench/ is sys.path[0])

from anchorcache import bench  # noqa: E402
from anchorcache.cli import free_port  # noqa: E402
from anchorcache.proxy.config import ROUTES  # noqa: E402
from anchorcache.proxy.splitter import get_adapter  # noqa: E402
from anchorcache.proxy.splitter.tokenizers import load_tokenizer  # noqa: E402
from anchorcache.testing.data import conversations, turn_requests  # noqa: E402

RESULTS = REPO / "bench" / "results"


def pick(n: int, toolsets: int, turns: int) -> list[dict]:
    """`n` conversations with at least `turns` turns from the `toolsets` most common
    toolsets (by first tool), taken in turn from each."""
    groups: dict[str, list[dict]] = {}
    for conv in sorted(conversations("base"), key=lambda c: len(str(c))):
        if len(turn_requests(conv, turns)) == turns:
            groups.setdefault(conv["tools"][0]["function"]["name"], []).append(conv)
    top = sorted(groups.values(), key=len, reverse=True)[:toolsets]
    return [top[i % len(top)][i // len(top)] for i in range(n)]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flush(workers: list[str]) -> None:
    """Every run starts cold: each worker's anchors (`/anchor/flush`) and SGLang's device
    tree (`/flush_cache`) dropped. (SGLang's host anchors survive `/flush_cache`, and a new
    proxy learns the anchors a worker still holds, so without the first a run would restore
    what the runs before it wrote.)"""
    for w in workers:
        for path in ("/anchor/flush", "/flush_cache"):
            httpx.post(w + path, timeout=60).raise_for_status()


def run(proxy: str, convs: list[dict], turns: int, concurrent: int, max_tokens: int,
        prompts: dict[tuple[int, int], list[int]],
        kill: tuple[int, Callable[[], None]] | None = None, cpu_of: int | None = None) -> dict:
    """Every conversation's turns in order, `concurrent` conversations at once. `kill`:
    (at which request, what to call just before sending it); no new request is sent while
    it runs (the requests in flight go on). `cpu_of` (with `concurrent` 1): the proxy's pid,
    whose CPU each request costs is then measured (`proxy_cpu_ms`: p50, p90, mean, over all
    requests and over each conversation's later turns)."""
    assert cpu_of is None or concurrent == 1, "per-request CPU needs one request at a time"
    cpu_ms: dict[tuple[int, int], float] = {}
    order: list[tuple[int, int]] = []  # (conversation, turn) in the order sent
    replies: dict[tuple[int, int], bench.Reply] = {}
    failures: list[str] = []
    lock = threading.Lock()
    sent = itertools.count(1)
    gate = threading.Event()
    gate.set()

    def one(c: int) -> None:
        with httpx.Client(timeout=900) as client:
            for t in range(turns):
                gate.wait()
                n = next(sent)
                if kill is not None and n == kill[0]:
                    gate.clear()
                    try:
                        kill[1]()
                    finally:
                        gate.set()
                with lock:
                    order.append((c, t))
                messages = turn_requests(convs[c], turns)[t]
                for attempt in (1, 2):  # an agent retries a failed turn once
                    try:
                        before = bench.cpu_ns(cpu_of) if cpu_of is not None else 0
                        replies[c, t] = bench.ask(client, bench.BenchTarget(proxy), messages,
                                                  convs[c]["tools"], max_tokens)
                        if cpu_of is not None:
                            cpu_ms[c, t] = (bench.cpu_ns(cpu_of) - before) / 1e6
                        break
                    except bench.BenchError as e:
                        failures.append(str(e))
                        if attempt == 2:
                            return

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrent) as pool:
        list(pool.map(one, range(len(convs))))
    wall = time.perf_counter() - t0
    # ideal: the tokens of each prompt that no prompt sent before it presented
    seen: list[list[int]] = []
    ideal = 0
    for key in order:
        p = prompts[key]
        ideal += len(p) - max((bench.lcp(p, q) for q in seen), default=0)
        seen.append(p)
    per_turn = {}
    for t in range(turns):
        ttfts = sorted(r.ttft_s for (_, tt), r in replies.items() if tt == t)
        if ttfts:
            per_turn[t + 1] = {"ttft_p50_s": round(statistics.median(ttfts), 4),
                               "ttft_p99_s": round(ttfts[min(len(ttfts) - 1,
                                                            int(0.99 * len(ttfts)))], 4)}
    prefilled = sum(r.usage["prompt_tokens"] - r.usage["prompt_tokens_details"]["cached_tokens"]
                    for r in replies.values())
    out: dict = {}
    if cpu_ms:
        def stats(xs: list[float]) -> dict:
            xs = sorted(xs)
            return {"n": len(xs), "p50": round(statistics.median(xs), 2),
                    "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 2),
                    "mean": round(statistics.fmean(xs), 2)}
        out["proxy_cpu_ms"] = {"all": stats(list(cpu_ms.values())),
                               "later_turns": stats([v for (_, t), v in cpu_ms.items() if t])}
    return out | {"requests": len(replies), "failed": len(failures), "failures": failures[:5],
            "wall_s": round(wall, 2), "requests_per_s": round(len(replies) / wall, 3),
            "prompt_tokens": sum(len(prompts[k]) for k in replies), "prefilled": prefilled,
            "ideal": ideal, "prefill_over_ideal": round(prefilled / max(1, ideal), 3),
            "per_turn": per_turn}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="sglang", choices=("sglang", "embedded"))
    ap.add_argument("--model", default=None, help="model dir (default: the tiny Qwen3)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--toolsets", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dp", action="store_true",
                    help="one SGLang server with --dp-size 2 (its two ranks as the targets)")
    ap.add_argument("--name", default=None, help="default: route_replay_<backend>[_dp]")
    ap.add_argument("--kill-only", action="store_true", help="only the kill runs")
    ap.add_argument("--no-kill", action="store_true", help="no kill runs")
    ap.add_argument("--profile", help="py-spy record the proxy of the one-at-a-time run "
                    "into this file (raw format)")
    ap.add_argument("--routes", default=",".join(ROUTES),
                    help="the routing policies to compare (default: all)")
    args = ap.parse_args()
    if args.dp and args.backend != "sglang":
        ap.error("--dp needs --backend sglang")
    name = args.name or f"route_replay_{args.backend}" + ("_dp" if args.dp else "")

    model = model_or_tiny(args.model)
    adapter = get_adapter("auto", load_tokenizer(model))
    convs = pick(args.conversations, args.toolsets, args.turns)
    prompts = {(c, t): list(adapter.split(m, conv["tools"] or None).input_ids)
               for c, conv in enumerate(convs)
               for t, m in enumerate(turn_requests(conv, args.turns))}
    longest = max(len(p) for p in prompts.values())
    if args.backend == "sglang":
        worker_args = ("worker", "--backend", "sglang", "--model", model)
        tail: tuple[str, ...] = ("--", "--max-total-tokens", str(int(1.2 * longest) + 64))
    else:
        worker_args, tail = ("worker", "--model", model, "--threads", "1"), ()
    print(f"{len(convs)} conversations x {args.turns} turns, {args.concurrent} at a time; "
          f"prompts up to {longest} tokens; backend {args.backend}", flush=True)

    results: dict[str, dict] = {}
    with ExitStack() as stack:
        if args.dp:  # one server, its ranks the targets: the proxy is given the server's URL
            server = stack.enter_context(spawn(*worker_args, tail=(*tail, "--dp-size", "2")))
            given, workers = [server], [f"{server}/dp/0", f"{server}/dp/1"]
        else:
            workers = [stack.enter_context(spawn(*worker_args, tail=tail)) for _ in range(2)]
            given = list(workers)
        for policy in () if args.kill_only else [r for r in args.routes.split(",") if r]:
            flush(workers)
            with spawn("proxy", *itertools.chain(*(("--worker", w) for w in given)),
                       "--route", policy) as proxy:
                before = cpu_s(proxy.pid)
                results[policy] = run(proxy, convs, args.turns, args.concurrent, args.max_tokens,
                                      prompts)
                used = cpu_s(proxy.pid) - before
                results[policy]["proxy_cpu_ms_per_request"] = round(
                    1e3 * used / max(1, results[policy]["requests"]), 2)
            print(policy, json.dumps({k: v for k, v in results[policy].items()
                                      if k != "per_turn"}), flush=True)
        if not args.kill_only:  # the proxy's CPU per request: one request at a time
            flush(workers)
            with spawn("proxy", *itertools.chain(*(("--worker", w) for w in given)),
                       "--route", "affinity") as proxy:
                spy = bench.start_py_spy(proxy.pid, args.profile) if args.profile else None
                results["affinity_one_at_a_time"] = run(
                    proxy, convs, args.turns, 1, args.max_tokens, prompts, cpu_of=proxy.pid)
                if spy is not None:
                    bench.stop_py_spy(spy)
            print("affinity_one_at_a_time", json.dumps(
                results["affinity_one_at_a_time"]["proxy_cpu_ms"]), flush=True)
        if not args.dp and not args.no_kill:  # (a rank of one server cannot be killed alone)
            kill_run(results, workers[0], worker_args, tail, convs, args, prompts)

    print()
    print(f"{'run':>24} {'req':>4} {'fail':>4} {'prefilled':>9} {'ideal':>7} {'ratio':>6} "
          f"{'req/s':>6} {'cpu ms/req':>10} " + " ".join(f"t{t} p50/p99" for t in
                                                        range(1, args.turns + 1)))
    for run_name, r in results.items():
        ttft = " ".join(f"{r['per_turn'][t]['ttft_p50_s']:.2f}/{r['per_turn'][t]['ttft_p99_s']:.2f}"
                        if t in r["per_turn"] else "-" for t in range(1, args.turns + 1))
        print(f"{run_name:>24} {r['requests']:>4} {r['failed']:>4} {r['prefilled']:>9} "
              f"{r['ideal']:>7} {r['prefill_over_ideal']:>6} {r['requests_per_s']:>6} "
              f"{cpu_column(r):>10} {ttft}")
    data = {"backend": args.backend, "model": model, "conversations": len(convs),
            "turns": args.turns, "concurrent": args.concurrent, "longest_prompt": longest,
            "runs": results}
    bench.write_json(data, RESULTS / f"{name}{'_kill' if args.kill_only else ''}.json")
    behind = "2 DP ranks of one SGLang server" if args.dp else f"2 {args.backend} workers"
    plot(results, args.turns, RESULTS / f"{name}{'_kill' if args.kill_only else ''}.png",
         f"{behind}, {len(convs)} BFCL conversations, {args.concurrent} at a time")


def cpu_column(r: dict) -> str:
    """The table's proxy CPU: the mean over a concurrent run, the median one at a time."""
    if "proxy_cpu_ms" in r:
        return f"p50 {r['proxy_cpu_ms']['all']['p50']}"
    return str(r.get("proxy_cpu_ms_per_request", "-"))


def kill_run(results: dict[str, dict], survivor: str, worker_args: tuple[str, ...],
             tail: tuple[str, ...], convs: list[dict], args: argparse.Namespace,
             prompts: dict) -> None:
    """Affinity with the second worker SIGKILLed halfway and a replacement started on its
    port (`survivor` stays), once without a disk tier, once with the killed worker's, and
    once with both workers on one directory (shared storage: a survivor of its own, started
    on the directory, takes the killed worker's files for the requests retried on it)."""
    for name, disk in (("affinity_killed_halfway", None), ("affinity_killed_halfway_disk", "own"),
                       ("affinity_killed_halfway_shared", "shared")):
        flush([survivor])
        with tempfile.TemporaryDirectory(prefix="route-replay-disk-") as folder:
            results[name] = _kill_run(survivor, worker_args, tail, convs, args, prompts,
                                      ("--anchor-disk-dir", folder) if disk else (),
                                      shared=disk == "shared")
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "per_turn"}),
              flush=True)


def _kill_run(survivor: str, worker_args: tuple[str, ...], tail: tuple[str, ...],
              convs: list[dict], args: argparse.Namespace, prompts: dict,
              disk: tuple[str, ...], shared: bool = False) -> dict:
    port = free_port()
    with ExitStack() as stack:
        if shared:
            survivor = stack.enter_context(spawn(*worker_args, *disk, tail=tail))
        doomed = stack.enter_context(spawn(*worker_args, *disk, tail=tail, port=port))
        proxy = stack.enter_context(spawn("proxy", "--worker", survivor, "--worker", doomed,
                                          "--route", "affinity", "--health-interval-s", "1"))

        def restart() -> None:
            """SIGKILL, then the supervisor's restart: the same port (and directory); the
            second half is sent once the proxy has seen it come back (its health check)."""
            os.killpg(doomed.pid, signal.SIGKILL)
            stack.enter_context(spawn(*worker_args, *disk, tail=tail, port=port))
            time.sleep(3)

        out = run(proxy, convs, args.turns, args.concurrent, args.max_tokens, prompts,
                  kill=(len(prompts) // 2, restart))
        # what the replacement's disk tier did (null without one)
        out["replacement_disk"] = httpx.get(doomed + "/anchor/stats", timeout=60).json()["disk"]
        return out


def plot(results: dict[str, dict], turns: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    ax1.bar(names, [results[n]["prefill_over_ideal"] for n in names])
    ax1.axhline(1.0, color="gray", linestyle="--")
    ax1.set_ylabel("prefilled / ideal")
    ax1.tick_params(axis="x", rotation=20)
    for n in names:
        ts = [t for t in range(1, turns + 1) if t in results[n]["per_turn"]]
        ax2.plot(ts, [results[n]["per_turn"][t]["ttft_p50_s"] for t in ts], marker="o", label=n)
    ax2.set_xlabel("turn")
    ax2.set_ylabel("TTFT p50 (s)")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
