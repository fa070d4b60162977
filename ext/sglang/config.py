"""The SGLang worker's anchor settings, handed from the launcher to SGLang's scheduler.

The scheduler is a subprocess SGLang spawns; the only channel our launcher has into it
is the environment it inherits. The launcher (`anchorcache worker --backend sglang`)
writes one JSON variable, the scheduler's cache factory reads it back. Two more: with
data parallelism, the folder of the ranks' RPC sockets (`rpc.RANK_RPC_DIR`, read by the
plugin's hook), and for tests only (no launcher flag sets it)
`ANCHORCACHE_SGLANG_SLAB_DUMP_DIR`: `slab_dump_dir`; for benchmarks,
`ANCHORCACHE_SGLANG_HYBRID_CAPTURE=kernels|subpass|cuts`: `hybrid_capture` (and
`ANCHORCACHE_SGLANG_HYBRID_CUTS=1`: `cuts`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import orjson

from anchorcache.defaults import ANCHOR_BYTES, ANCHOR_SLOTS, PINNED_SLOTS

ENV = "ANCHORCACHE_SGLANG_CONFIG"
DUMP_ENV = "ANCHORCACHE_SGLANG_SLAB_DUMP_DIR"
CUTS_ENV = "ANCHORCACHE_SGLANG_HYBRID_CUTS"
CAPTURE_ENV = "ANCHORCACHE_SGLANG_HYBRID_CAPTURE"
HYBRID_CAPTURES = ("auto", "kernels", "subpass", "cuts")


@dataclass(frozen=True)
class SGLangAnchorConfig:
    anchor_slots: int = ANCHOR_SLOTS
    anchor_capacity_bytes: int = ANCHOR_BYTES  # host slabs
    pinned_slots: int = PINNED_SLOTS  # the thin region: toolsets' instruction and tool anchors
    # pinned anchors' prefixes stay locked in the tree; at most this share of the pool,
    # which the contract keeps out of every request's limit (0: pins stay host-only)
    pin_budget_fraction: float = 0.1
    # POST /debug/fault arms one fault in the scheduler's cache (tests show that the checks
    # catch a wrong restore); off unless the worker is started with --fault-injection
    fault_injection: bool = False
    # tests: TP rank 0 also saves every anchor it confirms, its chain's slabs and tokens, as
    # `<key hex>.pt` here, so a test can compare them with the embedded worker's
    slab_dump_dir: str | None = None
    # the disk tier (ext/disk_tier.py, docs/disk-tier.md): its directory (None: none) and
    # budget (None: a share of the free disk; 0: off); TP 1 and DP 1 only
    anchor_disk_dir: str | None = None
    anchor_disk_bytes: int | None = None
    # hybrid models: how states at anchor depths are taken (ext/sglang/capture.py): `auto`
    # (inside the forward where the layers can: by the CPU recipe's kernels, else by a
    # second pass of a Gated DeltaNet layer's own; else prefill chunks end there), or one
    # of `kernels`, `subpass`, `cuts` (prefill chunks end at anchor depths everywhere: the
    # path before, kept for the benchmark and tests that compare them)
    hybrid_capture: str = "auto"

    def __post_init__(self) -> None:
        if self.anchor_slots < 1 or not 0 <= self.pinned_slots < self.anchor_slots:
            raise ValueError("need anchor_slots >= 1 and 0 <= pinned_slots < anchor_slots")
        if self.anchor_capacity_bytes < 1:
            raise ValueError("anchor_capacity_bytes must be positive")
        if not 0 <= self.pin_budget_fraction < 0.5:
            raise ValueError("pin_budget_fraction must be in [0, 0.5)")
        if self.hybrid_capture not in HYBRID_CAPTURES:
            raise ValueError(f"hybrid_capture must be one of {', '.join(HYBRID_CAPTURES)}")

    def to_env(self) -> dict[str, str]:
        return {ENV: orjson.dumps(asdict(self)).decode()}

    @classmethod
    def from_env(cls) -> SGLangAnchorConfig:
        raw = os.environ.get(ENV)
        config = cls(**orjson.loads(raw)) if raw else cls()
        dump = os.environ.get(DUMP_ENV)
        if dump:
            config = replace(config, slab_dump_dir=dump)
        if os.environ.get(CUTS_ENV) == "1":
            config = replace(config, hybrid_capture="cuts")
        if os.environ.get(CAPTURE_ENV):
            config = replace(config, hybrid_capture=os.environ[CAPTURE_ENV])
        return config
