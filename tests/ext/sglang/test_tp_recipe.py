"""The CPU recipe's tensor-parallel part (ext/sglang/cpu.py): each rank's cores, and the
hook that keeps PyNccl out of the CPU engine's groups (docs/sglang.md "Tensor parallelism")."""

from __future__ import annotations

import pytest

from anchorcache.ext.sglang import cpu


@pytest.mark.parametrize("args, tp", [([], 1), (["--tp", "2"], 2), (["--tp-size=4"], 4),
                                      (["--tensor-parallel-size", "2", "--port", "1"], 2),
                                      (["--tp"], 1), (["--tp", "x"], 1)])
def test_tp_size_from_sglang_arguments(args, tp):
    assert cpu.tp_size(args) == tp


def test_threads_bind_splits_the_cores_one_run_per_rank():
    assert cpu.threads_bind(2, [0, 1]) == "0|1"  # the 2-core machine: a core each
    assert cpu.threads_bind(2, list(range(16))) == "0-7|8-15"
    assert cpu.threads_bind(2, [0, 2, 4, 6]) == "0,2|4,6"
    assert cpu.threads_bind(4, [0, 1]) == "0|1|0|1"  # fewer cores than ranks: shared
    assert cpu.threads_bind(1, [3]) == "3"


def test_cpu_env_binds_the_ranks_unless_told(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "build_stub_libcuda", lambda: tmp_path)
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpu.THREADS_BIND not in cpu.cpu_env({}, [])
    assert cpu.cpu_env({}, ["--tp", "2"])[cpu.THREADS_BIND] == "0|1"
    given = {cpu.THREADS_BIND: "1|0"}
    assert cpu.cpu_env(given, ["--tp", "2"])[cpu.THREADS_BIND] == "1|0"
    # SGLang's CPU engine counts dp x tp ranks against the bind (or against NUMA nodes)
    assert cpu.cpu_env({}, ["--dp-size", "2"])[cpu.THREADS_BIND] == "0|1"
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpu.cpu_env({}, ["--dp-size", "2", "--tp", "2"])[cpu.THREADS_BIND] == "0|1|2|3"


def test_the_cpu_engine_hooks_only_on_the_cpu_engine(monkeypatch):
    """No PyNccl for TP groups, and a DP controller that waits on its socket: on the CPU
    engine only."""
    from sglang.srt.plugins import hook_registry

    registered = []
    monkeypatch.setattr(hook_registry.HookRegistry, "register",
                        classmethod(lambda cls, target, hook, kind: registered.append(
                            (target, hook, kind))))
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    cpu.register_cpu_hooks()
    assert registered == []
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    cpu.register_cpu_hooks()
    hooks = {target: hook for target, hook, kind in registered
             if kind == hook_registry.HookType.AROUND}
    from anchorcache.ext.sglang import cpu_attention

    assert set(hooks) == {cpu.NO_PYNCCL_TARGET, cpu.DP_LOOP_TARGET, cpu.QWEN3_NEXT_GDN_TARGET,
                          cpu_attention.EXTEND_TARGET, cpu_attention.DECODE_TARGET}
    assert len(registered) == 5
    hook = hooks[cpu.NO_PYNCCL_TARGET]
    seen = {}
    hook(lambda *a, **k: seen.update(k), [[0, 1]], 0, "gloo", use_pynccl=True)
    assert seen["use_pynccl"] is False


@pytest.mark.parametrize("args", [["--attn-dp-size", "2"], ["--pp-size", "2"],
                                  ["--pipeline-parallel-size=2"], ["--enable-dp-attention"],
                                  ["--tokenizer-worker-num", "2"]])
def test_attention_dp_and_pipeline_parallelism_are_refused_by_name(args):
    refusal = cpu.parallelism_refusal(args)
    assert "parallelism" in refusal or "tokenizer workers" in refusal


@pytest.mark.parametrize("args", [[], ["--tp", "2"], ["--dp-size", "2"],
                                  ["--data-parallel-size=4", "--tp", "2"], ["--dp-size", "x"]])
def test_tensor_and_data_parallelism_are_served(args):
    assert cpu.parallelism_refusal(args) is None


def test_the_cli_refuses_pipeline_parallelism_before_starting_anything():
    """`anchorcache serve/worker --backend sglang -- --pp-size 2`: a usage error naming
    pipeline parallelism, not SGLang started with stages our anchors cannot address."""
    import os
    import subprocess
    import sys

    for command in ("worker", "serve"):
        out = subprocess.run([sys.executable, "-m", "anchorcache.cli", command, "--backend",
                              "sglang", "--", "--pp-size", "2"],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "COLUMNS": "400"})  # rich's box: one line
        assert out.returncode == 2, out
        text = " ".join(out.stderr.split())
        assert "pipeline parallelism" in text and "--dp-size N" in text, text
