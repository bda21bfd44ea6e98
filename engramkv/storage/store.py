"""The persistent event store: a directory of namespaces, each one stream's events, behind `EventMemory`.

    STORE/
      catalog.sqlite          the catalog (or any SQLAlchemy URL, e.g. PostgreSQL)
      LOCK                    flock'ed by the one writer; holds its pid
      ns/000001/              one directory per namespace, named by catalog id (never by user text,
        segments/*.seg        so no name can reach outside the store)
        index/layer-NNN.faiss, manifest.json
        checkpoint-NNNNNNNN.pt   the resident engine state at the last commit

An event blob is [token ids int32 (T,) | representatives float32 (layers, F) | layer 0 KV | ...],
each layer's KV in the store's codec (`codec.py`). Write order, for crash safety: blobs appended;
at a commit the segments are fsynced, the checkpoint is written (tmp, fsync, rename), then one
catalog transaction inserts the event rows and points the namespace at the checkpoint. On open a
writer trims whatever no committed row points at, so a resumed ingest continues from exactly the
committed state.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import re
import shutil
import threading
import uuid
import zlib
from array import array
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session as DbSession

from engramkv.config import StoreConfig
from engramkv.errors import (
    NamespaceError,
    ReadOnlyError,
    StoreCorruptError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    StoreMismatchError,
)
from engramkv.spec import ModelSpec
from engramkv.memory.events import DocumentProgress, Event
from engramkv.memory.summary import key_summary
from engramkv.storage import catalog as cat
from engramkv.storage.codec import Codec, decode_layer, encode_layers, layer_nbytes
from engramkv.storage.durable import replace_durably
from engramkv.storage.heap import release_free_heap
from engramkv.storage.index import LayerIndexes
from engramkv.storage.segments import BlobRef, SegmentError, SegmentLog
from engramkv.storage.tiers import LRUBytes

_NAME = re.compile(r"^[A-Za-z0-9_@:+=-][A-Za-z0-9_.@:+=-]{0,127}$")
DEFAULT_NAME = "default"


def check_name(kind: str, name: str) -> str:
    """Namespace names are labels, never paths; still, refuse anything that looks like one."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise NamespaceError(
            f"invalid {kind} {name!r}: use 1-128 letters, digits or _ . @ : + = - (not starting with '.', no '..')"
        )
    return name


@dataclass(frozen=True)
class NamespaceInfo:
    """One namespace of a store, as `EventStore.namespaces()` lists it."""

    user_id: str
    agent_id: str
    session_id: str
    tokens: int
    events: int
    documents: int
    disk_bytes: int


class EventStore:
    """A store directory opened by one process: read-write (one writer at a time) or read-only."""

    def __init__(self, path: str | Path, spec: ModelSpec, cfg: StoreConfig, read_only: bool = False):
        self.path = Path(path).expanduser().resolve()
        self.spec, self.cfg, self.read_only = spec, cfg, read_only
        self._lock_fd: int | None = None
        if read_only:
            if not (self.path / "catalog.sqlite").exists() and cfg.catalog_url is None:
                raise StoreError(f"no engramkv store at {self.path}")
        else:
            if self.path.exists() and not self.path.is_dir():
                raise StoreError(f"{self.path} exists and is not a directory")
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock()
        self.db = cat.open_catalog(cfg.catalog_url or f"sqlite:///{self.path / 'catalog.sqlite'}")
        self.codec = self._check_fingerprint()
        self._open: dict[int, NamespaceMemory] = {}

    def _lock(self) -> None:
        fd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreLockedError(
                f"store {self.path} is open for writing by another process (pid {holder}); "
                "one writer at a time — open it read-only or wait for that process to finish"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _check_fingerprint(self) -> str:
        mine = self.spec.model_dump()
        id_file = self.path / "STORE_ID"
        dir_id = id_file.read_text().strip() if id_file.exists() else None
        with DbSession(self.db) as db:
            info = cat.store_info(db)
            if info is None:
                if self.read_only:
                    raise StoreError(f"the store at {self.path} is empty")
                if dir_id is not None:
                    raise StoreMismatchError(f"{self.path} belongs to a store whose catalog is elsewhere (STORE_ID "
                                             f"{dir_id}); give the same catalog_url it was created with")
                store_uuid = str(uuid.uuid4())
                _write_text_durably(id_file, store_uuid)
                db.add(cat.StoreInfo(
                    id=1, format_version=cat.FORMAT_VERSION, store_uuid=store_uuid,
                    fingerprint=json.dumps(mine, sort_keys=True, default=str), codec=self.cfg.codec,
                ))
                db.commit()
                return self.cfg.codec
            if dir_id != info.store_uuid:
                raise StoreMismatchError(
                    f"the catalog {self.db.url.render_as_string(hide_password=True)} belongs to another store "
                    f"directory than {self.path} (store ids {info.store_uuid} vs {dir_id}); one catalog per store"
                )
            if info.format_version != cat.FORMAT_VERSION:
                raise StoreMismatchError(f"store format {info.format_version}, this engramkv reads {cat.FORMAT_VERSION}")
            theirs = info.fingerprint_dict()
            mine_json = json.loads(json.dumps(mine, default=str))
            if theirs != mine_json:
                diff = {k: (theirs.get(k), mine_json.get(k)) for k in sorted(set(theirs) | set(mine_json))
                        if theirs.get(k) != mine_json.get(k)}
                raise StoreMismatchError(
                    f"the store at {self.path} was written by model {theirs.get('model_id')!r}; it cannot serve "
                    f"{self.spec.model_id!r} (differs in: "
                    + ", ".join(f"{k}: store {a!r} vs model {b!r}" for k, (a, b) in diff.items()) + ")"
                )
            return info.codec

    # ------------------------------------------------------------------ namespaces
    def namespace(
        self, user_id: str = DEFAULT_NAME, agent_id: str = DEFAULT_NAME, session_id: str = DEFAULT_NAME,
        *, summary_layers: Sequence[int], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    ) -> NamespaceMemory:
        """The event memory of one stream; created on first use (read-only stores only open existing ones).

        summary_layers: the layers of the events' key summaries (`memory.summary.summary_layer_ids`).
        """
        names = (check_name("user_id", user_id), check_name("agent_id", agent_id),
                 check_name("session_id", session_id))
        with DbSession(self.db) as db:
            row = db.scalars(select(cat.NamespaceRow).filter_by(
                user_id=names[0], agent_id=names[1], session_id=names[2])).first()
            if row is None:
                if self.read_only:
                    raise NamespaceError(f"no namespace {'/'.join(names)} in {self.path}")
                row = cat.NamespaceRow(user_id=names[0], agent_id=names[1], session_id=names[2],
                                       n_tokens=0, n_events=0)
                db.add(row)
                db.commit()
            ns_id = row.id
        if ns_id in self._open:
            raise StoreError(f"namespace {'/'.join(names)} is already open in this process (one stream, one session)")
        memory = NamespaceMemory(self, ns_id, torch.device(device), dtype, list(summary_layers))
        self._open[ns_id] = memory
        return memory

    def _release(self, ns_id: int) -> None:
        self._open.pop(ns_id, None)

    def namespaces(self) -> list[NamespaceInfo]:
        with DbSession(self.db) as db:
            rows = db.scalars(select(cat.NamespaceRow).order_by(cat.NamespaceRow.id)).all()
            docs = dict(db.execute(select(cat.DocumentRow.namespace_id, func.count())
                                   .group_by(cat.DocumentRow.namespace_id)).all())
            return [NamespaceInfo(r.user_id, r.agent_id, r.session_id, r.n_tokens, r.n_events, docs.get(r.id, 0),
                                  _dir_bytes(self.namespace_dir(r.id))) for r in rows]

    def delete_namespace(self, user_id: str, agent_id: str = DEFAULT_NAME, session_id: str = DEFAULT_NAME) -> None:
        """Remove a namespace: its catalog rows (events, documents), index files, blobs and checkpoint."""
        if self.read_only:
            raise ReadOnlyError("cannot delete from a store opened read-only")
        with DbSession(self.db) as db, db.begin():
            row = db.scalars(select(cat.NamespaceRow).filter_by(
                user_id=check_name("user_id", user_id), agent_id=check_name("agent_id", agent_id),
                session_id=check_name("session_id", session_id))).first()
            if row is None:
                raise NamespaceError(f"no namespace {user_id}/{agent_id}/{session_id} in {self.path}")
            if row.id in self._open:
                raise StoreError("close the session on this namespace before deleting it")
            ns_id = row.id
            db.execute(delete(cat.EventRow).where(cat.EventRow.namespace_id == ns_id))
            db.execute(delete(cat.DocumentRow).where(cat.DocumentRow.namespace_id == ns_id))
            db.delete(row)
        # Files go after the rows: a crash in between leaves an orphan directory, which open ignores.
        shutil.rmtree(self.namespace_dir(ns_id), ignore_errors=True)

    def namespace_dir(self, ns_id: int) -> Path:
        return self.path / "ns" / f"{ns_id:06d}"

    def disk_bytes(self) -> int:
        return _dir_bytes(self.path)

    def close(self) -> None:
        for memory in list(self._open.values()):
            memory.close()
        self.db.dispose()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NamespaceMemory:
    """One namespace's events: an `EventMemory` whose events live on disk, with hot and warm tiers."""

    def __init__(
        self, store: EventStore, ns_id: int, device: torch.device, dtype: torch.dtype, summary_layers: list[int]
    ):
        spec, cfg = store.spec, store.cfg
        self.store, self.ns_id, self.cfg = store, ns_id, cfg
        self.codec: Codec = store.codec  # type: ignore[assignment]  # validated when the store was created
        self.device, self.dtype = device, dtype
        self.num_layers, self.kv_heads, self.head_dim = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self.dim = self.kv_heads * self.head_dim
        self.dir = store.namespace_dir(ns_id)
        self.writable = not store.read_only
        self.broken: str | None = None  # set when a write failed half-way: reopen to recover
        if self.writable:
            self.dir.mkdir(parents=True, exist_ok=True)
        # Per-event columns in compact arrays: 10M tokens are ~200k events, too many for objects.
        self._start, self._end = array("q"), array("q")
        self._segment, self._offset, self._length, self._crc = array("q"), array("q"), array("q"), array("q")
        self._surprise = array("d")  # mean, max interleaved
        self._overlay: dict[int, bytes] = {}  # read-only namespaces keep new events here, never on disk
        self._pending: list[dict[str, Any]] = []  # rows appended since the last commit
        self.document: DocumentProgress | None = None
        with DbSession(store.db) as db:
            row = db.get(cat.NamespaceRow, ns_id)
            assert row is not None
            self.names = (row.user_id, row.agent_id, row.session_id)
            self.committed_tokens, self.checkpoint_name, self.checkpoint_crc = row.n_tokens, row.checkpoint, row.checkpoint_crc
            events = db.execute(
                select(cat.EventRow.ordinal, cat.EventRow.token_start, cat.EventRow.token_end, cat.EventRow.segment,
                       cat.EventRow.offset, cat.EventRow.length, cat.EventRow.checksum, cat.EventRow.surprise_mean,
                       cat.EventRow.surprise_max)
                .where(cat.EventRow.namespace_id == ns_id).order_by(cat.EventRow.ordinal)
            ).all()
        for expected, e in enumerate(events):
            if e.ordinal != expected:
                raise StoreCorruptError(f"namespace {ns_id}: event {expected} missing from the catalog")
            self._append_columns(e.token_start, e.token_end, e.segment, e.offset, e.length, e.checksum,
                                 e.surprise_mean, e.surprise_max)
        self.committed_events = len(events)
        try:
            self.segments = SegmentLog(self.dir / "segments", cfg.segment_bytes, writable=self.writable)
            if self.writable:
                self._recover()
        except SegmentError as err:
            raise StoreCorruptError(f"namespace {'/'.join(self.names)}: {err}") from err
        self.hot: LRUBytes[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = LRUBytes(
            cfg.hot_bytes, lambda kv: kv[0].nbytes + kv[1].nbytes)
        self.warm: LRUBytes[int, bytes] = LRUBytes(cfg.warm_bytes, len)
        self.summary_layers = summary_layers
        self.indexes = LayerIndexes.load(self.dir / "index", self.num_layers, self.dim, cfg.index, summary_layers,
                                         self.committed_events, self._representatives, self._key_summary)
        self._index_saved_at = self.indexes.saved_events  # what was caught up or rebuilt gets saved at a commit
        prefetch = cfg.prefetch == "on" or (cfg.prefetch == "auto" and device.type == "cuda")
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="engramkv-prefetch") if prefetch else None
        self._prefetching: Future[None] | None = None
        self.read_ahead = cfg.read_ahead
        self._lock = threading.Lock()

    def _append_columns(self, start: int, end: int, segment: int, offset: int, length: int, crc: int,
                        surprise_mean: float, surprise_max: float) -> None:
        self._start.append(start)
        self._end.append(end)
        self._segment.append(segment)
        self._offset.append(offset)
        self._length.append(length)
        self._crc.append(crc)
        self._surprise.extend((surprise_mean, surprise_max))

    def _recover(self) -> None:
        """Cut what the last committed transaction does not point at: blob tails, newer checkpoints."""
        ends: dict[int, int] = {}
        for segment, offset, length in zip(self._segment, self._offset, self._length):
            ends[segment] = max(ends.get(segment, 0), offset + length)
        self.segments.truncate_to(ends)
        for path in self.dir.glob("checkpoint-*"):
            if path.name != self.checkpoint_name:
                path.unlink()

    # ------------------------------------------------------------------ EventMemory
    def __len__(self) -> int:
        return len(self._start)

    def event(self, event_id: int) -> Event:
        return Event(id=event_id, start=self._start[event_id], end=self._end[event_id],
                     surprise_mean=self._surprise[2 * event_id], surprise_max=self._surprise[2 * event_id + 1])

    def add(self, event: Event, keys: torch.Tensor, values: torch.Tensor, representatives: torch.Tensor,
            key_summary: torch.Tensor, token_ids: torch.Tensor) -> None:
        self._check_usable()
        if event.id != len(self):
            raise ValueError(f"event ids must be consecutive: expected {len(self)}, got {event.id}")
        reps = representatives.detach().float().cpu().numpy()  # (layers, F)
        summary = key_summary.detach().float().cpu().numpy()  # (S,)
        parts = [token_ids.to(torch.int32).cpu().numpy().astype("<i4").tobytes(), reps.astype("<f4").tobytes()]
        parts += encode_layers(self.codec, keys, values)  # one per layer
        blob = b"".join(parts)
        crc = zlib.crc32(blob)
        if self.writable:
            try:
                ref = self.segments.append(blob)
            except OSError as err:
                self._fail(err)
            segment, offset = ref.segment, ref.offset
            self._pending.append({
                "namespace_id": self.ns_id, "ordinal": event.id, "token_start": event.start,
                "token_end": event.end, "surprise_mean": event.surprise_mean, "surprise_max": event.surprise_max,
                "tier": "disk", "codec": self.codec, "segment": segment, "offset": offset, "length": len(blob),
                "checksum": crc,
            })
        else:
            segment, offset = -1, -1
            self._overlay[event.id] = blob
        self._append_columns(event.start, event.end, segment, offset, len(blob), crc,
                             event.surprise_mean, event.surprise_max)
        self.indexes.add(event.id, reps, summary)
        self.warm.put(event.id, blob)  # what was just sealed is what recall is likeliest to want next

    def tokens(self, event_id: int) -> list[int]:
        n = self._end[event_id] - self._start[event_id]
        return np.frombuffer(self._blob(event_id), dtype="<i4", count=n).tolist()

    def search(self, layer: int, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        return self.indexes.search(layer, query, k)

    def search_keys(self, summary: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        return self.indexes.search_summary(summary, k)

    def gather(self, layer: int, event_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Hkv, M, D) keys and values of `event_ids`, on the compute device in the model's dtype."""
        if self._prefetching is not None:
            self._prefetching.result()  # the worker fills the same caches; let it finish first
            self._prefetching = None
        if self.read_ahead:
            self._read_ahead(layer, event_ids)
        blocks = [self._layer_kv(event_id, layer) for event_id in event_ids]
        if self._prefetcher is not None and layer + 1 < self.num_layers and event_ids:
            # The next layer usually recalls mostly the same events: decode them while this layer attends.
            self._prefetching = self._prefetcher.submit(self._warm_up, layer + 1, list(event_ids))
        if not blocks:
            empty = torch.empty(self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        return torch.cat([k for k, _ in blocks], dim=1), torch.cat([v for _, v in blocks], dim=1)

    def _read_ahead(self, layer: int, event_ids: list[int]) -> None:
        cold = [self._ref(i) for i in event_ids
                if (i, layer) not in self.hot and i not in self.warm and i not in self._overlay]
        if len(cold) > 1:  # one blob gains nothing from being asked for twice
            try:
                self.segments.will_need(cold)
            except SegmentError as err:
                raise StoreCorruptError(f"namespace {'/'.join(self.names)}: {err}") from err

    def _warm_up(self, layer: int, event_ids: list[int]) -> None:
        for event_id in event_ids:
            self._layer_kv(event_id, layer)

    def _layer_kv(self, event_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self.hot.get((event_id, layer))
        if cached is not None:
            return cached
        k, v = self._decode(event_id, layer)
        kv = (k.to(self.device, self.dtype, non_blocking=True), v.to(self.device, self.dtype, non_blocking=True))
        self.hot.put((event_id, layer), kv)
        return kv

    def _decode(self, event_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # (Hkv, n, D) float16 each
        n = self._end[event_id] - self._start[event_id]
        layer_bytes = layer_nbytes(self.codec, self.kv_heads, n, self.head_dim)
        at = 4 * n + 4 * self.num_layers * self.dim + layer * layer_bytes
        layer_blob = memoryview(self._blob(event_id))[at : at + layer_bytes]
        return decode_layer(self.codec, layer_blob, self.kv_heads, n, self.head_dim)

    def _blob(self, event_id: int) -> bytes:
        """The event's whole blob: warm tier, else read (and checksum) from the cold tier."""
        blob = self.warm.get(event_id)
        if blob is not None:
            return blob
        if event_id in self._overlay:
            return self._overlay[event_id]
        ref = self._ref(event_id)
        try:
            blob = self.segments.read_copy(ref)  # a copy: the warm tier must not pin the map (recovery truncates)
        except SegmentError as err:
            raise StoreCorruptError(f"event {event_id} of {'/'.join(self.names)}: {err}") from err
        if zlib.crc32(blob) != ref.checksum:
            raise StoreCorruptError(f"event {event_id} of {'/'.join(self.names)}: checksum mismatch on disk")
        self.warm.put(event_id, blob)
        return blob

    def _ref(self, event_id: int) -> BlobRef:
        return BlobRef(self._segment[event_id], self._offset[event_id], self._length[event_id], self._crc[event_id])

    def _representatives(self, event_id: int) -> np.ndarray:  # (layers, F)
        n = self._end[event_id] - self._start[event_id]
        return np.frombuffer(self._blob(event_id), dtype="<f4", count=self.num_layers * self.dim,
                             offset=4 * n).reshape(self.num_layers, self.dim).copy()

    def _key_summary(self, event_id: int) -> np.ndarray:  # (S,) from the stored keys
        keys = torch.stack([self._decode(event_id, layer)[0] for layer in self.summary_layers])  # (S, Hkv, n, D)
        return key_summary(keys).numpy()

    @property
    def kv_bytes(self) -> int:
        """Bytes of event blobs (encoded KV, tokens, representatives) in this namespace."""
        return int(sum(self._length))

    # ------------------------------------------------------------------ commits and checkpoints
    def commit(self, snapshot: dict[str, Any]) -> None:
        """Make everything added so far durable, together with the stream state `snapshot` that follows it."""
        self._check_usable()
        if not self.writable:
            raise ReadOnlyError(f"namespace {'/'.join(self.names)} is open read-only")
        try:
            self.segments.sync()
            name = f"checkpoint-{len(self):08d}-{int(snapshot['engine']['n_tokens']):012d}.pt"
            crc = _write_durably(self.dir / name, snapshot)
            with DbSession(self.store.db) as db, db.begin():
                document = self.document
                if document is not None:
                    document.id = self._save_document(db, document)
                if self._pending:
                    for pending in self._pending:
                        pending["document_id"] = document.id if document is not None else None
                    db.execute(insert(cat.EventRow), self._pending)
                ns = db.get(cat.NamespaceRow, self.ns_id)
                assert ns is not None
                ns.n_tokens, ns.n_events = int(snapshot["engine"]["n_tokens"]), len(self)
                ns.checkpoint, ns.checkpoint_crc, ns.updated_at = name, crc, cat.utcnow()
        except OSError as err:
            self._fail(err)
        old = self.checkpoint_name
        self.checkpoint_name, self.checkpoint_crc = name, crc
        self.committed_events, self.committed_tokens = len(self), int(snapshot["engine"]["n_tokens"])
        self._pending = []
        if old and old != name:
            (self.dir / old).unlink(missing_ok=True)
        if len(self) - self._index_saved_at >= self.cfg.index_save_events:
            self.save_index()
        if self.cfg.release_free_memory:
            release_free_heap()

    def save_index(self) -> None:
        if self.writable and self.committed_events == len(self):
            self.indexes.save(self.dir / "index")
            self._index_saved_at = len(self)

    def _save_document(self, db: DbSession, doc: DocumentProgress) -> int:
        row = db.get(cat.DocumentRow, doc.id) if doc.id is not None else None
        if row is None:
            row = cat.DocumentRow(namespace_id=self.ns_id, name=doc.name, size_bytes=doc.size_bytes,
                                  content_key=doc.content_key, token_start=doc.token_start, token_end=doc.token_start)
            db.add(row)
        row.bytes_done, row.token_end, row.complete, row.updated_at = (
            doc.bytes_done, doc.token_end, doc.complete, cat.utcnow())
        db.flush()
        return row.id

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The stream state of the last commit, or None for a namespace never committed."""
        if self.checkpoint_name is None:
            return None
        path = self.dir / self.checkpoint_name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreCorruptError(f"checkpoint {path} named by the catalog is missing") from None
        if zlib.crc32(data) != self.checkpoint_crc:
            raise StoreCorruptError(f"checkpoint {path} fails its checksum")
        snapshot: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
        return snapshot

    def last_document(self) -> DocumentProgress | None:
        """The namespace's most recent document (the only one an interrupted ingest can resume)."""
        with DbSession(self.store.db) as db:
            row = db.scalars(select(cat.DocumentRow).where(cat.DocumentRow.namespace_id == self.ns_id)
                             .order_by(cat.DocumentRow.id.desc())).first()
            if row is None:
                return None
            return DocumentProgress(name=row.name, size_bytes=row.size_bytes, content_key=row.content_key,
                                    token_start=row.token_start, bytes_done=row.bytes_done, token_end=row.token_end,
                                    complete=row.complete, id=row.id)

    def event_details(self, event_ids: list[int]) -> dict[int, tuple[str | None, Any]]:
        """(document name, time sealed) of committed events; uncommitted ones get the current document."""
        details: dict[int, tuple[str | None, Any]] = {}
        with DbSession(self.store.db) as db:
            rows = db.execute(
                select(cat.EventRow.ordinal, cat.DocumentRow.name, cat.EventRow.created_at)
                .outerjoin(cat.DocumentRow, cat.EventRow.document_id == cat.DocumentRow.id)
                .where(cat.EventRow.namespace_id == self.ns_id, cat.EventRow.ordinal.in_(event_ids))
            ).all()
        for ordinal, name, created in rows:
            details[ordinal] = (name, created)
        current = self.document.name if self.document is not None else None
        for event_id in event_ids:
            details.setdefault(event_id, (current, None))
        return details

    def documents(self) -> list[DocumentProgress]:
        with DbSession(self.store.db) as db:
            rows = db.scalars(select(cat.DocumentRow).where(cat.DocumentRow.namespace_id == self.ns_id)
                              .order_by(cat.DocumentRow.id)).all()
            return [DocumentProgress(name=r.name, size_bytes=r.size_bytes, content_key=r.content_key,
                                     token_start=r.token_start, bytes_done=r.bytes_done, token_end=r.token_end,
                                     complete=r.complete, id=r.id) for r in rows]

    def _fail(self, err: OSError) -> Any:
        self.broken = str(err)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFullError(
                f"the disk under {self.dir} is full; the store keeps everything up to its last commit "
                f"({self.committed_tokens} tokens). Free space and run the same ingest again to resume."
            ) from err
        raise StoreError(f"writing to {self.dir} failed: {err}; the store keeps its last commit") from err

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise StoreError(f"a write to this namespace failed ({self.broken}); reopen the store to recover")

    # ------------------------------------------------------------------ verification and lifecycle
    def verify(self) -> int:
        """Check every committed blob's checksum against the catalog; returns the number checked."""
        for event_id in range(self.committed_events):
            ref = BlobRef(self._segment[event_id], self._offset[event_id], self._length[event_id],
                          self._crc[event_id])
            try:
                ok = self.segments.verify(ref)
            except SegmentError as err:
                raise StoreCorruptError(f"event {event_id}: {err}") from err
            if not ok:
                raise StoreCorruptError(f"event {event_id}: checksum mismatch")
        return self.committed_events

    def disk_bytes(self) -> int:
        return _dir_bytes(self.dir)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None
        if self.writable and self.broken is None and self.committed_events == len(self):
            self.save_index()
        self.segments.close()
        self.hot.clear()
        self.warm.clear()
        self.store._release(self.ns_id)


def _write_durably(path: Path, payload: dict[str, Any]) -> int:
    """torch.save `payload` durably over `path` (see durable.replace_durably); returns the crc32 of the bytes."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    replace_durably(path, data)
    return zlib.crc32(data)


def _write_text_durably(path: Path, text: str) -> None:
    replace_durably(path, text.encode())


def _dir_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
