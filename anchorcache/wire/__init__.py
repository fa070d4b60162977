"""The worker contract (docs/worker-protocol.md): its records, their one codec, and the key
derivation both sides share.

Imports neither `anchorcache.proxy` nor `anchorcache.ext` (nor torch): the proxy and the
workers each parse the JSON once at their HTTP edge into these records.

- `codec.py`: `Record` (a frozen `msgspec.Struct`) and the one codec: `from_json(cls, obj)`
  / `decode(raw, cls)` read a record (WireError, a 400, naming the field when malformed),
  `to_json(record)` / `encode(record)` write it (keys as hex, enums as their values).
- `generate.py`: `/generate`'s request and its `meta_info`.
- `replies.py`: the replies of the other routes.
- `keys.py`: anchor keys, engine cache keys, the worker secret.

Anchor keys: `anchor_key(namespace, model_id, P[:d])` is a 128-bit BLAKE2b digest over the
namespace (a server-side tenant secret, never client-supplied), the model id and every
token of the prefix. Both sides compute it; the worker recomputes it over the input ids it
actually received before restoring anything, so a planner bug cannot restore the wrong
prefix. Keys of several depths of one prompt are computed in one pass.

Engine cache keys: a worker's own prefix cache (SGLang's radix tree) is shared by every
request it serves, so each request carries `cache_key = engine_cache_key(namespace)`, a
digest of its caller's namespace, and the worker keys its cache by it (SGLang's
`extra_key`): a request can only hit what requests of the same namespace left there.
"""

from .codec import (
    KEY_BYTES,
    Depth,
    Epoch,
    Finite,
    Hex,
    Ids,
    Int64,
    Key,
    NonNeg,
    Record,
    TokenIds,
    WireError,
    convert,
    decode,
    encode,
    from_json,
    parse_ids,
    to_json,
)
from .generate import (
    CONSTRAINT_KINDS,
    GREEDY_TEMPERATURE,
    MAX_SAMPLES,
    MAX_TOP_LOGPROBS,
    AnchorHeld,
    AnchorHit,
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    AnchorReport,
    AnchorWritten,
    Confirmation,
    FinishAbort,
    FinishLength,
    FinishReason,
    FinishStop,
    GenerateMeta,
    GenerateRequest,
    Region,
    RestoreMiss,
    SamplingParams,
    SnapshotSpec,
)
from .keys import (
    CACHE_KEY_CHARS,
    MIN_SECRET_CHARS,
    WORKER_SECRET_ENV,
    CacheKey,
    anchor_key,
    anchor_keys,
    check_secret,
    engine_cache_key,
    key_hasher,
    parse_cache_key,
)
from .replies import (
    PIN_DEVICE,
    STATS_COUNTERS,
    AbortReply,
    CallTime,
    CaptureBy,
    CaptureStatsRecord,
    ConfirmReply,
    DiskSlotEntry,
    DiskStatsRecord,
    EvictReply,
    FlushReply,
    ImportReply,
    KeyOpReply,
    LookupHit,
    LookupReply,
    ModelInfo,
    PinDevice,
    PinReply,
    SlotCounters,
    SlotEntry,
    SlotsAborted,
    SlotsReply,
    StatsReply,
    StopReply,
    UnpinReply,
    VerifyReply,
    WorkerHealth,
)

__all__ = [
    "CACHE_KEY_CHARS", "CONSTRAINT_KINDS", "GREEDY_TEMPERATURE", "KEY_BYTES", "MAX_SAMPLES",
    "MAX_TOP_LOGPROBS", "MIN_SECRET_CHARS", "PIN_DEVICE", "STATS_COUNTERS", "WORKER_SECRET_ENV",
    "AbortReply", "AnchorHeld", "AnchorHit", "AnchorKind", "AnchorPlan", "AnchorRef",
    "AnchorReport", "AnchorWritten", "CacheKey", "CallTime", "CaptureBy", "CaptureStatsRecord",
    "ConfirmReply", "Confirmation", "Depth", "DiskSlotEntry", "DiskStatsRecord", "Epoch",
    "EvictReply",
    "FinishAbort", "FinishLength",
    "FinishReason", "FinishStop", "Finite", "FlushReply", "GenerateMeta", "GenerateRequest",
    "Hex", "Ids", "ImportReply", "Int64", "Key", "KeyOpReply", "LookupHit", "LookupReply", "ModelInfo",
    "NonNeg", "PinDevice", "PinReply", "Record", "Region", "RestoreMiss", "SamplingParams",
    "SlotCounters", "SlotEntry", "SlotsAborted", "SlotsReply", "SnapshotSpec", "StatsReply",
    "StopReply", "TokenIds", "UnpinReply", "VerifyReply", "WireError", "WorkerHealth", "anchor_key",
    "anchor_keys", "check_secret", "convert", "decode", "encode", "engine_cache_key",
    "from_json", "key_hasher", "parse_cache_key", "parse_ids", "to_json",
]
