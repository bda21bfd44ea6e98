"""The catalog: the schema of what a store holds, and every query on it (the only SQLAlchemy user).

SQLite by default, PostgreSQL (or any SQLAlchemy URL) by `StoreConfig.catalog_url`.

    store_info   one row: format version, the spec of the model that wrote the store, the codec
    namespaces   one stream each, named by (user_id, agent_id, session_id); its committed stream
                 position and the checkpoint file that restores its resident state
    documents    what was ingested into a namespace: name, size, how far ingestion got (for resume)
    events       one row per sealed event: token span, surprise statistics, where its blob lives
                 (segment, offset, length, crc32) and in which codec

The catalog is the truth after a crash: a blob is on disk (fsynced) before the row that points at
it is committed, and anything on disk that no committed row points at is garbage to be removed. The
functions below take the engine and run one short session (one transaction where they write).
"""

from __future__ import annotations

import datetime as dt
import json
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (BigInteger, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint, column,
                        create_engine, delete, event, func, insert, inspect, select, table, text)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from engramkv.errors import StoreCorruptError, StoreError, StoreFullError
from engramkv.memory.events import DocumentProgress, Event
from engramkv.storage.segments import BlobRef

FORMAT_VERSION = 1


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Base(DeclarativeBase):
    pass


class StoreInfo(Base):
    __tablename__ = "store_info"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    format_version: Mapped[int] = mapped_column(Integer)
    store_uuid: Mapped[str] = mapped_column(String(36))  # also in STORE/STORE_ID: pairs catalog and directory
    fingerprint: Mapped[str] = mapped_column(Text)  # JSON of the writing model's ModelSpec.model_dump()
    codec: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class NamespaceRow(Base):
    __tablename__ = "namespaces"
    __table_args__ = (UniqueConstraint("user_id", "agent_id", "session_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[str] = mapped_column(String(128))
    agent_id: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(128))
    n_tokens: Mapped[int] = mapped_column(BigInteger, default=0)  # committed stream position
    n_events: Mapped[int] = mapped_column(Integer, default=0)
    checkpoint: Mapped[str | None] = mapped_column(String(64), nullable=True)  # file name under the namespace dir
    checkpoint_crc: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DocumentRow(Base):
    __tablename__ = "documents"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(Text)  # a path, or a label for text given directly
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    content_key: Mapped[str] = mapped_column(String(64))  # size + hash of the head: recognises the same file
    bytes_done: Mapped[int] = mapped_column(BigInteger, default=0)  # committed read position (resume here)
    token_start: Mapped[int] = mapped_column(BigInteger)
    token_end: Mapped[int] = mapped_column(BigInteger)
    complete: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (UniqueConstraint("namespace_id", "ordinal"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id", ondelete="CASCADE"), index=True)
    ordinal: Mapped[int] = mapped_column(Integer)  # the engine's event id inside its namespace (0, 1, 2, ...)
    document_id: Mapped[int | None] = mapped_column(ForeignKey("documents.id", ondelete="SET NULL"), nullable=True)
    token_start: Mapped[int] = mapped_column(BigInteger)
    token_end: Mapped[int] = mapped_column(BigInteger)
    surprise_mean: Mapped[float] = mapped_column(Float)
    surprise_max: Mapped[float] = mapped_column(Float)
    codec: Mapped[str] = mapped_column(String(16))  # the store's codec when the blob was written
    segment: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[int] = mapped_column(BigInteger)  # crc32 of the blob
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# ---------------------------------------------------------------------- what the queries return
@dataclass(frozen=True)
class StoreRecord:
    format_version: int
    store_uuid: str
    fingerprint: dict[str, Any]  # ModelSpec.model_dump() of the model that wrote the store, through JSON
    codec: str


@dataclass(frozen=True)
class NamespaceState:
    id: int
    names: tuple[str, str, str]  # (user_id, agent_id, session_id)
    n_tokens: int
    n_events: int
    checkpoint: str | None
    checkpoint_crc: int | None


@dataclass(frozen=True)
class StoredEvent:
    """One event row: the event and where its blob lives."""

    event: Event
    ref: BlobRef


# ---------------------------------------------------------------------- opening and migrating
# Catalogs whose events table still has the NOT NULL `tier` column that stores before the storage split
# wrote (always "disk", read by nothing). A writer drops it; where it cannot (SQLite before 3.35),
# inserts fill it in.
_KEEPS_TIER: weakref.WeakSet[Engine] = weakref.WeakSet()
_EVENTS_WITH_TIER = table("events", *(column(c.name) for c in EventRow.__table__.columns), column("tier"))


def open_catalog(url: str, writable: bool = True) -> Engine:
    """Create the tables if needed and, for a writer, migrate an older schema.

    SQLite gets WAL mode and foreign keys (off by default there). A reader changes no schema: no
    query reads a retired column.
    """
    engine = create_engine(url)

    @event.listens_for(engine, "handle_error")
    def _damaged(context: Any) -> None:
        # A damaged SQLite file fails wherever it is first read: say so, naming the file, for every query.
        text = str(context.original_exception)
        if engine.dialect.name == "sqlite" and any(sign in text for sign in _DAMAGED_SQLITE):
            raise _damaged_catalog(engine, text) from context.original_exception

    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
            except UnicodeDecodeError as err:  # a damaged header can name no text encoding SQLite knows
                raise _damaged_catalog(engine, str(err)) from err
            cursor.execute("PRAGMA synchronous=FULL")  # a commit must survive a power cut, not just a kill
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    try:
        if engine.dialect.name == "sqlite":  # a damaged page can read as an empty table: check every page first
            with engine.connect() as conn:
                problems = [str(p) for p in conn.exec_driver_sql("PRAGMA quick_check").scalars()]
            if problems != ["ok"]:
                raise _damaged_catalog(engine, "; ".join(problems[:3]))
        Base.metadata.create_all(engine)
    except BaseException:
        engine.dispose()
        raise
    if writable and "tier" in {c["name"] for c in inspect(engine).get_columns("events")}:
        if _drops_columns(engine):
            with engine.begin() as conn:
                conn.execute(text("ALTER TABLE events DROP COLUMN tier"))
        else:
            _KEEPS_TIER.add(engine)
    return engine


_DAMAGED_SQLITE = ("malformed", "file is not a database", "database corruption")  # SQLite of a file not a database


def _damaged_catalog(db: Engine, why: str) -> StoreCorruptError:
    return StoreCorruptError(f"the catalog {describe(db)} is damaged ({why}); the store cannot be read without "
                             "it: restore the file from a backup")


def _drops_columns(engine: Engine) -> bool:
    """Whether the database has ALTER TABLE ... DROP COLUMN (SQLite from 3.35; PostgreSQL always)."""
    version = engine.dialect.server_version_info  # known once create_all has connected
    return engine.dialect.name != "sqlite" or (version is not None and tuple(version) >= (3, 35))


@contextmanager
def _reading(db: Engine) -> Iterator[Session]:
    """A reading session; a row that cannot be decoded (bad UTF-8, a misplaced NULL) is a StoreCorruptError."""
    with Session(db) as session:
        try:
            yield session
        except (UnicodeDecodeError, ValueError, TypeError, KeyError) as err:
            raise _damaged_catalog(db, f"a row cannot be read: {err}") from err


def server_connection(url: str) -> Any:
    """A DBAPI connection of its own to the catalog server at `url`, outside any pool (a lock's: `locks`)."""
    engine = create_engine(url)  # for its dialect's connection arguments: it never connects itself
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    engine.dispose()
    return engine.dialect.connect(*cargs, **cparams)


def describe(db: Engine) -> str:
    """The catalog's URL without its password, for messages."""
    return db.url.render_as_string(hide_password=True)


# ---------------------------------------------------------------------- the store
def store_info(db: Engine) -> StoreRecord | None:
    with _reading(db) as session:
        row = session.scalars(select(StoreInfo)).first()
        if row is None:
            return None
        fingerprint = json.loads(row.fingerprint)
        if not isinstance(fingerprint, dict) or not all(isinstance(v, str) for v in (row.store_uuid, row.codec)):
            raise ValueError("the store record is not one")
        return StoreRecord(row.format_version, row.store_uuid, fingerprint, row.codec)


def create_store_info(db: Engine, store_uuid: str, fingerprint: dict[str, Any], codec: str) -> None:
    with Session(db) as session, session.begin():
        session.add(StoreInfo(id=1, format_version=FORMAT_VERSION, store_uuid=store_uuid,
                              fingerprint=json.dumps(fingerprint, sort_keys=True, default=str), codec=codec))


# ---------------------------------------------------------------------- namespaces
def get_or_create_namespace(db: Engine, names: tuple[str, str, str], create: bool) -> int | None:
    """The id of the namespace `names`, created when missing if `create`; None when missing otherwise."""
    with Session(db) as session, session.begin():
        user_id, agent_id, session_id = names
        row = session.scalars(select(NamespaceRow).filter_by(
            user_id=user_id, agent_id=agent_id, session_id=session_id)).first()
        if row is None:
            if not create:
                return None
            row = NamespaceRow(user_id=user_id, agent_id=agent_id, session_id=session_id, n_tokens=0, n_events=0)
            session.add(row)
            session.flush()
        return row.id


def namespace_state(db: Engine, ns_id: int) -> NamespaceState | None:
    with _reading(db) as session:
        row = session.get(NamespaceRow, ns_id)
        return None if row is None else _state(row)


def list_namespaces(db: Engine) -> list[tuple[NamespaceState, int]]:
    """Every namespace in id order, with its number of documents."""
    with _reading(db) as session:
        rows = session.scalars(select(NamespaceRow).order_by(NamespaceRow.id)).all()
        docs = dict(session.execute(select(DocumentRow.namespace_id, func.count())
                                    .group_by(DocumentRow.namespace_id)).all())
        return [(_state(row), int(docs.get(row.id, 0))) for row in rows]


def delete_namespace_rows(db: Engine, ns_id: int) -> None:
    """The namespace's rows and its events' and documents' rows, in one transaction."""
    with Session(db) as session, session.begin():
        session.execute(delete(EventRow).where(EventRow.namespace_id == ns_id))
        session.execute(delete(DocumentRow).where(DocumentRow.namespace_id == ns_id))
        session.execute(delete(NamespaceRow).where(NamespaceRow.id == ns_id))


def _state(row: NamespaceRow) -> NamespaceState:
    return NamespaceState(row.id, (row.user_id, row.agent_id, row.session_id), row.n_tokens, row.n_events,
                          row.checkpoint, row.checkpoint_crc)


# ---------------------------------------------------------------------- events and commits
def load_events(db: Engine, ns_id: int, start: int = 0, stop: int | None = None) -> list[StoredEvent]:
    """The namespace's committed events with ordinals in [start, stop), in ordinal order."""
    within = [EventRow.namespace_id == ns_id, EventRow.ordinal >= start]
    within += [] if stop is None else [EventRow.ordinal < stop]  # (int4 in PostgreSQL: no sentinel bound)
    with _reading(db) as session:
        rows = session.execute(
            select(EventRow.ordinal, EventRow.token_start, EventRow.token_end, EventRow.surprise_mean,
                   EventRow.surprise_max, EventRow.segment, EventRow.offset, EventRow.length, EventRow.checksum)
            .where(*within).order_by(EventRow.ordinal)
        ).all()
    return [StoredEvent(Event(r.ordinal, r.token_start, r.token_end, r.surprise_mean, r.surprise_max),
                        BlobRef(r.segment, r.offset, r.length, r.checksum)) for r in rows]


def commit_namespace(
    db: Engine, ns_id: int, events: Sequence[StoredEvent], codec: str, document: DocumentProgress | None,
    n_tokens: int, n_events: int, checkpoint: str, checkpoint_crc: int,
) -> int | None:
    """One transaction: insert `events`, save `document`'s progress, point the namespace at `checkpoint`
    (with its stream position and event count). Returns the document's row id (None without one). A
    refused write (the catalog's disk full, a lost server) is a StoreError and changes nothing."""
    try:
        return _commit_namespace(db, ns_id, events, codec, document, n_tokens, n_events, checkpoint, checkpoint_crc)
    except DBAPIError as err:
        raise _write_failed(db, err) from err


def _write_failed(db: Engine, err: DBAPIError) -> StoreError:
    cause = err.orig
    text = str(cause)
    # SQLite says SQLITE_FULL in words; PostgreSQL's SQLSTATE 53100 is disk_full (psycopg: sqlstate).
    if "disk is full" in text or "No space left" in text or getattr(cause, "sqlstate", None) == "53100":
        return StoreFullError(f"the catalog {describe(db)} has no space left ({text.strip()}); the store keeps "
                              "everything up to its last commit. Free space and run the same ingest again to resume.")
    return StoreError(f"the catalog {describe(db)} refused a commit ({text.strip()}); the store keeps its last commit")


def _commit_namespace(
    db: Engine, ns_id: int, events: Sequence[StoredEvent], codec: str, document: DocumentProgress | None,
    n_tokens: int, n_events: int, checkpoint: str, checkpoint_crc: int,
) -> int | None:
    with Session(db) as session, session.begin():
        document_id = _save_document(session, ns_id, document) if document is not None else None
        rows = [{"namespace_id": ns_id, "ordinal": e.event.id, "document_id": document_id,
                 "token_start": e.event.start, "token_end": e.event.end, "surprise_mean": e.event.surprise_mean,
                 "surprise_max": e.event.surprise_max, "codec": codec, "segment": e.ref.segment,
                 "offset": e.ref.offset, "length": e.ref.length, "checksum": e.ref.checksum} for e in events]
        if rows and db in _KEEPS_TIER:
            now = utcnow()  # a Core insert into a plain table clause applies no Python-side defaults
            session.execute(insert(_EVENTS_WITH_TIER), [{**row, "tier": "disk", "created_at": now} for row in rows])
        elif rows:
            session.execute(insert(EventRow), rows)
        ns = session.get(NamespaceRow, ns_id)
        if ns is None:
            raise StoreCorruptError(f"namespace {ns_id} vanished from the catalog {describe(db)}")
        ns.n_tokens, ns.n_events = n_tokens, n_events
        ns.checkpoint, ns.checkpoint_crc, ns.updated_at = checkpoint, checkpoint_crc, utcnow()
    return document_id


def _save_document(session: Session, ns_id: int, doc: DocumentProgress) -> int:
    row = session.get(DocumentRow, doc.id) if doc.id is not None else None
    if row is None:
        row = DocumentRow(namespace_id=ns_id, name=doc.name, size_bytes=doc.size_bytes,
                          content_key=doc.content_key, token_start=doc.token_start, token_end=doc.token_start)
        session.add(row)
    row.bytes_done, row.token_end, row.complete, row.updated_at = (
        doc.bytes_done, doc.token_end, doc.complete, utcnow())
    session.flush()
    return row.id


# ---------------------------------------------------------------------- documents
def last_document(db: Engine, ns_id: int) -> DocumentProgress | None:
    with _reading(db) as session:
        row = session.scalars(select(DocumentRow).where(DocumentRow.namespace_id == ns_id)
                              .order_by(DocumentRow.id.desc())).first()
        return None if row is None else _progress(row)


def documents(db: Engine, ns_id: int) -> list[DocumentProgress]:
    with _reading(db) as session:
        rows = session.scalars(select(DocumentRow).where(DocumentRow.namespace_id == ns_id)
                               .order_by(DocumentRow.id)).all()
        return [_progress(row) for row in rows]


def event_details(db: Engine, ns_id: int, ordinals: Sequence[int]) -> dict[int, tuple[str | None, dt.datetime]]:
    """(document name, time committed) of the committed events among `ordinals`."""
    with _reading(db) as session:
        rows = session.execute(
            select(EventRow.ordinal, DocumentRow.name, EventRow.created_at)
            .outerjoin(DocumentRow, EventRow.document_id == DocumentRow.id)
            .where(EventRow.namespace_id == ns_id, EventRow.ordinal.in_(list(ordinals)))
        ).all()
    return {ordinal: (name, created) for ordinal, name, created in rows}


def _progress(row: DocumentRow) -> DocumentProgress:
    return DocumentProgress(name=row.name, size_bytes=row.size_bytes, content_key=row.content_key,
                            token_start=row.token_start, bytes_done=row.bytes_done, token_end=row.token_end,
                            complete=row.complete, id=row.id)
