"""The CPU recipe's reference kernels (ext/sglang/cpu_kernels.py) against transformers'
torch implementations of the same layers (Qwen3.5's Gated DeltaNet: the chunked gated
delta rule, the causal conv1d and its one-token update, Gemma RMSNorm) and SGLang's own
Triton-kernel formulas where transformers has no counterpart. Cheap: small tensors."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from anchorcache.ext.sglang import cpu_kernels as ck

qwen = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")

H, HV, K, V = 2, 4, 16, 8  # key heads, value heads (2 per key head), key and value dims


def _gdn_inputs(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(1, t, H, K, generator=g)
    k = torch.randn(1, t, H, K, generator=g)
    v = torch.randn(1, t, HV, V, generator=g)
    gate = -torch.rand(1, t, HV, generator=g) * 0.3
    beta = torch.rand(1, t, HV, generator=g)
    return q, k, v, gate, beta


def _hf_delta_rule(q, k, v, gate, beta, state):
    """transformers' chunked torch rule for one sequence (it wants equal head counts)."""
    r = HV // H
    out, final = qwen.torch_chunk_gated_delta_rule(
        q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2), v, gate, beta,
        chunk_size=4, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    return out, final


def test_chunk_gated_delta_rule_matches_transformers_per_sequence_and_slot():
    lengths = [5, 11]
    q, k, v, gate, beta = _gdn_inputs(lengths)
    pool = torch.randn(4, HV, K, V) * 0.1
    before = pool.clone()
    slots = torch.tensor([3, 1])
    cu = torch.tensor([0, 5, 16])
    out, finals = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
        q, k, v, gate, beta, pool, True, cu, False, True, slots) if _installed() else \
        ck.chunk_gated_delta_rule(q, k, v, gate, beta, pool, True, cu, False, True, slots)
    for i, (s, e) in enumerate([(0, 5), (5, 16)]):
        slot = int(slots[i])
        ref, ref_final = _hf_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], gate[:, s:e],
                                        beta[:, s:e], before[slot:slot + 1])
        torch.testing.assert_close(out[:, s:e], ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot], ref_final[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(finals[i], ref_final[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[[0, 2]], before[[0, 2]])  # other slots untouched


def test_decode_update_continues_the_prefill_state():
    """Prefill 6 tokens then decode 1 (gates from a, b) = transformers over all 7."""
    q, k, v, _, _ = _gdn_inputs([7], seed=1)
    a_log, dt_bias = torch.rand(HV), torch.randn(HV)
    a, b = torch.randn(7, HV), torch.randn(7, HV)
    g_all, beta_all = ck.fused_gdn_gating(a_log, a, b, dt_bias)
    pool = torch.zeros(2, HV, K, V)
    slot = torch.tensor([1])
    ck.chunk_gated_delta_rule(q[:, :6], k[:, :6], v[:, :6], g_all[:, :6], beta_all[:, :6],
                              pool, True, torch.tensor([0, 6]), False, True, slot)
    out = ck.fused_sigmoid_gating_delta_rule_update(
        a_log, dt_bias, q[:, 6:], k[:, 6:], v[:, 6:], a[6:], b[6:], pool, slot,
        torch.tensor([0, 1]), True)
    ref, ref_final = _hf_delta_rule(q, k, v, g_all, beta_all, None)
    torch.testing.assert_close(out, ref[:, 6:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[1], ref_final[0], rtol=1e-4, atol=1e-4)


def test_a_capture_inside_a_prefill_is_the_state_of_a_prefill_that_ends_there(monkeypatch):
    """ext/sglang/capture.py: the states (delta rule and conv window) the kernels write into
    a spare slot at an offset inside a sequence are, bit for bit, those a prefill of the
    sequence up to that offset leaves in its own slot; and the captures change nothing else
    (outputs, final states, other slots)."""
    from anchorcache.ext.sglang import capture

    lengths = [9, 13]
    q, k, v, gate, beta = _gdn_inputs(lengths, seed=3)
    cu, slots = torch.tensor([0, 9, 22]), torch.tensor([0, 1])
    dim, width = 6, 4
    g = torch.Generator().manual_seed(4)
    w, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    x = torch.randn(dim, 22, generator=g)
    has_init = torch.tensor([True, False])

    def run(pool, conv, wanted):
        monkeypatch.setattr(capture, "_WANTED", wanted)
        y = ck.causal_conv1d_fwd(x, w, bias, conv, cu, slots, has_init, True, -1, False)
        out, _ = ck.chunk_gated_delta_rule(q, k, v, gate, beta, pool, True, cu, False, True,
                                           slots)
        return y, out

    g0 = torch.Generator().manual_seed(5)
    pool0, conv0 = torch.randn(6, HV, K, V, generator=g0) * 0.1, torch.randn(6, dim, width - 1,
                                                                          generator=g0)
    plain_pool, plain_conv = pool0.clone(), conv0.clone()
    plain = run(plain_pool, plain_conv, None)
    pool, conv = pool0.clone(), conv0.clone()
    captured = run(pool, conv, {1: [(4, 3), (11, 5)], 0: [(1, 2)]})
    for a, b in zip(captured, plain, strict=True):
        assert torch.equal(a, b)  # outputs: the same bits
    assert torch.equal(pool[:2], plain_pool[:2]) and torch.equal(conv[:2], plain_conv[:2])
    assert torch.equal(pool[4], pool0[4]) and torch.equal(conv[4], conv0[4])  # not named
    # each capture against a prefill of its sequence that ends at its offset
    for seq, offset, spare in ((1, 4, 3), (1, 11, 5), (0, 1, 2)):
        s = int(cu[seq])
        ref_pool, ref_conv = pool0.clone(), conv0.clone()
        monkeypatch.setattr(capture, "_WANTED", None)
        ck.causal_conv1d_fwd(x[:, s:s + offset].contiguous(), w, bias, ref_conv,
                             torch.tensor([0, offset]), slots[seq:seq + 1],
                             has_init[seq:seq + 1], True, -1, False)
        ck.chunk_gated_delta_rule(*(t[:, s:s + offset] for t in (q, k, v, gate, beta)),
                                  ref_pool, True, torch.tensor([0, offset]), False, True,
                                  slots[seq:seq + 1])
        slot = int(slots[seq])
        assert torch.equal(pool[spare], ref_pool[slot]), (seq, offset)
        assert torch.equal(conv[spare], ref_conv[slot]), (seq, offset)


def test_gdn_gating_is_the_transformers_formula():
    a_log, dt_bias = torch.rand(HV), torch.randn(HV)
    a, b = torch.randn(3, HV) * 10, torch.randn(3, HV)
    g, beta = ck.fused_gdn_gating(a_log, a, b, dt_bias)
    assert g.shape == beta.shape == (1, 3, HV) and g.dtype == torch.float32
    torch.testing.assert_close(g[0], -a_log.exp() * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta[0], b.sigmoid())


def test_causal_conv1d_prefill_and_update_match_transformers():
    dim, width = 6, 4
    g = torch.Generator().manual_seed(2)
    w, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    x = torch.randn(dim, 9, generator=g)  # two sequences: 4 + 5 tokens, packed
    states = torch.randn(3, dim, width - 1, generator=g)
    before = states.clone()
    qsl, slots = torch.tensor([0, 4, 9]), torch.tensor([2, 0])
    has_init = torch.tensor([False, True])
    out = ck.causal_conv1d_fwd(x, w, bias, states, qsl, slots, has_init, True, -1, False)
    # sequence 0: no history (transformers' prefill conv)
    ref0 = qwen.causal_conv1d_fn(x[None, :, :4], w, bias, activation="silu")[0]
    torch.testing.assert_close(out[:, :4], ref0)
    # sequence 1: continues slot 0's history (transformers' update over 5 tokens)
    hist = before[0:1].clone()
    ref1 = qwen.causal_conv1d_update(x[None, :, 4:], hist, w, bias, activation="silu")[0]
    torch.testing.assert_close(out[:, 4:], ref1)
    torch.testing.assert_close(states[0], hist[0])
    torch.testing.assert_close(states[2], x[:, 1:4])  # the last width - 1 inputs
    torch.testing.assert_close(states[1], before[1])
    # decode: one token per row, rows in any slot order
    step = torch.randn(2, dim, generator=g)
    hist2 = states[[2, 0]].clone()
    dec = ck.causal_conv1d_update(step, states, w, bias, True, None, torch.tensor([2, 0]), -1,
                                  False)
    ref2 = qwen.causal_conv1d_update(step[:, :, None], hist2, w, bias, activation="silu")
    torch.testing.assert_close(dec, ref2[:, :, 0])
    torch.testing.assert_close(states[[2, 0]], hist2)


def test_gemma_qk_norm_and_gate_match_transformers_rmsnorm():
    heads, kv_heads, hd, t = 4, 2, 16, 3
    g = torch.Generator().manual_seed(3)
    qg = torch.randn(t, heads * 2 * hd, generator=g)
    k = torch.randn(t, kv_heads * hd, generator=g)
    qw, kw = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    norm = qwen.Qwen3_5RMSNorm(hd, eps=1e-6)
    q_out, k_out, gate = ck.fused_qk_gemma_rmsnorm_with_gate(qg, k, qw, kw, 1e-6, hd, heads)
    qg3 = qg.view(t, heads, 2 * hd)
    with torch.no_grad():
        norm.weight.copy_(qw)
        torch.testing.assert_close(q_out, norm(qg3[..., :hd]).reshape(-1, hd))
        norm.weight.copy_(kw)
        torch.testing.assert_close(k_out, norm(k.view(t, kv_heads, hd)).reshape(-1, hd))
    torch.testing.assert_close(gate, qg3[..., hd:].reshape(-1, hd))
    q2, k2 = ck.fused_qk_gemma_rmsnorm(qg3[..., :hd].reshape(t, -1), k, qw, kw, 1e-6, hd)
    torch.testing.assert_close((q2, k2), (q_out, k_out))


def test_sigmoid_mul_in_place_through_a_strided_gate():
    x = torch.randn(3, 4 * 8)
    qg = torch.randn(3, 4, 16)
    gate = qg[..., 8:]  # strided view, as Qwen3.5's attention passes it
    want = x * torch.sigmoid(gate.reshape(3, -1))
    ck.fused_sigmoid_mul(x, gate)
    torch.testing.assert_close(x, want)


def test_split_contiguous_projections():
    nqk, nv, hqk, hv, t = 2, 4, 16, 8, 3
    qkvz = torch.randn(t, 2 * nqk * hqk + 2 * nv * hv)
    ba = torch.randn(t, 2 * nv)
    mixed, z, b, a = ck.fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, nqk, nv, hqk, hv)
    qkv_w = 2 * nqk * hqk + nv * hv
    torch.testing.assert_close(mixed, qkvz[:, :qkv_w])
    torch.testing.assert_close(z, qkvz[:, qkv_w:].view(t, nv, hv))
    torch.testing.assert_close((b, a), (ba[:, :nv], ba[:, nv:]))


def test_install_registers_missing_ops_under_sglang_names():
    names = ck.install()
    assert set(names) <= set(ck.SCHEMAS)
    for name in ck.SCHEMAS:
        assert hasattr(torch.ops.sgl_kernel, name)
    assert ck.install() == []  # idempotent: nothing missing the second time
    gates = torch.ops.sgl_kernel.fused_gdn_gating_cpu(torch.zeros(2), torch.zeros(1, 2),
                                                      torch.zeros(1, 2), torch.zeros(2))
    torch.testing.assert_close(gates[1], torch.full((1, 1, 2), 0.5))


def test_hybrid_strategy_args_only_for_hybrid_configs(tmp_path):
    import json

    hybrid, dense = tmp_path / "h", tmp_path / "d"
    hybrid.mkdir()
    dense.mkdir()
    (hybrid / "config.json").write_text(json.dumps(
        {"layer_types": ["linear_attention", "full_attention"]}))
    (dense / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    out = ck.with_hybrid_args(["--page-size", "1"], str(hybrid))
    assert out == ["--page-size", "1", "--mamba-radix-cache-strategy", "no_buffer",
                   "--disable-overlap-schedule"]
    assert ck.with_hybrid_args(["--x"], str(dense)) == ["--x"]
    # the CPU engine bounds the Mamba state pool (SGLang would size it from RAM), unless given
    cpu = ck.with_hybrid_args([], str(hybrid), cpu=True)
    assert cpu[cpu.index("--max-mamba-cache-size") + 1] == str(ck.CPU_MAMBA_CACHE_SIZE)
    given = ck.with_hybrid_args(["--max-mamba-cache-size", "8"], str(hybrid), cpu=True)
    assert given.count("--max-mamba-cache-size") == 1 and given[1] == "8"
    assert "--max-mamba-cache-size" not in ck.with_hybrid_args([], str(dense), cpu=True)
    assert ck.is_hybrid({"text_config": {"mamba_d_state": 16}})


def _installed() -> bool:
    ck.install()
    return hasattr(torch.ops.sgl_kernel, "chunk_gated_delta_rule_cpu")


def test_gated_rmsnorm_matches_transformers():
    norm = qwen.Qwen3_5RMSNormGated(V, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(V))
        x, z = torch.randn(5, V), torch.randn(5, V)
        torch.testing.assert_close(ck.fused_rmsnorm_gated(x, norm.weight, z, 1e-6), norm(x, z))


def test_a_sliding_window_model_keeps_its_window_pool_at_page_size_1(tmp_path):
    """SGLang's sliding-window pool at page size 1 (anchors keep windows there); its plain
    pool, `--disable-hybrid-swa-memory`, with pages of several tokens or recurrent layers
    too (not twice, not for other models)."""
    import json

    swa, both = tmp_path / "s", tmp_path / "b"
    swa.mkdir()
    both.mkdir()
    (swa / "config.json").write_text(json.dumps(
        {"layer_types": ["sliding_attention", "full_attention"]}))
    (both / "config.json").write_text(json.dumps(
        {"text_config": {"layer_types": ["sliding_attention", "linear_attention"]}}))
    assert ck.with_hybrid_args(["--x"], str(swa)) == ["--x"]
    assert ck.with_hybrid_args(["--page-size", "1"], str(swa)) == ["--page-size", "1"]
    for paged in (["--page-size", "16"], ["--page-size=16"]):
        assert ck.with_hybrid_args(paged, str(swa)) == [*paged, "--disable-hybrid-swa-memory"]
    given = ["--page-size", "16", "--disable-hybrid-swa-memory"]
    assert ck.with_hybrid_args(given, str(swa)) == given
    assert ck.with_hybrid_args([], str(both)) == [
        "--disable-hybrid-swa-memory", "--mamba-radix-cache-strategy", "no_buffer",
        "--page-size", "1", "--disable-overlap-schedule"]


@pytest.mark.parametrize("window", [None, 5])
def test_sink_attention_matches_transformers_granite_swa(window):
    """ext/sglang/cpu_attention.py against transformers' Granite SWA eager attention (the
    sink as an extra softmax-denominator logit), GQA, queries at an offset as in an
    extend over a cached prefix, with and without a sliding window."""
    from types import SimpleNamespace

    from anchorcache.ext.sglang.cpu_attention import sink_attention

    granite = importlib.import_module("transformers.models.granite_swa.modeling_granite_swa")
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, lk, lq = 4, 2, 16, 12, 5
    q = torch.randn(heads, lq, d, generator=g)
    k = torch.randn(kv_heads, lk, d, generator=g)
    v = torch.randn(kv_heads, lk, d, generator=g)
    sinks = torch.randn(heads, generator=g) * 2
    start = lk - lq
    got = sink_attention(q, k, v, sinks, scaling=d ** -0.5, q_start=start, window=window)
    q_pos = torch.arange(start, lk)[:, None]
    k_pos = torch.arange(lk)[None]
    seen = (k_pos <= q_pos) & ((k_pos >= q_pos - window) if window else True)
    mask = torch.zeros(lq, lk).masked_fill(~seen, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=sinks, training=False)
    want, _ = granite.eager_attention_forward(module, q[None], k[None], v[None], mask[None, None],
                                              d ** -0.5)
    torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
    plain = sink_attention(q, k, v, torch.full((heads,), -1e4), scaling=d ** -0.5,
                           q_start=start, window=window)
    assert (plain - got).abs().max() > 1e-2  # the sinks matter
    # without sinks (a sliding-window model without them, on SGLang's window pool): torch's
    # own attention with the same mask
    none = sink_attention(q, k, v, None, scaling=d ** -0.5, q_start=start, window=window)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), attn_mask=mask, scale=d ** -0.5)
    torch.testing.assert_close(none, sdpa, rtol=1e-5, atol=1e-6)


def test_sink_attention_in_blocks_equals_one_block(monkeypatch):
    """Queries in blocks (each over the keys it can see), or over only the keys they see,
    give what one block over all keys gives."""
    from anchorcache.ext.sglang import cpu_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 8, generator=g) for n in (23, 40, 40))
    sinks = torch.randn(2, generator=g)
    for window in (None, 6):
        whole = cpu_attention.sink_attention(q, k, v, sinks, scaling=0.3, q_start=17,
                                             window=window)
        monkeypatch.setattr(cpu_attention, "BLOCK", 5)
        blocks = cpu_attention.sink_attention(q, k, v, sinks, scaling=0.3, q_start=17,
                                              window=window)
        monkeypatch.setattr(cpu_attention, "BLOCK", 512)
        torch.testing.assert_close(blocks, whole, rtol=1e-6, atol=1e-6)
        if window is not None:  # only the keys the queries see, as the hook gathers them
            first = 17 - window
            seen = cpu_attention.sink_attention(q, k[:, first:], v[:, first:], sinks,
                                                scaling=0.3, q_start=17, window=window,
                                                k_start=first)
            torch.testing.assert_close(seen, whole, rtol=1e-6, atol=1e-6)


def test_a_capture_the_kernels_did_not_write_whole_is_never_read():
    """`Captures.end`: a spare slot named to the forward that did not get every layer's
    conv window and state (here the second layer's kernels never ran: a fault no real
    forward produces, hence the stand-ins for SGLang's pool, batch and plan) is dropped,
    freed, and its request's anchors fail; one written whole is kept."""
    from types import SimpleNamespace

    from anchorcache.ext.sglang import capture

    layers, slots, dim, width = 2, 6, 6, 4
    conv = torch.zeros(layers, slots, dim, width - 1)
    temporal = torch.zeros(layers, slots, HV, K, V)
    freed: list[int] = []
    pool = SimpleNamespace(
        mamba_pool=SimpleNamespace(mamba_cache=SimpleNamespace(conv=[conv], temporal=temporal)),
        translate_mamba_indices=lambda t: t,
        mamba_allocator=SimpleNamespace(free=lambda t: freed.append(int(t[0]))))
    req = SimpleNamespace(rid="r", kv=SimpleNamespace(mamba_pool_idx=torch.tensor([1])))
    spares = iter([torch.tensor([4]), torch.tensor([5])])
    caps = capture.Captures(pool, lambda: next(spares))
    store = SimpleNamespace(tip_depth=lambda rid: 0,
                            table=SimpleNamespace(contains=lambda key, depth: False))
    batch = SimpleNamespace(reqs=[req], prefix_lens=[0], extend_lens=[9])
    q, k, v, gate, beta = _gdn_inputs([9], seed=8)
    x, w = torch.randn(dim, 9), torch.randn(dim, width)
    for run_layers, kept in ((1, False), (2, True)):
        plan = SimpleNamespace(todo=[SimpleNamespace(depth=5)], keys={5: b"k"}, captured={},
                               failed=False)
        plans = SimpleNamespace(get=lambda rid, plan=plan: plan)
        caps.begin(batch, plans, store)
        for layer in range(run_layers):
            ck.causal_conv1d_fwd(x, w, None, conv[layer], torch.tensor([0, 9]),
                                 torch.tensor([1]), torch.tensor([False]), True, -1, False)
            ck.chunk_gated_delta_rule(q, k, v, gate, beta, temporal[layer], True,
                                      torch.tensor([0, 9]), False, True, torch.tensor([1]))
        caps.end()
        assert (5 in plan.captured) is kept and plan.failed is not kept
    assert freed == [4] and caps.unwritten == 1 and caps.taken == 2
