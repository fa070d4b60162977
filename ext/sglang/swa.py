"""Sliding-window models on SGLang's sliding-window pool: anchors that keep only the window.

By default SGLang gives a sliding-window model (`is_hybrid_swa`: gpt-oss, Granite SWA,
Gemma 4 ...) two KV pools (SGLang 0.5.23, `SWAKVPool` + `SWATokenToKVPoolAllocator`): the
full-attention layers' rows live in `full_kv_pool` by token slot, the sliding layers' rows
in `swa_kv_pool` by a second slot, `full_to_swa_index_mapping[full slot]` (0 once freed).
A request frees the window slots of the tokens that left its window, and SGLang's tree
keeps such a prefix as an SWA "tombstone": full rows, no window rows; its match ends only
where the last `window` tokens before it still have their window rows.

So an anchor at depth `d` is its full layers' rows (the kv slab, `[0, d)` over its chain,
as on a dense model) plus the sliding layers' rows of its last `window` tokens only, the
"window" `[d - window, d)`: what the first token past the anchor attends to. The window is
the anchor's state slab (`Slab.state`, flat bytes, `window_nbytes`): like a recurrent
state it belongs to exactly one depth, a restore puts back the tip's only, and pins and
budgets count it. `window` is the tree's (`swa_retain_window`, at least the model's
attention window), so a restored prefix is one SGLang's match accepts.

- A snapshot reads the window through the mapping, at once (`gather`): SGLang frees window
  slots as the request moves on, so they are copied before it does (on CUDA a gather on the
  scheduler's stream, then host-bound on the copy thread). Until its planned depths are
  copied, a request keeps their windows (`AnchorRadixCache.swa_retain_floor`), so a window
  of tokens the request computed itself is live. One that reaches into the prefix it
  matched in SGLang's tree may have been freed (the tree's older part of a prefix): its
  mapping is checked (on CUDA a wait for the device, for those only), and such a window is
  no anchor: `gather` returns None.
- A restore takes full slots for the whole fresh part and window slots for its last
  `window` tokens only (`Fresh`), writes both, and inserts the prefix with SGLang's
  evicted-window length set to where the window starts: the part before is a tombstone.

Page size 1 only (the allocator's `alloc`); not with a Mamba pool, SGLang's per-request
window ring or its unified memory pool: the factory refuses those (`refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from anchorcache.ext import kernels


@dataclass
class Fresh:
    """A restore's fresh slots: full slots for `[start, depth)`, the last `windowed` of
    them with a window slot each (the rest have none: SGLang's tombstone)."""

    rows: torch.Tensor  # full slots
    windowed: int

    def free(self, allocator: Any) -> None:
        plain = len(self.rows) - self.windowed
        if plain:
            allocator.free_full_segment(self.rows[:plain], start_pos=0)
        if self.windowed:
            allocator.free(self.rows[plain:])


class WindowPool:
    """The sliding layers' K/V (`[slots, kv_heads, head_dim]` each) behind SGLang's mapping,
    and the window an anchor keeps of them."""

    def __init__(self, allocator: Any, window: int) -> None:
        pool = allocator.get_kvcache()
        self.allocator = allocator
        self.mapping: torch.Tensor = pool.full_to_swa_index_mapping
        self.k = list(pool.swa_kv_pool.k_buffer)
        self.v = list(pool.swa_kv_pool.v_buffer)
        self.window = int(window)

    @property
    def nbytes(self) -> int:
        """Bytes of one anchor's window (its state slab): every sliding layer's K and V
        for `window` tokens; an anchor shallower than that pads the front with zeros."""
        k0 = self.k[0]
        return len(self.k) * 2 * self.window * k0.shape[1] * k0.shape[2] * k0.element_size()

    def span(self, depth: int) -> tuple[int, int]:
        """The token positions `[lo, depth)` of the window of an anchor at `depth`."""
        return max(0, depth - self.window), depth

    def gather(self, full_slots: torch.Tensor, *, check: bool = True) -> torch.Tensor | None:
        """The window rows of the tokens in `full_slots` (the last `window` of a prefix, by
        full slot) as `[sliding layers, 2, window, kv_heads, head_dim]`, front rows zero
        when there are fewer; None if any of them has no window slot any more. Without
        `check` the caller knows they have (on CUDA the check waits for the device)."""
        swa = self.mapping[full_slots]
        if check and len(swa) and not bool((swa > 0).all()):
            return None
        k0 = self.k[0]
        out = torch.zeros((len(self.k), 2, self.window, *k0.shape[1:]), dtype=k0.dtype,
                          device=k0.device)
        tail = out[:, :, self.window - len(swa):]
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            tail[layer, 0] = k[swa]  # (on CUDA, in stream order: no wait here)
            tail[layer, 1] = v[swa]
        return out

    def as_state(self, window: torch.Tensor) -> torch.Tensor:
        """A host copy of a gathered window as the flat bytes of a state slab."""
        return window.contiguous().cpu().view(torch.uint8).flatten()

    def write(self, state: torch.Tensor, full_slots: torch.Tensor) -> None:
        """Put a state slab's window back: its last `len(full_slots)` tokens into the window
        slots of `full_slots` (which the restore just took)."""
        k0 = self.k[0]
        window = state.view(k0.dtype).view(len(self.k), 2, self.window, *k0.shape[1:])
        n = len(full_slots)
        if n:
            slab = window[:, :, self.window - n:].to(k0.device).contiguous()
            kernels.restore_chain([slab], [self.mapping[full_slots].to(torch.int64).contiguous()],
                              self.k, self.v, layout="thd")

    def take(self, n: int, windowed: int) -> Fresh | None:
        """`n` fresh full slots, the last `windowed` of them paired with a window slot (as
        SGLang's own `alloc` pairs them); None without room (nothing taken)."""
        allocator = self.allocator
        full = allocator.full_attn_allocator.alloc(n) if n else torch.zeros(0, dtype=torch.int64)
        if full is None:
            return None
        full = full.to(torch.int64)
        if windowed:
            swa = allocator.swa_attn_allocator.alloc(windowed)
            if swa is None:
                allocator.full_attn_allocator.free(full)
                return None
            allocator.set_full_to_swa_mapping(full[n - windowed:], swa)
        return Fresh(full, windowed)


def refusal(ctx: Any, allocator: Any) -> str | None:
    """Why anchors cannot run on this sliding-window pool, or None."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    hint = " (or serve with SGLang's plain pool: --disable-hybrid-swa-memory)"
    if ctx.is_hybrid_ssm:
        return "anchorcache does not serve a model with both Mamba and sliding-window pools" + hint
    if type(allocator) is not SWATokenToKVPoolAllocator or allocator.swa_req_ring:
        return (f"anchorcache on SGLang's sliding-window pool needs its paged allocator, not "
                f"{type(allocator).__name__}" + hint)
    if allocator.page_size != 1:
        return "anchorcache on SGLang's sliding-window pool needs --page-size 1" + hint
    return None
