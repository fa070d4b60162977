"""A hybrid model (tiny random Qwen3.5: Gated DeltaNet + attention) served by the SGLang
worker on CPU: SGLang 0.5.23's scheduler, radix cache and Mamba pool, the CPU recipe's
reference kernels (ext/sglang/cpu_kernels.py, `no_buffer` Mamba strategy), our anchor cache.

- Its greedy tokens and their logprobs equal transformers' on the same weights.
- Anchors keep the recurrent state at their depths, captured inside the forward without
  ending a prefill chunk there (ext/sglang/capture.py: the anchored run's outputs are the
  plain run's, bit for bit): the seeds'
  headline case, a second conversation with the same tools and another first message,
  restores the instruction anchor, where SGLang alone reuses nothing; a later turn
  restores the conversation anchor after a flush.
- A restore is exact: its state is the captured one byte for byte, and its tokens equal a
  cold run whose prefill chunks end at the same depths (`cold_cut`: the prefixes run first
  as requests of their own), logprobs to float32 rounding (`close`: the captured state
  came from a forward over the whole first prompt, the cold run's from one that ended at
  the depth). A cold run in one chunk differs in the last float bits (1e-4
  on logprobs: the projections' matrix products over another number of rows), which a
  random tiny model can turn into another token at a near-tie; so through the proxy,
  anchors on equal anchors off up to such a tie (`same_up_to_a_tie`).
- A restore's state is the snapshot's byte for byte (`/anchor/verify`), and a corrupted
  state restore (fault injection) is caught by that check.
- States SGLang evicts or flushes are never restored from the device: restores come from
  host slabs (interleaved requests, flushes and slot churn).
- Through the proxy, a BFCL replay with anchors on equals anchors off; a toolset that
  starts with another one's first tools restores their tool anchors.
- With `--tp 2` (SGLang's CPU tensor parallelism, the GDN heads and state split over two
  ranks) a restore is exact too, and a state corrupted on one rank only is caught. That
  server takes its captures as a GPU does (`subpass`, ext/sglang/subpass.py: a second pass
  of each GDN layer's own kernels over the captured prefix), not by the reference kernels.
- The embedded worker writes the same slabs (KV and state, docs/ext.md) for the same
  prompt and depths, to float32 rounding, and restores the SGLang worker's to its own cold
  run's tokens (the module's server saves what it confirms for that: `slab_dir`).

One server for the module, and a second one with `--tp 2` for its test; each costs about a
minute to start on a 2-core machine."""

from __future__ import annotations

from functools import partial

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchorcache.testing.data import conversations, turn_requests, two_turn_prompts
from anchorcache.testing.exactness import (
    NEW,
    close,
    cold_cut,
    equal_to_transformers,
    generate,
    replay_on_equals_off,
    restore,
    same,
    same_up_to_a_tie,
    save,
)
from anchorcache.testing.isolation import check_tenants_stay_apart
from anchorcache.testing.servers import proxy_process, sglang_worker_process
from anchorcache.testing.worker_api import flush_device, post
from anchorcache.wire import AnchorKind, AnchorPlan, Region, SnapshotSpec

pytestmark = pytest.mark.slow

PROMPTS = ([9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30, 576, 6722, 374],
           list(range(1000, 1040)))
POOL = 6000


@pytest.fixture(scope="module")
def slab_dir(tmp_path_factory):
    """Where the module's SGLang worker saves every anchor it confirms (tests only:
    `SGLangAnchorConfig.slab_dump_dir`), for the comparison with the embedded worker."""
    return tmp_path_factory.mktemp("sglang-slabs")


@pytest.fixture(scope="module")
def hybrid(slab_dir):
    """(worker, model dir): the SGLang worker with our anchor cache on the tiny Qwen3.5."""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
    from anchorcache.ext.sglang.config import DUMP_ENV

    # (its config.json carries `full_attention_interval`, which SGLang's Qwen3.5 config reads)
    model = build_tiny_model("qwen3_5", tiny_model_dir("qwen3_5"))
    # SGLang keeps the conv window in bfloat16 unless told (SGLANG_MAMBA_CONV_DTYPE), which
    # rounds the float32 model's state at every chunk end and decode step; and its `--dtype
    # auto` serves a float32 checkpoint in float16 (KV pool included), so: float32 throughout,
    # as transformers and the embedded worker run it
    with sglang_worker_process("--max-total-tokens", str(POOL), "--dtype", "float32",
                               model=str(model),
                               env={**CONV_FLOAT32, DUMP_ENV: str(slab_dir)}) as worker:
        yield worker, model


CONV_FLOAT32 = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


@pytest.fixture(scope="module")
def prompts(qwen3_tokenizer):
    """(tool anchor depth, conversation anchor depth, turn-1 ids, turn-2 ids) of 2 BFCL
    conversations under the Qwen3 chat template (the tiny Qwen3.5 speaks its tokenizer)."""
    return two_turn_prompts(qwen3_tokenizer, 2)


def test_greedy_tokens_and_logprobs_equal_transformers(hybrid):
    """Cold, and over SGLang's own cached state (a second turn: the first turn's KV rows and
    its recurrent + conv state at their end, `no_buffer`). Logprobs: prefill through the
    delta rule and the conv for the first token, decode steps for the rest; measured at most
    7e-6 apart (float32 rounding), 0.016 while SGLang served this float32 model in float16
    (its `--dtype auto`, before the module's server said float32)."""
    from transformers import AutoModelForCausalLM

    worker, model_dir = hybrid
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check = partial(equal_to_transformers, model, worker.url)
    flush_device(worker.url)
    for ids in PROMPTS:
        check(list(ids))
    first = list(PROMPTS[0])
    out1, _ = check(first)
    _, cached = check(first + out1 + [5, 6, 7])
    assert cached == len(first) + NEW - 1  # SGLang's state at the first turn's end


def test_instruction_anchor_serves_a_new_conversation_sglang_alone_does_not(hybrid, prompts):
    """The seeds' headline case: same system prompt and tools, another first message."""
    worker, _ = hybrid
    url = worker.url
    tool_depth, _, p1, _ = prompts[0]
    other = p1[:tool_depth] + prompts[1][2][prompts[1][0]:]  # same tools, other user turn
    assert other[:tool_depth] == p1[:tool_depth] and other != p1
    flush_device(url)
    cold = generate(url, other)
    assert cold["meta_info"]["cached_tokens"] == 0
    # SGLang alone: the first conversation's KV is in the tree, its states only at chunk
    # ends and the prompt end, so nothing of the shared instruction prefix is reused
    flush_device(url)
    generate(url, p1)
    alone = generate(url, other)
    assert alone["meta_info"]["cached_tokens"] == 0
    assert alone["output_ids"] == cold["output_ids"]
    # with anchors: the first conversation's forward captures the state at the anchor's
    # depth without ending its prefill there (ext/sglang/capture.py), so its outputs are the
    # anchors-off ones, bit for bit; SGLang's tree holds the KV rows of the shared prefix, so
    # a restore over them puts back the state only; after a flush, the rows as well
    # (the shared prefix runs a few tokens past the tools: the next turn's opening)
    ref = cold_cut(url, other, tool_depth)
    flush_device(url)
    plain = generate(url, p1, logprobs=True)
    flush_device(url)
    keys, first = save(url, p1, tool_depth, out=True)
    same(first, plain)
    stats = httpx.get(url + "/anchor/stats", timeout=60).json()
    assert stats["captures"]["mode"] == "in_forward" and stats["captures"]["taken"] >= 1
    in_tree = generate(url, other, restore((tool_depth, keys[tool_depth])), logprobs=True)
    assert in_tree["meta_info"]["cached_tokens"] == tool_depth
    assert in_tree["meta_info"]["anchors"]["restored_tokens"] == 0  # (the state only)
    close(in_tree, ref)
    flush_device(url)
    warm = generate(url, other, restore((tool_depth, keys[tool_depth])), logprobs=True)
    assert warm["meta_info"]["cached_tokens"] == tool_depth
    assert warm["meta_info"]["anchors"]["restored"][0]["depth"] == tool_depth
    close(warm, ref)


def test_turn_boundary_chain_restores_after_a_flush_and_verifies(hybrid, prompts):
    """Turn 2 restores turn 1's chain (instruction + conversation anchor, each with its
    own state) from the host tier: output equal to a cold run, the tree's rows and state
    equal to the slabs; a corrupted state restore is what `/anchor/verify` catches."""
    worker, _ = hybrid
    url = worker.url
    tool_depth, conv_depth, p1, p2 = prompts[1]
    cold = cold_cut(url, p2, tool_depth, conv_depth)
    cold_tool = cold_cut(url, p2, tool_depth)
    flush_device(url)
    keys = save(url, p1, tool_depth, conv_depth)
    chain = restore((tool_depth, keys[tool_depth]), (conv_depth, keys[conv_depth]))
    for only_tool in (True, False):
        flush_device(url)
        plan = restore((tool_depth, keys[tool_depth])) if only_tool else chain
        warm = generate(url, p2, plan, logprobs=True)
        assert warm["meta_info"]["cached_tokens"] == (tool_depth if only_tool else conv_depth)
        close(warm, cold_tool if only_tool else cold)
    ok = post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})
    assert ok["device_tokens"] == conv_depth and ok["mismatch"] is None
    assert ok["state_equal"] is True
    flush_device(url)
    assert post(url, "/debug/fault", {"where": "restore_state_flip"})["armed"]
    generate(url, p2, chain)
    bad = post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})
    assert bad["device_tokens"] == conv_depth and bad["mismatch"] is None
    assert bad["state_equal"] is False
    flush_device(url)
    close(generate(url, p2, chain, logprobs=True), cold)
    assert post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})["state_equal"] is True


# The two engines run the same float32 model with other kernels and summation orders
# (SGLang's attention and projections, the CPU recipe's token-by-token delta rule against
# transformers' chunked one), so their slabs agree to float32 rounding, not bit for bit.
# Measured (2 anchors of 357 and 360 tokens, 4 state pieces each): KV at most 9.4e-7 and
# states at most 9.9e-7 of the piece's largest magnitude, while the same slab in another
# layout (a transposed GDN state, a conv window one column off) is off by 0.9 or more. The
# bound is 100x the rounding seen (other CPUs sum in other orders) and far below a layout
# error.
SLAB_RTOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest magnitude of `b`."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _pieces(slab: torch.Tensor, layout) -> list[torch.Tensor]:
    """A state slab cut into its typed pieces (docs/ext.md: each at a 64-byte boundary)."""
    from anchorcache.ext import kernels

    pieces = [torch.zeros((1, *shape), dtype=dtype) for shape, dtype in layout]
    kernels.restore_chain([], [], [], [], layout="thd", state_slab=slab, states=pieces)
    return [p[0] for p in pieces]


def test_embedded_worker_writes_the_same_slabs(hybrid, slab_dir, prompts):
    """docs/ext.md's slabs, from both workers: the same prompt snapshotted at the same two
    depths by the SGLang worker (its Mamba pool copied as it is) and by the embedded
    worker's own code (`anchors.capture_slabs` over transformers' cache) give KV and state
    slabs of equal sizes and layouts, equal values to rounding (`SLAB_RTOL`), and not equal
    to the same slab in another layout. And the SGLang worker's slabs, restored by the
    embedded worker (`anchors.cache_from_slabs`), give its cold run's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from anchorcache.ext.embedded import cache_io
    from anchorcache.ext.embedded.anchors import Slab, cache_from_slabs, capture_slabs

    worker, model_dir = hybrid
    tool_depth, conv_depth, p1, p2 = prompts[0]
    assert p1[:conv_depth] == p2[:conv_depth]
    ns = bytes(range(96, 112))  # this test's own namespace: its anchors are written here
    plan = AnchorPlan(ns, snapshot=(SnapshotSpec(tool_depth, AnchorKind.INSTRUCTION, Region.THICK),
                                    SnapshotSpec(conv_depth, AnchorKind.CONVERSATION, Region.THICK)))
    flush_device(worker.url)
    written = generate(worker.url, p1, plan)["meta_info"]["anchors"]["written"]
    post(worker.url, "/anchor/confirm", {"slots": [w["slot"] for w in written]})
    by_depth = {w["depth"]: w for w in written}
    assert sorted(by_depth) == [tool_depth, conv_depth]
    dumps = {d: torch.load(slab_dir / f"{w['key']}.pt") for d, w in by_depth.items()}
    assert dumps[conv_depth]["ids"] == p1[:conv_depth]
    assert dumps[conv_depth]["rows"] == [(0, tool_depth), (tool_depth, conv_depth)]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = cache_io.CacheSpec.from_model(model)
    ours: dict[int, Slab] = {}

    def on_boundary(position: int, cache) -> None:
        if position in (tool_depth, conv_depth):
            start = max(ours, default=0)
            kv, state = capture_slabs(spec, cache, start, position)
            ours[position] = Slab(bytes(16), position, start, None, AnchorKind.CONVERSATION,
                                  kv, state, 0)

    cold_cache = cache_io.new_cache(model)
    cold_logits = cache_io.prefill(model, cold_cache, p2, 0, [tool_depth, conv_depth],
                                   on_boundary=on_boundary)

    # sizes and layouts: the reply's nbytes, the KV slabs' shapes, the state pieces
    layout = spec.state_layout()
    assert dumps[conv_depth]["layout"] == [(shape, str(dtype)) for shape, dtype in layout]
    c = model.config
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + (
        c.linear_num_value_heads * c.linear_value_head_dim)
    gdn = (c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim)
    assert list(layout) == [((conv_dim, c.linear_conv_kernel_dim - 1), torch.float32),
                            (gdn, torch.float32)] * 2  # two GDN layers
    kv_seen = state_seen = 0.0
    wrong_seen = float("inf")
    for depth, link in zip((tool_depth, conv_depth), dumps[conv_depth]["kv"], strict=True):
        mine = ours[depth]
        assert mine.kv is not None and mine.state is not None
        assert by_depth[depth]["nbytes"] == mine.kv.nbytes + spec.state_bytes
        assert link.shape == mine.kv.shape and link.dtype == mine.kv.dtype
        kv_seen = max(kv_seen, _rel(link, mine.kv))
        theirs = dumps[depth]["state"]
        assert theirs.shape == mine.state.shape == (spec.state_bytes,)
        for i, (a, b) in enumerate(zip(_pieces(theirs, layout), _pieces(mine.state, layout),
                                       strict=True)):
            state_seen = max(state_seen, _rel(a, b))
            # another layout of the same piece: a transposed GDN state, or a conv window
            # one column off (transformers' `kernel` columns cut at the wrong end)
            other = b.transpose(-1, -2) if i % 2 else torch.cat([b[:, :1], b[:, :-1]], 1)
            wrong_seen = min(wrong_seen, _rel(a, other))
    print(f"slab differences: KV {kv_seen:.2e}, states {state_seen:.2e}, "
          f"another layout {wrong_seen:.2e}")
    assert kv_seen < SLAB_RTOL and state_seen < SLAB_RTOL < wrong_seen

    # the SGLang worker's chain restored by the embedded worker: its cold run's tokens
    theirs_chain = [Slab(bytes(16), depth, start, None, AnchorKind.CONVERSATION, kv,
                         dumps[conv_depth]["state"] if depth == conv_depth else None, 0)
                    for (start, depth), kv in zip(dumps[conv_depth]["rows"],
                                                  dumps[conv_depth]["kv"], strict=True)]
    warm_cache = cache_from_slabs(model, spec, theirs_chain)
    warm_logits = cache_io.prefill(model, warm_cache, p2, conv_depth, [])
    cold, warm = [], []
    for cache, logits, out in ((cold_cache, cold_logits, cold), (warm_cache, warm_logits, warm)):
        position = len(p2)
        for _ in range(NEW):
            out.append(int(logits[0, -1].argmax()))
            logits = cache_io.decode_step(model, cache, out[-1], position)
            position += 1
    assert warm == cold


@pytest.fixture(scope="module")
def churn(hybrid, prompts):
    """Saved anchors and cold outputs for the interleaving test."""
    worker, _ = hybrid
    tool_depth, conv_depth, p1, p2 = prompts[0]
    cold = cold_cut(worker.url, p2, tool_depth, conv_depth)
    flush_device(worker.url)
    keys = save(worker.url, p1, tool_depth, conv_depth)
    return restore((tool_depth, keys[tool_depth]), (conv_depth, keys[conv_depth])), p2, cold


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["restore", "flush", "other", "plain"]), min_size=3,
                max_size=6))
def test_interleaved_requests_flushes_and_churn_never_restore_stale_state(hybrid, churn, kernels):
    """Whatever ran before (restores, flushes, other prompts taking and freeing Mamba
    slots, SGLang's own cache of the same prompt), turn 2 gives its cold output (one whose
    prefill chunks end at the anchors' depths, as the restore's and SGLang's own cache's do)."""
    worker, _ = hybrid
    chain, p2, cold = churn
    for i, op in enumerate(kernels):
        if op == "flush":
            flush_device(worker.url)
        elif op == "other":
            generate(worker.url, list(range(2000 + 37 * i, 2300 + 37 * i)), max_new=3)
        else:
            out = generate(worker.url, p2, chain if op == "restore" else None, logprobs=True)
            assert out["output_ids"] == cold["output_ids"], (kernels, i)


def test_bfcl_replay_through_the_proxy_with_anchors_equals_without(hybrid):
    replay_on_equals_off(hybrid[0].url, conversations("base")[2])


def test_a_toolset_sharing_the_first_tools_restores_their_tool_anchors(hybrid):
    """The benchmark's turn-1 case: BFCL conversations 0 and 4 share their first 16 tools
    only. A toolset's first request through the proxy also writes tool anchors (each with
    its recurrent state; a prefill chunk ends at each); a second toolset made of the first
    16 tools and another restores them up to where the two part, after a flush, and
    answers as its cold run does."""
    from anchorcache.proxy.planner import Planner
    from anchorcache.proxy.splitter import get_adapter
    from anchorcache.proxy.splitter.tokenizers import load_tokenizer

    worker, model = hybrid
    conv = conversations("base")[0]
    msgs, first = turn_requests(conv, 1)[0], conv["tools"]
    second = first[:16] + [t for t in conversations("base")[1]["tools"]
                           if t["function"]["name"] not in {f["function"]["name"] for f in first}]
    adapter = get_adapter("auto", load_tokenizer(str(model)))
    a, b = adapter.split(msgs, first), adapter.split(msgs, second)
    shared = next(i for i, (x, y) in enumerate(zip(a.input_ids, b.input_ids, strict=False)) if x != y)
    want = [d for d in Planner("m", "e")._tool_cuts(a) if d <= shared]  # the default gap
    assert len(want) >= 3 and shared < b.instruction_cut
    with proxy_process(worker.url, "--anchors") as on, \
            proxy_process(worker.url, "--no-anchors") as off:
        def ask(proxy, tools):
            flush_device(worker.url)
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0,
                                   timeout=600)
            return client.chat.completions.create(
                model="default", messages=msgs, tools=tools, temperature=0, max_tokens=8,
                logprobs=True)

        ask(on, first)
        cold, warm = ask(off, second), ask(on, second)
    same_up_to_a_tie(warm.choices[0], cold.choices[0])
    assert warm.usage.prompt_tokens_details.cached_tokens == want[-1]
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


def test_tensor_parallel_restores_each_ranks_state_exactly(prompts):
    """`--tp 2`: each rank snapshots and restores its own shard of the KV heads and of the
    recurrent state; the restored chain's output equals a cold run with the same chunk
    ends, and `/anchor/verify` (which combines the ranks) sees a state corrupted on rank 1
    only. The states are captured as on a GPU (`subpass`): the anchored run's outputs are
    the plain run's, bit for bit, and each rank's captures were all written."""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
    from anchorcache.ext.sglang.config import CAPTURE_ENV

    model = build_tiny_model("qwen3_5", tiny_model_dir("qwen3_5"))
    tool_depth, conv_depth, p1, p2 = prompts[1]
    # float32, as the module's server (`close`'s bound is float32 rounding)
    with sglang_worker_process("--max-total-tokens", str(POOL), "--tp", "2", "--dtype",
                               "float32", model=str(model),
                               env={**CONV_FLOAT32, CAPTURE_ENV: "subpass"}) as worker:
        url = worker.url
        cold = cold_cut(url, p2, tool_depth, conv_depth)
        flush_device(url)
        plain = generate(url, p1, logprobs=True)
        flush_device(url)
        keys, first = save(url, p1, tool_depth, conv_depth, out=True)
        same(first, plain)
        captures = httpx.get(url + "/anchor/stats", timeout=60).json()["captures"]
        assert captures["mode"] == "in_forward" and captures["by"] == "subpass"
        assert captures["taken"] >= 1 and captures["unwritten"] == 0
        chain = restore((tool_depth, keys[tool_depth]), (conv_depth, keys[conv_depth]))
        flush_device(url)
        warm = generate(url, p2, chain, logprobs=True)
        assert warm["meta_info"]["cached_tokens"] == conv_depth
        close(warm, cold)
        assert post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})["state_equal"] is True
        flush_device(url)
        post(url, "/debug/fault", {"where": "restore_state_flip", "rank": 1})
        generate(url, p2, chain)
        bad = post(url, "/anchor/verify", {"key": keys[conv_depth].hex()})
        assert bad["mismatch"] is None and bad["state_equal"] is False


def test_tenants_never_see_each_others_prompts_on_a_hybrid_model(hybrid):
    """The hybrid tree (KV and Mamba states) keys the request's namespace too."""
    worker, _ = hybrid
    with proxy_process(worker.url) as proxy:
        check_tenants_stay_apart(proxy, worker.url)
