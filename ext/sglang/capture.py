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
  `cpu_kernels.chunk_gated_delta_rule`; for Mamba2, `cpu_mamba2.mamba_chunk_scan_combined`)
  run the recurrence token by token, so the state after any token is at hand: at each
  named offset they write the conv window (the last `width - 1` inputs) and the recurrent
  state of every layer into the spare slot, in the pool's own layout, as they write a
  sequence's final state into its own slot. Nothing else of the forward changes: the
  request's outputs and its final state are the same bits with or without captures. The
  Mamba2 scan is handed gathered initial states, not the pool: it learns each sequence's
  slot from the conv call just before it in the same layer (`conv_called`) and the layer's
  state tensor from that conv's state tensor (`scan_targets`, named by `Captures.begin`).
- SGLang's checkpoint after the forward (`Snapshots.take`) copies the spare slot's state
  with the KV rows into the anchor, then frees the slot (`Captures.free`); a request that
  ends first frees its spare slots at its end (`AnchorRadixCache._join`).

Where the kernels cannot hand out a state inside a sequence (a GPU's FLA Triton kernels,
a real `sgl_kernel` CPU build), a Gated DeltaNet layer takes its captures in a second pass
of its own kernels over each captured prefix, before its forward (`subpass`,
ext/sglang/subpass.py): the forward itself is still not cut, and its outputs are still the
plain run's; Mamba2 layers the same way where asked. Elsewhere (Mamba2 layers off CPU,
unless asked) `capture_mode` is None and prefill chunks still end at anchor depths
(ext/sglang/admission.py): docs/sglang.md says where and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # (the module imports with torch alone: gpu_check's offline CUDA tests)
    from anchorcache.wire import CaptureBy

# How captures are taken (`capture_mode`): by the kernels of the forward itself, or by a
# second pass of a layer's kernels over each captured prefix (ext/sglang/subpass.py)
KERNELS: Final = "kernels"
SUBPASS: Final = "subpass"
# What the kernels read while a forward runs: request state slot (physical) → [(offset into
# its extend, spare slot (physical))], offsets ascending. None between forwards.
_WANTED: dict[int, list[tuple[int, int]]] | None = None
# Mamba2: each layer's conv state tensor's address → the layer's SSM state tensor; and the
# last conv call's (state tensor address, sequences' slots), which the scan after it reads
_LAYER_STATES: dict[int, Any] = {}
_LAST_CONV: tuple[int, list[int]] | None = None
# spare slot → the pieces written into it in this forward (a conv window and a recurrent
# state per layer): a capture with fewer is never read (`Captures.end`)
_WRITES: dict[int, int] = {}


@dataclass(frozen=True)
class Segment:
    """One capture of a `subpass` forward: the state after the forward's input tokens
    `[lo, hi)` (one request's, packed as the forward packs them), from the state in slot
    `source` (the request's own, or its previous capture's spare), goes into slot `spare`.
    `initial`: whether `source` holds a state (not a new sequence's first segment)."""

    source: int
    spare: int
    lo: int
    hi: int
    initial: bool


# `subpass` forwards: the captures, in rounds (round r: each request's r-th capture, which
# starts from its capture r - 1); None between forwards and in `kernels` forwards
_ROUNDS: list[list[Segment]] | None = None


def rounds() -> list[list[Segment]] | None:
    """The `subpass` captures the running forward asks for (None: none)."""
    return _ROUNDS


def wanted(slot: int) -> list[tuple[int, int]]:
    """The captures the running forward asks of the sequence in state slot `slot`."""
    return _WANTED.get(slot, []) if _WANTED else []


def wrote(spare: int) -> None:
    """A kernel wrote one piece of a capture (a layer's conv window or state) into `spare`."""
    _WRITES[spare] = _WRITES.get(spare, 0) + 1


def conv_called(conv_states: Any, slots: list[int]) -> None:
    """A prefill conv ran over sequences in `slots` with layer state `conv_states`."""
    global _LAST_CONV
    if _WANTED:
        _LAST_CONV = (conv_states.data_ptr(), slots)


def layer_states(conv_states: Any) -> Any:
    """The SSM state tensor of the layer whose conv state tensor is `conv_states`."""
    return _LAYER_STATES[conv_states.data_ptr()]


def scan_targets() -> tuple[Any, list[int]] | None:
    """For the Mamba2 scan running now: (the layer's SSM state tensor, the sequences'
    slots), from the conv call before it; None when nothing is captured."""
    if not _WANTED or _LAST_CONV is None or _LAST_CONV[0] not in _LAYER_STATES:
        return None
    return _LAYER_STATES[_LAST_CONV[0]], _LAST_CONV[1]


def capture_mode(pool: Any, wanted: str = "auto") -> CaptureBy | None:
    """How this process captures states inside a prefill of `pool`'s mixers: `kernels` on
    CPU, for Gated DeltaNet layers served by the CPU recipe's reference kernels (not a real
    `sgl_kernel` CPU build's) and Mamba2 layers served by its Mamba2 kernels (SGLang has no
    other on CPU); `subpass` for Gated DeltaNet layers elsewhere (any device, any of SGLang's
    kernels: ext/sglang/subpass.py); None (prefill chunks end at anchor depths) for Mamba2
    layers off CPU, whose second pass (`subpass`) runs only where asked. `wanted`
    (`SGLangAnchorConfig.hybrid_capture`): `auto`, or one mode (`cuts`: none), for the
    benchmark and tests that compare them."""
    from sglang.srt.utils import is_cpu

    from . import cpu_kernels, cpu_mamba2, subpass

    if wanted == "cuts":
        return None
    # SGLang's pool names the conv's q/k/v blocks exactly for Gated DeltaNet mixers
    gdn = getattr(pool, "conv_shard_groups", None) is not None
    ours = (cpu_kernels if gdn else cpu_mamba2)
    if wanted in ("auto", KERNELS) and is_cpu() and ours.CAPTURING <= ours.INSTALLED:
        return KERNELS
    # (Mamba2 layers by a second pass only where asked: not yet run on a GPU, subpass.py)
    if (wanted == SUBPASS or (wanted == "auto" and gdn)) and subpass.install(gdn):
        return SUBPASS
    return None


class Captures:
    """Spare Mamba slots for the states captured inside one forward; see the module
    docstring. `alloc_state()` gives a free slot (`[1]`, logical) or None; `mode`: who
    writes them (`capture_mode`)."""

    def __init__(self, req_to_token_pool: Any, alloc_state: Any,
                 mode: CaptureBy = KERNELS) -> None:
        self._pool = req_to_token_pool
        self._alloc_state = alloc_state
        self.mode = mode
        cache = req_to_token_pool.mamba_pool.mamba_cache
        self._layers = {cache.conv[0][layer].data_ptr(): cache.temporal[layer]
                        for layer in range(cache.temporal.shape[0])}
        self._pieces = 2 * int(cache.temporal.shape[0])  # a conv window and a state per layer
        self._named: list[tuple[Any, int]] = []  # (plan, depth) named to this forward
        self.taken = 0  # captures named to the kernels, since start
        self.no_slot = 0  # planned depths not captured: no Mamba slot free
        self.unwritten = 0  # named, but the kernels did not write every piece: dropped
        self.dead = False  # a forward named captures and none of them got a piece

    def begin(self, batch: Any, plans: Any, store: Any) -> None:
        """Name the captures of extend batch `batch` (its requests' planned depths strictly
        inside their extends) to the kernels; each request's spare slots go in its plan's
        `captured` {depth: (logical slot tensor, physical slot)}."""
        global _WANTED, _ROUNDS, _LAYER_STATES
        from .hybrid import state_slot

        wanted: dict[int, list[tuple[int, int]]] = {}
        rounds: list[list[Segment]] = []
        packed = 0  # where each request's extend starts in the forward's input
        for req, start, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                      strict=False):
            at, packed = packed, packed + extend
            p = plans.get(req.rid)
            if p is None or not p.todo:
                continue
            floor = max(start, store.tip_depth(req.rid))
            taken: list[tuple[int, int]] = []  # (offset into the extend, spare slot)
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
                taken.append((d - start, physical))
                self._named.append((p, d))
                self.taken += 1
            if not taken:
                continue
            taken.sort()
            source = state_slot(self._pool, req)
            if self.mode == KERNELS:
                wanted[source] = taken
                continue
            lo, initial = at, start > 0  # (SGLang's own `has_initial_state`)
            for r, (offset, spare) in enumerate(taken):
                if r == len(rounds):
                    rounds.append([])
                rounds[r].append(Segment(source, spare, lo, at + offset, initial))
                source, lo, initial = spare, at + offset, True
        _WANTED = wanted or None
        _ROUNDS = rounds or None
        _LAYER_STATES = self._layers
        _WRITES.clear()

    def end(self) -> None:
        """After the forward: a capture whose spare slot did not get every layer's conv
        window and state (a kernel that did not see it) is dropped, its slot freed, and the
        request's anchors with it (on every rank: a rank may not hold what another lacks):
        never an anchor written with a stale state."""
        global _WANTED, _ROUNDS, _LAST_CONV
        _WANTED = _ROUNDS = _LAST_CONV = None
        if self._named and not _WRITES:  # (nothing of this process's forward takes them)
            self.dead = True
        for p, d in self._named:
            got = p.captured.get(d)
            if got is not None and _WRITES.get(got[1], 0) != self._pieces:
                self.unwritten += 1
                self._give_back(p, d)
                p.failed = True  # (its anchors go, on every rank alike: `Snapshots.join`)
        self._named = []
        _WRITES.clear()

    def free(self, p: Any, up_to: int | None = None) -> None:
        """Give back plan `p`'s spare slots (those at depths up to `up_to`; all by default)."""
        for d in [d for d in p.captured if up_to is None or d <= up_to]:
            self._give_back(p, d)

    def _give_back(self, p: Any, depth: int) -> None:
        self._pool.mamba_allocator.free(p.captured.pop(depth)[0])
