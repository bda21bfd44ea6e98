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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engramkv.errors import StoreLockedError

# The first key of every engramkv advisory lock ("ekv"); the second is the namespace's catalog id, or 0 (ids
# start at 1) for opening the store itself.
ADVISORY_KEY = 0x656B76
OPEN_WAIT_S = 120  # the longest an opener of a shared store waits for another process opening it


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
    """A PostgreSQL advisory lock on one namespace, on a connection of its own (opened by the dialect of `db`, a
    SQLAlchemy Engine, outside its pool: a server holding many namespaces must not starve the pool)."""

    def __init__(self, db: Any, ns_id: int, label: str):
        cargs, cparams = db.dialect.create_connect_args(db.url)
        self._conn: Any = db.dialect.connect(*cargs, **cparams)  # a DBAPI connection
        me = f"engramkv pid {os.getpid()} on {socket.gethostname()}"[:63]  # application_name holds 63 bytes
        self._keys = (ADVISORY_KEY, ns_id)
        try:
            cursor = self._conn.cursor()
            cursor.execute("SELECT set_config('application_name', %s, false)", (me,))
            cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", self._keys)
            got = cursor.fetchone()[0]
            holder = None
            if not got:
                cursor.execute("SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                               "WHERE l.locktype = 'advisory' AND l.classid::bigint = %s AND l.objid::bigint = %s "
                               "AND l.objsubid = 2 AND l.granted", self._keys)
                row = cursor.fetchone()
                holder = row[0] if row else None
            self._conn.commit()  # a session-level lock outlives the transaction; the connection must not idle in one
        except BaseException:
            self._conn.close()
            raise
        if not got:
            self._conn.close()
            raise StoreLockedError(f"namespace {label} is open for writing by {holder or 'another process'}; one "
                                   "writer per namespace — open it read-only or wait for that writer to finish")

    def release(self) -> None:
        """Close the lock's connection: the server releases every lock the session held."""
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - a connection already lost has released the lock with it
                pass
            self._conn = None


@contextmanager
def opening_shared_store(conn: Any) -> Iterator[None]:
    """Held while a store with a PostgreSQL catalog is opened, on `conn` (a DBAPI connection of its own, closed
    at the end): processes started at once on a new store all find it missing, and only one may create its
    tables, STORE_ID, bases and catalog record (the others then open what it made). Opens of an existing store
    take turns for the few queries of their checks."""
    try:
        cursor = conn.cursor()
        cursor.execute(f"SET lock_timeout = '{OPEN_WAIT_S}s'")  # a holder stuck on a stalled mount must not hang all
        try:
            cursor.execute("SELECT pg_advisory_lock(%s, 0)", (ADVISORY_KEY,))  # waits while another opens it
        except Exception as err:  # noqa: BLE001 - the driver's lock-timeout error; which class is the driver's
            raise StoreLockedError(f"another process has been opening this store for {OPEN_WAIT_S} s ({err}); "
                                   "try again, or find the process stuck opening it") from err
        conn.commit()
        yield
    finally:
        conn.close()  # the server releases the lock with the connection
