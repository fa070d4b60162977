"""The other hybrid architectures SGLang serves, on the SGLang worker on CPU, with our anchor
cache (tiny random models; test_sglang_hybrid_cpu.py covers Qwen3.5 in depth):

- Falcon-H1 (Mamba2: attention and a Mamba2 mixer in every layer): SGLang 0.5.23's own
  `FalconH1ForCausalLM` and `MambaMixer2` over the CPU recipe's Mamba2 kernels
  (ext/sglang/cpu_mamba2.py);
- Qwen3-Next (Gated DeltaNet, attention and MoE layers): its own `Qwen3NextForCausalLM`
  over the GDN kernels (ext/sglang/cpu_kernels.py) and the recipe's Qwen3-Next hooks
  (ext/sglang/cpu.py: the GDN layer built on the CPU device, the shared expert's gate in
  torch, the fused gated norm's CPU branch).

For each:
- Its greedy tokens and their logprobs equal transformers' on the same weights, cold and
  over SGLang's own cached state (a second turn).
- Anchors keep the recurrent state (conv window + SSM / delta-rule state) at their depths:
  a chain restored from the host tier after a flush gives the tokens of a cold run whose
  prefill chunks end at the same depths, logprobs to float32 rounding (`close`: on a GDN
  model the state was captured inside a forward over the whole first prompt), and the
  tokens of a plain cold run (anchors off); the tree's state equals the slab (`/anchor/verify`), and a
  corrupted state restore is what that check catches.

Falcon-H1's server takes its captures as a GPU's would (`subpass`, ext/sglang/subpass.py:
a second pass of each Mamba2 layer's own conv and scan over the captured prefix), Qwen3-Next's
by the reference kernels themselves (`kernels`); test_mamba2_cpu_kernels.py checks the
Mamba2 kernels' own captures.

One server per architecture (module-scoped, parametrized): one to two minutes each to start
on a 2-core machine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
import torch

from anchorcache.testing.data import two_turn_prompts
from anchorcache.testing.exactness import (
    close,
    cold_cut,
    equal_to_transformers,
    generate,
    restore,
    same,
    save,
)
from anchorcache.testing.servers import sglang_worker_process
from anchorcache.testing.worker_api import flush_device, post

pytestmark = pytest.mark.slow

PROMPTS = ([9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30, 576, 6722, 374],
           list(range(1000, 1040)))
POOL = 6000
# float32 throughout, as transformers runs the model: SGLang keeps the conv window in
# bfloat16 unless told, and serves a float32 checkpoint in float16 under `--dtype auto`
CONV_FLOAT32 = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


CAPTURES = {"falcon_h1": "subpass", "qwen3_next": "kernels"}  # who writes each one's


@pytest.fixture(scope="module", params=list(CAPTURES))
def hybrid(request):
    """(worker, model dir): the SGLang worker with our anchor cache on a tiny model of the
    architecture (Qwen3-Next's config.json carries `full_attention_interval`, which SGLang's
    config reads), capturing as `CAPTURES` says."""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
    from anchorcache.ext.sglang.config import CAPTURE_ENV

    model = build_tiny_model(request.param, tiny_model_dir(request.param))
    env = {**CONV_FLOAT32, CAPTURE_ENV: CAPTURES[request.param]}
    with sglang_worker_process("--max-total-tokens", str(POOL), "--dtype", "float32",
                               model=str(model), env=env) as worker:
        yield worker, model, CAPTURES[request.param]


def test_greedy_tokens_and_logprobs_equal_transformers(hybrid):
    """Cold (prefill through the conv and the chunked scan, decode through the one-token
    update), and over SGLang's own cached state at the first turn's end."""
    from transformers import AutoModelForCausalLM

    worker, model_dir, _ = hybrid
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check = partial(equal_to_transformers, model, worker.url)
    flush_device(worker.url)
    for ids in PROMPTS:
        check(list(ids))
    first = list(PROMPTS[0])
    out1, _ = check(first)
    _, cached = check(first + out1 + [5, 6, 7])
    assert cached > len(first)  # SGLang's own recurrent state at the first turn's end


def test_chain_restore_after_a_flush_equals_a_cold_run(hybrid, qwen3_tokenizer):
    """Turn 2 of a BFCL conversation restores turn 1's chain (tool anchor + conversation
    anchor, each with its conv and recurrent state) from the host tier, and its tool anchor
    alone (a state captured inside turn 1's forward)."""
    worker, _, by = hybrid
    url = worker.url
    tool_depth, conv_depth, p1, p2 = two_turn_prompts(qwen3_tokenizer, 1)[0]
    flush_device(url)
    off = generate(url, p2, logprobs=True)  # anchors off: no plan, one prefill
    assert off["meta_info"]["cached_tokens"] == 0
    cold = cold_cut(url, p2, tool_depth, conv_depth)
    assert cold["output_ids"] == off["output_ids"]
    flush_device(url)
    plain = generate(url, p1, logprobs=True)
    flush_device(url)
    keys, first = save(url, p1, tool_depth, conv_depth, out=True)
    same(first, plain)  # captures inside the forward change none of its outputs
    captures = httpx.get(url + "/anchor/stats", timeout=60).json()["captures"]
    assert captures["mode"] == "in_forward" and captures["by"] == by
    assert captures["taken"] >= 1 and captures["unwritten"] == 0
    chain = restore((tool_depth, keys[tool_depth]), (conv_depth, keys[conv_depth]))
    flush_device(url)
    warm = generate(url, p2, chain, logprobs=True)
    assert warm["meta_info"]["cached_tokens"] == conv_depth
    assert [r["depth"] for r in warm["meta_info"]["anchors"]["restored"]] == [tool_depth,
                                                                              conv_depth]
    close(warm, cold)
    assert warm["output_ids"] == off["output_ids"]
    ok = post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})
    assert ok["device_tokens"] == conv_depth and ok["mismatch"] is None
    assert ok["state_equal"] is True
    # a corrupted state restore: the tree's state no longer equals the slab
    flush_device(url)
    assert post(url, "/debug/fault", {"where": "restore_state_flip"})["armed"]
    generate(url, p2, chain)
    assert post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})["state_equal"] is False
    flush_device(url)
    close(generate(url, p2, chain, logprobs=True), cold)
    # the tool anchor alone: its state is the one captured inside turn 1's forward
    cold_tool = cold_cut(url, p2, tool_depth)
    flush_device(url)
    warm_tool = generate(url, p2, restore((tool_depth, keys[tool_depth])), logprobs=True)
    assert warm_tool["meta_info"]["cached_tokens"] == tool_depth
    close(warm_tool, cold_tool)


def test_captures_of_requests_prefilled_together_are_each_their_own(hybrid, qwen3_tokenizer):
    """Four conversations' first turns sent at once (SGLang packs the ones waiting into one
    prefill, where each capture is taken from its own rows): each one's tool anchor
    restores its own state, a turn 2 over it equal to its cold run."""
    worker, _, _ = hybrid
    url = worker.url
    prompts = two_turn_prompts(qwen3_tokenizer, 4)
    flush_device(url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        keys = list(pool.map(lambda p: save(url, p[2], p[0]), prompts))
    for (tool_depth, _, _, p2), k in zip(prompts, keys, strict=True):
        cold = cold_cut(url, p2, tool_depth)
        flush_device(url)
        warm = generate(url, p2, restore((tool_depth, k[tool_depth])), logprobs=True)
        assert warm["meta_info"]["cached_tokens"] == tool_depth
        close(warm, cold)
