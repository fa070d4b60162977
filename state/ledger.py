"""The SQLite ledger: tenants, API keys, toolsets, anchors, reservations, events.

Pure bookkeeping over one SQLite file (sqlite-utils, WAL): no network, no clock but the one
it is given, so it is tested in milliseconds on a real file. The proxy is its only writer:
one process, or the processes of one proxy (`--processes`), each with its own connection;
every method is one short transaction (writers wait for each other, `busy_timeout`), so a
proxy killed at any point leaves a ledger that opens cleanly and that `reconcile` brings
back in line with the worker. For several processes the ledger numbers every anchor change
(`anchor_changes`), names the process of each open reservation (`owner`), counts requests
in flight per tenant and process (`enter_flight`) and keeps named, expiring locks
(`try_lock`).

Invariant: an anchor is `committed` only after its worker acknowledged it (a confirm reply
naming its slot, or the worker reporting it already held), and it stays committed only
while that worker epoch lists it. API keys are stored as SHA-256 digests (they are 256-bit
random secrets, so a slow hash would add nothing); tenant salts are server-side secrets
that never leave the ledger, which is why the file is created mode 0600.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import sqlite_utils

from .records import (
    AnchorRow,
    AnchorStatus,
    ApiKey,
    HeldSlot,
    NewAnchor,
    Quotas,
    ReconcileReport,
    ReservationOutcome,
    Tenant,
    Toolset,
)
from .schema import migrate

LEDGER_FILE = "ledger.sqlite3"
LOCK_FILE = "ledger.lock"
# rows that can no longer matter (closed reservations, anchors no worker holds, events) are
# deleted once this much older (`Ledger.housekeep`)
RETENTION_S = 7 * 24 * 3600.0
HITS_FLUSH_S = 1.0  # hits counted in memory are written at least this often (`note_hits`)
KEY_PREFIX = "ac-"


class LedgerError(ValueError):
    """A request the ledger refuses (unknown tenant, duplicate name, ...)."""


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _hex(b: bytes | None) -> str | None:
    return b.hex() if b is not None else None


def _unhex(s: str | None) -> bytes | None:
    return bytes.fromhex(s) if s else None


class Ledger:
    def __init__(self, db: sqlite_utils.Database, *, clock: Callable[[], float] = time.time,
                 lock: int | None = None) -> None:
        self.db = db
        self.clock = clock
        self._lock = lock  # the file descriptor holding `exclusive`'s lock, if any
        self.owner = os.getpid()  # the reservations and requests in flight this process holds
        # hits noted and not yet written (`note_hits`): (worker, epoch, key hex) → [count,
        # last hit]; and when they were last written
        self._hits: dict[tuple[str, str, str], list[float]] = {}
        self._hits_flushed = clock()

    @classmethod
    def open(cls, path: Path | str, *, clock: Callable[[], float] = time.time,
             exclusive: bool = False) -> Ledger:
        """Open (creating if needed) the ledger at `path`: a file, or a directory that gets
        `ledger.sqlite3`. Runs pending migrations. `exclusive` (a proxy): hold a lock beside
        it until `close`, so that a second proxy on the same ledger refuses to start (each
        would take the other's open reservations for its own crash leftovers) with a
        LedgerError naming the holder. The processes of one proxy (`--processes`) open it
        without: their parent holds the lock, and each tells its reservations from its
        siblings' by `owner` (its pid)."""
        path = Path(path)
        if path.is_dir() or not path.suffix:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = path / LEDGER_FILE
        else:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.exists():
            path.touch(mode=0o600)
        lock = _lock(path.with_name(LOCK_FILE)) if exclusive else None
        db = sqlite_utils.Database(path)
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a power loss may lose the last commits (counters, anchor rows that the
        # workers' listings rebuild), never corrupt; key and tenant changes commit FULL
        # (`_durable`)
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")
        migrate(db)
        return cls(db, clock=clock, lock=lock)

    def close(self) -> None:
        try:
            self.flush_hits()
        except sqlite3.Error:  # (a ledger closing on a failing disk: the counts are lost)
            pass
        self.db.close()
        if self._lock is not None:
            os.close(self._lock)  # (releases the lock)
            self._lock = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction around what runs inside; within another, part of it. (sqlite-utils
        4 commits each statement of its own `execute` at once unless a transaction is open:
        a method of several statements, or several methods, are atomic only inside one.)"""
        if self.db.conn.in_transaction:
            yield
            return
        with self.db.atomic():
            yield

    def _rows(self, sql: str, args: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """The rows of one read, as dicts (on the request path: sqlite-utils' `rows_where`
        looks the table up in the schema first, two reads more, and `query` wraps the read
        in a savepoint)."""
        cur = self.db.conn.execute(sql, list(args))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    @contextlib.contextmanager
    def _durable(self) -> Iterator[None]:
        """One transaction, fsynced at commit (`synchronous=FULL`): a key revoked or a tenant
        created survives a power loss once the call returns."""
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            with self.db.atomic():
                yield
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")

    def housekeep(self, retention_s: float = RETENTION_S) -> dict[str, int]:
        """Delete what can no longer matter, older than `retention_s`: closed reservations,
        anchor rows no worker holds (lost, evicted, aborted), events. Open reservations,
        committed and reserved anchors, tenants, keys and toolsets stay; stored responses
        go once they expire, whatever `retention_s`. The rows deleted, by table."""
        before = self.clock() - retention_s
        deleted = {}
        with self.transaction():
            deleted["responses"] = self.db.execute(
                "DELETE FROM responses WHERE expires_at <= ?", [self.clock()]).rowcount
            deleted["reservations"] = self.db.execute(
                "DELETE FROM reservations WHERE outcome IS NOT NULL AND outcome != 'open' "
                "AND coalesce(closed_at, opened_at) < ?", [before]).rowcount
            deleted["anchors"] = self.db.execute(
                "DELETE FROM anchors WHERE status NOT IN ('committed', 'reserved') "
                "AND coalesce(updated_at, created_at) < ?", [before]).rowcount
            deleted["events"] = self.db.execute("DELETE FROM events WHERE at < ?",
                                                [before]).rowcount
        return deleted

    def size(self) -> dict[str, int]:
        """The ledger's rows by table and its bytes on disk (database and write-ahead log)."""
        rows = {t: self.db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("tenants", "api_keys", "toolsets", "anchors", "reservations", "events",
                          "responses")}
        path = Path(self.db.conn.execute("PRAGMA database_list").fetchone()[2])
        disk = sum(f.stat().st_size for f in (path, path.with_name(path.name + "-wal"))
                   if f.exists())
        return {**{f"{t}_rows": n for t, n in rows.items()}, "file_bytes": disk}

    def event(self, kind: str, tenant: str | None = None, **detail: Any) -> None:
        self.db.table("events").insert({"at": self.clock(), "kind": kind, "tenant": tenant,
                                  "detail": orjson.dumps(detail).decode()})

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        return [{**r, "detail": orjson.loads(r["detail"])} for r in self.db.table("events").rows_where(
            order_by="id desc", limit=limit)]

    # ---- tenants and keys ---------------------------------------------------------------
    @staticmethod
    def _tenant(r: dict[str, Any]) -> Tenant:
        return Tenant(r["name"], bytes.fromhex(r["salt"]),
                      Quotas(r["max_pinned_toolsets"], r["max_anchor_bytes"], r["max_in_flight"]),
                      r["created_at"])

    def tenant(self, name: str) -> Tenant | None:
        rows = self._rows("SELECT * FROM tenants WHERE name = ?", [name])
        return self._tenant(rows[0]) if rows else None

    def tenants(self) -> list[Tenant]:
        return [self._tenant(r) for r in self.db.table("tenants").rows_where(order_by="created_at")]

    def create_tenant(self, name: str, quotas: Quotas = Quotas()) -> tuple[Tenant, str, str]:
        """A new tenant with a fresh secret salt and a first API key: (tenant, key_id, key).
        Raises LedgerError if the name is taken."""
        try:
            with self._durable():
                if self.tenant(name) is not None:
                    raise LedgerError(f"tenant {name!r} already exists")
                tenant = self._insert_tenant(name, quotas)
                key_id, api_key = self._insert_key(name)
        except sqlite3.IntegrityError:  # created at the same moment through another connection
            raise LedgerError(f"tenant {name!r} already exists") from None
        self.event("tenant_created", name)
        return tenant, key_id, api_key

    def ensure_tenant(self, name: str, quotas: Quotas = Quotas()) -> Tenant:
        """The tenant `name`, created (without a key) if it does not exist yet."""
        if (tenant := self.tenant(name)) is not None:  # (every anonymous request)
            return tenant
        try:
            with self._durable():
                return self.tenant(name) or self._insert_tenant(name, quotas)
        except sqlite3.IntegrityError:  # created at the same moment through another connection
            tenant = self.tenant(name)
            assert tenant is not None
            return tenant

    def _insert_tenant(self, name: str, quotas: Quotas) -> Tenant:
        row = {"name": name, "salt": secrets.token_hex(32), "created_at": self.clock(),
               **quotas.to_json()}
        self.db.table("tenants").insert(row)
        return self._tenant(row)

    def set_quotas(self, name: str, quotas: Quotas) -> Tenant:
        if self.tenant(name) is None:
            raise LedgerError(f"no tenant {name!r}")
        with self._durable():
            self.db.table("tenants").update(name, quotas.to_json())
        tenant = self.tenant(name)
        assert tenant is not None
        return tenant

    def add_key(self, tenant: str) -> tuple[str, str]:
        """A new API key for `tenant`: (key_id, key). The key is shown once, stored hashed."""
        if self.tenant(tenant) is None:
            raise LedgerError(f"no tenant {tenant!r}")
        with self._durable():
            out = self._insert_key(tenant)
        self.event("key_created", tenant, key_id=out[0])
        return out

    def _insert_key(self, tenant: str) -> tuple[str, str]:
        key_id = "key_" + secrets.token_hex(6)
        api_key = KEY_PREFIX + secrets.token_urlsafe(32)
        self.db.table("api_keys").insert({"key_id": key_id, "tenant": tenant,
                                    "key_hash": hash_key(api_key), "created_at": self.clock(),
                                    "revoked_at": None})
        return key_id, api_key

    def revoke_key(self, tenant: str, key_id: str) -> bool:
        """Revoke a key of `tenant`; False if it has no such key. Revoking twice is a no-op."""
        with self._durable():
            cur = self.db.execute(
                "UPDATE api_keys SET revoked_at = coalesce(revoked_at, ?) WHERE key_id = ? "
                "AND tenant = ?", [self.clock(), key_id, tenant])
        if cur.rowcount:
            self.event("key_revoked", tenant, key_id=key_id)
        return bool(cur.rowcount)

    def keys(self, tenant: str) -> list[ApiKey]:
        return [ApiKey(r["key_id"], r["tenant"], r["created_at"], r["revoked_at"])
                for r in self.db.table("api_keys").rows_where("tenant = ?", [tenant], order_by="created_at")]

    def lookup_key(self, api_key: str) -> ApiKey | None:
        """The key record for a presented API key (revoked ones too), or None."""
        rows = self._rows("SELECT * FROM api_keys WHERE key_hash = ?", [hash_key(api_key)])
        if not rows:
            return None
        r = rows[0]
        return ApiKey(r["key_id"], r["tenant"], r["created_at"], r["revoked_at"])

    # ---- toolsets -----------------------------------------------------------------------
    @staticmethod
    def _toolset(r: dict[str, Any]) -> Toolset:
        ids = tuple(np.frombuffer(r["input_ids"], dtype="<i4").tolist())
        return Toolset(r["toolset"], r["tenant"], bytes.fromhex(r["namespace"]), r["depth"], ids,
                       bool(r["pinned"]), bool(r["shared"]), r["created_at"])

    def put_toolset(self, tenant: str, namespace: bytes, key: bytes, input_ids: Iterable[int], *,
                    pinned: bool | None = None, shared: bool | None = None) -> Toolset:
        """Record (or update) the toolset whose instruction anchor is `key`; flags left None
        keep their stored value (False for a new toolset)."""
        ids = np.asarray(list(input_ids), dtype="<i4")
        old = self.toolset(key.hex())
        if old is not None and old.tenant != tenant:
            raise LedgerError("toolset key collision across tenants")  # keys carry the tenant
        if old is not None and pinned in (None, old.pinned) and shared in (None, old.shared) \
                and old.namespace == namespace and old.input_ids == tuple(ids.tolist()):
            return old  # recorded as it is (each turn on a toolset settles it again)
        row = {"toolset": key.hex(), "tenant": tenant, "namespace": namespace.hex(),
               "depth": len(ids), "input_ids": ids.tobytes(),
               "pinned": int(pinned if pinned is not None else (old.pinned if old else False)),
               "shared": int(shared if shared is not None else (old.shared if old else False)),
               "created_at": old.created_at if old else self.clock()}
        self.db.table("toolsets").upsert(row, pk="toolset")
        ts = self.toolset(key.hex())
        assert ts is not None
        return ts

    def toolset(self, toolset: str) -> Toolset | None:
        rows = self._rows("SELECT * FROM toolsets WHERE toolset = ?", [toolset])
        return self._toolset(rows[0]) if rows else None

    def toolsets(self, tenant: str | None = None, *, pinned: bool | None = None,
                 shared: bool | None = None) -> list[Toolset]:
        where, args = self._where(tenant=tenant, pinned=None if pinned is None else int(pinned),
                                  shared=None if shared is None else int(shared))
        return [self._toolset(r) for r in self.db.table("toolsets").rows_where(where, args, order_by="created_at")]

    def set_toolset(self, toolset: str, *, pinned: bool | None = None,
                    shared: bool | None = None) -> Toolset:
        if self.toolset(toolset) is None:
            raise LedgerError(f"no toolset {toolset!r}")
        changes = {k: int(v) for k, v in (("pinned", pinned), ("shared", shared)) if v is not None}
        if changes:
            self.db.table("toolsets").update(toolset, changes)
        ts = self.toolset(toolset)
        assert ts is not None
        return ts

    # ---- stored responses (the Responses API's `store`) ---------------------------------
    def put_response(self, response_id: str, tenant: str, body: bytes, *, ttl_s: float,
                     max_tenant_bytes: int | None = None) -> int:
        """Store (or replace) a response of `tenant` until `ttl_s` from now. With
        `max_tenant_bytes`, the tenant's oldest other responses are deleted until its stored
        bodies fit (one tenant cannot fill the disk); how many were deleted."""
        now = self.clock()
        with self.transaction():
            self.db.table("responses").upsert({"id": response_id, "tenant": tenant,
                                               "created_at": now, "expires_at": now + ttl_s,
                                               "body": body}, pk="id")
            if max_tenant_bytes is None:
                return 0
            rows = self.db.execute("SELECT id, length(body) FROM responses WHERE tenant = ? "
                                   "ORDER BY created_at DESC, rowid DESC", [tenant]).fetchall()
            total, drop = 0, []
            for rid, size in rows:
                total += size
                if total > max_tenant_bytes and rid != response_id:
                    drop.append(rid)
            for rid in drop:
                self.db.execute("DELETE FROM responses WHERE id = ?", [rid])
        return len(drop)

    def response(self, response_id: str, tenant: str) -> bytes | None:
        """A stored response's body, if `tenant` stored it and it has not expired: another
        tenant's id reads as unknown."""
        row = self.db.execute("SELECT body FROM responses WHERE id = ? AND tenant = ? AND "
                              "expires_at > ?", [response_id, tenant, self.clock()]).fetchone()
        return bytes(row[0]) if row is not None else None

    def delete_response(self, response_id: str, tenant: str) -> bool:
        """Delete a response `tenant` stored; False if it has none by that id."""
        with self.transaction():
            cur = self.db.execute("DELETE FROM responses WHERE id = ? AND tenant = ? AND "
                                  "expires_at > ?", [response_id, tenant, self.clock()])
        return bool(cur.rowcount)

    # ---- reservations and anchors -------------------------------------------------------
    @staticmethod
    def _where(**eq: Any) -> tuple[str | None, list[Any]]:
        parts, args = [], []
        for col, value in eq.items():
            if value is not None:
                parts.append(f"{col} = ?")
                args.append(value)
        return (" AND ".join(parts) or None), args

    def open_reservation(self, rid: str, tenant: str, worker: str, epoch: str) -> None:
        self.db.execute("INSERT INTO reservations (rid, tenant, worker, epoch, opened_at, outcome, "
                        "owner) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        [rid, tenant, worker, epoch, self.clock(), ReservationOutcome.OPEN.value,
                         self.owner])

    def close_reservation(self, rid: str, outcome: ReservationOutcome, reason: str | None = None) -> bool:
        """Close an open reservation; anchors of it still reserved become aborted. False if it
        was not open (closed already, e.g. by reconcile)."""
        now = self.clock()
        with self.transaction():
            cur = self.db.execute(
                "UPDATE reservations SET outcome = ?, reason = ?, closed_at = ? "
                "WHERE rid = ? AND outcome = 'open'", [outcome.value, reason, now, rid])
            self.db.execute("UPDATE anchors SET status = 'aborted', updated_at = ? "
                            "WHERE rid = ? AND status = 'reserved'", [now, rid])
        return bool(cur.rowcount)

    def reservations(self, outcome: ReservationOutcome | None = None) -> list[dict[str, Any]]:
        where, args = self._where(outcome=outcome.value if outcome else None)
        return list(self.db.table("reservations").rows_where(where, args, order_by="opened_at"))

    def _upsert_anchors(self, rid: str | None, worker: str, epoch: str, namespace: bytes,
                        tenant: str, anchors: Iterable[NewAnchor], status: AnchorStatus) -> None:
        now = self.clock()
        anchors = list(anchors)
        if self._hits and any((worker, epoch, a.key.hex()) in self._hits for a in anchors):
            self.flush_hits()  # (a re-written key's hits are its old incarnation's)
        # a re-written key starts over; one reported held keeps its hits
        self.db.conn.executemany(
            "INSERT INTO anchors (worker, epoch, key, depth, parent, namespace, tenant, slot, "
            "nbytes, kind, status, hits, last_hit, rid, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, NULL, ?, ?, ?) "
            "ON CONFLICT (worker, epoch, key) DO UPDATE SET depth = excluded.depth, "
            "parent = excluded.parent, slot = excluded.slot, nbytes = excluded.nbytes, "
            "kind = excluded.kind, status = excluded.status, rid = excluded.rid, "
            "namespace = excluded.namespace, tenant = excluded.tenant, "
            "updated_at = excluded.updated_at, "
            "hits = CASE WHEN anchors.status = 'committed' THEN anchors.hits ELSE 0 END",
            [[worker, epoch, a.key.hex(), a.depth, _hex(a.parent), namespace.hex(), tenant,
              a.slot, a.nbytes, a.kind, status.value, rid, now, now] for a in anchors])

    def record_written(self, rid: str, worker: str, epoch: str, namespace: bytes, tenant: str,
                       anchors: Iterable[NewAnchor]) -> None:
        """Snapshots the worker wrote for `rid`: reserved until `commit`."""
        with self.transaction():
            self._upsert_anchors(rid, worker, epoch, namespace, tenant, anchors, AnchorStatus.RESERVED)

    def record_committed(self, rid: str, worker: str, epoch: str, namespace: bytes, tenant: str,
                         anchors: Iterable[NewAnchor]) -> None:
        """Snapshots the worker wrote for `rid` and confirmed as the request ended (in band):
        committed at once (one statement, where `record_written` then `commit` take two)."""
        with self.transaction():
            self._upsert_anchors(rid, worker, epoch, namespace, tenant, anchors, AnchorStatus.COMMITTED)

    def record_held(self, worker: str, epoch: str, namespace: bytes, tenant: str,
                    anchors: Iterable[NewAnchor]) -> None:
        """Anchors the worker reported it already held: committed (the worker says so)."""
        with self.transaction():
            self._upsert_anchors(None, worker, epoch, namespace, tenant, anchors, AnchorStatus.COMMITTED)

    def commit(self, worker: str, epoch: str, keys: Iterable[bytes]) -> None:
        """The worker confirmed these anchors."""
        now = self.clock()
        with self.transaction():
            self.db.conn.executemany("UPDATE anchors SET status = 'committed', updated_at = ? "
                                     "WHERE worker = ? AND epoch = ? AND key = ?",
                                     [[now, worker, epoch, key.hex()] for key in keys])

    def mark(self, worker: str, epoch: str, keys: Iterable[bytes], status: AnchorStatus) -> int:
        """Set committed/reserved anchors' status (evicted, lost...); returns how many changed."""
        now = self.clock()
        with self.transaction():
            return self.db.conn.executemany(
                "UPDATE anchors SET status = ?, updated_at = ? WHERE worker = ? AND epoch = ? "
                "AND key = ? AND status IN ('committed', 'reserved')",
                [[status.value, now, worker, epoch, key.hex()] for key in keys]).rowcount

    def lose_worker(self, worker: str) -> int:
        """`worker` went out of reach: its committed and reserved anchors become lost (a
        reconcile at the same epoch, once it answers again, takes back those it still lists).
        Returns how many."""
        with self.transaction():
            return self.db.execute(
                "UPDATE anchors SET status = 'lost', updated_at = ? WHERE worker = ? "
                "AND status IN ('committed', 'reserved')", [self.clock(), worker]).rowcount

    def record_hits(self, worker: str, epoch: str, keys: Iterable[bytes]) -> None:
        """A hit on each of `keys` (a chain's links), written now."""
        self.note_hits(worker, epoch, keys)
        self.flush_hits()

    def note_hits(self, worker: str, epoch: str, keys: Iterable[bytes]) -> None:
        """A hit on each of `keys`, counted in memory and written with the others at most
        `HITS_FLUSH_S` later (`flush_hits`): a request that restored a long chain costs no
        UPDATE per link. Every read of this ledger that returns hits writes them first; a
        re-written key writes its own first; another process sees them within
        `HITS_FLUSH_S` of a later request, a `flush_hits` or `close`."""
        now = self.clock()
        for key in keys:
            entry = self._hits.setdefault((worker, epoch, key.hex()), [0, now])
            entry[0] += 1
            entry[1] = now
        if now - self._hits_flushed >= HITS_FLUSH_S:
            self.flush_hits()

    def flush_hits(self) -> None:
        """Write the hits `note_hits` counted: one UPDATE per key hit, in one transaction."""
        self._hits_flushed = self.clock()
        if not self._hits:
            return
        pending, self._hits = self._hits, {}
        with self.transaction():
            self.db.conn.executemany(
                "UPDATE anchors SET hits = hits + ?, last_hit = max(coalesce(last_hit, 0), ?) "
                "WHERE worker = ? AND epoch = ? AND key = ?",
                [[int(n), last, worker, epoch, key]
                 for (worker, epoch, key), (n, last) in pending.items()])

    @staticmethod
    def _anchor(r: dict[str, Any]) -> AnchorRow:
        return AnchorRow(bytes.fromhex(r["key"]), r["depth"], _unhex(r["parent"]),
                         bytes.fromhex(r["namespace"]), r["tenant"], r["worker"], r["epoch"],
                         r["slot"], r["nbytes"], r["kind"], AnchorStatus(r["status"]), r["hits"],
                         r["last_hit"], r["created_at"])

    def anchors(self, *, worker: str | None = None, epoch: str | None = None,
                tenant: str | None = None, status: AnchorStatus | None = None,
                key: bytes | None = None) -> list[AnchorRow]:
        self.flush_hits()
        where, args = self._where(worker=worker, epoch=epoch, tenant=tenant,
                                  status=status.value if status else None,
                                  key=key.hex() if key else None)
        return [self._anchor(r) for r in self.db.table("anchors").rows_where(where, args, order_by="depth, created_at")]

    def anchor_bytes(self, tenant: str, worker: str, epoch: str) -> int:
        row = self.db.execute(
            "SELECT coalesce(sum(nbytes), 0) FROM anchors WHERE tenant = ? AND worker = ? "
            "AND epoch = ? AND status IN ('committed', 'reserved')", [tenant, worker, epoch]).fetchone()
        return int(row[0])

    def stats(self) -> dict[str, Any]:
        self.flush_hits()
        q = self.db.execute
        by_status = dict(q("SELECT status, count(*) FROM anchors GROUP BY status").fetchall())
        held = q("SELECT coalesce(sum(nbytes), 0), coalesce(sum(hits), 0) FROM anchors "
                 "WHERE status = 'committed'").fetchone()
        outcomes = dict(q("SELECT outcome, count(*) FROM reservations GROUP BY outcome").fetchall())
        reasons = dict(q("SELECT coalesce(reason, ''), count(*) FROM reservations "
                         "WHERE outcome IN ('aborted', 'abandoned') GROUP BY reason").fetchall())
        return {"anchors": by_status, "bytes_committed": held[0], "hits": held[1],
                "reservations": outcomes, "aborted_by_reason": reasons,
                "tenants": q("SELECT count(*) FROM tenants").fetchone()[0],
                "toolsets": q("SELECT count(*) FROM toolsets").fetchone()[0],
                "pinned_toolsets": q("SELECT count(*) FROM toolsets WHERE pinned").fetchone()[0]}

    # ---- several processes on one ledger -------------------------------------------------
    def number_anchor_changes(self) -> None:
        """From now on, number every change this connection makes to an anchor's status,
        slot or epoch (for `anchor_changes`): one of several processes calls it at start.
        Temporary triggers, this connection's alone: one process, which nobody reads the
        numbers of, pays nothing for them. SQLite's one writer at a time makes the numbers
        commit in order."""
        bump = ("BEGIN UPDATE anchor_seq SET value = value + 1 WHERE id = 1; "
                "UPDATE anchors SET seq = (SELECT value FROM anchor_seq WHERE id = 1) "
                "WHERE rowid = NEW.rowid; END")
        self.db.execute("CREATE TEMP TRIGGER IF NOT EXISTS anchors_seq_insert AFTER INSERT ON "
                        f"main.anchors {bump}")
        self.db.execute("CREATE TEMP TRIGGER IF NOT EXISTS anchors_seq_update AFTER UPDATE OF "
                        f"status, slot, epoch ON main.anchors {bump}")

    def anchor_seq(self) -> int:
        """The number of the last anchor change (`anchor_changes` reads those after it)."""
        return int(self.db.execute("SELECT value FROM anchor_seq WHERE id = 1").fetchone()[0])

    def anchor_changes(self, after: int, limit: int = 10_000) -> tuple[int, list[AnchorRow]]:
        """Anchors whose status, slot or epoch changed after change number `after` (by any
        process), as they are now, in the order of their last change; and the number to
        ask after next time. One indexed read; nothing when nothing changed."""
        self.flush_hits()
        rows = self._rows("SELECT * FROM anchors WHERE seq > ? ORDER BY seq LIMIT ?",
                          [after, limit])
        return (rows[-1]["seq"] if rows else after), [self._anchor(r) for r in rows]

    def try_lock(self, name: str, owner: str, ttl_s: float) -> bool:
        """Take the lock `name` for `owner` until `ttl_s` from now (again, if `owner` holds
        it); False while another owner holds it unexpired. One statement: atomic across
        processes."""
        now = self.clock()
        with self.transaction():
            return bool(self.db.execute(
                "INSERT INTO locks (name, owner, expires_at) VALUES (?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, "
                "expires_at = excluded.expires_at "
                "WHERE locks.expires_at <= ? OR locks.owner = excluded.owner",
                [name, owner, now + ttl_s, now]).rowcount)

    def unlock(self, name: str, owner: str) -> None:
        with self.transaction():
            self.db.execute("DELETE FROM locks WHERE name = ? AND owner = ?", [name, owner])

    def enter_flight(self, tenant: str, limit: int | None) -> bool:
        """One more request of `tenant` in flight in this process, unless the tenant has
        `limit` in flight in all processes together already (then False, nothing counted).
        One statement, which takes the write lock before it reads the total: two processes
        cannot both take the last place."""
        with self.transaction():
            return bool(self.db.execute(
                "INSERT INTO in_flight (tenant, owner, num_requests) SELECT ?, ?, 1 "
                "WHERE ? IS NULL OR (SELECT coalesce(sum(num_requests), 0) FROM in_flight "
                "WHERE tenant = ?) < ? "
                "ON CONFLICT (tenant, owner) DO UPDATE SET num_requests = num_requests + 1",
                [tenant, self.owner, limit, tenant, limit]).rowcount)

    def leave_flight(self, tenant: str) -> None:
        with self.transaction():
            self.db.execute("UPDATE in_flight SET num_requests = num_requests - 1 "
                            "WHERE tenant = ? AND owner = ?", [tenant, self.owner])
            self.db.execute("DELETE FROM in_flight WHERE owner = ? AND num_requests <= 0",
                            [self.owner])

    def flights(self) -> dict[str, int]:
        """Requests in flight per tenant, every process's together."""
        return dict(self.db.execute("SELECT tenant, sum(num_requests) FROM in_flight "
                                    "GROUP BY tenant HAVING sum(num_requests) > 0").fetchall())

    def forget_flights(self, alive: Callable[[int], bool]) -> int:
        """Drop the requests in flight of processes that are gone (`alive` False) and this
        one's (a process starts with none; its pid may be a dead one's); how many rows."""
        owners = [o for (o,) in self.db.execute("SELECT DISTINCT owner FROM in_flight")
                  if o == self.owner or not alive(o)]
        with self.transaction():
            return sum(self.db.execute("DELETE FROM in_flight WHERE owner = ?", [o]).rowcount
                       for o in owners)

    # ---- reconcile ----------------------------------------------------------------------
    def reconcile(self, worker: str, epoch: str, held: Iterable[HeldSlot], *,
                  staged: Iterable[tuple[int, bytes]] = (), in_flight: Iterable[str] = (),
                  reason: str = "reconcile",
                  alive: Callable[[int], bool] | None = None) -> ReconcileReport:
        """Bring the ledger in line with `worker`'s slot listing at `epoch`.

        `held`: the worker's committed slots; `staged`: its reserved (unconfirmed) slots as
        (slot, key); `in_flight`: rids this proxy is still running (their reservations and
        reserved anchors are left to them; empty at start). Anchors of other epochs become
        lost (and lost ones of this epoch it still lists, committed again: it was out of
        reach, not restarted); committed anchors the worker no longer lists become evicted; reserved anchors it
        lists as committed are adopted (a confirm whose reply was lost), the others aborted;
        open reservations not in flight are closed as abandoned.

        Anchors listed on the worker's disk tier only (`held` with `slot` None) that the
        ledger holds no live row of at this epoch are *recovered*: a restarted worker lists
        the files it indexed, a worker sharing a directory lists another's. (One listed in a
        memory slot under a new epoch was put there by this epoch's requests, whose replies
        recorded it already; one the ledger lost track of stays out.) Each is committed
        under this epoch for the namespace and tenant the ledger recorded it for, on any
        worker at any epoch; the key is derived from that namespace, so no other tenant's
        prompt can ever key it. A key the ledger never saw, or saw at another depth or for
        more than one (namespace, tenant), is left out: nothing says whose it is.

        `alive(owner)` (one of several processes of a proxy): the open reservations of
        another process for which it says True are in flight too, as this one's own are.
        """
        now = self.clock()
        by_key = {h.key.hex(): h for h in held}
        staged_set = {(slot, key.hex()) for slot, key in staged}
        keep = set(in_flight)
        if alive is not None:
            keep |= {rid for rid, owner in self.db.execute(
                "SELECT rid, owner FROM reservations WHERE worker = ? AND outcome = 'open' "
                "AND owner IS NOT NULL AND owner != ?", [worker, self.owner])
                if alive(owner)}
        kept = adopted = evicted = aborted = 0
        stale: list[int] = []
        with self.transaction():
            lost = self.db.execute(
                "UPDATE anchors SET status = 'lost', updated_at = ? WHERE worker = ? AND epoch != ? "
                "AND status IN ('committed', 'reserved')", [now, worker, epoch]).rowcount
            rows = list(self.db.execute(
                "SELECT key, depth, status, slot, rid FROM anchors WHERE worker = ? AND epoch = ? "
                "AND status IN ('committed', 'reserved', 'lost')", [worker, epoch]).fetchall())
            for key, depth, status, slot, rid in rows:
                if status == "reserved" and rid in keep:
                    continue
                h = by_key.get(key)
                if h is not None and h.depth == depth:  # lost: out of reach, not restarted
                    self.db.execute("UPDATE anchors SET status = 'committed', slot = ?, nbytes = ?, "
                                    "updated_at = ? WHERE worker = ? AND epoch = ? AND key = ?",
                                    [h.slot, h.nbytes, now, worker, epoch, key])
                    kept += status in ("committed", "lost")
                    adopted += status == "reserved"
                    continue
                if status == "lost":  # not listed: stays lost
                    continue
                new = "evicted" if status == "committed" else "aborted"
                self.db.execute("UPDATE anchors SET status = ?, updated_at = ? WHERE worker = ? "
                                "AND epoch = ? AND key = ?", [new, now, worker, epoch, key])
                if status == "committed":
                    evicted += 1
                else:
                    aborted += 1
                    if (slot, key) in staged_set:
                        stale.append(slot)
            seen = {key for key, *_ in rows}
            recovered = self._recover(worker, epoch, [h for k, h in by_key.items()
                                                      if k not in seen and h.slot is None], now)
            open_rids = [r for (r,) in self.db.execute(
                "SELECT rid FROM reservations WHERE worker = ? AND outcome = 'open'", [worker])
                if r not in keep]
            for rid in open_rids:
                self.db.execute("UPDATE reservations SET outcome = 'abandoned', reason = ?, "
                                "closed_at = ? WHERE rid = ?", [reason, now, rid])
        report = ReconcileReport(worker, epoch, kept, adopted, lost, evicted, aborted,
                                 len(open_rids), tuple(sorted(stale)), recovered)
        self.event("reconcile", None, reason=reason, **report.to_json())
        return report

    def _recover(self, worker: str, epoch: str, listed: Iterable[HeldSlot], now: float) -> int:
        """Commit `listed` under (`worker`, `epoch`) for the one namespace and tenant the
        ledger knows each key by (see `reconcile`); how many. In reconcile's transaction."""
        n = 0
        for h in listed:
            owners = self.db.execute(
                "SELECT DISTINCT namespace, tenant, depth FROM anchors WHERE key = ?",
                [h.key.hex()]).fetchall()
            if len(owners) != 1 or owners[0][2] != h.depth:
                continue
            namespace, tenant, _ = owners[0]
            (kind,) = self.db.execute(
                "SELECT kind FROM anchors WHERE key = ? ORDER BY updated_at DESC LIMIT 1",
                [h.key.hex()]).fetchone()
            self.db.execute(
                "INSERT INTO anchors (worker, epoch, key, depth, parent, namespace, tenant, slot, "
                "nbytes, kind, status, hits, last_hit, rid, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'committed', 0, NULL, NULL, ?, ?) "
                "ON CONFLICT (worker, epoch, key) DO UPDATE SET status = 'committed', "
                "slot = excluded.slot, nbytes = excluded.nbytes, parent = excluded.parent, "
                "updated_at = excluded.updated_at",
                [worker, epoch, h.key.hex(), h.depth, _hex(h.parent), namespace, tenant, h.slot,
                 h.nbytes, kind, now, now])
            n += 1
        return n


def _lock(path: Path) -> int:
    """An exclusive lock on `path` (created if needed), held by the returned descriptor;
    LedgerError naming the process that holds it already."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise LedgerError(f"the ledger {path.parent} is in use by another proxy (pid {holder}); "
                          "give each proxy a state dir of its own (--state-dir)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
