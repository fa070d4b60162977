"""The ledger on a real SQLite file: schema, tenants and keys, toolsets, anchor life cycle,
reconcile. Pure bookkeeping, milliseconds."""

from __future__ import annotations

import sqlite3
import stat

import pytest

from anchorcache.state.ledger import Ledger, LedgerError
from anchorcache.state.records import AnchorStatus, HeldSlot, NewAnchor, ReservationOutcome
from anchorcache.state.schema import SCHEMA_VERSION, SchemaError

W, E1, E2 = "http://w", "e1", "e2"
NS = bytes(16)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def anchor(i: int, depth: int, parent: int | None = None, slot: int | None = None) -> NewAnchor:
    return NewAnchor(key(i), depth, key(parent) if parent is not None else None,
                     slot if slot is not None else i, 100 * depth, "conversation")


@pytest.fixture()
def ledger(tmp_path):
    led = Ledger.open(tmp_path / "state")
    led.ensure_tenant("t")
    yield led
    led.close()


def test_open_creates_a_private_wal_file_at_the_current_schema(tmp_path):
    led = Ledger.open(tmp_path / "state")
    path = tmp_path / "state" / "ledger.sqlite3"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert led.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert led.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    led.close()
    Ledger.open(tmp_path / "state").close()  # reopening migrates nothing and keeps the data


def test_a_newer_schema_is_refused(tmp_path):
    Ledger.open(tmp_path / "s").close()
    conn = sqlite3.connect(tmp_path / "s" / "ledger.sqlite3")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaError, match="schema version"):
        Ledger.open(tmp_path / "s")


def test_tenants_get_secret_salts_and_hashed_keys(ledger):
    a, key_id, api_key = ledger.create_tenant("acme")
    b, _, _ = ledger.create_tenant("globex")
    assert len(a.salt) == 32 and a.salt != b.salt
    assert api_key.startswith("ac-")
    stored = ledger.db.execute("SELECT key_hash FROM api_keys WHERE key_id = ?", [key_id]).fetchone()[0]
    assert api_key not in stored and api_key not in str(list(ledger.db["api_keys"].rows))
    assert ledger.lookup_key(api_key).tenant == "acme"
    assert ledger.lookup_key(api_key + "x") is None
    with pytest.raises(LedgerError, match="already exists"):
        ledger.create_tenant("acme")
    assert [t.name for t in ledger.tenants()] == ["t", "acme", "globex"]


def test_revoked_keys_are_found_but_marked(ledger):
    ledger.create_tenant("acme")
    key_id, api_key = ledger.add_key("acme")
    assert ledger.lookup_key(api_key).revoked_at is None
    assert not ledger.revoke_key("globex", key_id)  # another tenant's key id
    assert ledger.revoke_key("acme", key_id)
    assert ledger.lookup_key(api_key).revoked_at is not None
    with pytest.raises(LedgerError):
        ledger.add_key("nobody")


def test_toolsets_keep_their_ids_and_flags(ledger):
    ts = ledger.put_toolset("t", NS, key(7), [1, 2, 3], pinned=True)
    assert (ts.toolset, ts.depth, ts.input_ids, ts.pinned, ts.shared) == (key(7).hex(), 3, (1, 2, 3), True, False)
    again = ledger.put_toolset("t", NS, key(7), [1, 2, 3])  # seen again in traffic: flags stay
    assert again.pinned and again.created_at == ts.created_at
    ledger.set_toolset(ts.toolset, pinned=False, shared=True)
    assert [t.toolset for t in ledger.toolsets(shared=True)] == [ts.toolset]
    assert ledger.toolsets(pinned=True) == []


def test_an_anchor_is_committed_only_once_acknowledged(ledger):
    ledger.open_reservation("r1", "t", W, E1)
    ledger.record_written("r1", W, E1, NS, "t", [anchor(1, 10), anchor(2, 20, 1)])
    assert {a.status for a in ledger.anchors()} == {AnchorStatus.RESERVED}
    ledger.commit(W, E1, [key(1)])  # the confirm reply named only slot 1
    assert ledger.close_reservation("r1", ReservationOutcome.CONFIRMED)
    assert [(a.depth, a.status) for a in ledger.anchors()] == [
        (10, AnchorStatus.COMMITTED), (20, AnchorStatus.ABORTED)]
    assert not ledger.close_reservation("r1", ReservationOutcome.ABORTED)  # closed once


def test_anchors_confirmed_in_band_are_committed_as_recorded(ledger):
    """The worker confirmed slot 1 as the request ended, not slot 2 (the in-band confirm):
    committed at once under the request's id; the refused one aborted by the close."""
    ledger.open_reservation("r1", "t", W, E1)
    ledger.record_written("r0", W, E1, NS, "t", [anchor(1, 10)])  # an earlier write, aborted
    ledger.close_reservation("r0", ReservationOutcome.ABORTED)
    with ledger.transaction():
        ledger.record_committed("r1", W, E1, NS, "t", [anchor(1, 10)])
        ledger.record_written("r1", W, E1, NS, "t", [anchor(2, 20, 1)])
        assert ledger.close_reservation("r1", ReservationOutcome.CONFIRMED)
    assert ledger.db.execute("SELECT depth, status, rid FROM anchors ORDER BY depth").fetchall() \
        == [(10, "committed", "r1"), (20, "aborted", "r1")]
    assert ledger.anchor_bytes("t", W, E1) == 1000


def test_a_failed_request_aborts_its_anchors_with_a_reason(ledger):
    ledger.open_reservation("r1", "t", W, E1)
    ledger.record_written("r1", W, E1, NS, "t", [anchor(1, 10)])
    ledger.close_reservation("r1", ReservationOutcome.ABORTED, "client_disconnected")
    assert ledger.anchors()[0].status == AnchorStatus.ABORTED
    assert ledger.stats()["aborted_by_reason"] == {"client_disconnected": 1}


def test_held_anchors_are_committed_and_keep_their_hits(ledger):
    ledger.record_held(W, E1, NS, "t", [anchor(1, 10)])
    ledger.record_hits(W, E1, [key(1)])
    ledger.record_held(W, E1, NS, "t", [anchor(1, 10)])
    [row] = ledger.anchors()
    assert (row.status, row.hits) == (AnchorStatus.COMMITTED, 1)
    assert ledger.anchor_bytes("t", W, E1) == 1000


def test_reconcile_after_a_proxy_kill(ledger):
    # committed and still held; committed but evicted meanwhile; confirmed on the worker but
    # the reply was lost; written and never confirmed (still staged on the worker)
    ledger.record_held(W, E1, NS, "t", [anchor(1, 10), anchor(2, 20, 1)])
    ledger.open_reservation("r1", "t", W, E1)
    ledger.record_written("r1", W, E1, NS, "t", [anchor(3, 30, 1), anchor(4, 40, 3)])
    held = [HeldSlot(1, key(1), 10, None, 1000), HeldSlot(3, key(3), 30, key(1), 2000)]
    report = Ledger.reconcile(ledger, W, E1, held, staged=[(4, key(4))])
    assert (report.kept, report.evicted, report.adopted, report.aborted) == (1, 1, 1, 1)
    assert report.reservations_closed == 1 and report.stale_reserved_slots == (4,)
    status = {a.key: a.status for a in ledger.anchors()}
    assert status == {key(1): AnchorStatus.COMMITTED, key(2): AnchorStatus.EVICTED,
                      key(3): AnchorStatus.COMMITTED, key(4): AnchorStatus.ABORTED}
    assert ledger.reservations(ReservationOutcome.OPEN) == []
    # an adopted anchor takes the worker's slot and size
    assert ledger.anchors(key=key(3))[0].nbytes == 2000


def test_reconcile_on_a_new_epoch_loses_everything_old(ledger):
    ledger.record_held(W, E1, NS, "t", [anchor(1, 10)])
    ledger.record_held("http://other", E1, NS, "t", [anchor(1, 10)])
    ledger.open_reservation("r1", "t", W, E1)
    ledger.record_written("r1", W, E1, NS, "t", [anchor(2, 20, 1)])
    report = ledger.reconcile(W, E2, [HeldSlot(1, key(1), 10, None, 1)])
    assert report.lost == 2 and report.kept == 0
    assert {a.status for a in ledger.anchors(worker=W)} == {AnchorStatus.LOST}
    # another worker's anchors are not this worker's business
    assert ledger.anchors(worker="http://other")[0].status == AnchorStatus.COMMITTED


def test_a_worker_out_of_reach_loses_its_anchors_until_it_answers_again(ledger):
    ledger.record_held(W, E1, NS, "t", [anchor(1, 10), anchor(2, 20, 1)])
    ledger.record_held("http://other", E1, NS, "t", [anchor(1, 10)])
    assert ledger.lose_worker(W) == 2
    assert {a.status for a in ledger.anchors(worker=W)} == {AnchorStatus.LOST}
    assert ledger.anchors(worker="http://other")[0].status == AnchorStatus.COMMITTED
    # back at the same epoch (it was unreachable, not restarted): what it still lists returns
    report = ledger.reconcile(W, E1, [HeldSlot(1, key(1), 10, None, 1000)])
    assert (report.kept, report.lost, report.evicted) == (1, 0, 0)
    status = {a.key: a.status for a in ledger.anchors(worker=W)}
    assert status == {key(1): AnchorStatus.COMMITTED, key(2): AnchorStatus.LOST}
    # back under a new epoch (restarted): nothing returns
    ledger.lose_worker(W)
    ledger.reconcile(W, E2, [HeldSlot(1, key(1), 10, None, 1000)])
    assert {a.status for a in ledger.anchors(worker=W)} == {AnchorStatus.LOST}


def test_reconcile_leaves_requests_in_flight_alone(ledger):
    ledger.open_reservation("live", "t", W, E1)
    ledger.record_written("live", W, E1, NS, "t", [anchor(1, 10)])
    report = ledger.reconcile(W, E1, [], in_flight={"live"})
    assert report.reservations_closed == 0 and report.aborted == 0
    assert ledger.anchors()[0].status == AnchorStatus.RESERVED
    ledger.commit(W, E1, [key(1)])
    assert ledger.close_reservation("live", ReservationOutcome.CONFIRMED)


def test_a_rewritten_key_starts_over(ledger):
    ledger.record_held(W, E1, NS, "t", [anchor(1, 10)])
    ledger.record_hits(W, E1, [key(1)])
    ledger.mark(W, E1, [key(1)], AnchorStatus.EVICTED)
    ledger.open_reservation("r", "t", W, E1)
    ledger.record_written("r", W, E1, NS, "t", [anchor(1, 10, slot=9)])
    [row] = ledger.anchors()
    assert (row.status, row.hits, row.slot) == (AnchorStatus.RESERVED, 0, 9)


def test_housekeeping_deletes_only_what_can_no_longer_matter(tmp_path):
    now = [1000.0]
    led = Ledger.open(tmp_path / "state", clock=lambda: now[0])
    led.ensure_tenant("t")
    led.open_reservation("old", "t", W, E1)
    led.record_written("old", W, E1, NS, "t", [anchor(1, 10), anchor(2, 20, 1)])
    led.commit(W, E1, [key(1)])
    led.close_reservation("old", ReservationOutcome.CONFIRMED)  # anchor 2 aborted
    led.open_reservation("open", "t", W, E1)  # still in flight, however old
    led.event("something", "t")
    now[0] += 8 * 24 * 3600
    led.open_reservation("new", "t", W, E1)
    led.close_reservation("new", ReservationOutcome.ABORTED, "x")
    before = led.size()
    assert led.housekeep(7 * 24 * 3600) == {"responses": 0, "reservations": 1, "anchors": 1,
                                          "events": 1}
    assert {r["rid"] for r in led.reservations()} == {"open", "new"}
    assert [(a.depth, a.status) for a in led.anchors()] == [(10, AnchorStatus.COMMITTED)]
    assert led.tenant("t") is not None
    after = led.size()
    assert after["reservations_rows"] == before["reservations_rows"] - 1 and after["file_bytes"] > 0
    assert led.housekeep(7 * 24 * 3600) == {"responses": 0, "reservations": 0, "anchors": 0,
                                          "events": 0}
    led.close()


def test_a_second_proxy_on_the_ledger_is_refused_until_the_first_closes(tmp_path):
    first = Ledger.open(tmp_path / "state", exclusive=True)
    with pytest.raises(LedgerError, match="in use by another proxy"):
        Ledger.open(tmp_path / "state", exclusive=True)
    reader = Ledger.open(tmp_path / "state")  # (ops-style readers are not proxies)
    reader.close()
    first.close()
    Ledger.open(tmp_path / "state", exclusive=True).close()


def test_key_changes_commit_with_a_full_sync(ledger, monkeypatch):
    """Creating a tenant or key and revoking one run under synchronous=FULL (a power loss
    cannot roll a revocation back); everything else keeps NORMAL."""
    seen = []
    real = ledger.db.execute

    def execute(sql, *args):
        if sql.startswith("PRAGMA synchronous"):
            seen.append(sql)
        return real(sql, *args)

    monkeypatch.setattr(ledger.db, "execute", execute)
    _, key_id, _ = ledger.create_tenant("k")
    ledger.revoke_key("k", key_id)
    assert seen == ["PRAGMA synchronous=FULL", "PRAGMA synchronous=NORMAL"] * 2
    assert ledger.db.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_a_tenant_created_twice_at_once_is_a_ledger_error_not_a_crash(tmp_path):
    one, two = Ledger.open(tmp_path / "s"), Ledger.open(tmp_path / "s")
    one.create_tenant("race")
    real = two.tenant
    two.tenant = lambda name: None  # type: ignore[method-assign]  (its check ran first)
    with pytest.raises(LedgerError, match="already exists"):
        two.create_tenant("race")
    two.tenant = real  # type: ignore[method-assign]
    assert two.ensure_tenant("race").name == "race"
    one.close()
    two.close()


def test_stored_responses_are_per_tenant_and_expire(tmp_path):
    now = [1000.0]
    led = Ledger.open(tmp_path, clock=lambda: now[0])
    led.put_response("resp_1", "a", b'{"x": 1}', ttl_s=60)
    assert led.response("resp_1", "a") == b'{"x": 1}' and led.response("resp_1", "b") is None
    assert not led.delete_response("resp_1", "b")
    now[0] += 61
    assert led.response("resp_1", "a") is None
    assert led.housekeep()["responses"] == 1 and led.size()["responses_rows"] == 0
    led.close()


def test_a_tenants_stored_responses_are_held_to_its_byte_cap_oldest_first(tmp_path):
    """One tenant storing responses cannot fill the disk: past `max_tenant_bytes` its own
    oldest go (never the one just stored, never another tenant's)."""
    now = [1000.0]
    led = Ledger.open(tmp_path, clock=lambda: now[0])
    led.put_response("other", "b", b"x" * 50, ttl_s=60, max_tenant_bytes=100)
    for i in range(4):
        now[0] += 1
        led.put_response(f"r{i}", "a", b"x" * 40, ttl_s=60, max_tenant_bytes=100)
    assert [led.response(f"r{i}", "a") is not None for i in range(4)] == [False, False, True, True]
    assert led.response("other", "b") == b"x" * 50
    assert led.put_response("big", "a", b"x" * 500, ttl_s=60, max_tenant_bytes=100) == 2
    assert led.response("big", "a") is not None and led.size()["responses_rows"] == 2
    led.close()


def test_a_request_settles_in_one_transaction_that_others_see_whole_or_not_at_all(tmp_path):
    """sqlite-utils 4 commits each statement of its `execute` at once outside a transaction:
    what a request's settle writes (commit, hits, the reservation's close) must be one
    transaction, seen by another connection (another proxy process) all at once, and
    rolled back whole when it fails midway. One BEGIN and one COMMIT, however many
    anchors."""
    led = Ledger.open(tmp_path / "state")
    other = Ledger.open(tmp_path / "state")
    led.ensure_tenant("t")
    led.open_reservation("r1", "t", W, E1)
    led.record_written("r1", W, E1, NS, "t", [anchor(i, 10 * i, slot=i) for i in range(1, 30)])

    statements: list[str] = []
    led.db.conn.set_trace_callback(statements.append)
    with led.transaction():
        led.commit(W, E1, [key(i) for i in range(1, 30)])
        led.record_hits(W, E1, [key(i) for i in range(1, 30)])
        assert led.close_reservation("r1", ReservationOutcome.CONFIRMED)
        # not yet visible to another connection
        assert {a.status for a in other.anchors(worker=W)} == {AnchorStatus.RESERVED}
        assert other.reservations(ReservationOutcome.OPEN)
    led.db.conn.set_trace_callback(None)
    assert [s for s in statements if s in ("BEGIN", "COMMIT")] == ["BEGIN", "COMMIT"]
    assert {(a.status, a.hits) for a in other.anchors(worker=W)} == {(AnchorStatus.COMMITTED, 1)}
    assert not other.reservations(ReservationOutcome.OPEN)

    led.open_reservation("r2", "t", W, E1)
    with pytest.raises(RuntimeError), led.transaction():
        led.record_written("r2", W, E1, NS, "t", [anchor(40, 400, slot=40)])
        led.close_reservation("r2", ReservationOutcome.CONFIRMED)
        raise RuntimeError("the worker's confirm reply was garbage")
    assert other.anchors(key=key(40)) == []
    assert [r["rid"] for r in other.reservations(ReservationOutcome.OPEN)] == ["r2"]
    led.close()
    other.close()


def test_noted_hits_are_written_in_one_batch_read_back_and_never_carried_over(tmp_path):
    """`note_hits` counts a request's chain in memory: nothing is written until a second
    has passed (then one UPDATE per key, counts and latest time), a read of this ledger
    writes them first, another connection sees them once written; a key written again
    (a new incarnation, hits from 0) never gets its old incarnation's pending hits."""
    now = [1000.0]
    led = Ledger.open(tmp_path / "state", clock=lambda: now[0])
    other = Ledger.open(tmp_path / "state")
    led.ensure_tenant("t")
    led.open_reservation("r1", "t", W, E1)
    led.record_written("r1", W, E1, NS, "t", [anchor(i, 10 * i) for i in (1, 2, 3)])
    led.commit(W, E1, [key(1), key(2)])
    statements: list[str] = []
    led.db.conn.set_trace_callback(statements.append)
    for _ in range(3):
        now[0] += 0.1
        led.note_hits(W, E1, [key(1), key(2), key(3)])
    assert statements == []  # nothing written yet
    assert {a.key: a.hits for a in other.anchors(worker=W)} == {key(i): 0 for i in (1, 2, 3)}
    # key 3 (still reserved) is written again: its pending hits are its old incarnation's
    # (written first, then reset with the row, as when they were written at once)
    led.record_written("r1", W, E1, NS, "t", [anchor(3, 30, slot=7)])
    led.db.conn.set_trace_callback(None)
    assert {a.key: (a.hits, round(a.last_hit, 6)) for a in led.anchors(worker=W)} == {
        key(1): (3, 1000.3), key(2): (3, 1000.3), key(3): (0, 1000.3)}
    now[0] += 0.5
    led.note_hits(W, E1, [key(1)])
    assert other.anchors(worker=W, key=key(1))[0].hits == 3  # (under a second: counted only)
    now[0] += 1.0
    led.note_hits(W, E1, [key(2)])  # a second on: both written
    assert {a.key: a.hits for a in other.anchors(worker=W)} == {key(1): 4, key(2): 4, key(3): 0}
    led.note_hits(W, E1, [key(1)])
    led.close()  # (writes what is left)
    assert other.anchors(worker=W, key=key(1))[0].hits == 5
    other.close()
