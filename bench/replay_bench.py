"""Replay BFCL multi-turn conversations through the proxy, anchors on vs off.

Starts one embedded worker and two proxies in front of it (--anchors / --no-anchors) and
replays conversations through both with `anchorcache.bench.replay` (the engine of
`anchorcache bench`): per turn, prompt tokens, tokens actually prefilled, the ideal (tokens
not seen before in this replay) and TTFT (time to the first streamed event of a
max_tokens=1 request: restore + prefill + one token + proxy overhead). Prints a table,
writes JSON and a PNG (TTFT and prefilled tokens per turn) to bench/results/.

    .venv/bin/python bench/replay_bench.py [--conversations 3] [--max-turns 6]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from anchorcache import bench  # noqa: E402
from anchorcache.cli import free_port, wait_ready  # noqa: E402
from anchorcache.proxy.splitter import get_adapter  # noqa: E402
from anchorcache.proxy.splitter.tokenizers import load_tokenizer  # noqa: E402
from anchorcache.testing.data import conversations, turn_requests  # noqa: E402

RESULTS = REPO / "bench" / "results"


class Url(str):
    """A spawned server's base URL, with its process id (`pid`)."""

    pid: int


def model_or_tiny(model: str | None) -> str:
    """`model` (a model dir, or a tiny arch's name such as `qwen3_5`), or the tiny random
    Qwen3 (the real Qwen3 tokenizer), built once."""
    from anchorcache.ext.embedded.tiny_models import (
        SLIDING_ARCHS,
        TINY_ARCHS,
        build_tiny_model,
        tiny_model_dir,
    )

    if model is not None and model not in TINY_ARCHS + SLIDING_ARCHS:
        return model
    arch = model or "qwen3"
    return str(build_tiny_model(arch, tiny_model_dir(arch), seed=0))


@contextmanager
def spawn(*args: str, tail: tuple[str, ...] = (), port: int | None = None):
    """`anchorcache ARGS --port P ... TAIL` in its own session (`port`: P, else a free
    one); its URL (a `Url`) once healthy. On exit the whole session is killed (an SGLang
    worker's scheduler and detokenizer too). A proxy not given a `--state-dir` gets a
    temporary one: never the user's own ledger (nor one ledger for two proxies)."""
    port = port or free_port()
    state = None
    if args[0] == "proxy" and "--state-dir" not in args:
        state = tempfile.TemporaryDirectory(prefix="anchorcache-bench-")
        args = (*args, "--state-dir", state.name)
    # one proxy process unless a bench asks for more (`--processes`): the figures in
    # docs/benchmarks.md are one process's, whatever the box's cores
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", *args, "--port", str(port),
                             "--log-level", "warning", *tail], start_new_session=True,
                            env={"ANCHORCACHE_PROCESSES": "1", **os.environ,
                                 "TOKENIZERS_PARALLELISM": "false"})
    url = Url(f"http://127.0.0.1:{port}")
    url.pid = proc.pid
    try:
        wait_ready(url + "/health", proc, timeout_s=900)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:  # SGLang's scheduler and detokenizer live in the same session
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if state is not None:
            state.cleanup()


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

    def show(r: bench.TurnResult) -> None:
        print(f"{r.conversation:>22} t{r.turn} prompt={r.prompt_tokens:>5} "
              f"prefilled={r.prefilled_on:>5} ideal={r.ideal:>5} "
              f"ttft on={r.ttft_on_s:6.2f}s off={r.ttft_off_s:6.2f}s", flush=True)

    with ExitStack() as stack:
        worker = stack.enter_context(spawn("worker", "--model", model, "--threads", str(args.threads)))
        on = stack.enter_context(spawn("proxy", "--worker", worker, "--anchors"))
        off = stack.enter_context(spawn("proxy", "--worker", worker, "--no-anchors"))
        rows = bench.replay(convs, bench.BenchTarget(on), bench.BenchTarget(off), max_turns=args.max_turns,
                            max_tokens=1, on_turn=show,
                            tokenize=lambda m, t: adapter.split(m, t or None).input_ids)
        info = httpx.get(worker + "/model_info").json()
    assert all(r.identical for r in rows), "anchors on and off disagree"

    later = [r for r in rows if r.turn >= 2]
    big = [r for r in rows if r.turn >= 3 and r.prompt_tokens > 4000]
    summary = {
        "model": info["model_id"], "threads": args.threads, "requests": len(rows),
        "prefill_over_ideal_turn2plus": round(sum(r.prefilled_on for r in later)
                                              / max(1, sum(r.ideal for r in later)), 4),
        "max_prefill_over_ideal_turn2plus": round(max((r.prefilled_on / max(1, r.ideal)
                                                       for r in later), default=0), 4),
        "ttft_speedup_turn3plus_over4k_median": round(statistics.median(
            r.ttft_off_s / r.ttft_on_s for r in big), 2) if big else None,
        "ttft_speedup_turn3plus_over4k_min": round(min(
            r.ttft_off_s / r.ttft_on_s for r in big), 2) if big else None,
    }
    print()
    print(f"{'conv':>22} {'turn':>4} {'prompt':>6} {'prefill on':>10} {'ideal':>6} {'off':>6} "
          f"{'ttft on s':>9} {'ttft off s':>10} {'speedup':>7}")
    for r in rows:
        print(f"{r.conversation:>22} {r.turn:>4} {r.prompt_tokens:>6} "
              f"{r.prefilled_on:>10} {r.ideal:>6} {r.prefilled_off:>6} "
              f"{r.ttft_on_s:>9.3f} {r.ttft_off_s:>10.3f} "
              f"{r.ttft_off_s / r.ttft_on_s:>7.1f}")
    print(json.dumps(summary, indent=2))
    data = bench.report(rows, model=info["model_id"], meta={"threads": args.threads})
    bench.write_json({**data, "summary": {**data["summary"], **summary}},
                     RESULTS / f"{args.name}.json")
    bench.plot(rows, RESULTS / f"{args.name}.png",
               f"{info['model_id']}, BFCL multi-turn replay")


if __name__ == "__main__":
    main()
