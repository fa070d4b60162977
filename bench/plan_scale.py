"""The planner's cost per request as a tenant's conversations multiply and grow.

In process, no worker: `--conversations` agent conversations of one tenant on one toolset
(a shared instruction prefix of `--instruction` tokens) run their turns round-robin, as
concurrent agents do; each turn adds a tool result or user message of `--message` tokens
after the last reply of `--reply` tokens (each length drawn from half to 1.5 times that). Every turn is planned, then settled as the worker
would: the snapshots past the restore written, chained, keyed as the worker keys them
(`wire.anchor_keys`), plus the response anchor past the prompt. Per (conversations, turns):
the median and p90 microseconds of `Planner.plan` over the last round (one plan per
conversation, the index holding every earlier turn's anchors; runs of other seeds added
up to 64 plans) and the restore chain's length. `--no-prior`: the splits do not name the
prompt they extend (as from an adapter without kept turns): the planner scans. The proxy plans each request once per routing candidate, so a figure here is paid
once or twice per request.

    .venv/bin/python bench/plan_scale.py [--conversations 1,16,64,256] [--turns 5,50]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from anchorcache import bench  # noqa: E402
from anchorcache.proxy.planner import Planner, tenant_namespace  # noqa: E402
from anchorcache.proxy.splitter.types import Cut, CutKind, SplitResult  # noqa: E402
from anchorcache.wire import AnchorKind, AnchorReport, AnchorWritten, TokenIds, anchor_keys  # noqa: E402

MODEL = "bench"
NS = tenant_namespace(b"s" * 32, "tenant")


def settle(planner: Planner, plan, ids: list[int], reply: list[int], slot: int) -> int:
    """What the worker reports for `plan` on `ids` (then `reply` generated), all confirmed."""
    specs = [s for s in plan.request.snapshot if s.depth > plan.restore_depth]
    depths = [s.depth for s in specs] + [len(ids) + len(reply)]
    kinds = [s.kind for s in specs] + [AnchorKind.RESPONSE]
    keys = anchor_keys(plan.namespace, MODEL, ids + reply, depths)
    parent = plan.chain[-1].key if plan.chain else None
    written = []
    for depth, kind in zip(depths, kinds, strict=True):
        written.append(AnchorWritten(slot, keys[depth], depth, parent, 1, kind))
        parent, slot = keys[depth], slot + 1
    planner.record(plan.namespace, AnchorReport(written=tuple(written)),
                   [w.slot for w in written], [])
    return slot


def run(conversations: int, turns: int, instruction: int, message: int, reply: int,
        prior: bool = True, seed: int = 0) -> dict:
    rng = random.Random(seed)
    tokens = lambda k: [rng.randrange(150_000) for _ in range(k)]  # noqa: E731
    planner = Planner(MODEL, "epoch")
    head = tokens(instruction)
    prompts = [list(head) for _ in range(conversations)]
    priors: list[bytes | None] = [None] * conversations
    slot, times, chains = 0, [], []
    for turn in range(turns):
        for c in range(conversations):
            ids = prompts[c]
            start = len(ids)
            ids += tokens(rng.randrange(message // 2, 3 * message // 2))
            cuts = (Cut(CutKind.INSTRUCTION, instruction),
                    Cut(CutKind.CONVERSATION, start), Cut(CutKind.MESSAGES, len(ids)))
            split = SplitResult("bench", TokenIds.of(ids), cuts,
                                prior_token_bytes=priors[c] if prior else None)
            priors[c] = split.token_bytes  # (the splitter's kept turn, for the next one)
            t0 = time.perf_counter()
            plan = planner.plan(split, NS)
            if turn == turns - 1:
                times.append((time.perf_counter() - t0) * 1e6)
                chains.append(len(plan.chain))
            out = tokens(rng.randrange(reply // 2, 3 * reply // 2))
            slot = settle(planner, plan, ids, out, slot)
            ids += out
    return {"conversations": conversations, "turns": turns, "prompt_tokens": len(prompts[0]),
            "anchors": len(planner.index), "chain_links": statistics.median(chains),
            "times": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", default="1,16,64,256")
    ap.add_argument("--turns", default="5,50")
    ap.add_argument("--instruction", type=int, default=2000)
    ap.add_argument("--message", type=int, default=300)
    ap.add_argument("--reply", type=int, default=100)
    ap.add_argument("--no-prior", action="store_true",
                    help="splits without the prompt they extend (the scan alone)")
    ap.add_argument("--name", default="plan_scale")
    args = ap.parse_args()
    rows = []
    print(f"{'convs':>6} {'turns':>6} {'tokens':>7} {'anchors':>8} {'links':>6} "
          f"{'p50 us':>8} {'p90 us':>8}")
    for turns in map(int, args.turns.split(",")):
        for convs in map(int, args.conversations.split(",")):
            runs = [run(convs, turns, args.instruction, args.message, args.reply,
                        not args.no_prior, seed) for seed in range(max(1, 64 // convs))]
            times = sorted(t for r in runs for t in r.pop("times"))
            r = {**runs[0], "samples": len(times), "plan_us_p50": round(statistics.median(times), 1),
                 "plan_us_p90": round(times[int(0.9 * (len(times) - 1))], 1)}
            rows.append(r)
            print(f"{convs:>6} {turns:>6} {r['prompt_tokens']:>7} {r['anchors']:>8} "
                  f"{r['chain_links']:>6} {r['plan_us_p50']:>8} {r['plan_us_p90']:>8}",
                  flush=True)
    bench.write_json({"prior": not args.no_prior, "instruction": args.instruction, "message": args.message,
                      "reply": args.reply, "rows": rows},
                     REPO / "bench" / "results" / f"{args.name}.json")


if __name__ == "__main__":
    main()
