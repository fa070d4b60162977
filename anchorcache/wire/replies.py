"""The replies of the contract's other routes (docs/worker-protocol.md, "Other routes")."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from msgspec import Meta

from .codec import Depth, Epoch, Finite, HexRecord, Ids, Key, NonNeg, Record


class WorkerHealth(Record, frozen=True):
    """`/health`."""

    status: str
    epoch: Epoch
    running_requests: tuple[str, ...] = ()
    queued_requests: tuple[str, ...] = ()


# a rank of a server of several workers: a path under its URL (no scheme, no `..`, not absolute)
RankPath = Annotated[str, Meta(pattern=r"^(?!/)(?![\s\S]*(?:^|/)\.\.(?:/|\Z))[^:]+\Z")]


class ModelInfo(Record, frozen=True):
    """`/model_info`. `vocab_size`: every input id must be below it; `max_context_tokens`:
    prompt + completion of one request."""

    model_id: str
    model_path: str
    tokenizer_path: str
    architecture: str
    max_context_tokens: Depth
    eos_token_ids: Ids
    hybrid: bool
    vocab_size: NonNeg
    backend: str  # embedded | sglang
    epoch: str = ""
    # a server of several workers (SGLang's data-parallel ranks): the paths, under this URL,
    # of each one's contract (`dp/0`, ...); empty: this URL is itself the worker
    ranks: tuple[RankPath, ...] = ()
    is_generation: bool = True  # SGLang's field: always true here


class AbortReply(Record, frozen=True):
    """`/abort_request`: whether the request ran or held unconfirmed anchors (now dropped)."""

    rid: str
    aborted: bool
    epoch: Epoch


class StopReply(Record, frozen=True):
    """`/stop_request`: whether the request was still running and now ends as a stop."""

    rid: str
    stopped: bool
    epoch: Epoch


class ConfirmReply(HexRecord, frozen=True):
    """`/anchor/confirm`: the staged anchors made visible, and the keys their victims had."""

    confirmed: Ids
    evicted: tuple[Key, ...]
    epoch: Epoch


class SlotsAborted(Record, frozen=True):
    """`/anchor/abort`: the staged anchors dropped (their victims survive)."""

    aborted: Ids
    epoch: Epoch


class LookupHit(HexRecord, frozen=True):
    depth: Depth
    key: Key
    committed: bool


class LookupReply(Record, frozen=True):
    """`/anchor/lookup`: for each depth asked, the prefix's key and whether it is committed."""

    hits: tuple[LookupHit, ...]
    epoch: Epoch


class SlotEntry(HexRecord, frozen=True):
    """One row of `/anchor/slots` (and of ext/slots.py's table): a committed anchor or a
    pending reservation."""

    slot: NonNeg
    key: Key
    depth: Depth
    parent: Key | None
    nbytes: NonNeg
    pinned: bool
    hits: NonNeg
    last_use: int  # logical clock tick: its own commit or hit, or a descendant's (ancestors)
    state: Literal["committed", "reserved"]
    tier: str = "host"  # where its slab is: host (a slot's slab in memory)


class DiskSlotEntry(HexRecord, frozen=True):
    """An anchor the worker's disk tier holds and its memory does not (tier `disk`): no
    slot; a restore or a late lookup that names it loads it (docs/disk-tier.md)."""

    key: Key
    depth: Depth
    parent: Key | None
    nbytes: NonNeg
    pinned: bool
    tier: Literal["disk"] = "disk"


class SlotsReply(Record, frozen=True):
    """`/anchor/slots`."""

    slots: tuple[SlotEntry, ...]
    epoch: Epoch
    disk: tuple[DiskSlotEntry, ...] = ()  # on disk only (not in `slots`)


class SlotCounters(Record, frozen=True):
    """The slot table's counters (ext/slots.py's `SlotTable.stats()`)."""

    num_slots: NonNeg
    used_slots: NonNeg  # slots holding a committed anchor
    reserved_slots: NonNeg  # slots with a pending reservation (may also hold a committed one)
    free_slots: NonNeg  # neither
    bytes_used: NonNeg
    bytes_reserved: NonNeg
    bytes_capacity: NonNeg
    hits: NonNeg
    misses: NonNeg
    stale_evictions: NonNeg
    reservations: NonNeg  # successful reserve() calls, cumulative
    confirms: NonNeg
    aborts: NonNeg
    evictions: NonNeg  # anchors removed by confirm, evict, clear or staleness, cumulative


STATS_COUNTERS: tuple[str, ...] = SlotCounters.__struct_fields__


class CallTime(Record, frozen=True):
    """The scheduler's own time in one kind of anchor work (SGLang: an RPC op, or
    `snapshot` for the copies a checkpoint makes): what it costs every running request."""

    op: str
    calls: NonNeg
    total_ms: Finite
    max_ms: Finite


class DiskStatsRecord(Record, frozen=True):
    """The disk tier's figures in `/anchor/stats` (`disk`; null without a disk tier)."""

    enabled: bool  # false once a full or read-only disk turned it off
    bytes: NonNeg
    files: NonNeg
    budget_bytes: NonNeg
    writes: NonNeg
    loads: NonNeg
    skips: NonNeg  # files refused (truncated, bad checksum, other model/version/TP) and quarantined
    evictions: NonNeg
    imports: NonNeg = 0  # files another worker wrote into a shared directory, found on a miss


# how a hybrid model's anchors get their recurrent state: captured inside the forward
# (ext/sglang/capture.py), or at a prefill chunk that ends at the anchor's depth
StateCapture = Literal["in_forward", "chunk_cut"]
# who writes a state captured inside the forward: the forward's own kernels, or a second
# pass of a layer's kernels over the captured prefix (ext/sglang/subpass.py)
CaptureBy = Literal["kernels", "subpass"]


class CaptureStatsRecord(Record, frozen=True):
    """A hybrid model's state captures in `/anchor/stats` (`captures`; null elsewhere)."""

    mode: StateCapture
    taken: NonNeg = 0  # states captured inside a forward
    no_slot: NonNeg = 0  # planned depths not captured: no free recurrent-state slot
    unwritten: NonNeg = 0  # captures a kernel did not write whole: dropped, never read
    by: CaptureBy | None = None  # `in_forward` (and `chunk_cut` after captures went dead)


class StatsReply(SlotCounters, frozen=True):
    """`/anchor/stats`: the slot table's counters, the staged anchors, and what pins lock on
    the device (SGLang; 0 on a worker without a device tier)."""

    staged: NonNeg
    epoch: Epoch
    device_pinned_tokens: NonNeg = 0
    device_pin_budget_tokens: NonNeg = 0
    scheduler_calls: tuple[CallTime, ...] = ()  # a worker with a scheduler loop (SGLang)
    disk: DiskStatsRecord | None = None  # the disk tier's figures, when it has one
    captures: CaptureStatsRecord | None = None  # a hybrid model's (SGLang)


# what a pin did on the device: `none` where nothing was locked there (not pinned, or a
# worker without a device tier)
PinDevice = Literal["none", "locked", "over_budget", "no_device_space", "no_tokens",
                    "unsupported"]
PIN_DEVICE: tuple[str, ...] = get_args(PinDevice)


class PinReply(Record, frozen=True):
    """`/anchor/pin`: whether the key's anchor is pinned now, and what the device did."""

    pinned: bool
    epoch: Epoch
    device: PinDevice = "none"


class UnpinReply(Record, frozen=True):
    """`/anchor/unpin`: false when the key was not pinned."""

    unpinned: bool
    epoch: Epoch


class EvictReply(Record, frozen=True):
    """`/anchor/evict`: false when the worker held no such anchor."""

    evicted: bool
    epoch: Epoch


KeyOpReply = PinReply | UnpinReply | EvictReply


class FlushReply(Record, frozen=True):
    """`/anchor/flush` and `/flush_cache`: anchors dropped; `flushed_device`: the worker's
    own device prefix cache was flushed instead (SGLang's `/flush_cache`)."""

    flushed_anchors: NonNeg
    epoch: Epoch
    flushed_device: bool = False


class ImportReply(HexRecord, frozen=True):
    """`/anchor/import`: the anchor a slab file (another worker's `/anchor/export`) holds,
    now on this worker's disk tier; `imported` false when it was there already."""

    key: Key
    depth: Depth
    parent: Key | None
    imported: bool
    epoch: Epoch


class VerifyReply(HexRecord, frozen=True):
    """`/anchor/verify` (SGLang, a diagnostic): the device rows of a committed anchor's prefix
    against its host slabs; `mismatch`: the first differing token position, or None. On a
    hybrid model `state_equal` compares the recurrent state the tree holds at the anchor's
    depth with the anchor's state slab (None: no state there, or a dense model)."""

    key: Key
    depth: Depth
    device_tokens: NonNeg
    mismatch: NonNeg | None
    epoch: Epoch
    state_equal: bool | None = None
