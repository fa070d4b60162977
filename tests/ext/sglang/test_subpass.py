"""Captures by a second pass of a Gated DeltaNet layer's own kernels (ext/sglang/subpass.py,
the `subpass` mode a GPU runs): the kernels SGLang's backend calls, driven as
`GDNAttnBackend.forward_extend` drives them, over a batch of three requests (one new, two
continuing; captures at several depths of one, chained).

- The forward after the captures is the plain forward, bit for bit (outputs, final states);
  no slot but the spares changes.
- A capture's state (conv window, recurrent state) is the one a prefill of its request up
  to the depth leaves (a cold run), and what the reference kernels capture inside the
  forward themselves (`kernels` mode): on CPU, through the recipe's reference kernels, to
  float32 rounding (the batches differ); on a GPU, through SGLang's Triton conv, gating and
  FLA chunked delta rule, within their tolerance.
- A prefill restored from a capture (its state, the rest of the request) gives the plain
  forward's outputs for the rest, and its final state, to the same bounds.

The GPU case runs in `bench/gpu_check.sh` (its CUDA tests); here it is skipped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from anchorcache.ext.sglang import capture, subpass
from anchorcache.ext.sglang.capture import Segment

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]
H, HV, K, V, WIDTH = 2, 4, 32, 32, 4  # key heads, value heads, key/value dims, conv width
LAYER = SimpleNamespace(q_dim=H * K, k_dim=H * K, v_dim=HV * V, num_q_heads=H,
                        num_k_heads=H, num_v_heads=HV, head_q_dim=K, head_k_dim=K,
                        head_v_dim=V)
DIM = LAYER.q_dim + LAYER.k_dim + LAYER.v_dim
# three requests packed as SGLang packs an extend batch: (extend length, continuing from a
# state, capture offsets); slot i is request i's, spares from 3 on
EXTENDS = [(90, True, [5, 70]), (77, False, [64]), (40, True, [])]


class Kernels:
    """The layer's kernels on `device`, in the signatures subpass.run binds: SGLang's CUDA
    ones, or the CPU recipe's (ext/sglang/cpu_kernels.py), which SGLang's CPU backend
    calls. The recurrent state's last two dims are `[K, V]` on CPU, `[V, K]` on CUDA."""

    def __init__(self, device: str, weight: torch.Tensor, bias: torch.Tensor,
                 a_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        self.device, self.weight, self.bias = device, weight, bias
        self.a_log, self.dt_bias = a_log, dt_bias
        self.state_shape = (HV, K, V) if device == "cpu" else (HV, V, K)

    def conv(self, x: torch.Tensor, states: torch.Tensor, rows) -> torch.Tensor:
        if self.device == "cpu":
            from anchorcache.ext.sglang import cpu_kernels as ck

            return ck.causal_conv1d_fwd(x.transpose(0, 1), self.weight, self.bias, states,
                                        rows.starts, rows.slots, rows.initial, True, -1,
                                        False).transpose(0, 1)
        from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_fn

        return causal_conv1d_fn(x.transpose(0, 1), self.weight, self.bias, activation="silu",
                                conv_states=states, has_initial_state=rows.initial,
                                cache_indices=rows.slots, query_start_loc=rows.starts,
                                seq_lens_cpu=rows.lens).transpose(0, 1)

    def gates(self, a: torch.Tensor, b: torch.Tensor):
        if self.device == "cpu":
            from anchorcache.ext.sglang import cpu_kernels as ck

            return ck.fused_gdn_gating(self.a_log, a, b, self.dt_bias)
        from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating

        return fused_gdn_gating(self.a_log, a, b, self.dt_bias)

    def delta_rule(self, q, k, v, g, beta, states, rows) -> torch.Tensor:
        if self.device == "cpu":
            from anchorcache.ext.sglang import cpu_kernels as ck

            return ck.chunk_gated_delta_rule(q, k, v, g, beta, states, True, rows.starts,
                                             False, True, rows.slots)[0]
        from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g,
                                      beta, initial_state=states,
                                      initial_state_indices=rows.slots, cu_seqlens=rows.starts,
                                      use_qk_l2norm_in_kernel=True)[0]


def _forward(kernels: Kernels, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
             seqs: list[tuple[int, int, bool, int]]) -> torch.Tensor:
    """The layer's prefill over sequences `seqs` [(first row, end row, from a state, state
    slot)] of `x`, states in the pools updated in place: what SGLang's backend runs."""
    rows = SimpleNamespace(
        tokens=torch.cat([torch.arange(lo, hi) for lo, hi, _, _ in seqs]).to(x.device),
        lens=[hi - lo for lo, hi, _, _ in seqs],
        initial=torch.tensor([i for _, _, i, _ in seqs], device=x.device),
        slots=torch.tensor([s for _, _, _, s in seqs], dtype=torch.int32, device=x.device))
    bounds = [0]
    for n in rows.lens:
        bounds.append(bounds[-1] + n)
    rows.starts = torch.tensor(bounds, dtype=torch.int32, device=x.device)
    y = kernels.conv(x.index_select(0, rows.tokens), conv_pool, rows)
    n = y.shape[0]
    q, k, v = torch.split(y, [LAYER.q_dim, LAYER.k_dim, LAYER.v_dim], dim=-1)
    g, beta = kernels.gates(a.index_select(0, rows.tokens), b.index_select(0, rows.tokens))
    return kernels.delta_rule(q.reshape(1, n, H, K), k.reshape(1, n, H, K),
                              v.reshape(1, n, HV, V), g, beta, ssm_pool, rows)


def _setup(device: str, seed: int):
    if device == "cuda":
        pytest.importorskip("sglang")  # (gpu_check's offline set-up has none)
    g = torch.Generator().manual_seed(seed)
    total = sum(n for n, _, _ in EXTENDS)
    weight, bias = torch.randn(DIM, WIDTH, generator=g) * 0.5, torch.randn(DIM, generator=g)
    a_log, dt_bias = torch.rand(HV, generator=g), torch.randn(HV, generator=g)
    kernels = Kernels(device, *(t.to(device) for t in (weight, bias, a_log, dt_bias)))
    x = torch.randn(total, DIM, generator=g)
    a, b = torch.randn(total, HV, generator=g), torch.randn(total, HV, generator=g)
    slots = 3 + sum(len(c) for _, _, c in EXTENDS) + 1
    conv_pool = torch.randn(slots, DIM, WIDTH - 1, generator=g)
    ssm_pool = torch.randn(slots, *kernels.state_shape, generator=g) * 0.1
    return kernels, *(t.to(device) for t in (x, a, b, conv_pool, ssm_pool))


def _plan():
    """(the batch's sequences for `_forward`, the captures' rounds as `Captures.begin`
    names them, [(request, offset, spare)])."""
    seqs, rounds, caps, at, spare = [], [], [], 0, 3
    for i, (n, initial, offsets) in enumerate(EXTENDS):
        seqs.append((at, at + n, initial, i))
        source, lo, init = i, at, initial
        for r, o in enumerate(offsets):
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(Segment(source, spare, lo, at + o, init))
            caps.append((i, o, spare))
            source, lo, init, spare = spare, at + o, True, spare + 1
        at += n
    return seqs, rounds, caps


def _compare(device: str):
    """Another batch's forward, so not bit for bit: on CPU to float32 rounding (the
    elementwise gates, vectorized over other rows, differ in the last bit: ~1e-6
    relative here), on a GPU within the Triton kernels' tolerance. A wrong state (another
    depth, another request's, a stale one) is off by far more: O(1) on these inputs."""
    if device == "cpu":
        return lambda got, want: torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return lambda got, want: torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_subpass_captures_are_cold_prefill_states_and_change_nothing_else(device,
                                                                           monkeypatch):
    monkeypatch.setattr(capture, "_WANTED", None)  # (the CPU kernels capture nothing)
    kernels, x, a, b, conv0, ssm0 = _setup(device, seed=7)
    seqs, rounds, caps = _plan()
    conv_plain, ssm_plain = conv0.clone(), ssm0.clone()
    plain = _forward(kernels, x, a, b, conv_plain, ssm_plain, seqs)

    conv, ssm = conv0.clone(), ssm0.clone()
    monkeypatch.setattr(capture, "_WRITES", {})
    subpass.run(rounds, x, conv, ssm, LAYER,
                kernels.conv, lambda rows: kernels.gates(a.index_select(0, rows.tokens),
                                                         b.index_select(0, rows.tokens)),
                kernels.delta_rule)
    assert capture._WRITES == {spare: 2 for _, _, spare in caps}
    spares = [spare for _, _, spare in caps]
    others = [s for s in range(conv0.shape[0]) if s not in spares]
    assert torch.equal(conv[others], conv0[others]) and torch.equal(ssm[others], ssm0[others])
    after = _forward(kernels, x, a, b, conv, ssm, seqs)
    assert torch.equal(after, plain)  # the forward: the plain one, bit for bit
    assert torch.equal(conv[others], conv_plain[others])
    assert torch.equal(ssm[others], ssm_plain[others])

    close = _compare(device)
    for i, offset, spare in caps:  # each capture: a cold prefill up to its depth
        lo, _, initial, _ = seqs[i]
        cold_conv, cold_ssm = conv0.clone(), ssm0.clone()
        _forward(kernels, x, a, b, cold_conv, cold_ssm, [(lo, lo + offset, initial, i)])
        close(conv[spare], cold_conv[i])
        close(ssm[spare], cold_ssm[i])
        # a restore from it: the rest of the request from the captured state
        lo, hi, _, _ = seqs[i]
        rest_conv, rest_ssm = conv0.clone(), ssm0.clone()
        rest_conv[i], rest_ssm[i] = conv[spare], ssm[spare]
        rest = _forward(kernels, x, a, b, rest_conv, rest_ssm, [(lo + offset, hi, True, i)])
        start = sum(hi_ - lo_ for lo_, hi_, _, _ in seqs[:i])
        close(rest[0], plain[0, start + offset:start + hi - lo])
        close(rest_ssm[i], ssm_plain[i])


def test_subpass_captures_equal_the_reference_kernels_own(monkeypatch):
    """CPU: the same states as the `kernels` mode, where the reference kernels write each
    capture on the way through the forward (ext/sglang/cpu_kernels.py)."""
    kernels, x, a, b, conv0, ssm0 = _setup("cpu", seed=11)
    seqs, rounds, caps = _plan()
    conv, ssm = conv0.clone(), ssm0.clone()
    monkeypatch.setattr(capture, "_WANTED", None)
    subpass.run(rounds, x, conv, ssm, LAYER,
                kernels.conv, lambda rows: kernels.gates(a.index_select(0, rows.tokens),
                                                         b.index_select(0, rows.tokens)),
                kernels.delta_rule)
    conv_k, ssm_k = conv0.clone(), ssm0.clone()
    wanted: dict[int, list[tuple[int, int]]] = {}
    for i, offset, spare in caps:
        wanted.setdefault(i, []).append((offset, spare))
    monkeypatch.setattr(capture, "_WANTED", wanted)
    _forward(kernels, x, a, b, conv_k, ssm_k, seqs)
    close = _compare("cpu")
    for _, _, spare in caps:
        close(conv[spare], conv_k[spare])
        close(ssm[spare], ssm_k[spare])


def test_a_pass_that_fails_writes_nothing_and_the_forward_runs_on(monkeypatch, caplog):
    """`subpass.take` around a layer whose kernels raise (or a forward it does not take:
    speculative verify): no piece is counted, no slot changes, nothing is raised into the
    forward; `Captures.end` then drops the capture (unwritten), never read stale."""
    pytest.importorskip("sglang")  # (gpu_check's offline set-up has none)
    from anchorcache.ext.sglang import cpu_kernels

    cpu_kernels.install()  # (SGLang's GDN backend binds these ops at import on CPU)
    from sglang.srt.layers.attention.linear import gdn_backend

    kernels, x, a, b, conv0, ssm0 = _setup("cpu", seed=3)

    def conv_cpu(x, weight, bias, *, activation, conv_states, has_initial_state,
                 cache_indices, query_start_loc, seq_lens_cpu):  # (as SGLang's CPU one)
        return cpu_kernels.causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc,
                                             cache_indices, has_initial_state,
                                             activation == "silu", -1, False)

    # (this process is not the CPU recipe's scheduler: SGLang bound its Triton conv here)
    monkeypatch.setattr(gdn_backend, "causal_conv1d_fn", conv_cpu)
    _, rounds, _ = _plan()
    conv, ssm = conv0.clone(), ssm0.clone()

    def broken(**kwargs):
        raise RuntimeError("kernel refused the shapes")

    layer = SimpleNamespace(**vars(LAYER), layer_id=0, conv_weights=kernels.weight,
                            bias=kernels.bias, activation="silu")
    backend = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(
            mamba2_layer_cache=lambda layer_id: SimpleNamespace(conv=[conv], temporal=ssm)),
        kernel_dispatcher=SimpleNamespace(extend=broken), mis_metadata=None,
        _prefill_gates=lambda layer, a_, b_: kernels.gates(a_, b_))
    monkeypatch.setattr(capture, "_WANTED", None)
    for verify in (False, True):
        monkeypatch.setattr(capture, "_WRITES", {})
        batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda v=verify: v))
        subpass.take(backend, layer, batch, x, a, b, rounds)
        assert capture._WRITES == {}
        assert torch.equal(conv, conv0) and torch.equal(ssm, ssm0)
    assert "kernel refused the shapes" in caplog.text and "speculative verify" in caplog.text


# ---- Mamba2 (SGLang's MambaMixer2: the conv and the SSD scan by their module names) --------

MH, MP, MG, MN = 4, 16, 2, 16  # heads, head dim, groups, state size
M_DIM = MH * MP + 2 * MG * MN  # the conv's channels: x, B, C
CHUNK = 64


def _mamba2_kernels(device: str):
    """(conv, scan) as SGLang's Mamba2 mixer calls them on `device`: the CPU recipe's
    (ext/sglang/cpu_mamba2.py, which the CPU engine binds there), or the CUDA ones its
    module binds on a GPU."""
    if device == "cpu":
        from anchorcache.ext.sglang import cpu_mamba2

        return cpu_mamba2.causal_conv1d_fn, cpu_mamba2.mamba_chunk_scan_combined
    pytest.importorskip("sglang")
    import importlib

    module = importlib.import_module(subpass.MIXER_MODULE)
    return module.causal_conv1d_fn, module.mamba_chunk_scan_combined


def _mixer(conv, scan, p, conv_pool, ssm_pool, seqs):
    """The prefill half of `MambaMixer2.forward` over sequences `seqs` [(first row, end
    row, from a state, slot)] of the projected inputs `p` (xbc, dt): conv, scan, the final
    states written to the slots; returns the scan's output."""
    from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

    device = p["xbc"].device
    tokens = torch.cat([torch.arange(lo, hi) for lo, hi, _, _ in seqs]).to(device)
    lens = [hi - lo for lo, hi, _, _ in seqs]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
    initial = torch.tensor([i for _, _, i, _ in seqs], device=device)
    slots = torch.tensor([s for _, _, _, s in seqs], dtype=torch.int32, device=device)
    total = sum(lens)
    y = conv(p["xbc"].index_select(0, tokens).transpose(0, 1), p["weight"], p["bias"],
             activation="silu", conv_states=conv_pool, has_initial_state=initial,
             cache_indices=slots, query_start_loc=starts, seq_lens_cpu=lens).transpose(0, 1)
    hs, b, c = torch.split(y[:total], [MH * MP, MG * MN, MG * MN], dim=-1)
    seq_idx = torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.int32,
                                                   device=device), starts.diff()).unsqueeze(0)
    chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(
        starts, CHUNK, total)
    states = torch.where(initial[:, None, None, None], ssm_pool[slots.long()], 0)
    out = torch.empty(1, total, MH, MP, device=device)
    _, varlen, _ = scan(hs.reshape(1, total, MH, MP), p["dt"].index_select(0, tokens)[None],
                        p["A"], b.reshape(1, total, MG, MN), c.reshape(1, total, MG, MN),
                        chunk_size=CHUNK, D=p["D"], z=None, dt_bias=p["dt_bias"],
                        seq_idx=seq_idx, chunk_indices=chunk_indices,
                        chunk_offsets=chunk_offsets, cu_seqlens=starts, initial_states=states,
                        return_varlen_states=True, return_final_states=False,
                        return_track_states=True, track_seq_idx=None, track_end_locs=None,
                        dt_softplus=True, dt_limit=(0.0, float("inf")), out=out,
                        state_dtype=ssm_pool.dtype)
    ssm_pool[slots.long()] = varlen.to(ssm_pool.dtype)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_mamba2_subpass_captures_are_cold_prefill_states_and_change_nothing_else(device,
                                                                                  monkeypatch):
    pytest.importorskip("sglang")  # (its Mamba2 metadata; gpu_check's offline set-up has none)
    conv, scan = _mamba2_kernels(device)
    g = torch.Generator().manual_seed(5)
    total = sum(n for n, _, _ in EXTENDS)
    p = {"xbc": torch.randn(total, M_DIM, generator=g),
         "dt": torch.randn(total, MH, generator=g) - 2.0,
         "weight": torch.randn(M_DIM, WIDTH, generator=g) * 0.5,
         "bias": torch.randn(M_DIM, generator=g), "A": -torch.rand(MH, generator=g) - 0.01,
         "D": torch.randn(MH, generator=g), "dt_bias": torch.randn(MH, generator=g) * 0.5}
    p = {k: v.to(device) for k, v in p.items()}
    slots = 3 + sum(len(c) for _, _, c in EXTENDS) + 1
    conv0 = torch.randn(slots, M_DIM, WIDTH - 1, generator=g).to(device)
    ssm0 = (torch.randn(slots, MH, MP, MN, generator=g) * 0.1).to(device)
    seqs, rounds, caps = _plan()
    monkeypatch.setattr(capture, "_WANTED", None)  # (the CPU kernels capture nothing)
    conv_plain, ssm_plain = conv0.clone(), ssm0.clone()
    plain = _mixer(conv, scan, p, conv_plain, ssm_plain, seqs)

    conv_pool, ssm_pool = conv0.clone(), ssm0.clone()
    monkeypatch.setattr(capture, "_ROUNDS", rounds)
    monkeypatch.setattr(capture, "_LAYER_STATES", {conv_pool.data_ptr(): ssm_pool})
    monkeypatch.setattr(capture, "_WRITES", {})
    after = _mixer(subpass.mamba2_conv(conv), subpass.mamba2_scan(scan), p, conv_pool,
                   ssm_pool, seqs)
    monkeypatch.setattr(capture, "_ROUNDS", None)
    assert capture._WRITES == {spare: 2 for _, _, spare in caps}
    assert torch.equal(after, plain)  # the forward: the plain one, bit for bit
    spares = [spare for _, _, spare in caps]
    others = [s for s in range(slots) if s not in spares]
    assert torch.equal(conv_pool[others], conv_plain[others])
    assert torch.equal(ssm_pool[others], ssm_plain[others])

    close = _compare(device)
    for i, offset, spare in caps:
        lo, hi, initial, _ = seqs[i]
        cold_conv, cold_ssm = conv0.clone(), ssm0.clone()
        _mixer(conv, scan, p, cold_conv, cold_ssm, [(lo, lo + offset, initial, i)])
        assert torch.equal(conv_pool[spare], cold_conv[i])  # (the inputs themselves)
        close(ssm_pool[spare], cold_ssm[i])
        rest_conv, rest_ssm = conv0.clone(), ssm0.clone()
        rest_conv[i], rest_ssm[i] = conv_pool[spare], ssm_pool[spare]
        rest = _mixer(conv, scan, p, rest_conv, rest_ssm, [(lo + offset, hi, True, i)])
        start = sum(h - lo_ for lo_, h, _, _ in seqs[:i])
        close(rest[0], plain[0, start + offset:start + hi - lo])
        close(rest_ssm[i], ssm_plain[i])


def test_a_forward_whose_layers_take_no_capture_turns_captures_off(monkeypatch):
    """`Captures.end` after a forward in which nothing wrote any piece of the captures named
    to it (a layer type the wrappers do not know, a graph that never calls them): each is
    dropped with its request's anchors (`failed`), its spare slot given back, and the
    captures turn off for good (`dead`: the cache cuts prefill chunks from then on); a
    forward whose captures were written whole reads them. The pool is a stand-in for
    SGLang's Mamba pool (the fault, layers that never call us, is not one a real CPU
    forward produces)."""
    from anchorcache.ext.sglang.capture import Captures

    conv = torch.zeros(2, 8, 4, WIDTH - 1)  # [layers, slots, dim, width - 1]
    freed: list[int] = []
    pool = SimpleNamespace(
        mamba_pool=SimpleNamespace(mamba_cache=SimpleNamespace(
            conv=[conv], temporal=torch.zeros(2, 8, 2, 2))),
        translate_mamba_indices=lambda idx: idx,
        mamba_allocator=SimpleNamespace(free=lambda slot: freed.append(int(slot[0]))))
    spares = iter(range(4, 8))
    captures = Captures(pool, lambda: torch.tensor([next(spares)]), capture.SUBPASS)
    store = SimpleNamespace(tip_depth=lambda rid: 0,
                            table=SimpleNamespace(contains=lambda key, depth: False))

    def forward(writes: bool) -> SimpleNamespace:
        plan = SimpleNamespace(todo=[SimpleNamespace(depth=5)], captured={}, keys={5: b"k"},
                               failed=False)
        req = SimpleNamespace(rid="r", kv=SimpleNamespace(mamba_pool_idx=torch.tensor([1])))
        batch = SimpleNamespace(reqs=[req], prefix_lens=[0], extend_lens=[9])
        captures.begin(batch, SimpleNamespace(get=lambda rid: plan), store)
        assert capture.rounds() == [[capture.Segment(1, plan.captured[5][1], 0, 5, False)]]
        if writes:
            for _ in range(4):  # (a conv window and a state for each of the 2 layers)
                capture.wrote(plan.captured[5][1])
        captures.end()
        assert capture.rounds() is None
        return plan

    written = forward(writes=True)
    assert not written.failed and 5 in written.captured and not captures.dead
    dropped = forward(writes=False)
    assert dropped.failed and dropped.captured == {} and freed == [5]
    assert captures.dead and captures.unwritten == 1
