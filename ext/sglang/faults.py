"""The one fault a test may arm in the scheduler (`POST /debug/fault`, `--fault-injection`).

Each fault fires once, at the next place that takes it: a restore's copy (`restore_*`, in
ext/sglang/device.py) or a snapshot's copy (`snapshot_copy_fail`, ext/sglang/snapshots.py).
They exist to show that the checks catch a wrong restore and that a failed copy costs its
anchors only; a real pool cannot be made to produce them on demand.
"""

from __future__ import annotations

NAMES = ("restore_shift_row", "restore_state_flip", "restore_slow", "restore_copy_fail",
         "snapshot_copy_fail")
RESTORE_SLOW_S = 1.0  # the `restore_slow` fault's delay of one restore copy


class Faults:
    """At most one armed fault, owned by the scheduler's loop."""

    def __init__(self) -> None:
        self.armed: str | None = None

    def arm(self, where: str) -> None:
        assert where in NAMES
        self.armed = where

    def take(self, where: str) -> bool:
        """Whether `where` is armed; if so it fires now and is disarmed."""
        if self.armed != where:
            return False
        self.armed = None
        return True
