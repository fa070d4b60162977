"""The planner's incremental prefix keys: equal to `wire.anchor_keys` whatever
prompts came before, scoped per caller namespace, and bounded."""

from __future__ import annotations

import random
from array import array

from anchorcache.proxy.planner import PrefixKeys
from anchorcache.wire import anchor_keys

MODEL = "m"


def _buf(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


def test_keys_equal_the_wire_keys_over_related_prompts() -> None:
    rng = random.Random(0)
    keys = PrefixKeys(MODEL, per_scope=3, max_bytes=200_000)
    base = [rng.randrange(50_000) for _ in range(3000)]
    prompts: list[list[int]] = []
    for _ in range(300):
        if prompts and rng.random() < 0.7:  # a later turn, or a fork, of an earlier prompt
            p = rng.choice(prompts)
            p = p[:rng.randrange(1, len(p) + 1)] + [rng.randrange(50_000)
                                                    for _ in range(rng.randrange(500))]
        else:  # a new conversation over a common instruction prefix
            p = base[:rng.randrange(1, 3000)] + [rng.randrange(50_000)
                                                 for _ in range(rng.randrange(1, 2000))]
        prompts.append(p)
        scope = rng.choice([b"a", b"b"])
        namespace = rng.choice([scope, b"shared"])
        depths = [rng.randrange(1, len(p) + 1) for _ in range(rng.randrange(1, 8))]
        assert keys.keys(scope, namespace, _buf(p), depths) == anchor_keys(namespace, MODEL, p,
                                                                          depths)
    held = sum(len(m.buf) for entries in keys._scopes.values() for m in entries)
    assert held == keys._bytes <= 200_000


def test_a_scope_resumes_only_from_its_own_prompts(monkeypatch) -> None:
    keys = PrefixKeys(MODEL)
    ids = list(range(1000))
    seen: list[list] = []

    def verified(marks, buf, limit):
        seen.append(list(marks))
        return PrefixKeys._verified(marks, buf, limit)

    monkeypatch.setattr(keys, "_verified", verified)
    keys.keys(b"tenant-a", b"shared", _buf(ids), [500, 1000])
    # tenant b keys the same prompt in the same namespace: none of a's states is looked at
    assert keys.keys(b"tenant-b", b"shared", _buf(ids), [1000]) == anchor_keys(
        b"shared", MODEL, ids, [1000])
    assert seen == []
    keys.keys(b"tenant-a", b"shared", _buf(ids), [1000])  # a's own: resumed
    assert len(seen) == 1 and [m.depths for m in seen[0]] == [(500, 1000)]
