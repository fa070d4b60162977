"""Anchors on == anchors off, token for token, for dense and hybrid models.

Every case renders a real BFCL agent conversation with the Qwen3 chat template, cuts it
where the splitter would (end of the system/tools block: c1; end of the last completed
turn: c2), and compares greedy generation from a cold chunked prefill with generation
from a cache rebuilt out of copied K/V rows and recurrent/conv state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from anchorcache.ext.embedded import cache_io
from anchorcache.ext.embedded.tiny_models import TINY_ARCHS, build_tiny_model, is_complete

NUM_NEW_TOKENS = 16
SMOLLM2 = "smollm2"
# the archs without recurrent state (SmolLM2 is a Llama): a stale-state test has nothing to
# change on them
DENSE = ("qwen3", "llama", SMOLLM2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine
    OpenMP spin-waiting makes them up to 30x slower; restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Case(NamedTuple):
    name: str
    model: Any
    spec: cache_io.CacheSpec
    ids: list[int]
    c1: int
    c2: int


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(tokenizer: Any, text: str) -> tuple[list[int], int, int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cuts = [i + 1 for i, t in enumerate(ids) if t == im_end]
    assert len(cuts) >= 3, "expected system, at least one completed turn, and a new message"
    return ids, cuts[0], cuts[-2]


@pytest.fixture(scope="module", params=[*TINY_ARCHS, SMOLLM2])
def case(request: pytest.FixtureRequest, qwen3_tokenizer: Any,
         agent_prompt_texts: list[str]) -> Case:
    name = request.param
    if name == SMOLLM2:
        from transformers import AutoTokenizer

        path = request.getfixturevalue("smollm2_path")
        # SmolLM2's own template ignores tools: tokenize the Qwen3-rendered agent text with
        # SmolLM2's tokenizer (ChatML markers are special tokens in both).
        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        path = request.getfixturevalue("tiny_model_path")(name)
        tokenizer = qwen3_tokenizer
    model = _load(path)
    ids, c1, c2 = _prompt(tokenizer, agent_prompt_texts[0])
    return Case(name, model, cache_io.CacheSpec.from_model(model), ids, c1, c2)


def _greedy(model: Any, cache: Any, logits: torch.Tensor, position: int) -> list[int]:
    out: list[int] = []
    for _ in range(NUM_NEW_TOKENS):
        token = int(logits[0, -1].argmax())
        out.append(token)
        logits = cache_io.decode_step(model, cache, token, position)
        position += 1
    return out


def _cold(case: Case, on_boundary: Any = None) -> tuple[torch.Tensor, list[int]]:
    cache = cache_io.new_cache(case.model)
    logits = cache_io.prefill(case.model, cache, case.ids, 0, [case.c1, case.c2],
                              on_boundary=on_boundary)
    return logits, _greedy(case.model, cache, logits, len(case.ids))


def _warm(case: Case, keys: Any, values: Any, states: Any, depth: int
          ) -> tuple[torch.Tensor, list[int]]:
    cache = cache_io.cache_from_tensors(case.model, keys, values, states, spec=case.spec)
    logits = cache_io.prefill(case.model, cache, case.ids, depth, [])
    return logits, _greedy(case.model, cache, logits, len(case.ids))


def _prefix_copy(case: Case, depth: int, chunk_at: list[int]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Prefill `[0, depth)` in the given chunks; clone K/V rows and state through the views."""
    cache = cache_io.new_cache(case.model)
    cache_io.prefill(case.model, cache, case.ids[:depth], 0, chunk_at)
    keys, values = cache_io.kv_views(cache)
    states = cache_io.state_views(cache)
    return ([k[:, :, :depth].clone() for k in keys], [v[:, :, :depth].clone() for v in values],
            [s.clone() for s in states])


def test_restore_is_token_identical_to_cold(case: Case) -> None:
    cold_logits, cold = _cold(case)
    keys, values, states = _prefix_copy(case, case.c2, [case.c1])
    assert len(states) == len(case.spec.states)
    warm_logits, warm = _warm(case, keys, values, states, case.c2)
    assert warm == cold
    # Same chunking on both sides, so even the logits agree bit for bit.
    assert torch.equal(warm_logits, cold_logits)


def join_chain(segments: list[cache_io.CacheTensors]) -> cache_io.CacheTensors:
    """Root -> leaf segments as one `[0, leaf.depth)` copy with the leaf's states."""
    assert [s.start for s in segments] == [0] + [s.depth for s in segments[:-1]]
    leaf = segments[-1]
    layers = range(len(leaf.keys))
    return cache_io.CacheTensors(
        start=0, depth=leaf.depth,
        keys=tuple(torch.cat([s.keys[i] for s in segments], dim=-2) for i in layers),
        values=tuple(torch.cat([s.values[i] for s in segments], dim=-2) for i in layers),
        states=leaf.states,
    )


def test_chain_of_two_copies_restores_identically(case: Case) -> None:
    segments: dict[int, cache_io.CacheTensors] = {}

    def on_boundary(position: int, cache: Any) -> None:
        if position == case.c1:
            segments[position] = cache_io.snapshot(cache, 0, case.c1)
        elif position == case.c2:
            segments[position] = cache_io.snapshot(cache, case.c1, case.c2)

    _, cold = _cold(case, on_boundary)
    root, leaf = segments[case.c1], segments[case.c2]
    assert all(k.shape[-2] == case.c2 - case.c1 for k in leaf.keys)
    chain = join_chain([root, leaf])
    _, warm = _warm(case, chain.keys, chain.values, chain.states, case.c2)
    assert warm == cold


def test_slab_chain_restores_bit_for_bit(case: Case) -> None:
    """The embedded worker's own slabs (`anchors.capture_slabs`: docs/ext.md's layout, the
    conv window without its oldest column, a GDN state with its last dims swapped) restore a
    chain of two whose logits and greedy tokens equal the cold run's bit for bit: the column
    the slab drops is one no later step reads."""
    from anchorcache.ext import kernels
    from anchorcache.ext.embedded.anchors import Slab, cache_from_slabs, capture_slabs
    from anchorcache.wire import AnchorKind

    chain: list[Slab] = []

    def on_boundary(position: int, cache: Any) -> None:
        if position in (case.c1, case.c2):
            start = chain[-1].depth if chain else 0
            kv, state = capture_slabs(case.spec, cache, start, position)
            chain.append(Slab(bytes(16), position, start, None, AnchorKind.CONVERSATION, kv,
                              state, 0))

    cold_logits, cold = _cold(case, on_boundary)
    probe = cache_io.new_cache(case.model)
    cache_io.prefill(case.model, probe, case.ids[:2], 0)
    views = cache_io.slab_state_views(case.spec, cache_io.state_views(probe))
    assert [(tuple(v.shape[1:]), v.dtype) for v in views] == list(case.spec.state_layout())
    assert kernels.state_slab_nbytes(views) == case.spec.state_bytes
    for slab in chain:
        assert (slab.state is None if not case.spec.is_recurrent
                else slab.state.numel() == case.spec.state_bytes)
    for s in case.spec.states:  # the slab's layout (docs/ext.md), per kind of state
        if s.kind is cache_io.StateKind.CONV:
            assert s.slab_shape == (*s.shape[1:-1], s.shape[-1] - 1)
        elif case.name in ("qwen3_next", "qwen3_5"):
            assert s.swap_last and s.slab_shape == (*s.shape[1:-2], s.shape[-1], s.shape[-2])
        else:
            assert not s.swap_last and s.slab_shape == s.shape[1:]
    cache = cache_from_slabs(case.model, case.spec, chain)
    warm_logits = cache_io.prefill(case.model, cache, case.ids, case.c2, [])
    assert torch.equal(warm_logits, cold_logits)
    assert _greedy(case.model, cache, warm_logits, len(case.ids)) == cold


@pytest.mark.parametrize("case", [a for a in TINY_ARCHS if a not in DENSE], indirect=True)
def test_wrong_state_changes_output(case: Case) -> None:
    """K/V at c2 with the state taken at c1: the first delta position must see it, and
    where the model carries recurrent state (long memory), so must the greedy tokens."""
    assert case.spec.is_recurrent, case.name
    _, cold = _cold(case)
    keys, values, states = _prefix_copy(case, case.c2, [case.c1])
    _, _, stale_states = _prefix_copy(case, case.c1, [])

    def first_delta_logits(state_tensors: list[torch.Tensor]) -> torch.Tensor:
        cache = cache_io.cache_from_tensors(case.model, keys, values, state_tensors,
                                            spec=case.spec)
        return cache_io.decode_step(case.model, cache, case.ids[case.c2], case.c2)

    assert not torch.equal(first_delta_logits(stale_states), first_delta_logits(states))
    if any(s.kind is cache_io.StateKind.RECURRENT for s in case.spec.states):
        _, wrong = _warm(case, keys, values, stale_states, case.c2)
        assert wrong != cold


def test_spec_matches_layer_types(case: Case) -> None:
    config = case.model.config
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    assert case.spec.num_layers == len(types)
    assert case.spec.kv_layers == tuple(
        i for i, t in enumerate(types) if t in ("full_attention", "hybrid"))
    assert case.spec.state_layers == tuple(
        i for i, t in enumerate(types) if t in ("linear_attention", "hybrid", "conv"))
    conv, recurrent = cache_io.StateKind.CONV, cache_io.StateKind.RECURRENT
    for layer in case.spec.state_layers:
        kinds = [s.kind for s in case.spec.states if s.layer_idx == layer]
        assert kinds == ([conv] if types[layer] == "conv" else [conv, recurrent])
    if case.spec.kv_layers:
        cache = cache_io.new_cache(case.model)
        cache_io.prefill(case.model, cache, case.ids[:10], 0)
        keys, values = cache_io.kv_views(cache)
        assert [tuple(k.shape) for k in keys] == [
            (1, case.spec.num_kv_heads, 10, case.spec.head_dim)] * len(case.spec.kv_layers)
        assert case.spec.kv_bytes_per_token == sum(
            k[:, :, :1].nbytes + v[:, :, :1].nbytes for k, v in zip(keys, values, strict=True))


@pytest.mark.parametrize("case", TINY_ARCHS, indirect=True)  # (not SmolLM2: a real model)
def test_model_output_depends_on_prompt(case: Case, qwen3_tokenizer: Any,
                                        agent_prompt_texts: list[str]) -> None:
    """Guards the meaning of the identity tests: a random model that ignored its input
    would pass them trivially."""
    outputs = []
    for text in agent_prompt_texts:
        ids = qwen3_tokenizer(text, add_special_tokens=False)["input_ids"]
        cache = cache_io.new_cache(case.model)
        logits = cache_io.prefill(case.model, cache, ids, 0)
        outputs.append(_greedy(case.model, cache, logits, len(ids)))
    assert outputs[0] != outputs[1]
    assert all(len(set(out)) > 1 for out in outputs)


# ---- API edges (one hybrid model is enough) ---------------------------------------------


@pytest.fixture(scope="module")
def hybrid(qwen3_tokenizer: Any, agent_prompt_texts: list[str], tiny_model_path: Any) -> Case:
    model = _load(tiny_model_path("qwen3_next"))
    ids, c1, c2 = _prompt(qwen3_tokenizer, agent_prompt_texts[0])
    return Case("qwen3_next", model, cache_io.CacheSpec.from_model(model), ids, c1, c2)


def test_on_boundary_runs_after_every_chunk(hybrid: Case) -> None:
    seen: list[int] = []
    cache = cache_io.new_cache(hybrid.model)
    cache_io.prefill(hybrid.model, cache, hybrid.ids, 5, [hybrid.c1, hybrid.c2],
                     on_boundary=lambda pos, _: seen.append(pos), max_chunk_tokens=100)
    ends = sorted({*range(105, hybrid.c1, 100), hybrid.c1,
                   *range(hybrid.c1 + 100, hybrid.c2, 100), hybrid.c2,
                   *range(hybrid.c2 + 100, len(hybrid.ids), 100), len(hybrid.ids)})
    assert seen == ends


@pytest.mark.parametrize("boundaries", [[0], [10, 10], [20, 10], [10_000]])
def test_prefill_rejects_bad_boundaries(hybrid: Case, boundaries: list[int]) -> None:
    with pytest.raises(ValueError):
        cache_io.prefill(hybrid.model, cache_io.new_cache(hybrid.model), hybrid.ids, 0,
                         boundaries)


def test_prefill_rejects_start_at_end(hybrid: Case) -> None:
    with pytest.raises(ValueError):
        cache_io.prefill(hybrid.model, cache_io.new_cache(hybrid.model), hybrid.ids,
                         len(hybrid.ids))


def test_cache_from_tensors_rejects_mismatches(hybrid: Case) -> None:
    keys, values, states = _prefix_copy(hybrid, hybrid.c1, [])
    bad_inputs = [
        (keys[:-1], values[:-1], states),                      # missing KV layer
        (keys, values, states[:-1]),                           # missing state
        (keys, [v[:, :, :-1] for v in values], states),        # K and V of different depth
        (keys, values, [s[..., :-1] for s in states]),         # truncated state
        ([k[:, :1] for k in keys], [v[:, :1] for v in values], states),  # wrong head count
        ([k[:, :, :0] for k in keys], [v[:, :, :0] for v in values], states),  # empty prefix
    ]
    for k, v, s in bad_inputs:
        with pytest.raises(ValueError):
            cache_io.cache_from_tensors(hybrid.model, k, v, s, spec=hybrid.spec)


def test_restored_cache_does_not_alias_inputs(hybrid: Case) -> None:
    keys, values, states = _prefix_copy(hybrid, hybrid.c1, [])
    before = [s.clone() for s in states]
    cache = cache_io.cache_from_tensors(hybrid.model, keys, values, states, spec=hybrid.spec)
    cache_io.prefill(hybrid.model, cache, hybrid.ids, hybrid.c1, [])
    assert all(torch.equal(a, b) for a, b in zip(states, before, strict=True))


def test_snapshot_refuses_state_at_wrong_depth(hybrid: Case) -> None:
    cache = cache_io.new_cache(hybrid.model)
    cache_io.prefill(hybrid.model, cache, hybrid.ids[:hybrid.c2], 0, [hybrid.c1])
    with pytest.raises(ValueError):
        cache_io.snapshot(cache, 0, hybrid.c1)  # states are at c2, not c1


# ---- tiny model builder ------------------------------------------------------------------


def test_build_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = build_tiny_model("qwen3", tmp_path / "a", seed=3)
    b = build_tiny_model("qwen3", tmp_path / "b", seed=3)
    c = build_tiny_model("qwen3", tmp_path / "c", seed=4)
    assert is_complete(a) and is_complete(b)
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model("qwen3", a, seed=3) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp


def test_build_replaces_incomplete_dir(tmp_path: Path) -> None:
    out = tmp_path / "half"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a crashed build: no completion marker
    build_tiny_model("qwen3", out)
    assert is_complete(out)
    assert _load(out).config.model_type == "qwen3"


def test_unknown_arch_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_tiny_model("no_such_arch", tmp_path / "x")
