"""The catalog: what a store holds, in SQL (SQLite by default, PostgreSQL by URL), via SQLAlchemy 2.0.

    store_info   one row: format version, the fingerprint of the model that wrote the store, the codec
    namespaces   one stream each, named by (user_id, agent_id, session_id); its committed stream
                 position and the checkpoint file that restores its resident state
    documents    what was ingested into a namespace: name, size, how far ingestion got (for resume)
    events       one row per sealed event: token span, surprise statistics, where its blob lives
                 (segment, offset, length, crc32) and in which codec

The catalog is the truth after a crash: a blob is on disk (fsynced) before the row that points at
it is committed, and anything on disk that no committed row points at is garbage to be removed.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    select,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

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
    fingerprint: Mapped[str] = mapped_column(Text)  # JSON of hf.ModelSpec.fingerprint()
    codec: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    def fingerprint_dict(self) -> dict[str, Any]:
        return dict(json.loads(self.fingerprint))


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
    tier: Mapped[str] = mapped_column(String(8), default="disk")
    codec: Mapped[str] = mapped_column(String(16))
    segment: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[int] = mapped_column(BigInteger)  # crc32 of the blob
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


def open_catalog(url: str) -> Engine:
    """Create the tables if needed. SQLite gets WAL mode and foreign keys (off by default there)."""
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")  # a commit must survive a power cut, not just a kill
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    Base.metadata.create_all(engine)
    return engine


def store_info(session: Session) -> StoreInfo | None:
    return session.scalars(select(StoreInfo)).first()
