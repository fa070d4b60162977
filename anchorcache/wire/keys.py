"""Anchor keys, engine cache keys and the worker secret: what both sides of the contract
derive or check the same way (see the package docstring)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import msgspec
import numpy as np

from .codec import KEY_BYTES, convert

_PERSON = b"anchorcache.v1"
CACHE_KEY_CHARS = 32
# an engine cache key on the wire: `CACHE_KEY_CHARS` lowercase hex digits
CacheKey = Annotated[str, msgspec.Meta(pattern=f"^[0-9a-f]{{{CACHE_KEY_CHARS}}}$")]


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


def engine_cache_key(namespace: bytes) -> str:
    """The key that isolates a namespace in a worker's own prefix cache (hex): a digest, so
    the namespace itself (a tenant secret's hash) never leaves the proxy's side in clear."""
    return hashlib.blake2b(namespace, digest_size=CACHE_KEY_CHARS // 2,
                           person=b"ac.engine.key").hexdigest()


def parse_cache_key(value: Any) -> str | None:
    """An engine cache key on the wire (`CacheKey`, or null), else WireError."""
    key: str | None = convert(CacheKey | None, value, "cache_key")
    return key


# The secret a proxy and its workers share (`--worker-secret`): every worker call but
# `/health` carries it as `Authorization: Bearer SECRET`; a worker given one refuses the rest.
WORKER_SECRET_ENV = "ANCHORCACHE_WORKER_SECRET"
MIN_SECRET_CHARS = 16


def check_secret(secret: str | None, what: str) -> str | None:
    """`secret` if it is long enough (None passes); ValueError naming `what` otherwise."""
    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the {what} must be at least {MIN_SECRET_CHARS} characters")
    return secret
