"""Exactness checks of a model served by the SGLang worker (the hybrid and sliding-window
modules): its greedy tokens and logprobs against transformers' on the same weights, snapshot
and restore plans in one namespace, and a replay through anchors-on and anchors-off proxies."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx

from anchorcache.testing import worker_api
from anchorcache.testing.data import turn_requests
from anchorcache.testing.servers import proxy_process
from anchorcache.testing.worker_api import flush_device, post
from anchorcache.wire import AnchorKind, AnchorPlan, AnchorRef, Region, SnapshotSpec

NEW = 8  # tokens generated per request
NS = bytes(range(48, 64))
# a random tiny model has near-ties: where transformers' top two logits are closer than this,
# a rounding difference (SGLang's attention, the delta rule token by token vs chunked) may
# pick the other token, so greedy tokens are compared up to the first such step only
TIE = 0.05

generate = partial(worker_api.generate, max_new=NEW)


def save(url: str, ids: Any, *depths: int, out: bool = False) -> Any:
    """Snapshot `ids` at `depths` (instruction anchor first, then conversation anchors) and
    confirm; {depth: key} (and, with `out`, the run itself, logprobs included)."""
    kinds = [AnchorKind.INSTRUCTION] + [AnchorKind.CONVERSATION] * (len(depths) - 1)
    plan = AnchorPlan(NS, snapshot=tuple(SnapshotSpec(d, k, Region.THICK)
                                         for d, k in zip(depths, kinds, strict=True)))
    run = generate(url, ids, plan, logprobs=out)
    anchors = run["meta_info"]["anchors"]
    post(url, "/anchor/confirm", {"slots": [w["slot"] for w in anchors["written"]]})
    keys = {w["depth"]: bytes.fromhex(w["key"]) for w in anchors["written"] + anchors["held"]}
    return (keys, run) if out else keys


def restore(*links: tuple[int, bytes]) -> AnchorPlan:
    """A plan restoring the chain of (depth, key) `links`, root first."""
    return AnchorPlan(NS, restore=tuple(AnchorRef(key, depth) for depth, key in links))


def cold_cut(url: str, ids: Any, *depths: int) -> Any:
    """A cold run of `ids` (device flushed, no anchors) whose prefill chunks end at
    `depths`, as a restore over an anchor at each of them does: the prefix up to each depth
    runs first as a request of its own (one token; SGLang keeps its state at its end, the
    depth), so each prefill starts where the one before ended. Its `cached_tokens` is the
    last depth."""
    flush_device(url)
    for depth in depths:
        generate(url, list(ids[:depth]), max_new=1)
    return generate(url, ids, logprobs=True)


def same(a: Any, b: Any) -> None:
    """Equal tokens and logprobs (bit for bit)."""
    assert a["output_ids"] == b["output_ids"]
    assert a["output_token_logprobs"] == b["output_token_logprobs"]


# A hybrid model's anchor state captured inside a forward (ext/sglang/capture.py) comes from
# a forward over the whole first prompt; a cold run's from a forward that ends at the
# anchor's depth (`cold_cut`). The two round alike to float32's last bits but not bit for
# bit: measured on the tiny Qwen3.5 (a BFCL chain of 357 + 379 tokens), a restore's logprobs
# were at most 5.7e-6 from `cold_cut`'s and 4.8e-7 from a cold run in one forward, while
# `cold_cut` and the one-forward run were 5.2e-6 apart. A restore of another prefix or
# another depth moves them by orders of magnitude more.
LOGPROB_ATOL = 1e-4


def close(a: Any, b: Any) -> None:
    """Equal tokens, logprobs within `LOGPROB_ATOL` (a restore of a state captured inside
    a forward against a cold run)."""
    assert a["output_ids"] == b["output_ids"]
    got = [lp for lp, _, _ in a["output_token_logprobs"]]
    want = [lp for lp, _, _ in b["output_token_logprobs"]]
    assert len(got) == len(want)
    gap = max((abs(x - y) for x, y in zip(got, want, strict=True)), default=0.0)
    assert gap <= LOGPROB_ATOL, (gap, got, want)


def equal_to_transformers(model: Any, url: str, ids: list[int]) -> tuple[list[int], int]:
    """SGLang's greedy tokens for `ids` equal transformers' up to the first near-tie (`TIE`),
    and their logprobs (teacher-forced on SGLang's own tokens) within 1e-3; (SGLang's
    tokens, its cached_tokens)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    want = out.sequences[0, len(ids):].tolist()
    gaps = [float(t[0] - t[1]) for t in (s[0].topk(2).values for s in out.scores)]
    upto = next((i for i, g in enumerate(gaps) if g < TIE), NEW) + 1
    got = generate(url, ids, logprobs=True)
    assert upto >= 2 and got["output_ids"][:upto] == want[:upto], (got, want, gaps)
    seq = torch.tensor([ids + got["output_ids"]])
    with torch.no_grad():
        logits = model(seq).logits[0, len(ids) - 1:-1].float()
    ref = logits.log_softmax(-1).gather(1, seq[0, len(ids):, None])[:, 0]
    lps = torch.tensor([lp for lp, _, _ in got["output_token_logprobs"]])
    torch.testing.assert_close(lps, ref, rtol=0, atol=1e-3)
    return got["output_ids"], int(got["meta_info"]["cached_tokens"])


def same_up_to_a_tie(a: Any, b: Any, tol: float = 2e-3) -> None:
    """Greedy choices `a` and `b` (OpenAI SDK choices with logprobs) are the same, or they
    part at a near-tie: every token before it has the same logprob within `tol`, and at it
    both picks are within `tol`."""
    la, lb = a.logprobs.content, b.logprobs.content
    for x, y in zip(la, lb, strict=False):
        assert abs(x.logprob - y.logprob) < tol, (x, y)
        if x.token != y.token:
            return  # a near-tie: both picks equally likely to within `tol`
    assert a.message == b.message


def replay_on_equals_off(url: str, conv: dict[str, Any]) -> None:
    """Three turns of `conv` through an anchors-on and an anchors-off proxy in front of the
    worker at `url`, each from an empty device tree: the same choices (up to a near-tie),
    and from turn 2 on, part of the prompt restored; nothing left staged."""
    import openai

    with proxy_process(url, "--anchors") as on, proxy_process(url, "--no-anchors") as off:
        for turn, messages in enumerate(turn_requests(conv, 3), 1):
            outs = []
            for proxy in (off, on):
                flush_device(url)
                client: Any = openai.OpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0,
                                       timeout=600)
                outs.append(client.chat.completions.create(
                    model="default", messages=messages, tools=conv["tools"], temperature=0,
                    max_tokens=8, logprobs=True))
            cold, warm = outs
            same_up_to_a_tie(warm.choices[0], cold.choices[0])
            assert warm.usage.prompt_tokens == cold.usage.prompt_tokens > 1000
            cached = warm.usage.prompt_tokens_details.cached_tokens
            if turn >= 2:  # the instruction and the conversation so far come back
                assert 0 < cached < warm.usage.prompt_tokens, turn
    assert httpx.get(url + "/anchor/stats", timeout=30).json()["staged"] == 0
