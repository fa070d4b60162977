"""The CPU recipe's Mamba2 kernels (ext/sglang/cpu_mamba2.py) against transformers' torch
implementations of the same layer (`modeling_mamba2`: the chunked SSD scan, the one-token
state update, the causal conv1d and its update, and the whole `Mamba2Mixer` with its
cache), called the way SGLang's `MambaMixer2` calls them: packed sequences of different
lengths, states in slots of a pool, prefill in chunks then decode. No server; small
tensors."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from anchorcache.ext.sglang import cpu_mamba2 as mk

m2 = importlib.import_module("transformers.models.mamba2.modeling_mamba2")

HEADS, HEAD_DIM, GROUPS, STATE, WIDTH = 8, 16, 2, 16, 4
CHUNK = 64  # transformers' chunk size in the scan: the 70- and 133-token sequences span chunks
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _scan_inputs(total: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, total, HEADS, HEAD_DIM, generator=g)
    dt = torch.randn(1, total, HEADS, generator=g) - 2.0
    A = -torch.rand(HEADS, generator=g) * 0.5 - 0.01
    B = torch.randn(1, total, GROUPS, STATE, generator=g) * 0.5
    C = torch.randn(1, total, GROUPS, STATE, generator=g) * 0.5
    D = torch.randn(HEADS, generator=g)
    dt_bias = torch.randn(HEADS, generator=g) * 0.5
    return x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("with_initial", [False, True])
def test_scan_matches_transformers_per_packed_sequence(with_initial: bool):
    lengths = [5, 70, 133]
    cu = torch.tensor([0, 5, 75, 208])
    x, dt, A, B, C, D, dt_bias = _scan_inputs(sum(lengths))
    initial = torch.randn(3, HEADS, HEAD_DIM, STATE) * 0.3 if with_initial else None
    if initial is not None:
        initial[0] = 0  # as SGLang passes a sequence without a state: zeros
    out = torch.empty_like(x)
    chunk_states, varlen, tracked = mk.mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size=CHUNK, D=D, dt_bias=dt_bias, initial_states=initial,
        cu_seqlens=cu, dt_softplus=True, out=out, return_varlen_states=True,
        return_track_states=True, state_dtype=torch.float32)
    assert chunk_states is None and tracked is None
    assert varlen.shape == (3, HEADS, HEAD_DIM, STATE)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        ref, ref_final = m2.mamba2_chunk_scan(
            x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], chunk_size=CHUNK, D=D,
            dt_bias=dt_bias, dt_softplus=True, return_final_states=True,
            initial_states=None if initial is None else initial[i:i + 1])
        torch.testing.assert_close(out[:, s:e], ref, **TOL)
        torch.testing.assert_close(varlen[i], ref_final[0], **TOL)


def test_state_update_matches_transformers_per_slot_and_skips_padding():
    g = torch.Generator().manual_seed(1)
    batch = 3
    pool = torch.randn(5, HEADS, HEAD_DIM, STATE, generator=g) * 0.3
    before = pool.clone()
    x = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    dt = (torch.randn(batch, HEADS, generator=g) - 2.0)[:, :, None].expand(-1, -1, HEAD_DIM)
    A = (-torch.rand(HEADS, generator=g))[:, None, None].expand(-1, HEAD_DIM, STATE)
    B = torch.randn(batch, GROUPS, STATE, generator=g)
    C = torch.randn(batch, GROUPS, STATE, generator=g)
    D = torch.randn(HEADS, generator=g)[:, None].expand(-1, HEAD_DIM)
    dt_bias = torch.randn(HEADS, generator=g)[:, None].expand(-1, HEAD_DIM)
    slots = torch.tensor([4, mk.PAD_SLOT_ID, 1])
    out = torch.full_like(x, float("nan"))
    mk.selective_state_update(pool, x, dt, A, B, C, D, z=None, dt_bias=dt_bias,
                              dt_softplus=True, state_batch_indices=slots, out=out)
    for b, slot in ((0, 4), (2, 1)):
        state = before[slot:slot + 1].clone()
        ref = m2.mamba2_selective_state_update(state, x[b:b + 1], dt[b:b + 1], A, B[b:b + 1],
                                               C[b:b + 1], D, dt_bias=dt_bias,
                                               dt_softplus=True)
        torch.testing.assert_close(out[b], ref[0], **TOL)
        torch.testing.assert_close(pool[slot], state[0], **TOL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(pool[[0, 2, 3]], before[[0, 2, 3]])  # other slots untouched


def test_conv_prefill_and_update_match_transformers():
    g = torch.Generator().manual_seed(2)
    dim = 24  # two sequences: 3 tokens from a state, 9 from zeros
    cu = torch.tensor([0, 3, 12])
    x = torch.randn(dim, 12, generator=g)
    weight = torch.randn(dim, WIDTH, generator=g)
    bias = torch.randn(dim, generator=g)
    pool = torch.randn(4, dim, WIDTH - 1, generator=g)
    history = pool.clone()
    slots = torch.tensor([2, 0])
    has_initial = torch.tensor([True, False])
    out = mk.causal_conv1d_fn(x, weight, bias, query_start_loc=cu, cache_indices=slots,
                              has_initial_state=has_initial, conv_states=pool,
                              activation="silu")
    for i, (s, e) in enumerate(((0, 3), (3, 12))):
        prev = history[2] if i == 0 else torch.zeros(dim, WIDTH - 1)
        seq = torch.cat([prev, x[:, s:e]], dim=1)[None]
        ref = m2.causal_conv1d_fn(seq, weight, bias, activation="silu")[0, :, WIDTH - 1:]
        torch.testing.assert_close(out[:, s:e], ref, **TOL)
        torch.testing.assert_close(pool[int(slots[i])], seq[0, :, -(WIDTH - 1):])
    step = torch.randn(2, dim, generator=g)
    ref_states = [torch.cat([pool[int(s)][:, :1], pool[int(s)]], dim=1)[None].clone()
                  for s in slots]  # transformers keeps `width` columns; the oldest drops out
    got = mk.causal_conv1d_update(step, pool, weight, bias, "silu",
                                  conv_state_indices=slots)
    for b in range(2):
        ref = m2.causal_conv1d_update(step[b:b + 1, :, None], ref_states[b], weight, bias,
                                      activation="silu")
        torch.testing.assert_close(got[b], ref[0, :, 0], **TOL)
        torch.testing.assert_close(pool[int(slots[b])], ref_states[b][0, :, 1:], **TOL)


# ---- the whole mixer: SGLang's MambaMixer2 flow over our kernels vs transformers' ----------

def _mixer():
    from transformers import Mamba2Config

    cfg = Mamba2Config(hidden_size=64, num_hidden_layers=1, num_heads=HEADS,
                       head_dim=HEAD_DIM, state_size=STATE, expand=2, n_groups=GROUPS,
                       conv_kernel=WIDTH, chunk_size=CHUNK, vocab_size=16)
    torch.manual_seed(3)
    mixer = m2.Mamba2Mixer(cfg, 0).eval()
    with torch.no_grad():  # a long memory, so a wrong state shows in the output
        mixer.A_log.copy_(torch.empty(HEADS).uniform_(1e-3, 3e-2).log())
        mixer.D.copy_(torch.randn(HEADS))
    return cfg, mixer


def _split(mixer, hidden: torch.Tensor):
    proj = mixer.in_proj(hidden)
    return proj.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)


def _finish(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return mixer.out_proj(mixer.norm(y.reshape(gate.shape), gate))


def _xbc(mixer, xbc: torch.Tensor):
    inter, gs = mixer.intermediate_size, GROUPS * STATE
    return xbc.split([inter, gs, gs], dim=-1)


def _prefill(mixer, hidden, conv_pool, ssm_pool, slots, cu, has_initial):
    """SGLang's `MambaMixer2.forward`, prefill part, over our kernels: `hidden` `[T, 64]`."""
    gate, xbc, dt = _split(mixer, hidden)
    weight = mixer.conv1d.weight.squeeze(1)
    xbc = mk.causal_conv1d_fn(xbc.transpose(0, 1), weight, mixer.conv1d.bias,
                              query_start_loc=cu, cache_indices=slots,
                              has_initial_state=has_initial, conv_states=conv_pool,
                              activation="silu").transpose(0, 1)
    x, B, C = _xbc(mixer, xbc)
    total = hidden.shape[0]
    initial = torch.where(has_initial[:, None, None, None], ssm_pool[slots], 0)
    out = torch.empty(1, total, HEADS, HEAD_DIM)
    _, varlen, _ = mk.mamba_chunk_scan_combined(
        x.view(1, total, HEADS, HEAD_DIM), dt[None], -torch.exp(mixer.A_log.float()),
        B.view(1, total, GROUPS, -1), C.view(1, total, GROUPS, -1), chunk_size=CHUNK,
        D=mixer.D, dt_bias=mixer.dt_bias, initial_states=initial, cu_seqlens=cu,
        dt_softplus=True, out=out, return_varlen_states=True, return_track_states=True,
        state_dtype=ssm_pool.dtype)
    ssm_pool[slots] = varlen
    return _finish(mixer, out[0], gate)


def _decode(mixer, hidden, conv_pool, ssm_pool, slots):
    """SGLang's `MambaMixer2.forward`, decode part: `hidden` `[B, 64]`, one token a row."""
    gate, xbc, dt = _split(mixer, hidden)
    xbc = mk.causal_conv1d_update(xbc, conv_pool, mixer.conv1d.weight.squeeze(1),
                                  mixer.conv1d.bias, "silu", conv_state_indices=slots)
    x, B, C = _xbc(mixer, xbc)
    rows = hidden.shape[0]
    A = (-torch.exp(mixer.A_log.float()))[:, None, None].expand(-1, HEAD_DIM, STATE)
    out = torch.empty(rows, HEADS, HEAD_DIM)
    mk.selective_state_update(
        ssm_pool, x.view(rows, HEADS, HEAD_DIM), dt[:, :, None].expand(-1, -1, HEAD_DIM), A,
        B.view(rows, GROUPS, -1), C.view(rows, GROUPS, -1),
        mixer.D[:, None].expand(-1, HEAD_DIM), z=None,
        dt_bias=mixer.dt_bias[:, None].expand(-1, HEAD_DIM), dt_softplus=True,
        state_batch_indices=slots, out=out)
    return _finish(mixer, out, gate)


@torch.no_grad()
def test_mixer_chunked_prefill_and_decode_equal_transformers():
    """Two sequences (37 and 150 tokens) prefilled together in two chunks (the second from
    the states the first left in their slots), then three decode steps batched: every
    output and the final conv and SSM states equal transformers' mixer run per sequence
    with its cache."""
    from transformers.cache_utils import DynamicCache

    cfg, mixer = _mixer()
    g = torch.Generator().manual_seed(4)
    lengths, first = [37, 150], [20, 90]
    prompts = [torch.randn(n, 64, generator=g) for n in lengths]
    steps = [torch.randn(3, 64, generator=g) for _ in lengths]
    conv_pool = torch.zeros(4, mixer.conv_dim, WIDTH - 1)
    ssm_pool = torch.zeros(4, HEADS, HEAD_DIM, STATE)
    slots = torch.tensor([3, 1])

    def packed(parts):
        cu = torch.tensor([0] + [p.shape[0] for p in parts]).cumsum(0)
        return torch.cat(parts), cu

    hidden, cu = packed([p[:n] for p, n in zip(prompts, first, strict=True)])
    out1 = _prefill(mixer, hidden, conv_pool, ssm_pool, slots, cu, torch.tensor([False, False]))
    hidden, cu2 = packed([p[n:] for p, n in zip(prompts, first, strict=True)])
    out2 = _prefill(mixer, hidden, conv_pool, ssm_pool, slots, cu2, torch.tensor([True, True]))
    decoded = [_decode(mixer, torch.stack([s[t] for s in steps]), conv_pool, ssm_pool, slots)
               for t in range(3)]

    for i, prompt in enumerate(prompts):
        cache = DynamicCache(config=cfg)
        ref1 = mixer(prompt[None, :first[i]], cache_params=cache)[0]
        ref2 = mixer(prompt[None, first[i]:], cache_params=cache)[0]
        torch.testing.assert_close(out1[cu[i]:cu[i + 1]], ref1, **TOL)
        torch.testing.assert_close(out2[cu2[i]:cu2[i + 1]], ref2, **TOL)
        for t in range(3):
            ref = mixer(steps[i][None, t:t + 1], cache_params=cache)[0, 0]
            torch.testing.assert_close(decoded[t][i], ref, **TOL)
        layer = cache.layers[0]
        slot = int(slots[i])
        torch.testing.assert_close(conv_pool[slot], layer.conv_states[0][0, :, 1:], **TOL)
        torch.testing.assert_close(ssm_pool[slot], layer.recurrent_states[0][0], **TOL)
    assert F.mse_loss(out2, torch.zeros_like(out2)) > 0  # not a vacuous comparison


def test_a_capture_inside_a_prefill_is_the_state_of_a_scan_that_ends_there(monkeypatch):
    """ext/sglang/capture.py on Mamba2: the scan learns each sequence's slot from the conv
    call before it (its state tensor names the layer's SSM state tensor) and writes the
    state after the named number of tokens into the spare slot: bit for bit the recurrence
    over those tokens of the same forward's inputs, and the final state of a scan of the
    sequence up to there to rounding (its dt's softplus over fewer elements rounds its last
    ones otherwise); outputs and final states are unchanged."""
    from anchorcache.ext.sglang import capture

    cu = torch.tensor([0, 9, 22])
    x, dt, A, B, C, D, dt_bias = _scan_inputs(22, seed=6)
    g = torch.Generator().manual_seed(7)
    dim = 12
    xc, w = torch.randn(dim, 22, generator=g), torch.randn(dim, WIDTH, generator=g)
    conv_pool = torch.zeros(6, dim, WIDTH - 1)
    ssm_pool = torch.zeros(6, HEADS, HEAD_DIM, STATE)
    slots = torch.tensor([4, 1])

    def run(wanted):
        monkeypatch.setattr(capture, "_WANTED", wanted)
        monkeypatch.setattr(capture, "_LAST_CONV", None)
        monkeypatch.setattr(capture, "_LAYER_STATES", {conv_pool.data_ptr(): ssm_pool})
        mk.causal_conv1d_fn(xc, w, None, cu, slots, torch.tensor([False, False]), conv_pool)
        return mk.mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias,
                                            cu_seqlens=cu, dt_softplus=True,
                                            return_varlen_states=True)

    plain = run(None)
    captured = run({1: [(6, 3)], 4: [(2, 0)]})
    assert torch.equal(plain, captured)
    monkeypatch.setattr(capture, "_WANTED", None)  # (the references below capture nothing)
    for seq, offset, spare in ((1, 6, 3), (0, 2, 0)):
        s = int(cu[seq])
        part = slice(s, s + offset)
        step = mk._dt(dt, dt_bias, True)[..., None].expand(-1, -1, -1, HEAD_DIM)
        decay = A.float()[:, None, None].expand(HEADS, HEAD_DIM, STATE)
        _, same_forward = mk._ssd(x[0, part].float(), step[0, part], decay,
                                  mk._per_head(B, HEADS)[0, part],
                                  mk._per_head(C, HEADS)[0, part],
                                  torch.zeros(HEADS, HEAD_DIM, STATE))
        assert torch.equal(ssm_pool[spare], same_forward), (seq, offset)
        ref = mk.mamba_chunk_scan_combined(x[:, part], dt[:, part], A, B[:, part], C[:, part],
                                           CHUNK, D=D, dt_bias=dt_bias,
                                           cu_seqlens=torch.tensor([0, offset]),
                                           dt_softplus=True, return_varlen_states=True)
        torch.testing.assert_close(ssm_pool[spare], ref[0], **TOL)
        history = torch.cat([torch.zeros(dim, WIDTH - 1), xc[:, s:]], dim=1)  # (no state)
        assert torch.equal(conv_pool[spare], history[:, offset:offset + WIDTH - 1])
