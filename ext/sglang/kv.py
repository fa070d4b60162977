"""The scheduler's KV pool as our copies see it, and the copy thread that runs them.

Rows are addressed `thd` by token slot (`k_buffer[layer][slot]`), so a slab written by the
embedded worker's `bhtd` cache has the same bytes, at any page size. On a hybrid model
(Gated DeltaNet / Mamba layers) `states` are the recurrent state tensors (ext/sglang/
hybrid.py); on SGLang's sliding-window pool, `k`, `v` are the full-attention layers' and
`window` the sliding layers' (ext/sglang/swa.py). Copies run on one thread, off the
scheduler's loop; on CUDA on a stream of their own, ordered after the scheduler's work
(`fence`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from anchorcache.ext import kernels

from . import hybrid, swa


class DeviceKV:
    """Views of SGLang's pools (built once, from its `CacheInitParams`) and the copy thread."""

    def __init__(self, req_to_token_pool: Any, allocator: Any, *, mamba: bool,
                 sliding_window: int | None) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.k, self.v = hybrid.kv_views(allocator)
        self.states = hybrid.state_views(req_to_token_pool) if mamba else None
        self.window = (swa.WindowPool(allocator, sliding_window)
                       if sliding_window is not None else None)
        k0 = self.k[0]
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="anchorcache-copy")
        self.copy_stream = torch.cuda.Stream(k0.device) if k0.is_cuda else None
        self.forward_stream: Any = None  # SGLang's (CUDA), set by our adder hook (__init__.py)

    @property
    def kv_bytes_per_token(self) -> int:
        k0 = self.k[0]
        return len(self.k) * 2 * k0.shape[1] * k0.shape[2] * k0.element_size()

    @property
    def state_bytes(self) -> int:
        """One anchor's state slab: the recurrent state, or the sliding layers' window."""
        if self.states:
            return kernels.state_slab_nbytes(self.states)
        return self.window.nbytes if self.window is not None else 0

    @property
    def pinned(self) -> bool:
        """Host buffers are pinned (CUDA: copies run on the copy stream)."""
        return self.copy_stream is not None

    def rows_of(self, req: Any, lo: int, hi: int) -> torch.Tensor:
        """Request `req`'s pool slots `[lo, hi)`, from its own row of `req_to_token`."""
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, lo:hi].to(torch.int64)

    def on_copy_stream(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self.copy_stream) if self.copy_stream is not None \
            else nullcontext()

    def synchronize(self) -> None:
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def fence(self) -> None:
        """On CUDA, order the copy stream after everything the scheduler queued so far:
        its own stream and SGLang's forward stream (with the overlap schedule a batch may
        still be running there, reading or writing slots that were just freed)."""
        if self.copy_stream is None:
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        if self.forward_stream is not None:
            self.copy_stream.wait_stream(self.forward_stream)
