"""Why a batched SGLang run on CPU can differ from an unbatched one, measured.

1. The linear layers: each row of a batch multiplied alone (M = 1, a decode step of one
   request) against the whole batch at once (M = 8, one step of eight requests), with the
   tiny Qwen3's shapes: bit-identical or not, on this CPU.
2. SGLang itself (tiny Qwen3, real BFCL prompts): the eight turn-2 prompts of the SGLang
   tests, each run alone from scratch (cold), then all eight at once with anchors off, then
   all eight at once restoring their turn-1 anchors. Per prompt, the first output token
   that differs from cold, and how many requests SGLang ran in one batch at most.

Anchors off differing from cold as often as anchors on does is batch numerics, not a
restore. Prints a table; writes bench/results/sglang_batch_numerics.json.

    .venv/bin/python bench/sglang_batch_numerics.py [--rounds 2] [--max-new 48]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import threading
from pathlib import Path

import httpx
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from anchorcache.ext.embedded.tiny_models import (  # noqa: E402
    build_tiny_model,
    qwen3_tokenizer_dir,
    tiny_model_dir,
)
from anchorcache.testing.data import two_turn_prompts  # noqa: E402
from anchorcache.testing.servers import sglang_worker_process  # noqa: E402
from anchorcache.wire import (  # noqa: E402
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    GenerateRequest,
    Region,
    SamplingParams,
    SnapshotSpec,
)

NS = bytes(range(48, 64))


def linear_rows(model_dir: Path) -> list[dict]:
    """F.linear of 8 rows alone vs at once, for every weight shape of the tiny model."""
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    shapes = sorted({tuple(w.shape) for w in weights.values() if w.dim() == 2})
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(8, k, generator=gen)
        alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(8)])
        batch = F.linear(x, w)
        out.append({"out_features": n, "in_features": k,
                    "bit_identical": bool(torch.equal(alone, batch)),
                    "max_abs_diff": float((alone - batch).abs().max())})
    return out


def generate(url: str, ids: list[int], plan: AnchorPlan | None, max_new: int) -> dict:
    req = GenerateRequest(input_ids=tuple(ids), anchor=plan,
                          sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0))
    resp = httpx.post(url + "/generate", json=req.to_json(), timeout=600)
    resp.raise_for_status()
    return resp.json()


def post(url: str, path: str, body: dict | None = None) -> dict:
    resp = httpx.post(url + path, json=body or {}, timeout=120)
    resp.raise_for_status()
    return resp.json()


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def at_once(url: str, jobs: list, max_new: int) -> tuple[list[dict], int]:
    """Every (ids, plan) at once; the replies and SGLang's largest running batch seen."""
    running: list[int] = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            loads = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=60).json()
            running.append(int(loads["loads"][0]["num_running_reqs"]))

    post(url, "/flush_cache")
    with cf.ThreadPoolExecutor(len(jobs) + 1) as pool:
        watcher = pool.submit(watch)
        try:
            replies = list(pool.map(lambda job: generate(url, *job, max_new), jobs))
        finally:
            stop.set()
        watcher.result()
    return replies, max(running)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench/results/sglang_batch_numerics.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = build_tiny_model("qwen3", tiny_model_dir("qwen3"))
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    convs = two_turn_prompts(tokenizer, 8)
    linear = linear_rows(model)
    report: dict = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "torch": torch.__version__, "linear_alone_vs_batch": linear, "rounds": []}
    with sglang_worker_process(model=str(model)) as server:
        url = server.url
        cold = []
        for *_, p2 in convs:
            post(url, "/flush_cache")
            cold.append(generate(url, p2, None, args.max_new)["output_ids"])
        chains = []
        for tool_depth, conv_depth, p1, _ in convs:
            plan = AnchorPlan(NS, snapshot=(SnapshotSpec(tool_depth, AnchorKind.INSTRUCTION,
                                                         Region.THIN),
                                            SnapshotSpec(conv_depth, AnchorKind.CONVERSATION,
                                                         Region.THICK)))
            anchors = generate(url, p1, plan, 1)["meta_info"]["anchors"]
            post(url, "/anchor/confirm", {"slots": [w["slot"] for w in anchors["written"]]})
            keys = {w["depth"]: bytes.fromhex(w["key"])
                    for w in anchors["written"] + anchors["held"]}
            chains.append((AnchorRef(keys[tool_depth], tool_depth),
                           AnchorRef(keys[conv_depth], conv_depth)))
        for r in range(args.rounds):
            off, off_batch = at_once(url, [(p2, None) for *_, p2 in convs], args.max_new)
            on, on_batch = at_once(url, [(p2, AnchorPlan(NS, restore=chains[i]))
                                         for i, (*_, p2) in enumerate(convs)], args.max_new)
            report["rounds"].append({
                "round": r, "max_batch_anchors_off": off_batch, "max_batch_anchors_on": on_batch,
                "first_diff_anchors_off": [first_diff(o["output_ids"], c)
                                           for o, c in zip(off, cold, strict=True)],
                "first_diff_anchors_on": [first_diff(o["output_ids"], c)
                                          for o, c in zip(on, cold, strict=True)],
                "cached_tokens_anchors_on": [o["meta_info"]["cached_tokens"] for o in on],
                "anchor_depths": [conv.depth for _, conv in chains]})
    print(f"CPU capability {report['cpu_capability']}, torch {report['torch']}")
    print(f"{'linear (out x in)':>20} {'alone == batch':>15} {'max |diff|':>11}")
    for row in linear:
        print(f"{row['out_features']:>9} x {row['in_features']:<8} "
              f"{row['bit_identical']!s:>15} {row['max_abs_diff']:>11.3g}")
    print(f"\nfirst output token differing from the cold (alone) run, of {args.max_new}; "
          "- = identical")
    for rd in report["rounds"]:
        for side in ("off", "on"):
            diffs = " ".join("-" if d is None else str(d) for d in rd[f"first_diff_anchors_{side}"])
            print(f"round {rd['round']} anchors {side:>3} (batch up to "
                  f"{rd[f'max_batch_anchors_{side}']}): {diffs}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
