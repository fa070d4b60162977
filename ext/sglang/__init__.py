"""anchorcache inside an unmodified SGLang (docs/sglang.md).

`plugin` is the `sglang.srt.plugins` entry point: SGLang calls it in every process it
starts; it registers the `anchorcache` radix-cache backend (`--radix-cache-backend
anchorcache`). Nothing here imports SGLang at module level, so the package imports
without it.
"""

from __future__ import annotations

BACKEND_NAME = "anchorcache"


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
