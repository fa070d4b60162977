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


def test_keys_resumed_from_a_named_prior_prompt_are_right_whatever_it_is() -> None:
    """A prompt names the one it extends (the splitter's kept turn): keys resumed from it
    equal the wire keys whether it is truly a prefix, a fork or unrelated, and its lineage
    (the depths the prior keyed that this prompt repeats) is exactly those."""
    rng = random.Random(1)
    keys = PrefixKeys(MODEL, max_bytes=400_000)
    base = [rng.randrange(50_000) for _ in range(500)]
    kept: list[tuple[list[int], bytes, list[int]]] = []  # (ids, buf, depths keyed)
    for _ in range(200):
        prior = rng.choice(kept) if kept and rng.random() < 0.9 else None
        if prior is not None and rng.random() < 0.6:  # a later turn
            p = prior[0] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 300))]
        elif prior is not None and rng.random() < 0.5:  # a fork: an edit inside the prior
            p = list(prior[0])
            p[rng.randrange(len(p))] += 1
        else:  # another conversation over the common prefix
            p = base[:rng.randrange(1, 500)] + [rng.randrange(50_000) for _ in range(300)]
        buf = _buf(p)
        prompt = keys.prompt(b"t", b"t", buf, prior[1] if prior is not None else None)
        depths = [rng.randrange(1, len(p) + 1) for _ in range(rng.randrange(1, 6))]
        assert prompt.keys(depths) == anchor_keys(b"t", MODEL, p, depths)
        if prior is not None and any(m.buf is prior[1] for m in keys._scopes[(b"t", b"t")]):
            common = next((i for i, (a, b) in enumerate(zip(p, prior[0], strict=False))
                           if a != b), min(len(p), len(prior[0])))
            assert set(prompt.lineage) == {d for d in prior[2] if d <= common}
        else:
            assert prompt.lineage == ()
        prompt.keep()
        kept.append((p, buf, sorted(set(depths))))
