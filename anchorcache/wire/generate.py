"""`POST /generate`: the request (`GenerateRequest`: its sampling parameters and anchor plan)
and the `meta_info` a finished request replies with (`GenerateMeta`: its `AnchorReport`)."""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from .codec import (
    _FMAX,
    Depth,
    Epoch,
    Finite,
    Hex,
    HexRecord,
    Ids,
    Int64,
    Key,
    NonNeg,
    Record,
    WireError,
)
from .keys import CacheKey

# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32
# (a 1e-37 temperature turns every logit into ±inf and the softmax into NaN).
GREEDY_TEMPERATURE = 1e-5
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
MAX_SAMPLES = 16  # n: samples per request
MAX_TOP_LOGPROBS = 20
Grammar = Annotated[str, Meta(min_length=1)]


class AnchorKind(str, Enum):
    TOOL = "tool"  # the end of a tool schema inside the instruction prefix (the thin region)
    INSTRUCTION = "instruction"
    CONVERSATION = "conversation"
    RESPONSE = "response"


class Region(str, Enum):
    """The slot-table region a slab is reserved in (ext/slots.py)."""

    THIN = "thin"  # pinnable tool/instruction anchors
    THICK = "thick"  # conversation and response anchors


class SamplingParams(Record, frozen=True):
    """SGLang's own sampling-parameter names, so the SGLang worker passes them through.

    At most one constraint field (`json_schema`, `regex`, `ebnf`, `structural_tag`: each a
    string, as SGLang takes them) is set; the worker masks every token the grammar forbids.
    `n` samples start from one prefill; sample i draws from `seed + i` when `seed` is set.
    A temperature below `GREEDY_TEMPERATURE` is 0 (greedy), so that no sampler divides by it.
    """

    max_new_tokens: NonNeg = 128
    temperature: Annotated[float, Meta(ge=0, le=_FMAX)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1  # -1: no top-k; 0 is refused
    stop_token_ids: Ids = ()
    seed: Int64 | None = None
    ignore_eos: bool = False
    n: Annotated[int, Meta(ge=1, le=MAX_SAMPLES)] = 1
    json_schema: Grammar | None = None
    regex: Grammar | None = None
    ebnf: Grammar | None = None
    structural_tag: Grammar | None = None

    def __post_init__(self) -> None:
        if 0 < self.temperature < GREEDY_TEMPERATURE:
            msgspec.structs.force_setattr(self, "temperature", 0.0)
        if self.top_k == 0:
            raise WireError("'top_k' must be -1 or >= 1")
        if (self.json_schema, self.regex, self.ebnf, self.structural_tag).count(None) < 3:
            raise WireError(f"at most one of {', '.join(CONSTRAINT_KINDS)} may be set")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, grammar text) of the constraint, or None."""
        for kind in CONSTRAINT_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None


class AnchorRef(HexRecord, frozen=True, omit_defaults=True):
    """One committed anchor named by its key and depth (a link of a restore chain)."""

    key: Key
    depth: Depth
    namespace: Hex | None = None  # when not the plan's: a toolset an admin shared


class SnapshotSpec(Record, frozen=True):
    """Snapshot the state at `depth` (a chunk boundary of the prefill) under `kind`."""

    depth: Depth
    kind: AnchorKind = AnchorKind.CONVERSATION
    region: Region = Region.THICK


class AnchorPlan(HexRecord, frozen=True):
    """The anchor part of a generate request (absent: no anchoring at all).

    `restore` is a root→leaf chain, or its last links (the proxy names the leaf: the worker
    completes the chain by its own parent links); `snapshot` lists cuts to save during prefill;
    `snapshot_response` saves prompt + generated tokens at the end; `chunk_at` are prefill
    chunk boundaries (the snapshot depths are always boundaries too). `confirm`: the worker
    confirms what the request wrote as its end goes out (`meta_info.anchors.confirmed`),
    instead of waiting for `/anchor/confirm`.
    """

    namespace: Hex = Hex()
    restore: tuple[AnchorRef, ...] = ()
    snapshot: tuple[SnapshotSpec, ...] = ()
    snapshot_response: bool = False
    chunk_at: Ids = ()
    confirm: bool = False

    def depths(self) -> Iterator[int]:
        """Every depth the plan names."""
        yield from (r.depth for r in self.restore)
        yield from (s.depth for s in self.snapshot)
        yield from self.chunk_at


class GenerateRequest(Record, frozen=True, omit_defaults=True):
    """A `/generate` body: the prompt's ids, how to sample, and its anchor plan. Fields at
    their default are left out of the body (`stream` false, no `anchor`, ...)."""

    input_ids: Annotated[Ids, Meta(min_length=1)]
    sampling: SamplingParams = msgspec.field(default=SamplingParams(), name="sampling_params")
    rid: str | None = None
    stream: bool = False
    anchor: AnchorPlan | None = None
    return_logprob: bool = False  # SGLang's names: per-token logprobs of the output
    # and the k most likely alternatives at each position
    top_logprobs_num: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    cache_key: CacheKey | None = None  # `engine_cache_key` of the caller's namespace

    def __post_init__(self) -> None:
        if self.anchor is not None and max(self.anchor.depths(), default=0) > len(self.input_ids):
            raise WireError("an anchor depth exceeds the prompt length")


# ---- the reply: `meta_info` -----------------------------------------------------------------

class AnchorHit(HexRecord, frozen=True):
    """A link the worker restored."""

    key: Key
    depth: Depth
    kind: AnchorKind = AnchorKind.CONVERSATION


class RestoreMiss(HexRecord, frozen=True):
    """A planned link the worker refused, and why (key_mismatch, not_resident, ...)."""

    key: Key
    depth: Depth
    reason: str = ""


class AnchorWritten(HexRecord, frozen=True):
    """A snapshot the worker wrote into a reserved slot: invisible until confirmed."""

    slot: NonNeg
    key: Key
    depth: Depth
    parent: Key | None
    nbytes: NonNeg
    kind: AnchorKind


class AnchorHeld(AnchorWritten, frozen=True):
    """A snapshot the worker skipped because it already holds that prefix committed: reported
    (`meta_info.anchors.held`) so a proxy that forgot it (restart, lost confirm) learns it
    again; it needs no confirm."""


class Confirmation(HexRecord, frozen=True):
    """`meta_info.anchors.confirmed` of a request whose plan asked `confirm`: the slots of
    its `written` anchors the worker confirmed when it ended, and the keys their victims had
    (what `/anchor/confirm` would have replied)."""

    slots: Ids = ()
    evicted: tuple[Key, ...] = ()


class AnchorReport(Record, frozen=True):
    """`meta_info.anchors`: what one generate request restored, missed, wrote and found held."""

    restored: tuple[AnchorHit, ...] = ()  # the named links restored (a late chain: whole)
    restore_miss: tuple[RestoreMiss, ...] = ()
    written: tuple[AnchorWritten, ...] = ()
    held: tuple[AnchorHeld, ...] = ()
    late_lookup: bool = False  # the restored chain came from the late lookup, not the plan
    restored_tokens: NonNeg = 0  # of `cached_tokens`, those copied from host slabs
    confirmed: Confirmation | None = None  # None: not confirmed (no `confirm`, or it failed)


class FinishStop(Record, frozen=True, tag_field="type", tag="stop"):
    """Stopped at a stop token (`matched`; SGLang: None for a stop string)."""

    type: ClassVar[str] = "stop"
    matched: NonNeg | None = None


class FinishLength(Record, frozen=True, tag_field="type", tag="length"):
    """Stopped at `max_new_tokens` (`length`: the output's)."""

    type: ClassVar[str] = "length"
    length: NonNeg


class FinishAbort(Record, frozen=True, tag_field="type", tag="abort"):
    """The engine gave up: never a completion (the proxy answers 502)."""

    type: ClassVar[str] = "abort"


FinishReason = FinishStop | FinishLength | FinishAbort


class GenerateMeta(Record, frozen=True, omit_defaults=True):
    """`meta_info` of a finished generate request (of one sample when n > 1). Every field
    but `snapshot_ms` and `index` is always sent (those with no default)."""

    epoch: Epoch
    prompt_tokens: NonNeg
    completion_tokens: NonNeg
    cached_tokens: NonNeg
    prefill_tokens: NonNeg
    finish_reason: FinishReason
    anchors: AnchorReport
    restore_ms: Finite
    prefill_ms: Finite
    decode_ms: Finite
    snapshot_ms: Finite | None = None  # writing this request's anchors; absent: not timed
    rid: str = msgspec.field(default="", name="id")  # the request's id
    index: NonNeg | None = None  # the sample, when the request asked for n > 1

    @property
    def finish_type(self) -> str:
        """stop | length | abort"""
        return self.finish_reason.type
