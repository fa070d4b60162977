"""Replay BFCL multi-turn conversations through the proxy, anchors on vs off.

Starts one embedded worker and two proxies in front of it (--anchors / --no-anchors), and
for every turn of every conversation (request = the messages up to that turn) sends the
same request to both. Per turn it records prompt tokens, tokens actually prefilled, the
ideal (tokens not seen before in this tenant's traffic: prompt length minus the longest
common prefix with any earlier prompt), and TTFT (wall time of a max_tokens=1 request,
i.e. restore + prefill + one token + proxy overhead). Prints a table, writes JSON and a
PNG of TTFT per turn to bench/results/.

    .venv/bin/python bench/replay_bench.py [--conversations 3] [--max-turns 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from anchorcache.cli import free_port, wait_ready  # noqa: E402
from anchorcache.proxy.splitter import get_adapter  # noqa: E402
from anchorcache.proxy.tokenizers import load_tokenizer  # noqa: E402
from tests.data import conversations, turn_requests  # noqa: E402

RESULTS = REPO / "bench" / "results"


@contextmanager
def spawn(*args: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", *args, "--port", str(port),
                             "--log-level", "warning"], start_new_session=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/health", proc, timeout_s=600)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pick(n: int, max_turns: int, adapter, min_tokens: int, max_tokens: int) -> list[dict]:
    chosen = []
    for conv in conversations("base"):
        reqs = turn_requests(conv, max_turns)
        if len(reqs) < max_turns:
            continue
        first = len(adapter.split(reqs[0], conv["tools"]).input_ids)
        last = len(adapter.split(reqs[-1], conv["tools"]).input_ids)
        if first >= min_tokens and last <= max_tokens:
            chosen.append(conv)
        if len(chosen) == n:
            break
    return chosen


def ask(url: str, messages, tools) -> tuple[dict, float]:
    body = {"model": "default", "messages": messages, "tools": tools, "temperature": 0,
            "max_tokens": 1}
    t0 = time.perf_counter()
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    elapsed = time.perf_counter() - t0
    resp.raise_for_status()
    return resp.json(), elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--min-tokens", type=int, default=4000, help="first prompt at least this long")
    ap.add_argument("--max-tokens", type=int, default=7000, help="last prompt at most this long")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="replay_smollm2")
    args = ap.parse_args()

    from anchorcache.ext.embedded.model_store import resolve_model

    model = str(resolve_model(args.model))
    adapter = get_adapter("auto", load_tokenizer(model))
    convs = pick(args.conversations, args.max_turns, adapter, args.min_tokens, args.max_tokens)
    rows, seen = [], []
    with ExitStack() as stack:
        worker = stack.enter_context(spawn("worker", "--model", model, "--threads", str(args.threads)))
        on = stack.enter_context(spawn("proxy", "--worker", worker, "--anchors"))
        off = stack.enter_context(spawn("proxy", "--worker", worker, "--no-anchors"))
        for conv in convs:
            for turn, messages in enumerate(turn_requests(conv, args.max_turns), 1):
                ids = adapter.split(messages, conv["tools"]).input_ids
                ideal = len(ids) - max((lcp(ids, s) for s in seen), default=0)
                seen.append(ids)
                r_off, t_off = ask(off, messages, conv["tools"])
                r_on, t_on = ask(on, messages, conv["tools"])
                assert r_on["choices"][0]["message"] == r_off["choices"][0]["message"]
                u = r_on["usage"]
                rows.append({
                    "conversation": conv["id"], "turn": turn, "prompt_tokens": u["prompt_tokens"],
                    "prefilled_on": u["timings"]["prefill_tokens"],
                    "prefilled_off": r_off["usage"]["timings"]["prefill_tokens"],
                    "cached_on": u["prompt_tokens_details"]["cached_tokens"],
                    "ideal": ideal,
                    "ttft_on_s": round(t_on, 4), "ttft_off_s": round(t_off, 4),
                    "restore_ms_on": u["timings"]["restore_ms"],
                    "prefill_ms_on": u["timings"]["prefill_ms"],
                    "prefill_ms_off": r_off["usage"]["timings"]["prefill_ms"],
                    "anchor_hits": [h["kind"] for h in u["timings"]["anchor_hits"]],
                })
                print(f"{conv['id']:>22} t{turn} prompt={u['prompt_tokens']:>5} "
                      f"prefilled={rows[-1]['prefilled_on']:>5} ideal={ideal:>5} "
                      f"ttft on={t_on:6.2f}s off={t_off:6.2f}s", flush=True)
        info = httpx.get(worker + "/model_info").json()

    later = [r for r in rows if r["turn"] >= 2]
    big = [r for r in rows if r["turn"] >= 3 and r["prompt_tokens"] > 4000]
    summary = {
        "model": info["model_id"], "threads": args.threads, "requests": len(rows),
        "prefill_over_ideal_turn2plus": round(sum(r["prefilled_on"] for r in later)
                                              / max(1, sum(r["ideal"] for r in later)), 4),
        "max_prefill_over_ideal_turn2plus": round(max((r["prefilled_on"] / max(1, r["ideal"])
                                                       for r in later), default=0), 4),
        "ttft_speedup_turn3plus_over4k_median": round(statistics.median(
            r["ttft_off_s"] / r["ttft_on_s"] for r in big), 2) if big else None,
        "ttft_speedup_turn3plus_over4k_min": round(min(
            r["ttft_off_s"] / r["ttft_on_s"] for r in big), 2) if big else None,
    }
    print()
    print(f"{'conv':>22} {'turn':>4} {'prompt':>6} {'prefill on':>10} {'ideal':>6} {'off':>6} "
          f"{'ttft on s':>9} {'ttft off s':>10} {'speedup':>7}")
    for r in rows:
        print(f"{r['conversation']:>22} {r['turn']:>4} {r['prompt_tokens']:>6} "
              f"{r['prefilled_on']:>10} {r['ideal']:>6} {r['prefilled_off']:>6} "
              f"{r['ttft_on_s']:>9.3f} {r['ttft_off_s']:>10.3f} "
              f"{r['ttft_off_s'] / r['ttft_on_s']:>7.1f}")
    print(json.dumps(summary, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"summary": summary, "turns": rows}, indent=1))
    plot(rows, RESULTS / f"{args.name}.png", info["model_id"])


def plot(rows: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(rows))
    ax.plot(x, [r["ttft_off_s"] for r in rows], "o-", label="anchors off")
    ax.plot(x, [r["ttft_on_s"] for r in rows], "o-", label="anchors on")
    ax.set_yscale("log")
    ax.set_xticks(list(x), [f"{r['conversation'].rsplit('_', 1)[-1]}/t{r['turn']}" for r in rows],
                  rotation=90, fontsize=7)
    ax.set_xlabel("conversation / turn")
    ax.set_ylabel("TTFT (s, log)")
    ax.set_title(f"TTFT per turn, {model}, BFCL multi-turn replay")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
