"""The CPU recipe's SGLang arguments: the default KV pool and the user's arguments winning;
a hybrid model's Mamba strategy (CPU and GPU)."""

from __future__ import annotations

import json

from anchorcache.ext.sglang.cpu import (
    POOL_MIN_TOKENS,
    POOL_TOKENS,
    default_pool_tokens,
    kv_bytes_per_token,
    sglang_command,
    with_cpu_args,
)

GiB = 1 << 30


def _model(tmp_path, **cfg):
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_size": 64, "max_position_embeddings": 32768,
            "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    return str(tmp_path)


def _arg(args, name):
    return args[args.index(name) + 1]


def test_tiny_model_gets_the_full_default_pool(tmp_path):
    model = _model(tmp_path)
    assert kv_bytes_per_token(json.loads((tmp_path / "config.json").read_text())) == 2 * 2 * 2 * 16 * 4
    assert default_pool_tokens(model, ram_bytes=24 * GiB) == POOL_TOKENS == 32768
    cmd = sglang_command("python", model=model, host="127.0.0.1", port=1, log_level="warning",
                         extra=[], gpu=False)
    assert int(_arg(cmd, "--max-total-tokens")) == default_pool_tokens(model)


def test_pool_is_capped_by_context_and_by_ram(tmp_path):
    assert default_pool_tokens(_model(tmp_path, max_position_embeddings=8192),
                               ram_bytes=24 * GiB) == 8192
    # 8B-class model in bf16: 36 layers x 8 KV heads x 128 x 2 x 2 B = 147 KiB per token
    big = _model(tmp_path, num_hidden_layers=36, num_key_value_heads=8, head_dim=128,
                 num_attention_heads=32, dtype="bfloat16")
    per_token = 2 * 36 * 8 * 128 * 2
    assert default_pool_tokens(big, ram_bytes=16 * GiB) == (16 * GiB // 4) // per_token
    assert default_pool_tokens(big, ram_bytes=GiB // 8) == POOL_MIN_TOKENS


def test_user_arguments_win(tmp_path):
    model = _model(tmp_path)
    cmd = sglang_command("python", model=model, host="127.0.0.1", port=1, log_level="warning",
                         extra=["--max-total-tokens", "16384"], gpu=False)
    assert cmd.count("--max-total-tokens") == 1 and _arg(cmd, "--max-total-tokens") == "16384"
    args = with_cpu_args(["--max-total-tokens=2048"], pool_tokens=32768)
    assert [a for a in args if a.startswith("--max-total-tokens")] == ["--max-total-tokens=2048"]
    gpu = sglang_command("python", model=model, host="127.0.0.1", port=1, log_level="warning",
                         extra=[], gpu=True)
    assert "--max-total-tokens" not in gpu


def test_a_hybrid_model_gets_the_no_buffer_strategy_on_cpu_and_gpu(tmp_path):
    """Anchors on a hybrid model need SGLang's `no_buffer` Mamba strategy (with page size 1
    and no overlap schedule), a GPU included; a dense model gets none of it, and a strategy
    the user gives wins (the cache factory then refuses one it cannot serve)."""
    hybrid = _model(tmp_path, layer_types=["linear_attention", "full_attention"])
    for gpu in (False, True):
        cmd = sglang_command("python", model=hybrid, host="127.0.0.1", port=1,
                             log_level="warning", extra=[], gpu=gpu)
        assert _arg(cmd, "--mamba-radix-cache-strategy") == "no_buffer"
        assert _arg(cmd, "--page-size") == "1" and "--disable-overlap-schedule" in cmd
    mine = sglang_command("python", model=hybrid, host="127.0.0.1", port=1, log_level="warning",
                          extra=["--mamba-radix-cache-strategy", "extra_buffer"], gpu=True)
    assert mine.count("--mamba-radix-cache-strategy") == 1
    assert _arg(mine, "--mamba-radix-cache-strategy") == "extra_buffer"
    (tmp_path / "dense").mkdir()
    dense = sglang_command("python", model=_model(tmp_path / "dense"), host="127.0.0.1",
                           port=1, log_level="warning", extra=[], gpu=True)
    assert "--mamba-radix-cache-strategy" not in dense and "--disable-overlap-schedule" not in dense
