"""Committed-object metadata on disk (SQLite, WAL), so a master restart loses no object.

Why persist instead of only trusting node re-reports: a node re-reports what it holds, but only
the master knows each object's soft pin and TTL deadline, and a node cannot tell a committed
object from a put that was abandoned half-written. So the master keeps one row per committed
object (key, size, pin, TTL deadline, replicas as segment id + node id + offset,
checksum, the chain root of its namespace) and re-loads
them on start as *dormant* replicas, which become visible again when their segment (same stable
segment id, same node) remounts. Nodes may still re-report ``held`` objects on mount; the master
accepts both paths (see :mod:`pdserve.services.kvstore.master.state`).

The namespaces (chain root -> fingerprint digest, labels and tenant), the quarantines
(:mod:`.namespaces`) and the tenants' pins (:mod:`.pins`) have tables of their own, so a row
names its namespace by root only.

Writes are batched: the master calls :meth:`MetadataStore.apply` once per RPC with every
upsert and delete of that RPC, which is one transaction. Only JSON and plain columns are
stored; no pickle. Schema 3 added the root column and the two tables (a version 1 or 2 file
is migrated in place: its objects' namespaces are unknown); schema 4 the namespaces' tenant
column and the pins table (a version 3 file's namespaces have no tenant).
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import errors

SCHEMA_VERSION = 4


class StateDirInUse(errors.FailedPrecondition):
    """Another live master holds the state directory."""


@dataclass(frozen=True)
class StoredReplica:
    segment_id: str
    node_id: str
    offset: int


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    soft_pin: bool
    # Unix milliseconds when the TTL ends; 0 = no TTL.
    ttl_deadline_ms: int
    replicas: tuple[StoredReplica, ...]
    # The writer's checksum of the bytes (b"" = none).
    checksum: bytes = b""
    # The chain root (hex) of its namespace ("" = unknown).
    root: str = ""


@dataclass(frozen=True)
class StoredNamespace:
    """A chain root and the fingerprint (digest hex, labels) it belongs to."""

    root: str
    fingerprint: str
    labels: dict[str, str]
    #: The tenant whose requests write under it ("" = none).
    tenant: str = ""


@dataclass(frozen=True)
class StoredQuarantine:
    """A quarantined fingerprint: why, by whom, since when (unix ms)."""

    fingerprint: str
    reason: str
    by: str
    since_ms: int


@dataclass(frozen=True)
class StoredPin:
    """A tenant's pin: its name, chunk keys (chain order) and creation time (unix ms)."""

    tenant: str
    name: str
    keys: tuple[str, ...]
    created_ms: int


@dataclass
class NamespaceChanges:
    """One call's changes to the namespaces, quarantines and pins."""

    #: root -> its row, written.
    namespaces: dict[str, StoredNamespace] = field(default_factory=dict)
    #: Roots whose rows are deleted.
    dropped: set[str] = field(default_factory=set)
    #: digest -> its quarantine row (None = cleared: the row is deleted).
    quarantines: dict[str, StoredQuarantine | None] = field(default_factory=dict)
    #: (tenant, name) -> its pin row (None = unpinned: the row is deleted).
    pins: dict[tuple[str, str], StoredPin | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.namespaces or self.dropped or self.quarantines or self.pins)


class MetadataStore:
    """The SQLite file ``<state_dir>/kvstore-master.sqlite3``. Single-threaded use only."""

    def __init__(self, state_dir: str | Path) -> None:
        path = Path(state_dir).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / "kvstore-master.sqlite3"
        # One master per directory: two writing the same rows would corrupt each other.
        self._lock_fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StateDirInUse(
                f"state dir {path} is in use by another running kvstore master; give this one "
                "its own --state-dir (or --state-dir '' to keep metadata in memory only)"
            ) from None
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit survives a process crash (SIGKILL); only an OS crash
        # can lose the last transactions.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS objects ("
            " key TEXT PRIMARY KEY, size INTEGER NOT NULL, soft_pin INTEGER NOT NULL,"
            " ttl_deadline_ms INTEGER NOT NULL, replicas TEXT NOT NULL,"
            " checksum BLOB NOT NULL DEFAULT x'', root TEXT NOT NULL DEFAULT '')"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS namespaces ("
            " root TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, labels TEXT NOT NULL,"
            " tenant TEXT NOT NULL DEFAULT '')"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS quarantines (fingerprint TEXT PRIMARY KEY,"
            " reason TEXT NOT NULL, by_identity TEXT NOT NULL, since_ms INTEGER NOT NULL)"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS pins (tenant TEXT NOT NULL, name TEXT NOT NULL,"
            " keys TEXT NOT NULL, created_ms INTEGER NOT NULL, PRIMARY KEY (tenant, name))"
        )
        row = self._db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
        if row is not None and int(row[0]) == 1:  # version 1 had no checksums
            self._db.execute("ALTER TABLE objects ADD COLUMN checksum BLOB NOT NULL DEFAULT x''")
            row = ("2",)
        found = row
        if row is not None and int(row[0]) == 2:  # version 2 had no namespaces
            self._db.execute("ALTER TABLE objects ADD COLUMN root TEXT NOT NULL DEFAULT ''")
            row = ("4",)  # its namespaces table was made just now, with the tenant column
        if row is not None and int(row[0]) == 3:  # version 3 had no tenants
            self._db.execute("ALTER TABLE namespaces ADD COLUMN tenant TEXT NOT NULL DEFAULT ''")
            row = ("4",)
        if row is not found:
            self._db.execute("UPDATE meta SET value=? WHERE name='schema'", (str(SCHEMA_VERSION),))
        if row is None:
            self._db.execute(
                "INSERT INTO meta (name, value) VALUES ('schema', ?)", (str(SCHEMA_VERSION),)
            )
        elif int(row[0]) != SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path}: schema version {row[0]}, this master understands {SCHEMA_VERSION}"
            )

    def load(self) -> list[StoredObject]:
        out = []
        for key, size, pin, ttl, reps, checksum, root in self._db.execute(
            "SELECT key, size, soft_pin, ttl_deadline_ms, replicas, checksum, root FROM objects"
        ):
            replicas = tuple(StoredReplica(str(s), str(n), int(o)) for s, n, o in json.loads(reps))
            out.append(
                StoredObject(
                    key, int(size), bool(pin), int(ttl), replicas, bytes(checksum), str(root)
                )
            )
        return out

    def load_namespaces(self) -> tuple[list[StoredNamespace], list[StoredQuarantine]]:
        """The namespace and quarantine rows."""
        spaces = [
            StoredNamespace(str(r), str(f), dict(json.loads(labels)), str(t))
            for r, f, labels, t in self._db.execute(
                "SELECT root, fingerprint, labels, tenant FROM namespaces"
            )
        ]
        quarantines = [
            StoredQuarantine(str(f), str(reason), str(by), int(since))
            for f, reason, by, since in self._db.execute(
                "SELECT fingerprint, reason, by_identity, since_ms FROM quarantines"
            )
        ]
        return spaces, quarantines

    def load_pins(self) -> list[StoredPin]:
        """The pin rows."""
        return [
            StoredPin(str(t), str(n), tuple(json.loads(keys)), int(ms))
            for t, n, keys, ms in self._db.execute(
                "SELECT tenant, name, keys, created_ms FROM pins ORDER BY tenant, name"
            )
        ]

    def apply(
        self,
        upserts: Iterable[StoredObject],
        deletes: Iterable[str],
        changes: NamespaceChanges | None = None,
    ) -> None:
        """Writes one batch of changes in one transaction."""
        up = [
            (
                o.key,
                o.size,
                int(o.soft_pin),
                o.ttl_deadline_ms,
                json.dumps([[r.segment_id, r.node_id, r.offset] for r in o.replicas]),
                o.checksum,
                o.root,
            )
            for o in upserts
        ]
        dels = [(k,) for k in deletes]
        if not up and not dels and not changes:
            return
        self._db.execute("BEGIN")
        try:
            if dels:
                self._db.executemany("DELETE FROM objects WHERE key=?", dels)
            if up:
                self._db.executemany(
                    "INSERT OR REPLACE INTO objects"
                    " (key, size, soft_pin, ttl_deadline_ms, replicas, checksum, root)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    up,
                )
            if changes:
                self._apply_namespaces(changes)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _apply_namespaces(self, changes: NamespaceChanges) -> None:
        db = self._db
        db.executemany("DELETE FROM namespaces WHERE root=?", [(r,) for r in changes.dropped])
        db.executemany(
            "INSERT OR REPLACE INTO namespaces (root, fingerprint, labels, tenant)"
            " VALUES (?, ?, ?, ?)",
            [
                (n.root, n.fingerprint, json.dumps(n.labels, sort_keys=True), n.tenant)
                for n in changes.namespaces.values()
            ],
        )
        for (tenant, name), pin in changes.pins.items():
            if pin is None:
                db.execute("DELETE FROM pins WHERE tenant=? AND name=?", (tenant, name))
            else:
                db.execute(
                    "INSERT OR REPLACE INTO pins (tenant, name, keys, created_ms)"
                    " VALUES (?, ?, ?, ?)",
                    (tenant, name, json.dumps(list(pin.keys)), pin.created_ms),
                )
        for digest, q in changes.quarantines.items():
            if q is None:
                db.execute("DELETE FROM quarantines WHERE fingerprint=?", (digest,))
            else:
                db.execute(
                    "INSERT OR REPLACE INTO quarantines"
                    " (fingerprint, reason, by_identity, since_ms) VALUES (?, ?, ?, ?)",
                    (digest, q.reason, q.by, q.since_ms),
                )

    def close(self) -> None:
        self._db.close()
        os.close(self._lock_fd)
