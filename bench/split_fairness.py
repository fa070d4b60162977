"""One tenant's huge toolset against another tenant's small requests: bounded split work and
fair turns on the split threads.

Starts an embedded worker (the tiny Qwen3: the real Qwen3 tokenizer and tool template, a
32k context, prefill in milliseconds, so the proxy's own work is what is measured) and a
proxy, makes two tenants, and measures:

- `idle`: tenant B's small streamed request, time to its first event (TTFT), alone;
- for each load (tenant A's body, sent over and over from a thread while B's requests run):
  B's TTFT under that load, and A's request time and status;
  - `1024 tools`: 1,024 tools with 400-character descriptions (far over the context: it is
    refused once rendered and tokenized, with no tool cuts looked for);
  - `fits`: as many such tools as fit the context (about 24k tokens), a new system prompt
    each time, so every request is a toolset's first split (tool cuts looked for).

Prints a table and writes bench/results/split_fairness.json.

    .venv/bin/python bench/split_fairness.py [--requests 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
from anchorcache.testing.servers import proxy_process, tenant_key, worker_process

RESULTS = Path(__file__).resolve().parent / "results"


def tool(i: int) -> dict:
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool {i}. " + "Does things well. " * 22,
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def small_ttft(url: str, key: str, i: int) -> float:
    body = {"model": "default", "max_tokens": 2, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Say hi {i}."}]}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - t0
    raise RuntimeError("no event")


def big(url: str, key: str, tools: int, stop: threading.Event, out: list[tuple[int, float]]
        ) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        body = {"model": "default", "max_tokens": 1, "temperature": 0,
                "tools": [tool(i) for i in range(tools)],
                "messages": [{"role": "system", "content": f"Agent {n} at {time.time()}."},
                             {"role": "user", "content": "Go."}]}
        t0 = time.perf_counter()
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=600,
                          headers={"Authorization": f"Bearer {key}"})
        out.append((resp.status_code, time.perf_counter() - t0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8, help="tenant B's requests per load")
    args = ap.parse_args()
    model = build_tiny_model("qwen3", tiny_model_dir("qwen3"))
    rows = []
    with worker_process("--anchor-slots", "256", model=str(model)) as w, \
            proxy_process(w.url) as proxy:
        a, b = tenant_key(proxy, "bench-a"), tenant_key(proxy, "bench-b")
        small_ttft(proxy.url, b, -1)  # warm up
        idle = [small_ttft(proxy.url, b, i) for i in range(args.requests)]
        rows.append({"load": "idle", "b_ttft_p50_s": statistics.median(idle),
                     "b_ttft_max_s": max(idle)})
        # as many tools as fit a 32k context at about 100 tokens each, with room to spare
        for name, tools in (("1024 tools", 1024), ("fits", 220)):
            stop, out = threading.Event(), []
            thread = threading.Thread(target=big, args=(proxy.url, a, tools, stop, out))
            thread.start()
            time.sleep(0.5)  # A's first body is in flight
            loaded = [small_ttft(proxy.url, b, i) for i in range(args.requests)]
            stop.set()
            thread.join()
            statuses = sorted({s for s, _ in out})
            rows.append({"load": name, "b_ttft_p50_s": statistics.median(loaded),
                         "b_ttft_max_s": max(loaded), "a_requests": len(out),
                         "a_status": statuses,
                         "a_time_p50_s": statistics.median(t for _, t in out)})
    base = rows[0]["b_ttft_p50_s"]
    print(f"{'load':<12} {'B TTFT p50':>11} {'vs idle':>8} {'B max':>8} {'A status':>12} "
          f"{'A time p50':>11}")
    for r in rows:
        print(f"{r['load']:<12} {r['b_ttft_p50_s']:>10.3f}s {r['b_ttft_p50_s'] / base:>7.2f}x "
              f"{r['b_ttft_max_s']:>7.3f}s {','.join(map(str, r.get('a_status', []))):>12} "
              f"{r.get('a_time_p50_s', float('nan')):>10.3f}s")
    RESULTS.mkdir(exist_ok=True)
    out_path = RESULTS / "split_fairness.json"
    out_path.write_text(json.dumps({"model": "tiny qwen3 (embedded)", "rows": rows}, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
