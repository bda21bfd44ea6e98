"""Who may write: one process per store directory (SQLite catalog), or one per namespace (PostgreSQL).

With the catalog in the store's own SQLite file, the writer holds an flock on STORE/LOCK, which holds its
pid: one writing process per store, any number of readers. With a PostgreSQL catalog, processes on several
machines write to one store (its directory on a path they all mount), each to its own namespaces: the writer
of a namespace holds a session-level advisory lock on it in PostgreSQL, on a connection of its own kept for
as long as the namespace is open. A process that dies loses that connection and the server releases the lock
(a SIGKILL included). A second writer gets `StoreLockedError` naming the holder: the host and pid its
connection announced as its application_name.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import Any

from engramkv.errors import StoreLockedError

# The first key of every engramkv advisory lock ("ekv"); the second is the namespace's catalog id.
ADVISORY_KEY = 0x656B76


class DirectoryLock:
    """flock on STORE/LOCK, holding the writer's pid; released by `release` or by the process's end."""

    def __init__(self, store: Path):
        fd = os.open(store / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreLockedError(
                f"store {store} is open for writing by another process (pid {holder}); "
                "one writer at a time — open it read-only or wait for that process to finish"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


class NamespaceLock:
    """A PostgreSQL advisory lock on one namespace, on its own connection of `db` (a SQLAlchemy Engine)."""

    def __init__(self, db: Any, ns_id: int, label: str):
        self._conn = db.connect()
        me = f"engramkv pid {os.getpid()} on {socket.gethostname()}"[:63]  # application_name holds 63 bytes
        keys = {"k1": ADVISORY_KEY, "k2": ns_id}
        try:
            self._conn.exec_driver_sql("SELECT set_config('application_name', %(me)s, false)", {"me": me})
            got = self._conn.exec_driver_sql("SELECT pg_try_advisory_lock(%(k1)s, %(k2)s)", keys).scalar()
            holder = None if got else self._conn.exec_driver_sql(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.classid::bigint = %(k1)s AND l.objid::bigint = %(k2)s "
                "AND l.objsubid = 2 AND l.granted", keys).scalar()
            self._conn.commit()  # a session-level lock outlives the transaction; the connection must not idle in one
        except BaseException:
            self._conn.close()
            raise
        if not got:
            self._conn.close()
            raise StoreLockedError(f"namespace {label} is open for writing by {holder or 'another process'}; one "
                                   "writer per namespace — open it read-only or wait for that writer to finish")
        self._keys = keys

    def release(self) -> None:
        if self._conn is None:
            return
        try:
            self._conn.exec_driver_sql("SELECT pg_advisory_unlock(%(k1)s, %(k2)s)", self._keys)
            self._conn.commit()
            self._conn.close()
        except Exception:  # noqa: BLE001 - a lost connection has released the lock already; drop it, do not pool it
            self._conn.invalidate()
        self._conn = None
