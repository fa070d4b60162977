"""Recurrent states captured inside a prefill: an anchor on a hybrid model without a
prefill chunk of its own (issue 38).

SGLang keeps a request's recurrent state (conv window + delta-rule state) only where its
forward ends. Cutting the prefill chunk at each anchor depth gives a state there, at the
price of one more scheduler round per cut, and SGLang runs one chunked request per round:
under concurrency the cuts serialize prefills that would otherwise share a forward. So
where the kernels can hand out the state at a position inside a sequence, the forward is
not cut at all:

- Before an extend batch runs (`Scheduler.run_batch`, hooked in ext/sglang/__init__.py),
  `Captures.begin` looks at every anchored request in it and, for each planned depth its
  extend passes strictly inside (a depth at the extend's end is the request's own state
  after the forward, as before), takes a spare Mamba slot and names it to the kernels: the
  request's state slot, the offset into its extend, the spare slot.
- The CPU recipe's reference kernels (`cpu_kernels.causal_conv1d_fwd`,
  `cpu_kernels.chunk_gated_delta_rule`) run the delta rule token by token, so the state
  after any token is at hand: at each named offset they write the conv window (the last
  `width - 1` inputs) and the recurrent state of every GDN layer into the spare slot, in
  the pool's own layout, as they write a sequence's final state into its own slot. Nothing
  else of the forward changes: the request's outputs and its final state are the same bits
  with or without captures.
- SGLang's checkpoint after the forward (`Snapshots.take`) copies the spare slot's state
  with the KV rows into the anchor, then frees the slot (`Captures.free`); a request that
  ends first frees its spare slots at its end (`Snapshots.join`).

Where the kernels cannot (a GPU's Triton/FLA kernels, a real `sgl_kernel` CPU build, the
Mamba2 mixer's scan) `enabled` is false and prefill chunks still end at anchor depths
(ext/sglang/admission.py): docs/sglang.md says where and why.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("anchorcache.sglang")

# What the kernels read while a forward runs: request state slot (physical) → [(offset into
# its extend, spare slot (physical))], offsets ascending. None between forwards.
_WANTED: dict[int, list[tuple[int, int]]] | None = None


def wanted(slot: int) -> list[tuple[int, int]]:
    """The captures the running forward asks of the sequence in state slot `slot`."""
    return _WANTED.get(slot, []) if _WANTED else []


def kernels_capture(pool: Any) -> bool:
    """Whether this process's kernels for `pool`'s mixers capture inside a prefill: on CPU,
    Gated DeltaNet layers (the pool names their conv's q/k/v blocks), served by the CPU
    recipe's reference kernels (not a real `sgl_kernel` CPU build's)."""
    from sglang.srt.utils import is_cpu

    from . import cpu_kernels

    return (is_cpu() and getattr(pool, "conv_shard_groups", None) is not None
            and cpu_kernels.CAPTURING <= cpu_kernels.INSTALLED)


class Captures:
    """Spare Mamba slots for the states captured inside one forward; see the module
    docstring. `alloc_state()` gives a free slot (`[1]`, logical) or None."""

    def __init__(self, req_to_token_pool: Any, alloc_state: Any) -> None:
        self._pool = req_to_token_pool
        self._alloc_state = alloc_state
        self.taken = 0  # captures named to the kernels, since start
        self.no_slot = 0  # planned depths not captured: no Mamba slot free

    def begin(self, batch: Any, plans: Any, store: Any) -> None:
        """Name the captures of extend batch `batch` (its requests' planned depths strictly
        inside their extends) to the kernels; each request's spare slots go in its plan's
        `captured` {depth: (logical slot tensor, physical slot)}."""
        global _WANTED
        from .hybrid import state_slot

        wanted: dict[int, list[tuple[int, int]]] = {}
        for req, start, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                      strict=False):
            p = plans.get(req.rid)
            if p is None or not p.todo:
                continue
            floor = max(start, store.tip_depth(req.rid))
            for spec in p.todo:
                d = spec.depth
                if not floor < d < start + extend or d in p.captured \
                        or store.table.contains(p.keys[d], d):
                    continue
                slot = self._alloc_state()
                if slot is None:
                    self.no_slot += 1
                    continue
                physical = int(self._pool.translate_mamba_indices(slot)[0])
                p.captured[d] = (slot, physical)
                wanted.setdefault(state_slot(self._pool, req), []).append((d - start, physical))
                self.taken += 1
        _WANTED = wanted or None

    @staticmethod
    def end() -> None:
        global _WANTED
        _WANTED = None

    def free(self, p: Any, up_to: int | None = None) -> None:
        """Give back plan `p`'s spare slots (those at depths up to `up_to`; all by default)."""
        done = [d for d in p.captured if up_to is None or d <= up_to]
        for d in done:
            self._pool.mamba_allocator.free(p.captured.pop(d)[0])
