"""The ledger's schema as an ordered list of migrations; `PRAGMA user_version` is the version.

A migration is a function of the database that moves it from version i to i + 1; each is
idempotent (`if_not_exists`) and bumps the version last, so a proxy killed mid-migration
simply runs it again. They run at open: a ledger written by an older proxy opens cleanly,
one written by a newer proxy is refused instead of being misread.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlite_utils


def _v1(db: sqlite_utils.Database) -> None:
    db.table("tenants").create({"name": str, "salt": str, "max_pinned_toolsets": int,
                          "max_anchor_bytes": int, "max_in_flight": int, "created_at": float},
                         pk="name", if_not_exists=True)
    db.table("api_keys").create({"key_id": str, "tenant": str, "key_hash": str, "created_at": float,
                           "revoked_at": float}, pk="key_id",
                          foreign_keys=[("tenant", "tenants", "name")], if_not_exists=True)
    db.table("api_keys").create_index(["key_hash"], unique=True, if_not_exists=True)
    db.table("toolsets").create({"toolset": str, "tenant": str, "namespace": str, "depth": int,
                           "input_ids": bytes, "pinned": int, "shared": int,
                           "created_at": float}, pk="toolset",
                          foreign_keys=[("tenant", "tenants", "name")], if_not_exists=True)
    db.table("anchors").create({"worker": str, "epoch": str, "key": str, "depth": int, "parent": str,
                          "namespace": str, "tenant": str, "slot": int, "nbytes": int,
                          "kind": str, "status": str, "hits": int, "last_hit": float,
                          "rid": str, "created_at": float, "updated_at": float},
                         pk=("worker", "epoch", "key"), not_null={"status"}, if_not_exists=True)
    db.table("anchors").create_index(["status", "worker", "epoch"], if_not_exists=True)
    db.table("anchors").create_index(["tenant", "status"], if_not_exists=True)
    db.table("reservations").create({"rid": str, "tenant": str, "worker": str, "epoch": str,
                               "opened_at": float, "closed_at": float, "outcome": str,
                               "reason": str}, pk="rid", if_not_exists=True)
    db.table("reservations").create_index(["outcome"], if_not_exists=True)
    db.table("events").create({"id": int, "at": float, "kind": str, "tenant": str, "detail": str},
                        pk="id", if_not_exists=True)


def _v2(db: sqlite_utils.Database) -> None:
    # stored Responses API responses (proxy/responses_api.py): the response and its whole
    # conversation as one orjson blob, per tenant, until `expires_at`
    db.table("responses").create({"id": str, "tenant": str, "created_at": float,
                                  "expires_at": float, "body": bytes}, pk="id",
                                 not_null={"tenant", "expires_at", "body"},
                                 if_not_exists=True)
    db.table("responses").create_index(["expires_at"], if_not_exists=True)


def _v3(db: sqlite_utils.Database) -> None:
    # reconcile looks an anchor up by key alone: a restarted worker's disk tier lists anchors
    # of earlier epochs, a shared directory another worker's (Ledger._recover)
    db.table("anchors").create_index(["key"], if_not_exists=True)


def _v4(db: sqlite_utils.Database) -> None:
    # several proxy processes on one ledger (proxy/processes.py):
    # - with several, every change of an anchor's status, slot or epoch takes the next number
    #   of `anchor_seq` (`Ledger.number_anchor_changes`), so a process reads what the others
    #   changed since it last looked (`Ledger.anchor_changes`); a counter, not max(seq):
    #   deleted rows never hand a number out twice
    # - a reservation names the process that opened it (`owner`, its pid): a process
    #   reconciling leaves a live sibling's open reservations alone
    # - `in_flight`: each process's requests in flight per tenant (the tenant quota across
    #   processes); `locks`: named, expiring, cross-process locks (warming a toolset once)
    if "seq" not in db.table("anchors").columns_dict:
        db.execute("ALTER TABLE anchors ADD COLUMN seq INTEGER")
    db.table("anchors").create_index(["seq"], if_not_exists=True)
    db.execute("CREATE TABLE IF NOT EXISTS anchor_seq (id INTEGER PRIMARY KEY, value INTEGER NOT NULL)")
    db.execute("INSERT OR IGNORE INTO anchor_seq (id, value) VALUES (1, 0)")
    if "owner" not in db.table("reservations").columns_dict:
        db.execute("ALTER TABLE reservations ADD COLUMN owner INTEGER")
    db.table("in_flight").create({"tenant": str, "owner": int, "num_requests": int},
                                 pk=("tenant", "owner"), not_null={"num_requests"},
                                 if_not_exists=True)
    db.table("locks").create({"name": str, "owner": str, "expires_at": float}, pk="name",
                             not_null={"owner", "expires_at"}, if_not_exists=True)


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_v1, _v2, _v3, _v4]
SCHEMA_VERSION = len(MIGRATIONS)


class SchemaError(RuntimeError):
    pass


def migrate(db: sqlite_utils.Database) -> int:
    """Bring `db` to `SCHEMA_VERSION`; returns the version it had. Raises SchemaError for a
    ledger from a newer anchorcache."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaError(f"the ledger has schema version {version}; this anchorcache knows "
                          f"up to {SCHEMA_VERSION} (upgrade anchorcache or use another "
                          f"ANCHORCACHE_STATE_DIR)")
    for i in range(version, SCHEMA_VERSION):
        with db.atomic():  # a migration and its version number, whole or not at all
            MIGRATIONS[i](db)
            db.execute(f"PRAGMA user_version = {i + 1}")
    return int(version)
