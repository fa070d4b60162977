"""The anchor life cycle when the ledger fails under it (a real SQLite ledger, one write
made to fail: SQLite raises on a full or read-only disk, which no test can make it do on
demand). No worker is called: `begin` only plans and opens the reservation."""

from __future__ import annotations

import asyncio
import sqlite3

import aiohttp
import pytest

from anchorcache.proxy.lifecycle import AnchorLifecycle, Caller
from anchorcache.proxy.splitter.types import Cut, CutKind, SplitResult
from anchorcache.proxy.worker_client import WorkerClient
from anchorcache.state.ledger import Ledger

NS = bytes(range(16))
SPLIT = SplitResult("test", tuple(range(100, 400)), (Cut(CutKind.INSTRUCTION, 200),))


async def test_a_failed_reservation_lets_go_of_the_instruction_anchor_it_leads(tmp_path,
                                                                                monkeypatch):
    ledger = Ledger.open(tmp_path)
    async with aiohttp.ClientSession() as session:
        lc = AnchorLifecycle(WorkerClient(session, "http://127.0.0.1:9"), ledger,
                             model_id="m", epoch="e1", worker_id="w", shared_namespace=b"s" * 16,
                             single_flight_wait_s=60.0)
        caller = Caller("t", NS)
        real = ledger.open_reservation

        def full_disk(*args: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(ledger, "open_reservation", full_disk)
        with pytest.raises(sqlite3.OperationalError):
            await lc.begin("r1", caller, SPLIT)  # it would have written the instruction anchor
        monkeypatch.setattr(ledger, "open_reservation", real)
        # the next request of the toolset neither waits 60 s for it nor skips the anchor
        flight = await asyncio.wait_for(lc.begin("r2", caller, SPLIT), 5)
        assert flight.leads is not None
        assert [s.depth for s in flight.plan.request.snapshot if s.depth == 200] == [200]
        lc.fail(flight, "test")
        # the same through a warm-up (an admin warming a toolset)
        monkeypatch.setattr(ledger, "open_reservation", full_disk)
        with pytest.raises(sqlite3.OperationalError):
            await lc.warm("t", NS, SPLIT.input_ids[:200])
        monkeypatch.setattr(ledger, "open_reservation", real)
        again = await asyncio.wait_for(lc.begin("r3", caller, SPLIT), 5)
        assert again.leads is not None
        lc.fail(again, "test")
    ledger.close()
