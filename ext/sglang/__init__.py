"""anchorcache inside an unmodified SGLang (docs/sglang.md).

`plugin` is the `sglang.srt.plugins` entry point: SGLang calls it in every process it
starts; it registers the `anchorcache` radix-cache backend (`--radix-cache-backend
anchorcache`) and, around `Scheduler.get_prefill_adder_class`, a prefill adder that
passes over requests whose restore is in flight and, on hybrid models, ends prefill chunks
at anchor depths where the kernels cannot capture a state inside the forward
(ext/sglang/admission.py); around `Scheduler.run_batch`, those captures (ext/sglang/
capture.py); and, around `Scheduler.init_ipc_channels`, the scheduler RPC socket of each
data-parallel rank at a name our HTTP process knows (ext/sglang/rpc.py). Nothing here imports SGLang at module level,
so the package imports without it.
"""

from __future__ import annotations

BACKEND_NAME = "anchorcache"
ADDER_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class"
IPC_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_ipc_channels"
RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"


def plugin() -> None:
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    if BACKEND_NAME in registered_radix_cache_backends():
        return
    from .cpu import register_cpu_hooks

    register_cpu_hooks()  # the CPU engine's tensor parallelism (cpu.py)

    def factory(ctx):  # imported lazily: only the scheduler builds a cache
        from .cache import build

        return build(ctx)

    register_radix_cache_backend(BACKEND_NAME, factory)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADDER_TARGET, _prefill_adder, HookType.AROUND)
    HookRegistry.register(IPC_TARGET, _rank_rpc, HookType.AROUND)
    HookRegistry.register(RUN_BATCH_TARGET, _run_batch, HookType.AROUND)


def _run_batch(original, scheduler, batch, *args, **kwargs):  # type: ignore[no-untyped-def]
    """SGLang's forward of `batch`; with our cache on a hybrid model, the states our
    kernels capture inside it named first (ext/sglang/capture.py)."""
    cache = scheduler.tree_cache
    if not hasattr(cache, "begin_forward"):
        return original(scheduler, batch, *args, **kwargs)
    cache.begin_forward(batch)
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        cache.end_forward()


def _rank_rpc(original, scheduler, port_args, *args, **kwargs):  # type: ignore[no-untyped-def]
    """With data parallelism, this rank's scheduler RPC socket at `rpc.rank_rpc_name`."""
    import dataclasses

    from sglang.srt.runtime_context import get_parallel

    from .rpc import rank_rpc_name

    name = rank_rpc_name(get_parallel().dp_rank)
    if name is not None:
        port_args = dataclasses.replace(port_args, rpc_ipc_name=name)
    return original(scheduler, port_args, *args, **kwargs)


def _prefill_adder(original, scheduler, *args, **kwargs):  # type: ignore[no-untyped-def]
    """SGLang's prefill adder class; with our cache, ours (ext/sglang/admission.py)."""
    base = original(scheduler, *args, **kwargs)
    cache = scheduler.tree_cache
    if not hasattr(cache, "admit_restore"):
        return base
    # a restore's copy stream waits for the forward stream (with the overlap schedule a
    # batch may still run there when the copy starts: ext/sglang/kv.py `fence`), the
    # stream SGLang's HiCache fences its loads on too
    if cache.forward_stream is None:  # (once: the scheduler's runner keeps its stream)
        runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
        cache.forward_stream = getattr(runner, "forward_stream", None)
    from .admission import prefill_adder_class

    cls = _ADDERS.get(base)
    if cls is None:
        cls = _ADDERS[base] = prefill_adder_class(base)
    return cls


_ADDERS: dict[type, type] = {}
