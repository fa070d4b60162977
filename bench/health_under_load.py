"""`/health` latency while the proxy is handed a huge request body.

Starts one embedded worker and one proxy (`--max-body-bytes` 32 MiB), then, for each load,
probes `GET /health` back to back while the load requests are in flight (sent from
threads, in rounds), and reports the probes' latency (p50, p99, max) and how long the load
requests took:

- `idle`: no load;
- `16MiB`: one user message of 16 MiB of text (refused as over the context);
- `in-budget`: a message just under the early token budget's character bound, which is
  rendered and tokenized on the split thread before it is refused as over the context;
- `4x16MiB`: four 16 MiB bodies at once.

Prints a table and writes bench/results/health_under_load.json.

    .venv/bin/python bench/health_under_load.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from replay_bench import spawn  # noqa: E402  (same folder: bench/ is sys.path[0])

from anchorcache.proxy.split_pool import TokenBudget  # noqa: E402
from anchorcache.proxy.splitter.tokenizers import load_tokenizer  # noqa: E402

RESULTS = REPO / "bench" / "results"
MiB = 1 << 20


def body(chars: int) -> bytes:
    words = "lorem ipsum dolor sit amet, consectetur adipiscing elit. "
    text = (words * (chars // len(words) + 1))[:chars]
    return json.dumps({"model": "default", "max_tokens": 1,
                       "messages": [{"role": "user", "content": text}]}).encode()


def _send(url: str, data: bytes) -> tuple[int, float]:
    t0 = time.perf_counter()
    resp = httpx.post(url + "/v1/chat/completions", content=data, timeout=600,
                      headers={"Content-Type": "application/json"})
    return resp.status_code, time.perf_counter() - t0


async def probe_during(url: str, loads: list[bytes], rounds: int, idle_s: float) -> dict:
    """Probe /health back to back while `rounds` rounds of `loads` (sent at once, from
    threads, so the probing loop shares nothing with the senders but the GIL) are in flight."""
    lat: list[float] = []
    results: list[tuple[int, float]] = []

    def run_loads() -> None:
        if not loads:
            time.sleep(idle_s)
        for _ in range(rounds if loads else 0):
            with ThreadPoolExecutor(len(loads)) as pool:
                results.extend(pool.map(lambda d: _send(url, d), loads))

    loader = asyncio.create_task(asyncio.to_thread(run_loads))
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession() as probe:
        while not loader.done():
            t0 = time.perf_counter()
            async with probe.get(url + "/health") as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
            lat.append((time.perf_counter() - t0) * 1e3)
    await loader
    lat.sort()
    return {"probes": len(lat), "health_p50_ms": round(statistics.median(lat), 2),
            "health_p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2),
            "health_max_ms": round(lat[-1], 2), "health_statuses": statuses,
            "load_statuses": sorted({s for s, _ in results}),
            "load_requests": len(results),
            "load_s_mean": round(statistics.mean(t for _, t in results), 3) if results else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=10, help="load rounds per case")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = {}
    with ExitStack() as stack:
        worker = stack.enter_context(spawn("worker", "--threads", "2"))
        proxy = stack.enter_context(spawn("proxy", "--worker", worker,
                                          "--max-body-bytes", str(32 * MiB)))
        info = httpx.get(worker + "/model_info").json()
        budget = TokenBudget.for_tokenizer(load_tokenizer(info["tokenizer_path"]),
                                           info["max_context_tokens"])
        bound = (budget.context_tokens - 1) * (budget.max_chars_per_token or 4)
        big, near = body(16 * MiB), body(bound)
        cases = {"idle": [], "16MiB": [big], "in-budget": [near], "4x16MiB": [big] * 4}
        for name, loads in cases.items():
            rounds = max(1, args.rounds // 4) if name == "in-budget" else args.rounds
            rows[name] = asyncio.run(probe_during(proxy, loads, rounds, args.idle_s))
            rows[name]["body_bytes"] = len(loads[0]) if loads else 0
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'load':<10} {'body MiB':>9} {'requests':>9} {'probes':>7} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'max ms':>8} {'load s':>7}  statuses")
    for name, r in rows.items():
        print(f"{name:<10} {r['body_bytes'] / MiB:>9.2f} {r['load_requests']:>9} "
              f"{r['probes']:>7} {r['health_p50_ms']:>8} {r['health_p99_ms']:>8} "
              f"{r['health_max_ms']:>8} {r['load_s_mean']:>7}  {r['load_statuses']}")
    out = RESULTS / "health_under_load.json"
    out.write_text(json.dumps({"max_chars_per_token": budget.max_chars_per_token,
                               "context_tokens": budget.context_tokens,
                               "load_average": os.getloadavg()[0], "cases": rows}, indent=2))
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
