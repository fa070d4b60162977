"""What the worker keeps of the anchors requests confirmed as they ended (for their abort),
bounded in time and in number: a worker that serves for days keeps a minute of them."""

from __future__ import annotations

from anchorcache.ext import contract
from anchorcache.ext.contract import InBandConfirms


def test_a_request_keeps_its_keys_until_taken_a_minute_at_most():
    now = [0.0]
    kept = InBandConfirms(clock=lambda: now[0])
    kept.note("a", [b"k1"])
    kept.note("a", [b"k2"])  # another sample of the same request
    kept.note("b", [b"k3"])
    assert kept.take("a") == [b"k1", b"k2"]
    assert kept.take("a") == []  # taken once
    now[0] = contract.IN_BAND_KEPT_S + 1
    kept.note("c", [b"k4"])  # "b" is past the minute: gone
    assert kept.take("b") == []
    assert kept.take("c") == [b"k4"]


def test_at_most_so_many_requests_are_kept(monkeypatch):
    monkeypatch.setattr(contract, "IN_BAND_KEPT", 3)
    kept = InBandConfirms(clock=lambda: 0.0)
    for i in range(5):
        kept.note(f"r{i}", [bytes([i])])
    assert [kept.take(f"r{i}") for i in range(5)] == [[], [], [b"\x02"], [b"\x03"], [b"\x04"]]
