"""Pinned anchors on the device: their prefixes stay locked in SGLang's tree.

Within a budget of the pool (`pin_budget_fraction`) that the contract keeps out of every
request's limit, so no admitted request can starve; on a hybrid model each pin also holds a
Mamba slot, so at most a quarter of those go to pins. A device flush (SGLang's `reset`)
drops the tree the locks point into: the pins are forgotten, never unlocked, and placed
again at the next anchor operation (`pin_again`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anchorcache.ext.store import AnchorStore
from anchorcache.wire import PinDevice

from .device import Placer


@dataclass
class DevicePin:
    """A pinned anchor's prefix, held in SGLang's tree by a lock reference, under the
    engine cache key (SGLang's `extra_key`) of the namespace whose requests it serves."""

    lock: Any
    tokens: int
    extra_key: str | None


class Pins:
    """The device pins, by anchor key; see the module docstring."""

    def __init__(self, tree: Any, placer: Placer, store: AnchorStore, *, budget_tokens: int,
                 max_pins: int | None) -> None:
        self._tree = tree  # SGLang's tree (its `unlock`)
        self._placer = placer
        self._store = store
        self.budget_tokens = budget_tokens
        self._max_pins = max_pins  # a hybrid model's bound (each pin holds a Mamba slot)
        self._pins: dict[bytes, DevicePin] = {}
        self.pinned_tokens = 0
        self._repin: dict[bytes, str | None] = {}  # pins a device flush dropped → extra_key

    def pin(self, key: bytes, extra_key: str | None) -> PinDevice:
        """Lock the committed anchor `key`'s prefix in the tree, under `extra_key` (where
        requests of that cache key find it); how it went: `locked`, or why not
        (`over_budget`, `no_device_space`, `no_tokens`). An anchor is pinned on the device
        under one key: pinned again under another, it stays where it is."""
        if key in self._pins:
            return "locked"
        found = self._store.prefix_of(key)
        if found is None:
            return "no_tokens"
        chain, ids = found
        ids = ids[:self._placer.paged(len(ids))]
        if not ids:
            return "no_tokens"  # shorter than one page: nothing the tree can hold
        if self.pinned_tokens + len(ids) > self.budget_tokens or (
                self._max_pins is not None and len(self._pins) >= self._max_pins):
            return "over_budget"
        placed = self._placer.to_device(chain, ids, extra_key)
        if placed is None:
            return "no_device_space"
        self._pins[key] = DevicePin(placed[0], len(ids), extra_key)
        self.pinned_tokens += len(ids)
        return "locked"

    def unpin(self, key: bytes) -> None:
        self._repin.pop(key, None)
        pin = self._pins.pop(key, None)
        if pin is not None:
            self._tree.unlock(pin.lock)
            self.pinned_tokens -= pin.tokens

    def unpin_all(self) -> None:
        for key in list(self._pins) + list(self._repin):
            self.unpin(key)

    def pin_again(self) -> None:
        """Put back the pins a device flush dropped (those still pinned in the store)."""
        if not self._repin:
            return
        keys, self._repin = self._repin, {}
        pinned = {e.key for e in self._store.table.entries() if e.pinned}
        for key, extra_key in keys.items():
            if key in pinned:
                self.pin(key, extra_key)

    def forget(self) -> None:
        """A device flush dropped the tree the locks point into: forget them, never unlock;
        `pin_again` places them again."""
        self._repin.update((key, pin.extra_key) for key, pin in self._pins.items())
        self._pins.clear()
        self.pinned_tokens = 0
