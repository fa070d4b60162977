"""The proxy's clock of worker progress (proxy/worker_client.py `ProgressClock`), which
`anchorcache serve` uses to restart a worker that holds requests and sends nothing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from anchorcache.proxy.worker_client import ProgressClock


@dataclass
class Stream:  # what the clock reads of an aiohttp.StreamReader
    total_bytes: int = 0


@pytest.fixture()
def clock() -> tuple[ProgressClock, list[float]]:
    now = [1000.0]
    return ProgressClock(clock=lambda: now[0]), now


def test_idle_is_never_stalled(clock):
    progress, now = clock
    assert progress.stalled_s() is None
    held = progress.begin()
    progress.end(held, finished=True)
    now[0] += 3600
    assert progress.stalled_s() is None


def test_bytes_of_any_held_reply_are_progress_headers_are_not(clock):
    progress, now = clock
    a, b = progress.begin(), progress.begin()
    stream_a, stream_b = Stream(), Stream()
    now[0] += 5
    progress.attach(a, stream_a)
    progress.attach(b, stream_b)
    assert progress.stalled_s() == 5  # taking the request is not progress
    now[0] += 5
    stream_b.total_bytes = 120  # b streams (arrived, whether or not anyone read it yet)
    assert progress.stalled_s() == 0
    now[0] += 7
    assert progress.stalled_s() == 7  # a still stuck, b silent since
    stream_a.total_bytes = 40
    assert progress.stalled_s() == 0


def test_a_finished_request_is_progress_an_abandoned_one_is_not(clock):
    progress, now = clock
    stuck, other, gone = progress.begin(), progress.begin(), progress.begin()
    now[0] += 10
    progress.end(gone, finished=False)  # a client gone, a worker error
    assert progress.stalled_s() == 10
    progress.end(other, finished=True)
    assert progress.stalled_s() == 0
    now[0] += 4
    assert progress.stalled_s() == 4
    progress.end(stuck, finished=False)
    assert progress.stalled_s() is None


def test_the_clock_starts_when_the_first_request_is_held(clock):
    progress, now = clock
    now[0] += 500  # idle
    held = progress.begin()
    assert progress.stalled_s() == 0
    now[0] += 2
    progress.begin()  # a second one does not restart it
    assert progress.stalled_s() == 2
    progress.end(held, finished=False)
    assert progress.stalled_s() == 2
