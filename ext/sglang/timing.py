"""The scheduler's time in anchor work, by kind (`/anchor/stats` `scheduler_calls`)."""

from __future__ import annotations

import time

from anchorcache.wire import CallTime


class CallTimes:
    """Calls, total and peak milliseconds per kind of work: every running request waits
    that long. (`copy`, `restore_copy`: the copy thread's time, which no request waits for.)"""

    def __init__(self) -> None:
        self._ms: dict[str, tuple[int, float, float]] = {}  # kind: (calls, total, max)

    def add(self, kind: str, since: float, ms: float | None = None) -> None:
        """One call of `kind` that started at `since` (`time.perf_counter`), or took `ms`."""
        if ms is None:
            ms = 1e3 * (time.perf_counter() - since)
        calls, total, peak = self._ms.get(kind, (0, 0.0, 0.0))
        self._ms[kind] = (calls + 1, total + ms, max(peak, ms))

    def rows(self) -> tuple[CallTime, ...]:
        return tuple(CallTime(kind, calls, round(total, 3), round(peak, 3))
                     for kind, (calls, total, peak) in sorted(self._ms.items()))
