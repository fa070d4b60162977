"""Records and key derivation shared by both sides of the worker contract.

Imports neither `anchorcache.proxy` nor `anchorcache.ext` (nor torch): the proxy and the
workers each parse the JSON once at their HTTP edge into these records.

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

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

KEY_BYTES = 16
_PERSON = b"anchorcache.v1"
# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32
# (a 1e-37 temperature turns every logit into ±inf and the softmax into NaN).
GREEDY_TEMPERATURE = 1e-5
_INT64 = (-(1 << 63), (1 << 63) - 1)


class AnchorKind(str, Enum):
    TOOL = "tool"  # the end of a tool schema inside the instruction prefix (the thin region)
    INSTRUCTION = "instruction"
    CONVERSATION = "conversation"
    RESPONSE = "response"


class Region(str, Enum):
    THIN = "thin"  # pinnable tool/instruction anchors
    THICK = "thick"  # conversation and response anchors


def anchor_keys(namespace: bytes, model_id: str, input_ids: Sequence[int] | np.ndarray,
                depths: Iterable[int]) -> dict[int, bytes]:
    """Keys of the prefixes `input_ids[:d]` for every `d` in `depths`, in one pass.

    Raises ValueError for a depth outside `[1, len(input_ids)]`.
    """
    ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64))
    wanted = sorted(set(depths))
    if wanted and (wanted[0] < 1 or wanted[-1] > len(ids)):
        raise ValueError(f"anchor depths {wanted} outside [1, {len(ids)}]")
    h = key_hasher(namespace, model_id)
    buf = ids.tobytes()
    keys: dict[int, bytes] = {}
    done = 0
    for d in wanted:
        h.update(buf[done * 8 : d * 8])
        done = d
        keys[d] = h.copy().digest()
    return keys


def key_hasher(namespace: bytes, model_id: str) -> Any:
    """The BLAKE2b state `anchor_keys` starts from: fed the int64 bytes of a prefix, its
    digest is that prefix's key. A caller that keeps copies at depths it verified resumes
    from them instead of hashing the prefix again (proxy/planner.py)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON)
    model = model_id.encode()
    h.update(len(namespace).to_bytes(4, "little") + namespace)
    h.update(len(model).to_bytes(4, "little") + model)
    return h


def anchor_key(namespace: bytes, model_id: str, input_ids: Sequence[int] | np.ndarray) -> bytes:
    return anchor_keys(namespace, model_id, input_ids, [len(input_ids)])[len(input_ids)]


CACHE_KEY_CHARS = 32


def engine_cache_key(namespace: bytes) -> str:
    """The key that isolates a namespace in a worker's own prefix cache (hex): a digest, so
    the namespace itself (a tenant secret's hash) never leaves the proxy's side in clear."""
    return hashlib.blake2b(namespace, digest_size=CACHE_KEY_CHARS // 2,
                           person=b"ac.engine.key").hexdigest()


def parse_cache_key(value: Any) -> str | None:
    """An engine cache key on the wire: None, or `CACHE_KEY_CHARS` lowercase hex digits."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != CACHE_KEY_CHARS or \
            value.strip("0123456789abcdef"):
        raise WireError(f"'cache_key' must be {CACHE_KEY_CHARS} lowercase hex digits")
    return value


# The secret a proxy and its workers share (`--worker-secret`): every worker call but
# `/health` carries it as `Authorization: Bearer SECRET`; a worker given one refuses the rest.
WORKER_SECRET_ENV = "ANCHORCACHE_WORKER_SECRET"
MIN_SECRET_CHARS = 16


def check_secret(secret: str | None, what: str) -> str | None:
    """`secret` if it is long enough (None passes); ValueError naming `what` otherwise."""
    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the {what} must be at least {MIN_SECRET_CHARS} characters")
    return secret


CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
MAX_SAMPLES = 16  # n: samples per request
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's own sampling-parameter names, so the SGLang worker passes them through.

    At most one constraint field (`json_schema`, `regex`, `ebnf`, `structural_tag`: each a
    string, as SGLang takes them) is set; the worker masks every token the grammar forbids.
    `n` samples start from one prefill; sample i draws from `seed + i` when `seed` is set.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

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

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids), "seed": self.seed,
            "ignore_eos": self.ignore_eos}
        if self.n != 1:
            body["n"] = self.n
        if self.constraint is not None:
            kind, value = self.constraint
            body[kind] = value
        return body


@dataclass(frozen=True)
class AnchorRef:
    """One committed anchor named by its key and depth (a link of a restore chain)."""

    key: bytes
    depth: int
    namespace: bytes | None = None  # when not the plan's: a toolset an admin shared

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key.hex(), "depth": self.depth}
        if self.namespace is not None:
            d["namespace"] = self.namespace.hex()
        return d


@dataclass(frozen=True)
class SnapshotSpec:
    """Snapshot the state at `depth` (a chunk boundary of the prefill) under `kind`."""

    depth: int
    kind: AnchorKind
    region: Region = Region.THICK

    def to_json(self) -> dict[str, Any]:
        return {"depth": self.depth, "kind": self.kind.value, "region": self.region.value}


@dataclass(frozen=True)
class AnchorPlan:
    """The anchor part of a generate request (absent: no anchoring at all).

    `restore` is a root→leaf chain; `snapshot` lists cuts to save during prefill;
    `snapshot_response` saves prompt + generated tokens at the end; `chunk_at` are prefill
    chunk boundaries (the snapshot depths are always boundaries too).
    """

    namespace: bytes
    restore: tuple[AnchorRef, ...] = ()
    snapshot: tuple[SnapshotSpec, ...] = ()
    snapshot_response: bool = False
    chunk_at: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace.hex(),
                "restore": [r.to_json() for r in self.restore],
                "snapshot": [s.to_json() for s in self.snapshot],
                "snapshot_response": self.snapshot_response,
                "chunk_at": list(self.chunk_at)}


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    stream: bool = False
    anchor: AnchorPlan | None = None
    return_logprob: bool = False  # SGLang's names: per-token logprobs of the output
    top_logprobs_num: int = 0  # and the k most likely alternatives at each position
    cache_key: str | None = None  # `engine_cache_key` of the caller's namespace

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": list(self.input_ids),
                                "sampling_params": self.sampling.to_json(),
                                "stream": self.stream}
        if self.cache_key is not None:
            body["cache_key"] = self.cache_key
        if self.return_logprob:
            body["return_logprob"] = True
            body["top_logprobs_num"] = self.top_logprobs_num
        if self.rid is not None:
            body["rid"] = self.rid
        if self.anchor is not None:
            body["anchor"] = self.anchor.to_json()
        return body


@dataclass(frozen=True)
class AnchorWritten:
    """A snapshot the worker wrote into a reserved slot: invisible until confirmed."""

    slot: int
    key: bytes
    depth: int
    parent: bytes | None
    nbytes: int
    kind: AnchorKind

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "key": self.key.hex(), "depth": self.depth,
                "parent": self.parent.hex() if self.parent else None, "nbytes": self.nbytes,
                "kind": self.kind.value}


@dataclass(frozen=True)
class AnchorHeld(AnchorWritten):
    """A snapshot the worker skipped because it already holds that prefix committed: reported
    (`meta_info.anchors.held`) so a proxy that forgot it (restart, lost confirm) learns it
    again; it needs no confirm."""


class WireError(ValueError):
    """A record on the wire is malformed (the receiving side answers 400)."""


# ---- parsing at the worker's HTTP edge (raises WireError → 400) -----------------------------

def _int(obj: dict[str, Any], name: str, default: int | None = None, *, lo: int | None = None) -> int:
    value = obj.get(name, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"'{name}' must be an integer")
    if lo is not None and value < lo:
        raise WireError(f"'{name}' must be >= {lo}")
    return value


def _float(obj: dict[str, Any], name: str, default: float) -> float:
    value = obj.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError(f"'{name}' must be a number")
    value = float(value)
    if not math.isfinite(value):
        raise WireError(f"'{name}' must be finite")
    return value


def parse_ids(value: Any, name: str) -> tuple[int, ...]:
    """A JSON list of 64-bit integers (token ids, depths), else WireError."""
    lo, hi = _INT64
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and lo <= t <= hi for t in value):
        raise WireError(f"'{name}' must be a list of 64-bit integers")
    return tuple(value)


_ids = parse_ids


def _hex(value: Any, name: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except (TypeError, ValueError):
        raise WireError(f"'{name}' must be a hex string") from None


def parse_sampling(obj: Any) -> SamplingParams:
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise WireError("'sampling_params' must be an object")
    seed = obj.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not _INT64[0] <= seed <= _INT64[1]):
        raise WireError("'seed' must be a 64-bit integer")
    temperature = _float(obj, "temperature", 1.0)
    params = SamplingParams(
        max_new_tokens=_int(obj, "max_new_tokens", 128, lo=0),
        # normalised, so that the sampler never divides by a near-zero temperature
        temperature=0.0 if 0 <= temperature < GREEDY_TEMPERATURE else temperature,
        top_p=_float(obj, "top_p", 1.0),
        top_k=_int(obj, "top_k", -1),
        stop_token_ids=_ids(obj.get("stop_token_ids") or [], "stop_token_ids"),
        seed=seed,
        ignore_eos=bool(obj.get("ignore_eos", False)),
        n=_int(obj, "n", 1, lo=1),
        **_constraint(obj),
    )
    if params.n > MAX_SAMPLES:
        raise WireError(f"'n' must be <= {MAX_SAMPLES}")
    if params.temperature < 0:
        raise WireError("'temperature' must be >= 0")
    if not 0 < params.top_p <= 1:
        raise WireError("'top_p' must be in (0, 1]")
    if params.top_k == 0 or params.top_k < -1:
        raise WireError("'top_k' must be -1 or >= 1")
    return params


def _constraint(obj: dict[str, Any]) -> dict[str, str]:
    given = {k: obj[k] for k in CONSTRAINT_KINDS if obj.get(k) is not None}
    if len(given) > 1:
        raise WireError(f"at most one of {', '.join(CONSTRAINT_KINDS)} may be set")
    for kind, value in given.items():
        if not isinstance(value, str) or not value:
            raise WireError(f"'{kind}' must be a non-empty string")
    return given


def parse_anchor_plan(obj: Any) -> AnchorPlan | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise WireError("'anchor' must be an object")
    restore = []
    for link in obj.get("restore") or []:
        if not isinstance(link, dict):
            raise WireError("'anchor.restore' must be a list of {key, depth}")
        ns = link.get("namespace")
        restore.append(AnchorRef(_hex(link.get("key"), "key"), _int(link, "depth", lo=1),
                                 _hex(ns, "namespace") if ns is not None else None))
    snapshot = []
    for spec in obj.get("snapshot") or []:
        if not isinstance(spec, dict):
            raise WireError("'anchor.snapshot' must be a list of {depth, kind, region}")
        try:
            kind = AnchorKind(spec.get("kind", "conversation"))
            region = Region(spec.get("region", "thick"))
        except ValueError as e:
            raise WireError(str(e)) from None
        snapshot.append(SnapshotSpec(_int(spec, "depth", lo=1), kind, region))
    chunk_at = obj.get("chunk_at") or []
    return AnchorPlan(
        namespace=_hex(obj.get("namespace", ""), "namespace"),
        restore=tuple(restore),
        snapshot=tuple(snapshot),
        snapshot_response=bool(obj.get("snapshot_response", False)),
        chunk_at=_ids(chunk_at, "chunk_at"),
    )


def parse_generate(obj: Any) -> GenerateRequest:
    if not isinstance(obj, dict):
        raise WireError("request body must be a JSON object")
    ids = _ids(obj.get("input_ids"), "input_ids")
    if not ids:
        raise WireError("'input_ids' must not be empty")
    rid = obj.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise WireError("'rid' must be a string")
    plan = parse_anchor_plan(obj.get("anchor"))
    if plan is not None:
        depths = [r.depth for r in plan.restore] + [s.depth for s in plan.snapshot] + list(plan.chunk_at)
        if any(d > len(ids) for d in depths):
            raise WireError("an anchor depth exceeds the prompt length")
    top = _int(obj, "top_logprobs_num", 0, lo=0)
    if top > MAX_TOP_LOGPROBS:
        raise WireError(f"'top_logprobs_num' must be <= {MAX_TOP_LOGPROBS}")
    return GenerateRequest(input_ids=ids, sampling=parse_sampling(obj.get("sampling_params")),
                           rid=rid, stream=bool(obj.get("stream", False)), anchor=plan,
                           return_logprob=bool(obj.get("return_logprob", False)),
                           top_logprobs_num=top, cache_key=parse_cache_key(obj.get("cache_key")))


# ---- the reply half: parsed once at the proxy's edge (raises WireError) ------------------

def _key(value: Any, name: str) -> bytes:
    key = _hex(value, name)
    if len(key) != KEY_BYTES:
        raise WireError(f"'{name}' must be {KEY_BYTES} bytes of hex")
    return key


def _obj(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"'{name}' must be an object")
    return value


def _list(value: Any, name: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise WireError(f"'{name}' must be a list")
    return value


def _bool(obj: dict[str, Any], name: str, default: bool = False) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        raise WireError(f"'{name}' must be a boolean")
    return value


def _str(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise WireError(f"'{name}' must be a string")
    return value


def _epoch(obj: dict[str, Any]) -> str:
    epoch = obj.get("epoch")
    if not isinstance(epoch, str) or not epoch:
        raise WireError("'epoch' must be a non-empty string")
    return epoch


@dataclass(frozen=True)
class AnchorHit:
    """A link the worker restored."""

    key: bytes
    depth: int
    kind: AnchorKind

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key.hex(), "depth": self.depth, "kind": self.kind.value}


@dataclass(frozen=True)
class RestoreMiss:
    """A planned link the worker refused, and why (key_mismatch, not_resident, ...)."""

    key: bytes
    depth: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key.hex(), "depth": self.depth, "reason": self.reason}


@dataclass(frozen=True)
class AnchorReport:
    """`meta_info.anchors`: what one generate request restored, missed, wrote and found held."""

    restored: tuple[AnchorHit, ...] = ()
    restore_miss: tuple[RestoreMiss, ...] = ()
    written: tuple[AnchorWritten, ...] = ()
    held: tuple[AnchorHeld, ...] = ()
    late_lookup: bool = False  # the restored chain came from the late lookup, not the plan
    restored_tokens: int = 0  # of `cached_tokens`, those copied from host slabs

    def to_json(self) -> dict[str, Any]:
        return {"restored": [h.to_json() for h in self.restored],
                "restore_miss": [m.to_json() for m in self.restore_miss],
                "written": [w.to_json() for w in self.written],
                "held": [h.to_json() for h in self.held],
                "late_lookup": self.late_lookup, "restored_tokens": self.restored_tokens}


def _kind(value: Any) -> AnchorKind:
    try:
        return AnchorKind(value)
    except ValueError:
        raise WireError(f"unknown anchor kind {value!r}") from None


def _entry(obj: Any, name: str, cls: type[AnchorWritten]) -> AnchorWritten:
    d = _obj(obj, name)
    parent = d.get("parent")
    return cls(slot=_int(d, "slot", lo=0), key=_key(d.get("key"), "key"), depth=_int(d, "depth", lo=1),
               parent=_key(parent, "parent") if parent else None, nbytes=_int(d, "nbytes", lo=0),
               kind=_kind(d.get("kind")))


def parse_anchor_report(obj: Any) -> AnchorReport:
    d = _obj(obj if obj is not None else {}, "anchors")
    restored = tuple(AnchorHit(_key(_obj(h, "restored").get("key"), "key"), _int(h, "depth", lo=1),
                               _kind(h.get("kind", "conversation")))
                     for h in _list(d.get("restored"), "restored"))
    misses = tuple(RestoreMiss(_key(_obj(m, "restore_miss").get("key"), "key"),
                               _int(m, "depth", lo=1), str(m.get("reason", "")))
                   for m in _list(d.get("restore_miss"), "restore_miss"))
    written = tuple(_entry(w, "written", AnchorWritten) for w in _list(d.get("written"), "written"))
    held = tuple(_entry(h, "held", AnchorHeld) for h in _list(d.get("held"), "held"))
    return AnchorReport(restored, misses, written, held,  # type: ignore[arg-type]
                        late_lookup=_bool(d, "late_lookup"),
                        restored_tokens=_int(d, "restored_tokens", 0, lo=0))


@dataclass(frozen=True)
class GenerateMeta:
    """`meta_info` of a finished generate request (of one sample when n > 1)."""

    epoch: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_tokens: int
    finish_type: str  # stop | length | abort
    anchors: AnchorReport = AnchorReport()
    restore_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    snapshot_ms: float | None = None  # writing this request's anchors; absent: not timed
    rid: str = ""  # `id`: the request's id
    matched: int | None = None  # finish stop: the stop token (SGLang: None for a stop string)
    index: int | None = None  # the sample, when the request asked for n > 1

    def finish_reason(self) -> dict[str, Any]:
        if self.finish_type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.finish_type == "length":
            return {"type": "length", "length": self.completion_tokens}
        return {"type": self.finish_type}

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.rid, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "prefill_tokens": self.prefill_tokens, "restore_ms": self.restore_ms,
            "prefill_ms": self.prefill_ms, "decode_ms": self.decode_ms,
            "finish_reason": self.finish_reason(), "anchors": self.anchors.to_json(),
            "epoch": self.epoch}
        if self.snapshot_ms is not None:
            d["snapshot_ms"] = self.snapshot_ms
        if self.index is not None:
            d["index"] = self.index
        return d


def parse_generate_meta(obj: Any) -> GenerateMeta:
    d = _obj(obj, "meta_info")
    finish = d.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else None
    if finish_type not in ("stop", "length", "abort"):
        raise WireError(f"'finish_reason.type' must be stop, length or abort, not {finish_type!r}")
    assert isinstance(finish, dict)
    matched = finish.get("matched")
    prompt = _int(d, "prompt_tokens", lo=0)
    cached = _int(d, "cached_tokens", 0, lo=0)
    return GenerateMeta(
        epoch=_epoch(d), prompt_tokens=prompt, completion_tokens=_int(d, "completion_tokens", 0, lo=0),
        cached_tokens=cached, prefill_tokens=_int(d, "prefill_tokens", prompt - cached, lo=0),
        finish_type=finish_type, anchors=parse_anchor_report(d.get("anchors")),
        restore_ms=_float(d, "restore_ms", 0.0), prefill_ms=_float(d, "prefill_ms", 0.0),
        decode_ms=_float(d, "decode_ms", 0.0),
        snapshot_ms=_float(d, "snapshot_ms", 0.0) if "snapshot_ms" in d else None,
        rid=str(d.get("id", "")), matched=_int(finish, "matched", lo=0) if matched is not None else None,
        index=_int(d, "index", lo=0) if "index" in d else None)


@dataclass(frozen=True)
class ConfirmReply:
    """`/anchor/confirm`: the staged anchors made visible, and the keys their victims had."""

    confirmed: tuple[int, ...]
    evicted: tuple[bytes, ...]
    epoch: str

    def to_json(self) -> dict[str, Any]:
        return {"confirmed": list(self.confirmed), "evicted": [k.hex() for k in self.evicted],
                "epoch": self.epoch}


def parse_confirm(obj: Any) -> ConfirmReply:
    d = _obj(obj, "confirm reply")
    return ConfirmReply(_ids(d.get("confirmed", []), "confirmed"),
                        tuple(_key(k, "evicted") for k in _list(d.get("evicted"), "evicted")),
                        _epoch(d))


@dataclass(frozen=True)
class SlotEntry:
    """One row of `/anchor/slots`: a committed anchor or a pending reservation."""

    slot: int
    key: bytes
    depth: int
    parent: bytes | None
    nbytes: int
    pinned: bool
    hits: int
    last_use: int
    state: str  # committed | reserved
    tier: str = "host"  # where its slab is: host (a slot's slab in memory)

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "key": self.key.hex(), "depth": self.depth,
                "parent": self.parent.hex() if self.parent else None, "nbytes": self.nbytes,
                "pinned": self.pinned, "hits": self.hits, "last_use": self.last_use,
                "state": self.state, "tier": self.tier}


@dataclass(frozen=True)
class DiskSlotEntry:
    """An anchor the worker's disk tier holds and its memory does not (tier `disk`): no
    slot; a restore or a late lookup that names it loads it (docs/disk-tier.md)."""

    key: bytes
    depth: int
    parent: bytes | None
    nbytes: int
    pinned: bool

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key.hex(), "depth": self.depth,
                "parent": self.parent.hex() if self.parent else None, "nbytes": self.nbytes,
                "pinned": self.pinned, "tier": "disk"}


@dataclass(frozen=True)
class SlotsReply:
    slots: tuple[SlotEntry, ...]
    epoch: str
    disk: tuple[DiskSlotEntry, ...] = ()  # on disk only (not in `slots`)

    def to_json(self) -> dict[str, Any]:
        return {"slots": [s.to_json() for s in self.slots],
                "disk": [d.to_json() for d in self.disk], "epoch": self.epoch}


def parse_slots(obj: Any) -> SlotsReply:
    d = _obj(obj, "slots reply")
    out = []
    for s in _list(d.get("slots"), "slots"):
        s = _obj(s, "slots[]")
        parent = s.get("parent")
        state = s.get("state")
        if state not in ("committed", "reserved"):
            raise WireError(f"slot state must be committed or reserved, not {state!r}")
        out.append(SlotEntry(_int(s, "slot", lo=0), _key(s.get("key"), "key"), _int(s, "depth", lo=1),
                             _key(parent, "parent") if parent else None, _int(s, "nbytes", lo=0),
                             bool(s.get("pinned")), _int(s, "hits", 0, lo=0),
                             _int(s, "last_use", 0), state, str(s.get("tier", "host"))))
    disk = []
    for e in _list(d.get("disk", []), "disk"):
        e = _obj(e, "disk[]")
        parent = e.get("parent")
        disk.append(DiskSlotEntry(_key(e.get("key"), "key"), _int(e, "depth", lo=1),
                                  _key(parent, "parent") if parent else None,
                                  _int(e, "nbytes", lo=0), bool(e.get("pinned"))))
    return SlotsReply(tuple(out), _epoch(d), tuple(disk))


@dataclass(frozen=True)
class WorkerHealth:
    status: str
    epoch: str
    running_requests: tuple[str, ...] = ()
    queued_requests: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "epoch": self.epoch,
                "running_requests": list(self.running_requests),
                "queued_requests": list(self.queued_requests)}


def parse_health(obj: Any) -> WorkerHealth:
    d = _obj(obj, "health reply")
    return WorkerHealth(str(d.get("status", "")), _epoch(d),
                        tuple(str(r) for r in _list(d.get("running_requests"), "running_requests")),
                        tuple(str(r) for r in _list(d.get("queued_requests"), "queued_requests")))


@dataclass(frozen=True)
class AbortReply:
    """`/abort_request`: whether the request ran or held unconfirmed anchors (now dropped)."""

    rid: str
    aborted: bool
    epoch: str

    def to_json(self) -> dict[str, Any]:
        return {"rid": self.rid, "aborted": self.aborted, "epoch": self.epoch}


def parse_abort(obj: Any) -> AbortReply:
    d = _obj(obj, "abort reply")
    return AbortReply(_str(d, "rid"), _bool(d, "aborted"), _epoch(d))


@dataclass(frozen=True)
class StopReply:
    """`/stop_request`: whether the request was still running and now ends as a stop."""

    rid: str
    stopped: bool
    epoch: str

    def to_json(self) -> dict[str, Any]:
        return {"rid": self.rid, "stopped": self.stopped, "epoch": self.epoch}


def parse_stop(obj: Any) -> StopReply:
    d = _obj(obj, "stop reply")
    return StopReply(_str(d, "rid"), _bool(d, "stopped"), _epoch(d))


@dataclass(frozen=True)
class SlotsAborted:
    """`/anchor/abort`: the staged anchors dropped (their victims survive)."""

    aborted: tuple[int, ...]
    epoch: str

    def to_json(self) -> dict[str, Any]:
        return {"aborted": list(self.aborted), "epoch": self.epoch}


def parse_slots_aborted(obj: Any) -> SlotsAborted:
    d = _obj(obj, "anchor abort reply")
    return SlotsAborted(_ids(d.get("aborted", []), "aborted"), _epoch(d))


@dataclass(frozen=True)
class LookupHit:
    depth: int
    key: bytes
    committed: bool

    def to_json(self) -> dict[str, Any]:
        return {"depth": self.depth, "key": self.key.hex(), "committed": self.committed}


@dataclass(frozen=True)
class LookupReply:
    """`/anchor/lookup`: for each depth asked, the prefix's key and whether it is committed."""

    hits: tuple[LookupHit, ...]
    epoch: str

    def to_json(self) -> dict[str, Any]:
        return {"hits": [h.to_json() for h in self.hits], "epoch": self.epoch}


def parse_lookup(obj: Any) -> LookupReply:
    d = _obj(obj, "lookup reply")
    hits = tuple(LookupHit(_int(h, "depth", lo=1), _key(h.get("key"), "key"), _bool(h, "committed"))
                 for h in (_obj(h, "hits[]") for h in _list(d.get("hits"), "hits")))
    return LookupReply(hits, _epoch(d))


STATS_COUNTERS = ("num_slots", "used_slots", "reserved_slots", "free_slots", "bytes_used",
                  "bytes_reserved", "bytes_capacity", "hits", "misses", "stale_evictions",
                  "reservations", "confirms", "aborts", "evictions")


@dataclass(frozen=True)
class CallTime:
    """The scheduler's own time in one kind of anchor work (SGLang: an RPC op, or
    `snapshot` for the copies a checkpoint makes): what it costs every running request."""

    op: str
    calls: int
    total_ms: float
    max_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "calls": self.calls, "total_ms": round(self.total_ms, 3),
                "max_ms": round(self.max_ms, 3)}


@dataclass(frozen=True)
class DiskStatsRecord:
    """The disk tier's figures in `/anchor/stats` (`disk`; null without a disk tier)."""

    enabled: bool  # false once a full or read-only disk turned it off
    bytes: int
    files: int
    budget_bytes: int
    writes: int
    loads: int
    skips: int  # files refused (truncated, bad checksum, other model/version/TP) and quarantined
    evictions: int
    imports: int = 0  # files another worker wrote into a shared directory, found on a miss


@dataclass(frozen=True)
class StatsReply:
    """`/anchor/stats`: the slot table's counters (`STATS_COUNTERS`, ext/slots.py's
    SlotStats), the staged anchors, and what pins lock on the device (SGLang; 0 on a worker
    without a device tier)."""

    counters: tuple[tuple[str, int], ...]  # (name, value) in STATS_COUNTERS' order
    staged: int
    epoch: str
    device_pinned_tokens: int = 0
    device_pin_budget_tokens: int = 0
    scheduler_calls: tuple[CallTime, ...] = ()  # a worker with a scheduler loop (SGLang)
    disk: DiskStatsRecord | None = None  # the disk tier's figures, when it has one

    @classmethod
    def of(cls, counters: dict[str, int], staged: int, epoch: str, **device: int) -> StatsReply:
        return cls(tuple((name, int(counters[name])) for name in STATS_COUNTERS), staged, epoch,
                   **{k: int(v) for k, v in device.items()})  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        return {**dict(self.counters), "staged": self.staged,
                "device_pinned_tokens": self.device_pinned_tokens,
                "device_pin_budget_tokens": self.device_pin_budget_tokens,
                "scheduler_calls": [c.to_json() for c in self.scheduler_calls],
                "disk": asdict(self.disk) if self.disk is not None else None,
                "epoch": self.epoch}


def parse_stats(obj: Any) -> StatsReply:
    d = _obj(obj, "stats reply")
    calls = tuple(CallTime(str(c.get("op")), _int(c, "calls", lo=0),
                           float(c.get("total_ms", 0.0)), float(c.get("max_ms", 0.0)))
                  for c in (_obj(c, "scheduler_calls[]")
                            for c in _list(d.get("scheduler_calls", []), "scheduler_calls")))
    reply = StatsReply.of({name: _int(d, name, lo=0) for name in STATS_COUNTERS},
                          _int(d, "staged", lo=0), _epoch(d),
                          **{name: _int(d, name, 0, lo=0) for name in (
                              "device_pinned_tokens", "device_pin_budget_tokens")})
    disk = None
    if d.get("disk") is not None:
        dd = _obj(d["disk"], "disk")
        disk = DiskStatsRecord(bool(dd.get("enabled")), **{name: _int(dd, name, lo=0) for name in (
            "bytes", "files", "budget_bytes", "writes", "loads", "skips", "evictions")},
            imports=_int(dd, "imports", 0, lo=0))
    return replace(reply, scheduler_calls=calls, disk=disk)


PIN_DEVICE = ("none", "locked", "over_budget", "no_device_space", "no_tokens", "unsupported")


@dataclass(frozen=True)
class KeyOpReply:
    """`/anchor/pin`, `/anchor/unpin`, `/anchor/evict`: whether the key's anchor changed.
    A pin also says what happened on the device (`PIN_DEVICE`; `none` where nothing was
    locked there: not pinned, or a worker without a device tier)."""

    op: str  # pinned | unpinned | evicted
    done: bool
    epoch: str
    device: str | None = None  # pins only

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {self.op: self.done}
        if self.op == "pinned":
            d["device"] = self.device or "none"
        d["epoch"] = self.epoch
        return d


def parse_key_op(obj: Any, op: str) -> KeyOpReply:
    """The reply of the key operation whose field is `op` (pinned, unpinned or evicted)."""
    d = _obj(obj, f"{op} reply")
    device = None
    if op == "pinned":
        device = d.get("device", "none")
        if device not in PIN_DEVICE:
            raise WireError(f"'device' must be one of {', '.join(PIN_DEVICE)}, not {device!r}")
    return KeyOpReply(op, _bool(d, op), _epoch(d), device)


@dataclass(frozen=True)
class FlushReply:
    """`/anchor/flush` and `/flush_cache`: anchors dropped; `flushed_device`: the worker's
    own device prefix cache was flushed instead (SGLang's `/flush_cache`)."""

    flushed_anchors: int
    epoch: str
    flushed_device: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"flushed_anchors": self.flushed_anchors, "flushed_device": self.flushed_device,
                "epoch": self.epoch}


def parse_flush(obj: Any) -> FlushReply:
    d = _obj(obj, "flush reply")
    return FlushReply(_int(d, "flushed_anchors", lo=0), _epoch(d), _bool(d, "flushed_device"))


@dataclass(frozen=True)
class ModelInfo:
    """`/model_info`. `vocab_size`: every input id must be below it; `max_context_tokens`:
    prompt + completion of one request."""

    model_id: str
    model_path: str
    tokenizer_path: str
    architecture: str
    max_context_tokens: int
    eos_token_ids: tuple[int, ...]
    hybrid: bool
    vocab_size: int
    backend: str  # embedded | sglang
    epoch: str = ""
    # a server of several workers (SGLang's data-parallel ranks): the paths, under this URL,
    # of each one's contract (`dp/0`, ...); empty: this URL is itself the worker
    ranks: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = {"model_id": self.model_id, "model_path": self.model_path,
               "tokenizer_path": self.tokenizer_path, "is_generation": True,
               "architecture": self.architecture, "max_context_tokens": self.max_context_tokens,
               "eos_token_ids": list(self.eos_token_ids), "hybrid": self.hybrid,
               "vocab_size": self.vocab_size, "backend": self.backend, "epoch": self.epoch}
        if self.ranks:
            out["ranks"] = list(self.ranks)
        return out


def parse_model_info(obj: Any) -> ModelInfo:
    d = _obj(obj, "model_info reply")
    return ModelInfo(_str(d, "model_id"), _str(d, "model_path"), _str(d, "tokenizer_path"),
                     _str(d, "architecture"), _int(d, "max_context_tokens", lo=1),
                     _ids(d.get("eos_token_ids", []), "eos_token_ids"), _bool(d, "hybrid"),
                     _int(d, "vocab_size", lo=0), _str(d, "backend"), _epoch(d),
                     parse_ranks(d.get("ranks", [])))


def parse_ranks(value: Any) -> tuple[str, ...]:
    """`/model_info`'s `ranks`: relative paths (no scheme, no `..`, no leading slash)."""
    if not isinstance(value, list) or not all(
            isinstance(r, str) and r and not r.startswith("/") and ":" not in r
            and ".." not in r.split("/") for r in value):
        raise WireError("model_info reply: 'ranks' must be a list of relative paths")
    return tuple(value)


@dataclass(frozen=True)
class VerifyReply:
    """`/anchor/verify` (SGLang, a diagnostic): the device rows of a committed anchor's prefix
    against its host slabs; `mismatch`: the first differing token position, or None. On a
    hybrid model `state_equal` compares the recurrent state the tree holds at the anchor's
    depth with the anchor's state slab (None: no state there, or a dense model)."""

    key: bytes
    depth: int
    device_tokens: int
    mismatch: int | None
    epoch: str
    state_equal: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key.hex(), "depth": self.depth, "device_tokens": self.device_tokens,
                "mismatch": self.mismatch, "epoch": self.epoch, "state_equal": self.state_equal}


def parse_verify(obj: Any) -> VerifyReply:
    d = _obj(obj, "verify reply")
    mismatch = d.get("mismatch")
    return VerifyReply(_key(d.get("key"), "key"), _int(d, "depth", lo=1),
                       _int(d, "device_tokens", lo=0),
                       _int(d, "mismatch", lo=0) if mismatch is not None else None, _epoch(d),
                       None if d.get("state_equal") is None else _bool(d, "state_equal"))
