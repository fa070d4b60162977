"""Restores at admission: a request's verified chain put back into SGLang's tree.

Our prefill adder (ext/sglang/admission.py) asks `admit` before it admits a request with a
plan. The first time, the chain is verified (ext/store.py), once, and its page-aligned
prefix starts into the tree (`Placer.place`: fresh slots, the copy on the copy thread);
while the copy is in flight the request is passed over. Once the copy is done on every
rank the prefix is inserted (`land_if_copied`, at the request's next match or at the start
of any admission round), unlocked: SGLang's admission locks it as any prefix hit. A queued
request thus holds no lock (docs/sglang.md, "A queued request holds no lock").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from anchorcache.ext.store import AnchorStore

from .device import Landed, Placer
from .plans import Plan
from .timing import CallTimes

log = logging.getLogger("anchorcache.worker")


_READING = object()  # `Restores._read_ahead`: the request's disk reads are in flight
_NOTHING: Future[dict[tuple[bytes, int], Any]] = Future()  # a read with nothing to read
_NOTHING.set_result({})


class Restores:
    """Admission of anchored requests' restores; see the module docstring."""

    def __init__(self, tree: Any, placer: Placer, store: AnchorStore, times: CallTimes) -> None:
        self._tree = tree  # SGLang's tree (its `unlock`)
        self._placer = placer
        self._store = store
        self._times = times

    def admit(self, req: Any, p: Plan, room: Callable[[], int]) -> str:
        """`go` (nothing to restore, or its prefix is in the tree, or it cannot be: then the
        request prefills it), `wait` (its copy is in flight: pass it over this round),
        `no_room` (the restore's fresh slots exceed `room()`, what this round can still give
        out: SGLang treats it as a request that does not fit)."""
        if p.placed:
            return "go"
        t = time.perf_counter()
        if p.landing is not None:
            self._times.add("restore_wait", t)  # (counts the rounds it waited)
            return "wait"
        if p.check is None:
            read = self._read_ahead(p)
            if read is _READING:
                self._times.add("disk_read_wait", t)  # (counts the rounds it waited)
                return "wait"
            p.check = check = self._store.check_chain(p.ids, p.plan, read)
            p.info = {**check.info(), "held": [h.to_json() for h in check.held]}
        check = p.check
        # the tree holds whole pages; the tail is prefilled
        depth = self._placer.paged(check.depth)
        verdict = "go"
        if not check.chain or depth == 0:
            p.placed, p.missed = True, "under_one_page" if check.chain else None
        else:
            started = self._placer.place(check.chain, p.ids[:depth], req.extra_key, room)
            if started == "no_room":
                verdict = "no_room"
            elif isinstance(started, str):
                p.placed, p.missed = True, started  # served without: it prefills the prefix
            elif started.copy is None:  # all of it on the device already (and matched)
                self._placed(req.rid, p, self._placer.land(started))
            else:
                p.landing, verdict = started, "wait"
        p.restore_s += time.perf_counter() - t
        self._times.add("restore", t)
        return verdict

    def _read_ahead(self, p: Plan) -> Any:
        """The links `p`'s check may take from the disk tier, read on the copy thread (every
        check made there), so the scheduler's loop never reads a file: `_READING` while the
        read is in flight on any rank (the ranks check the chain in the same round), then
        what was read (None without a disk tier: nothing to read)."""
        store = self._store
        if store.disk is None:
            return None
        if p.reading is None:
            links = store.disk_reads(p.ids, p.plan)
            p.reading = self._placer.off_loop(store.read_links, links) if links else _NOTHING
        if not self._placer.done_everywhere(p.reading):
            return _READING
        reading, p.reading = p.reading, _NOTHING
        try:
            return reading.result()
        except Exception:  # a bug, not a bad file (a file that fails is None): no disk links
            log.exception("reading anchors from the disk tier failed")
            return {}

    def land_if_copied(self, rid: str, p: Plan) -> None:
        """Insert request `rid`'s restore if its copy is done on every rank."""
        if p.landing is not None and self._placer.landed(p.landing):
            t = time.perf_counter()
            landing, p.landing = p.landing, None
            self._placed(rid, p, self._placer.land(landing))
            p.restore_s += time.perf_counter() - t
            self._times.add("land", t)

    def _placed(self, rid: str, p: Plan, placed: Landed | None) -> None:
        p.placed = True
        if placed is None:  # (the copy failed: the request prefills the prefix)
            p.missed = "no_device_space"
            return
        lock, p.restored_tokens, _ = placed
        self._tree.unlock(lock)  # SGLang's admission locks what it matches
        p.missed = None
        assert p.check is not None
        self._store.chained(rid, p.check.chain[-1].key, p.check.depth)

    def settle(self, rid: str, p: Plan) -> None:
        """A request that leaves with its restore in flight: the copy is waited for and the
        prefix inserted all the same (its slots are then the tree's, unlocked)."""
        if p.landing is not None:
            landing, p.landing = p.landing, None
            placed = self._placer.land(landing)
            if placed is not None:
                self._tree.unlock(placed[0])

    def forget(self, plans: Iterable[Plan]) -> None:
        """A device flush (SGLang flushes only with no request queued, so none is in flight:
        one would be waited for and forgotten, its slots freed by the allocator's reset)."""
        for p in plans:
            if p.landing is not None and p.landing.copy is not None:
                p.landing.copy.exception()
            p.landing = None
        self._placer.forget()
