"""How SGLang 0.5.23 serves on a machine without a GPU (the "CPU recipe").

Three things, each found necessary by trying without it: the CPU engine switch
`SGLANG_USE_CPU_ENGINE=1`; a stub `libcuda.so.1` on `LD_LIBRARY_PATH`, because the
CUDA-only kernel wheel imports one driver symbol; and the CPU flags below. The stub is
compiled from `stub_libcuda.c` into the anchorcache cache dir, once per source version.
With `--tp N`, two more (docs/sglang.md "Tensor parallelism"): each rank's cores
(`SGLANG_CPU_OMP_THREADS_BIND`) and no PyNccl in the CPU engine's process groups (a hook
our plugin registers).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

STUB_SOURCE = Path(__file__).with_name("stub_libcuda.c")
# SGLang arguments for CPU serving; an explicit user argument of the same name wins
CPU_ARGS = {"--device": "cpu", "--attention-backend": "torch_native",
            "--mem-fraction-static": "0.95"}
# --sleep-on-idle: an idle scheduler otherwise spins a core polling its sockets, which on a
# CPU machine is a core taken from the forward passes of every other process (SGLang's own
# idle sleeper polls the request and RPC sockets, so neither waits longer than before)
CPU_FLAGS = ("--disable-cuda-graph", "--sleep-on-idle")
# the default KV pool on CPU (`--max-total-tokens`, docs/sglang.md "CPU machines"): room for
# a few agent prompts (median 4-7k tokens, long ones 20k+), at most the model's context, and
# at most POOL_RAM_FRACTION of the machine's RAM at the model's KV bytes per token
POOL_TOKENS = 32768
POOL_MIN_TOKENS = 4096
POOL_RAM_FRACTION = 0.25
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def build_stub_libcuda(out_dir: Path | None = None) -> Path:
    """Compile the stub into `<cache>/sglang-stub-<hash>/libcuda.so.1` (once); its folder."""
    from anchorcache.paths import cache_dir

    digest = hashlib.sha256(STUB_SOURCE.read_bytes()).hexdigest()[:12]
    folder = out_dir or cache_dir() / f"sglang-stub-{digest}"
    lib = folder / "libcuda.so.1"
    if lib.is_file():
        return folder
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc/cc) to build the stub libcuda.so.1")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / "libcuda.so.1"
        subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(STUB_SOURCE)],
                       check=True)
        os.replace(built, lib)  # atomic: a concurrent build never leaves half a library
    return folder


def cpu_env(base: dict[str, str], args: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """`base` plus the CPU engine switch and the stub on the library path; with `--tp N` or
    `--dp-size N` in SGLang's `args`, each rank's cores (`SGLANG_CPU_OMP_THREADS_BIND`,
    unless set: SGLang counts dp x tp ranks against it, or against NUMA nodes without it)."""
    stub = str(build_stub_libcuda())
    path = base.get("LD_LIBRARY_PATH")
    env = {**base, "SGLANG_USE_CPU_ENGINE": "1",
           "LD_LIBRARY_PATH": stub + (os.pathsep + path if path else "")}
    ranks = tp_size(args) * dp_size(args)
    if ranks > 1 and not env.get(THREADS_BIND):
        env[THREADS_BIND] = threads_bind(ranks)
    return env


# SGLang's CPU engine binds each TP rank's OpenMP threads to the cores this variable names
# ("0-7|8-15": rank 0 on cores 0-7, rank 1 on 8-15). Unset, it binds one rank per NUMA node
# and refuses more ranks than nodes ("ranks should be <= the number of NUMA nodes").
THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"


def tp_size(args: list[str] | tuple[str, ...]) -> int:
    """SGLang's `--tp` / `--tp-size` / `--tensor-parallel-size` among `args` (1 if absent)."""
    return _int_arg(args, ("--tp", "--tp-size", "--tensor-parallel-size"))


def dp_size(args: list[str] | tuple[str, ...]) -> int:
    """SGLang's `--dp-size` / `--data-parallel-size` among `args` (1 if absent)."""
    return _int_arg(args, ("--dp-size", "--data-parallel-size"))


# SGLang's parallelism modes that split one server into schedulers we cannot address apart:
# attention-DP groups share one tree across ranks' requests, and pipeline stages hold
# different layers. Tensor parallelism (tp.py) and data parallelism (each rank a worker of
# its own under `/dp/K`, ext/sglang/http.py) are served.
UNSERVED_PARALLELISM = {
    ("--attn-dp-size", "--attention-data-parallel-size"): "attention data parallelism",
    ("--pp-size", "--pipeline-parallel-size"): "pipeline parallelism",
}


def parallelism_refusal(args: list[str] | tuple[str, ...]) -> str | None:
    """Why anchorcache cannot serve SGLang with `args`, or None: more than one attention-DP
    group or pipeline stage (`UNSERVED_PARALLELISM`), or more than one tokenizer (HTTP)
    process."""
    for names, what in UNSERVED_PARALLELISM.items():
        n = _int_arg(args, names)
        if n > 1:
            return (f"anchorcache does not serve SGLang's {what} ({names[0]} {n}): each "
                    f"scheduler would keep its own anchors and epoch, and no request could be "
                    f"sent to the one that holds its anchors. Tensor parallelism (--tp N) and "
                    f"data parallelism (--dp-size N) are served, and so are several SGLang "
                    f"workers behind one proxy (docs/configuration.md).")
    workers = _int_arg(args, ("--tokenizer-worker-num",))
    if workers > 1:
        return (f"anchorcache does not serve SGLang with several tokenizer workers "
                f"(--tokenizer-worker-num {workers}): the worker contract's routes and the "
                f"scheduler's pushed reports live in one HTTP process. Leave it at 1.")
    if "--enable-dp-attention" in args:
        return ("anchorcache does not serve SGLang's attention data parallelism "
                "(--enable-dp-attention); tensor parallelism (--tp N) is served.")
    return None


def _int_arg(args: list[str] | tuple[str, ...], names: tuple[str, ...]) -> int:
    """The integer SGLang option `names` among `args` (1 if absent or not a number, which
    SGLang's own parser then reports)."""
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in names:
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return int(raw)
            except ValueError:
                return 1  # SGLang's own parser reports it
    return 1


def threads_bind(tp: int, cores: list[int] | None = None) -> str:
    """The cores this process may use split into `tp` equal runs, one per rank ("0|1" for
    two ranks on two cores); a rank gets one core at least (shared when there are fewer)."""
    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // tp)
    groups = []
    for r in range(tp):
        mine = cores[r * per:(r + 1) * per] or [cores[r % len(cores)]]
        contiguous = mine == list(range(mine[0], mine[-1] + 1))
        groups.append(f"{mine[0]}-{mine[-1]}" if contiguous and len(mine) > 1
                      else ",".join(str(c) for c in mine))
    return "|".join(groups)


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """K + V bytes one token takes in the pool, from a HF `config.json` (text config)."""
    cfg = config.get("text_config") or config
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    width = DTYPE_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), 2)
    return 2 * layers * kv_heads * head_dim * width


def _ram_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_pool_tokens(model: str, ram_bytes: int | None = None) -> int:
    """The CPU recipe's `--max-total-tokens`: POOL_TOKENS, capped by the model's context and
    by POOL_RAM_FRACTION of RAM; POOL_MIN_TOKENS at least (or the context, if smaller)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return POOL_TOKENS  # not a local folder: SGLang resolves it; our default as is
    cfg = config.get("text_config") or config
    context = int(cfg.get("max_position_embeddings") or POOL_TOKENS)
    try:
        per_token = kv_bytes_per_token(config)
    except (KeyError, TypeError, ValueError):
        return min(POOL_TOKENS, context)
    ram = _ram_bytes() if ram_bytes is None else ram_bytes
    by_ram = int(ram * POOL_RAM_FRACTION) // max(per_token, 1)
    return min(context, max(POOL_MIN_TOKENS, min(POOL_TOKENS, by_ram)))


def with_cpu_args(args: list[str], pool_tokens: int = POOL_TOKENS) -> list[str]:
    """SGLang arguments plus the CPU ones the user did not give."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    out = list(args)
    for name, value in {**CPU_ARGS, "--max-total-tokens": str(pool_tokens)}.items():
        if name not in given:
            out += [name, value]
    out += [f for f in CPU_FLAGS if f not in given]
    return out


def sglang_command(python: str, *, model: str, host: str, port: int, log_level: str,
                   extra: list[str], gpu: bool) -> list[str]:
    """The command line of the SGLang worker process (our launcher + SGLang's arguments)."""
    args = ["--model-path", model, "--host", host, "--port", str(port),
            "--radix-cache-backend", "anchorcache", "--skip-server-warmup",
            "--log-level", log_level, *extra]
    from .cpu_kernels import with_hybrid_args

    if not gpu:
        args = with_cpu_args(args, default_pool_tokens(model))
    # a hybrid model's anchors need SGLang's `no_buffer` Mamba strategy, on a GPU too
    # (its default, extra_buffer, tracks states on a fixed grid; ext/sglang/hybrid.py), and
    # a sliding-window model's anchors need SGLang's plain KV pool (cpu_kernels.SLIDING_FLAGS)
    args = with_hybrid_args(args, model, cpu=not gpu)
    return [python, "-m", "anchorcache.ext.sglang.launch", *args]


# SGLang 0.5.23 on CPU with --tp > 1: `parallel_state.init_model_parallel_group` gives every
# group a PyNccl communicator unless the platform is out of tree without pynccl, and the
# in-tree CPU platform is not out of tree, so the TP group's constructor runs
# `torch.cuda.device("cpu")` and dies ("Expected a cuda device, but got: cpu"). On the CPU
# engine no group may use NCCL; its all-reduce falls back to gloo (`GroupCoordinator.all_reduce`
# on a CPU tensor without SGLang's CPU shm kernel).
NO_PYNCCL_TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


# SGLang 0.5.23's data-parallel controller polls its input socket without blocking, in a loop
# with no wait: one core busy while idle. On a GPU host that is one core of many; on a small
# CPU box it is half of what the ranks have. On the CPU engine its loop waits on the socket
# (zmq.Poller) instead, and drains it as SGLang's does; the dispatch is SGLang's own.
DP_LOOP_TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.event_loop"
DP_POLL_MS = 1000  # the longest wait; the watchdog is fed at least this often


def dp_event_loop(original: Any, controller: Any) -> None:
    import zmq
    from sglang.srt.managers.io_struct import sock_recv

    poller = zmq.Poller()
    poller.register(controller.recv_from_tokenizer, zmq.POLLIN)
    while True:
        poller.poll(DP_POLL_MS)
        while True:
            controller.soft_watchdog.feed()
            try:
                req = sock_recv(controller.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            controller._request_dispatcher(req)


# SGLang 0.5.23's Qwen3-Next GDN layer builds its gated norm on
# `torch.get_device_module().current_device()` (models/qwen3_next.py): torch's current
# accelerator, which a CUDA build of torch names without a driver too, so the call raises
# "Found no NVIDIA driver". On the CPU engine the layer is built with the CPU's module
# answering that call (only a call without a device, only inside that constructor).
QWEN3_NEXT_GDN_TARGET = "sglang.srt.models.qwen3_next.Qwen3GatedDeltaNet.__init__"


def on_cpu_device_module(original: Any, *args: Any, **kwargs: Any) -> Any:
    import torch

    accelerator = torch.get_device_module

    def device_module(device: Any = None) -> Any:
        return torch.cpu if device is None else accelerator(device)

    setattr(torch, "get_device_module", device_module)  # noqa: B010
    try:
        return original(*args, **kwargs)
    finally:
        setattr(torch, "get_device_module", accelerator)  # noqa: B010


# Its MoE block (SGLang's Qwen2-MoE, models/qwen2_moe.py) adds the shared expert through a
# Triton kernel (`fused_gate_sigmoid_mul_add`) unless the gate runs on AMX: on the CPU
# engine that name is bound to the same sum in torch.
SHARED_GATE_MODULE = "sglang.srt.models.qwen2_moe"


def fused_gate_sigmoid_mul_add(hidden_states: Any, gate_weight: Any, shared_output: Any,
                               final_hidden_states: Any) -> None:
    """final += sigmoid(hidden . gate_weight) * shared, per row, in float32, in place."""
    gate = (hidden_states.float() @ gate_weight.float()).sigmoid()[:, None]
    final_hidden_states.copy_((final_hidden_states.float() + gate * shared_output.float())
                              .to(final_hidden_states.dtype))


def bind_shared_gate() -> None:
    import importlib

    try:
        module = importlib.import_module(SHARED_GATE_MODULE)
    except ImportError:
        return
    setattr(module, "fused_gate_sigmoid_mul_add", fused_gate_sigmoid_mul_add)  # noqa: B010


def register_cpu_hooks() -> None:
    """In every SGLang process of the CPU engine (`SGLANG_USE_CPU_ENGINE=1`): the hybrid
    models' reference kernels (cpu_kernels.py, cpu_mamba2.py) and attention sinks
    (cpu_attention.py); no PyNccl; the data-parallel controller waits for input instead of
    spinning; Qwen3-Next's GDN layer is built on the CPU device."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    from . import cpu_mamba2
    from .cpu_kernels import install

    install()  # reference kernels for the CPU ops of hybrid models, where missing
    cpu_mamba2.install()  # and for SGLang's Mamba2 mixer, which has no CPU path
    from . import cpu_attention

    cpu_attention.register()  # attention sinks on the torch_native backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def no_pynccl(original: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    HookRegistry.register(NO_PYNCCL_TARGET, no_pynccl, HookType.AROUND)
    HookRegistry.register(DP_LOOP_TARGET, dp_event_loop, HookType.AROUND)
    HookRegistry.register(QWEN3_NEXT_GDN_TARGET, on_cpu_device_module, HookType.AROUND)
    bind_shared_gate()
