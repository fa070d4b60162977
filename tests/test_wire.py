"""The contract's records and their one codec (anchorcache/wire/): every record reads back
what it writes; anything malformed, at every entry point, is a WireError (a 400 at a worker,
a `worker_error` at the proxy) naming the field, never another exception."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anchorcache import wire
from anchorcache.wire.codec import HexRecord, _hex_fields

K1, K2 = bytes(range(16)), bytes(range(16, 32))
EP = "0123456789abcdef"

SAMPLES: list[wire.Record] = [
    wire.GenerateRequest((1, 2, 3), wire.SamplingParams(max_new_tokens=4, temperature=0.5,
                                                        stop_token_ids=(2,), seed=7, n=2,
                                                        regex="[a-z]+"),
                         rid="r", anchor=wire.AnchorPlan(
                             b"ns", restore=(wire.AnchorRef(K1, 2, b"shared"),),
                             snapshot=(wire.SnapshotSpec(3, wire.AnchorKind.TOOL,
                                                         wire.Region.THIN),),
                             snapshot_response=True, chunk_at=(2, 3)),
                         return_logprob=True, top_logprobs_num=3,
                         cache_key=wire.engine_cache_key(b"ns")),
    wire.GenerateRequest((5,)),
    wire.GenerateMeta(EP, 10, 2, 4, 6, wire.FinishStop(2), wire.AnchorReport(
        restored=(wire.AnchorHit(K1, 4, wire.AnchorKind.INSTRUCTION),),
        restore_miss=(wire.RestoreMiss(K2, 8, "not_resident"),),
        written=(wire.AnchorWritten(3, K2, 8, K1, 100, wire.AnchorKind.CONVERSATION),),
        held=(wire.AnchorHeld(1, K1, 4, None, 50, wire.AnchorKind.INSTRUCTION),),
        late_lookup=True, restored_tokens=4), 1.5, 2.0, 3.0, snapshot_ms=0.5, rid="r",
        index=1),
    wire.GenerateMeta(EP, 10, 7, 0, 10, wire.FinishLength(7), wire.AnchorReport(), 0.0, 1.0,
                      2.0),
    wire.GenerateMeta(EP, 10, 0, 0, 10, wire.FinishAbort(), wire.AnchorReport(), 0.0, 0.0, 0.0),
    wire.WorkerHealth("ok", EP, ("a",), ("b",)),
    wire.ModelInfo("m", "/p", "/t", "Qwen3ForCausalLM", 4096, (2,), True, 1000, "sglang", EP,
                   ("dp/0", "dp/1")),
    wire.AbortReply("r", True, EP),
    wire.StopReply("r", False, EP),
    wire.ConfirmReply((1, 2), (K1,), EP),
    wire.SlotsAborted((3,), EP),
    wire.LookupReply((wire.LookupHit(4, K1, True),), EP),
    wire.SlotsReply((wire.SlotEntry(0, K1, 4, None, 10, True, 2, 7, "committed"),), EP,
                    (wire.DiskSlotEntry(K2, 8, K1, 20, False),)),
    wire.StatsReply(*range(14), staged=1, epoch=EP, device_pinned_tokens=64,
                    device_pin_budget_tokens=128,
                    scheduler_calls=(wire.CallTime("restore", 3, 1.5, 0.75),),
                    disk=wire.DiskStatsRecord(True, 1, 2, 3, 4, 5, 6, 7, imports=8)),
    wire.PinReply(True, EP, "locked"),
    wire.UnpinReply(False, EP),
    wire.EvictReply(True, EP),
    wire.FlushReply(3, EP, flushed_device=True),
    wire.VerifyReply(K1, 4, 4, None, EP, state_equal=True),
]


def _classes(base: type) -> list[type]:
    out = []
    for sub in base.__subclasses__():
        out += [sub, *_classes(sub)]
    return out


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_reads_back_what_it_writes(record: wire.Record) -> None:
    body = record.to_json()
    assert wire.from_json(type(record), body) == record
    assert wire.decode(wire.encode(record), type(record)) == record
    assert orjson.loads(wire.encode(record)) == body  # JSON text and object agree
    assert orjson.loads(orjson.dumps(body)) == body  # plain JSON: lists, strings, numbers


def test_keys_are_hex_and_enums_their_values() -> None:
    body = SAMPLES[0].to_json()
    assert body["anchor"]["namespace"] == b"ns".hex()
    assert body["anchor"]["restore"] == [{"key": K1.hex(), "depth": 2,
                                          "namespace": b"shared".hex()}]
    assert body["anchor"]["snapshot"] == [{"depth": 3, "kind": "tool", "region": "thin"}]
    meta = SAMPLES[2].to_json()
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert meta["id"] == "r" and meta["anchors"]["written"][0]["parent"] == K1.hex()
    assert SAMPLES[3].to_json()["finish_reason"] == {"type": "length", "length": 7}
    assert "index" not in SAMPLES[3].to_json() and "snapshot_ms" not in SAMPLES[3].to_json()


def test_every_record_with_hex_fields_turns_bytes_into_hex() -> None:
    """msgspec writes plain bytes as base64: a record with a key field must be a HexRecord,
    which makes them `Hex` (written as hex) however it was built."""
    for cls in _classes(wire.Record):
        if _hex_fields(cls):
            assert issubclass(cls, HexRecord), cls
    ref = wire.AnchorRef(bytearray(K1), 3)  # any bytes-like value
    assert isinstance(ref.key, wire.Key) and ref.to_json()["key"] == K1.hex()
    assert ref.key == K1 and hash(ref.key) == hash(K1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=300),
       st.lists(st.integers(0, 1 << 40), max_size=5))
def test_token_ids_are_the_tuple_they_hold(ids: list[int], more: list[int]) -> None:
    """`TokenIds` (a prompt's ids as int64 bytes) is written, keyed, sliced and compared as
    the tuple of the same ints: a request built from one is byte for byte the same body."""
    t = wire.TokenIds.of(ids)
    as_tuple = tuple(ids)
    assert t == as_tuple and as_tuple == t and t == ids and hash(t) == hash(as_tuple)
    assert t != as_tuple[:-1] and t != (*as_tuple[:-1], as_tuple[-1] ^ 1)
    assert len(t) == len(ids) and list(t) == ids and t[-1] == ids[-1]
    assert t[1:-1] == as_tuple[1:-1] and type(t[:2]) is tuple
    assert t + tuple(more) == as_tuple + tuple(more) and (t + ()) is t
    body = wire.GenerateRequest(input_ids=t, rid="r")  # type: ignore[arg-type]
    assert wire.encode(body) == wire.encode(wire.GenerateRequest(input_ids=as_tuple, rid="r"))
    assert wire.decode(wire.encode(body), wire.GenerateRequest).input_ids == as_tuple
    depths = sorted({1, len(ids)})
    assert wire.anchor_keys(b"ns", "m", t, depths) == wire.anchor_keys(b"ns", "m", as_tuple, depths)
    with pytest.raises(ValueError):
        wire.TokenIds(b"1234567")  # not whole int64s


def test_sampling_rules() -> None:
    assert wire.SamplingParams(temperature=1e-7).temperature == 0.0  # greedy, never divided by
    assert wire.from_json(wire.SamplingParams, {"temperature": 5e-324}).greedy
    with pytest.raises(wire.WireError, match="top_k"):
        wire.from_json(wire.SamplingParams, {"top_k": 0})
    with pytest.raises(wire.WireError, match="at most one"):
        wire.from_json(wire.SamplingParams, {"regex": "a", "ebnf": "b"})
    with pytest.raises(wire.WireError, match="exceeds the prompt"):
        wire.from_json(wire.GenerateRequest, {"input_ids": [1, 2], "anchor": {
            "namespace": "00", "snapshot": [{"depth": 3}]}})


@pytest.mark.parametrize(("cls", "body", "field"), [
    (wire.GenerateRequest, {"input_ids": []}, "input_ids"),
    (wire.GenerateRequest, {"input_ids": [1 << 63]}, "input_ids[0]"),
    (wire.GenerateRequest, {"input_ids": [1, True]}, "input_ids[1]"),
    (wire.GenerateRequest, {"input_ids": [1], "sampling_params": {"top_p": 1.5}},
     "sampling_params.top_p"),
    (wire.GenerateRequest, {"input_ids": [1], "sampling_params": {"n": 17}}, "sampling_params.n"),
    (wire.GenerateRequest, {"input_ids": [1], "cache_key": "tenant-a"}, "cache_key"),
    (wire.GenerateRequest, {"input_ids": [1], "anchor": {"restore": [{"key": "00", "depth": 1}]}},
     "anchor.restore[0].key"),
    (wire.GenerateRequest, {"input_ids": [1], "anchor": {"snapshot": [{"depth": 1, "kind": "x"}]}},
     "anchor.snapshot[0].kind"),
    (wire.GenerateMeta, {**SAMPLES[3].to_json(), "finish_reason": {"type": "done"}},
     "finish_reason.type"),
    (wire.GenerateMeta, {**SAMPLES[3].to_json(), "epoch": ""}, "epoch"),
    (wire.ModelInfo, {**SAMPLES[6].to_json(), "ranks": ["../x"]}, "ranks[0]"),
    (wire.PinReply, {"pinned": True, "epoch": EP, "device": "maybe"}, "device"),
    (wire.SlotsReply, {"slots": [{**SAMPLES[12].to_json()["slots"][0], "state": "gone"}],
                       "epoch": EP}, "slots[0].state"),
])
def test_a_malformed_field_is_named(cls: type, body: Any, field: str) -> None:
    with pytest.raises(wire.WireError, match=re.escape(f"'{field}'")):
        wire.from_json(cls, body)


def test_the_field_level_entry_points() -> None:
    assert wire.parse_ids([1, 2], "depths") == (1, 2)
    with pytest.raises(wire.WireError, match=r"'depths\[1\]'"):
        wire.parse_ids([1, "2"], "depths")
    assert wire.parse_cache_key(None) is None
    assert wire.parse_cache_key("ab" * 16) == "ab" * 16
    for bad in ("AB" * 16, "ab", 7):
        with pytest.raises(wire.WireError, match="cache_key"):
            wire.parse_cache_key(bad)
    for raw in (b"{", b"[]", b'{"input_ids": [1], "stream": "yes"}', b"\xff"):
        with pytest.raises(wire.WireError):
            wire.decode(raw, wire.GenerateRequest)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
ENTRY_POINTS = sorted({type(r) for r in SAMPLES} | {wire.SamplingParams, wire.AnchorPlan,
                                                     wire.AnchorReport}, key=lambda c: c.__name__)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("cls", ENTRY_POINTS, ids=lambda c: c.__name__)
def test_anything_malformed_is_a_wire_error(cls: type, data: st.DataObject) -> None:
    """Arbitrary JSON, and a valid body with one field (or one nested field) replaced by
    arbitrary JSON, either reads or raises WireError."""
    samples = [r for r in SAMPLES if type(r) is cls] or [cls()]
    body = data.draw(st.sampled_from(samples)).to_json()
    mutated = data.draw(st.sampled_from(["whole", "field", "nested"]))
    if mutated == "whole":
        body = data.draw(JSON)
    else:
        name = data.draw(st.sampled_from(sorted(body) or ["x"]))
        if mutated == "nested" and isinstance(body.get(name), dict) and body[name]:
            inner = dict(body[name])
            inner[data.draw(st.sampled_from(sorted(inner)))] = data.draw(JSON)
            body[name] = inner
        else:
            body[name] = data.draw(JSON)
    try:
        raw = orjson.dumps(body)
    except TypeError:  # an integer past 64 bits: no JSON text orjson writes
        raw = b"[]"
    for read in (lambda: wire.from_json(cls, body), lambda: wire.decode(raw, cls)):
        try:
            record = read()
        except wire.WireError:
            continue
        assert wire.from_json(cls, record.to_json()) == record


def test_the_documented_bodies_read() -> None:
    """docs/worker-protocol.md's request and reply, as a worker or proxy of before the
    declarations wrote them (every field present): they read, and what is written back
    differs only by fields left at their default."""
    request = {"rid": "r", "input_ids": [1, 9690, 198, 5, 6],
               "sampling_params": {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0,
                                   "top_k": -1, "stop_token_ids": [2], "seed": None,
                                   "ignore_eos": False, "n": 1, "json_schema": "{}"},
               "return_logprob": False, "top_logprobs_num": 0, "stream": False,
               "anchor": {"namespace": "00" * 16,
                          "restore": [{"key": K1.hex(), "depth": 2}, {"key": K2.hex(), "depth": 4}],
                          "snapshot": [{"depth": 5, "kind": "conversation", "region": "thick"}],
                          "snapshot_response": True, "chunk_at": [2, 5]}}
    req = wire.from_json(wire.GenerateRequest, request)
    assert req.anchor is not None and req.anchor.restore[1] == wire.AnchorRef(K2, 4)
    assert req.sampling.constraint == ("json_schema", "{}")
    back = req.to_json()  # fields at their default left out, unset constraints null
    assert wire.from_json(wire.GenerateRequest, back) == req
    assert set(request) - set(back) == {"return_logprob", "top_logprobs_num", "stream"}
    assert back["sampling_params"] == {**request["sampling_params"], "regex": None,
                                       "ebnf": None, "structural_tag": None}
    meta = {"id": "r", "prompt_tokens": 5210, "completion_tokens": 3, "cached_tokens": 4410,
            "prefill_tokens": 800, "restore_ms": 3.1, "prefill_ms": 412.0, "decode_ms": 60.2,
            "snapshot_ms": 5.4, "finish_reason": {"type": "stop", "matched": 2},
            "anchors": {"restored": [{"key": K1.hex(), "depth": 812, "kind": "instruction"}],
                        "restore_miss": [],
                        "written": [{"slot": 17, "key": K2.hex(), "depth": 4990,
                                     "parent": K1.hex(), "nbytes": 1234, "kind": "conversation"}],
                        "held": [{"slot": 3, "key": K1.hex(), "depth": 812, "parent": None,
                                  "nbytes": 999, "kind": "instruction"}],
                        "late_lookup": False, "restored_tokens": 4410},
            "epoch": EP}
    # (a worker of before confirmed nothing as a request ended: `confirmed` null)
    assert wire.GenerateMeta.from_json(meta).to_json() == {
        **meta, "anchors": {**meta["anchors"], "confirmed": None}}
