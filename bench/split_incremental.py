"""Proxy-side render+split time on the long-context BFCL conversations: whole vs incremental.

For each conversation the agent's requests are replayed in order through one adapter:
- template: the model's own Jinja template rendered + encoded whole (what a proxy without
  the splitter pays; Qwen3 only, the template ships with the tokenizer);
- whole: `split(..., use_cache=False)` (render + chunked encode + cuts);
- incremental: `split(...)` with the prefix cache warmed by the previous request.
Prints a table per token-count bucket and writes bench/results/split_incremental.json.

Usage: python bench/split_incremental.py [--adapter qwen3] [--conversations 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from anchorcache.proxy.splitter import get_adapter, normalize_messages, normalize_tools
from anchorcache.proxy.splitter.tokenizers import load_tokenizer
from anchorcache.testing.data import conversations

BUCKETS = [(0, 10_000), (10_000, 15_000), (15_000, 25_000), (25_000, 10**9)]


def requests_of(messages):
    return [messages[:end] for end in range(1, len(messages))
            if messages[end]["role"] == "assistant" and messages[end - 1]["role"] != "assistant"]


def timed_ms(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default="qwen3", help="qwen3, smollm2 (chatml) or llama3")
    ap.add_argument("--conversations", type=int, default=40)
    args = ap.parse_args()
    tok = load_tokenizer(args.adapter)
    adapter = get_adapter("auto", tok)
    everything = sorted(conversations("long_context"), key=lambda c: len(json.dumps(c)))
    n = min(args.conversations, len(everything))
    convs = [everything[i * len(everything) // n] for i in range(n)]  # spread over sizes
    rows = []
    for conv in convs:
        adapter.cache.clear()
        tools = conv["tools"]
        for n, msgs in enumerate(requests_of(conv["messages"])):
            whole = adapter.split(msgs, tools, use_cache=False)
            row = {"id": conv["id"], "request": n, "num_tokens": len(whole.input_ids),
                   "whole_ms": timed_ms(lambda m=msgs, t=tools: adapter.split(m, t, use_cache=False))}
            if n:  # the cache holds the previous request's anchors (and this one's after 1 run)
                adapter.split(msgs, tools)
                row["incremental_ms"] = timed_ms(lambda m=msgs, t=tools: adapter.split(m, t))
                assert adapter.split(msgs, tools) == whole
            if tok.chat_template and args.adapter == "qwen3":
                nm, nt = normalize_messages(msgs), normalize_tools(tools)
                row["template_ms"] = timed_ms(lambda nm=nm, nt=nt: tok.encode(tok.render(nm, nt)))
            rows.append(row)
    summary = []
    print(f"adapter={adapter.name}  conversations={len(convs)}  requests={len(rows)}")
    print(f"{'tokens':>14} {'n':>5} {'template ms':>12} {'whole ms':>9} {'incr ms':>8} {'ratio':>7}")
    for lo, hi in BUCKETS:
        sel = [r for r in rows if lo <= r["num_tokens"] < hi and "incremental_ms" in r]
        if not sel:
            continue
        med = {k: statistics.median(r[k] for r in sel) if all(k in r for r in sel) else None
               for k in ("template_ms", "whole_ms", "incremental_ms")}
        ratio = med["whole_ms"] / med["incremental_ms"]
        summary.append({"min_tokens": lo, "max_tokens": hi, "requests": len(sel),
                        "median_tokens": statistics.median(r["num_tokens"] for r in sel),
                        **{f"median_{k}": v for k, v in med.items()}, "whole_over_incremental":
                        ratio})
        tmpl = f"{med['template_ms']:.2f}" if med["template_ms"] is not None else "-"
        print(f"{lo:>6}-{min(hi, 999999):<7} {len(sel):>5} {tmpl:>12} {med['whole_ms']:>9.2f} "
              f"{med['incremental_ms']:>8.2f} {ratio:>6.1f}x")
    out = Path(__file__).parent / "results" / f"split_incremental_{adapter.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"adapter": adapter.name, "summary": summary, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
