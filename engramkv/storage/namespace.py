"""One namespace of a store: its events' columns and tiers, commits and recovery, as an `EventMemory`.

    STORE/ns/000001/
      segments/*.seg            the cold tier: one blob per event (`blob.py` draws its layout)
      index/layer-NNN.faiss, summary.faiss, manifest.json
      checkpoint-NNNNNNNN-TTTTTTTTTTTT.pt   the resident engine state at the last commit

A read goes hot (decoded KV of (event, layer) on the compute device, or a new event's exact KV until
the next commit), then warm (whole blobs in host RAM), then cold (`segments.py`, checksummed on the way
in); see `tiers.py`.

Write order, for crash safety: blobs are appended as events are added; a commit fsyncs the
segments, writes the checkpoint (tmp, fsync, rename), then one catalog transaction inserts the new
event rows and points the namespace at the checkpoint. On open a writer trims whatever no
committed row points at, so a resumed ingest continues from exactly the committed state. A
namespace opened read-only keeps the events added to it in RAM and refuses commits.
"""

from __future__ import annotations

import datetime as dt
import errno
import io
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from engramkv.errors import NamespaceError, ReadOnlyError, StoreCorruptError, StoreError, StoreFullError
from engramkv.memory.events import DocumentProgress, Event, TierBytes
from engramkv.storage import catalog as cat
from engramkv.storage.blob import BlobLayout
from engramkv.storage.columns import EventColumns
from engramkv.storage.durable import dir_bytes, replace_durably
from engramkv.storage.heap import release_free_heap
from engramkv.storage.index import LayerIndexes
from engramkv.storage.segments import BlobRef, SegmentError, SegmentLog
from engramkv.storage.tiers import HotTier, LRUBytes, Prefetcher

if TYPE_CHECKING:
    from engramkv.storage.store import EventStore


class NamespaceMemory:
    """One namespace's events: an `EventMemory` whose events live on disk, with hot and warm tiers."""

    persistent = True

    def __init__(self, store: EventStore, ns_id: int, device: torch.device, dtype: torch.dtype,
                 summary_layers: list[int]):
        spec, cfg = store.spec, store.cfg
        self.store, self.ns_id, self.cfg = store, ns_id, cfg
        self.codec = store.codec  # the catalog's name of it (validated when the store was opened)
        self.device, self.dtype, self.summary_layers = device, dtype, summary_layers
        self.layout = BlobLayout(store.kv_codec, spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.dir = store.namespace_dir(ns_id)
        self.writable, self.read_ahead = not store.read_only, cfg.read_ahead
        self.broken: str | None = None  # set when a write failed half-way: reopen to recover
        self._closed = False
        self._document: DocumentProgress | None = None  # of the last commit: events sealed since belong to it
        if self.writable:
            self.dir.mkdir(parents=True, exist_ok=True)
        state = cat.namespace_state(store.db, ns_id)
        if state is None:
            raise StoreCorruptError(f"namespace {ns_id} is not in the catalog {cat.describe(store.db)}")
        self.location, self.namespace = str(store.path), "/".join(state.names)  # what `EventMemory` reports
        self.committed_tokens, self.checkpoint_name, self.checkpoint_crc = (
            state.n_tokens, state.checkpoint, state.checkpoint_crc)
        self._columns = EventColumns()
        _load_rows(store.db, ns_id, self.layout, self._columns)
        self.committed_events = len(self._columns)
        self._overlay: dict[int, bytes] = {}  # read-only namespaces keep new events here, never on disk
        try:
            self.segments = SegmentLog(self.dir / "segments", cfg.segment_bytes, writable=self.writable)
            if self.writable:
                _recover(self.segments, self._columns, self.dir, self.checkpoint_name)
        except SegmentError as err:
            raise StoreCorruptError(f"namespace {self.namespace}: {err}") from err
        self.hot = HotTier(cfg.hot_bytes, device, dtype, cfg.hot_write_through and self.writable)
        self.warm: LRUBytes[int, bytes] = LRUBytes(cfg.warm_bytes, len)
        self.indexes = LayerIndexes.load(self.dir / "index", spec.num_layers, self.layout.dim, cfg.index,
                                         summary_layers, self.committed_events, self.representatives,
                                         self._key_summaries, self.layer_representatives)
        self._index_saved_at = self.indexes.saved_events  # what was caught up or rebuilt gets saved at a commit
        self._prefetch = Prefetcher(cfg.prefetch == "on" or (cfg.prefetch == "auto" and device.type == "cuda"))

    # ------------------------------------------------------------------ EventMemory
    def __len__(self) -> int:
        return len(self._columns)

    def event(self, event_id: int) -> Event:
        return self._columns.event(event_id)

    @property
    def shortest_event(self) -> int:
        return self._columns.shortest

    def blob_ref(self, event_id: int) -> BlobRef:
        """Where the event's blob lives in the cold tier (segment -1 for one added to a read-only namespace)."""
        return self._columns.ref(event_id)

    def add(self, events: Sequence[Event], keys: torch.Tensor, values: torch.Tensor, representatives: torch.Tensor,
            key_summaries: torch.Tensor, token_ids: torch.Tensor) -> None:
        """`EventMemory.add`, each event stored alone; the indexes take the representatives its blob gives back."""
        start = 0
        for event, event_reps, summary in zip(events, representatives, key_summaries, strict=True):
            self._check_usable()
            if event.id != len(self):
                raise StoreError(f"event ids must be consecutive: expected {len(self)}, got {event.id}")
            part, start = slice(start, start + event.length), start + event.length
            kv = keys[:, :, part].contiguous(), values[:, :, part].contiguous()  # (layers, Hkv, n, D) each
            try:
                blob = self.layout.encode(token_ids[part], event_reps.detach().float().cpu().numpy(), *kv)
            except ValueError as err:
                raise StoreError(f"event {event.id} of {self.namespace} cannot be stored: {err}") from err
            stored_reps = self.layout.representatives(blob, event.length)  # (layers, F): lowrank's int8, as on resume
            if self.writable:
                try:
                    ref = self.segments.append(blob)
                except OSError as err:
                    self._fail(err)
            else:
                ref = BlobRef(-1, -1, len(blob), zlib.crc32(blob))
                self._overlay[event.id] = blob
            self._columns.append(event, ref)
            self.indexes.add(event.id, stored_reps, summary.detach().float().cpu().numpy())  # (S,)
            self.warm.put(event.id, blob)  # what was just sealed is what recall is likeliest to want next
            self._prefetch.wait()  # else the prefetch thread's puts would order the hot tier by timing
            self.hot.stored(event.id, *kv)

    def adopt(self, events: Sequence[Event], refs: Sequence[BlobRef], representatives: Sequence[np.ndarray],
              summaries: np.ndarray) -> None:
        """Append events (ids, spans already this namespace's) whose blobs `refs` locate in this namespace's
        segments, adopted from a store of this codec (`SegmentLog.adopt`): a merge. representatives: (layers, F)
        per event; summaries: (N, S)."""
        self._check_usable()  # a read-only namespace's segments refuse the adoption before this
        for event, ref in zip(events, refs, strict=True):  # each must follow the last, with its span's blob size
            _check_row(cat.StoredEvent(event, ref), len(self), self._columns, self.layout,
                       f"the events merged into {self.namespace}")
            self._columns.append(event, ref)
        for event, reps, summary in zip(events, representatives, summaries, strict=True):
            self.indexes.add(event.id, reps, summary)

    def tokens(self, event_id: int) -> list[int]:
        return self.layout.tokens(self.blob(event_id), self._columns.n_tokens(event_id))

    def representatives(self, event_id: int) -> np.ndarray:  # (layers, F) float32
        """The event's per-layer representatives, as its layer indexes hold them (before any centring)."""
        return self.layout.representatives(self.blob(event_id), self._columns.n_tokens(event_id))

    def layer_representatives(self, event_ids: Sequence[int], layer: int) -> np.ndarray:  # (c, F) float32
        """One layer's representatives, to re-score a low-rank search: read alone, unchecked (damage only mis-ranks)."""
        rows: list[bytes] = []
        for event_id in event_ids:
            at, size = self.layout.representative_span(self._columns.n_tokens(event_id), layer)
            blob = self.warm.get(event_id) or self._overlay.get(event_id)
            rows.append(blob[at : at + size] if blob is not None else self._cold_part(event_id, at, size))
        return self.layout.decode_representatives(b"".join(rows), len(rows))

    def search(self, layer: int, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        return self.indexes.search(layer, query, k)

    def search_keys(self, summary: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        return self.indexes.search_summary(summary, k)

    def gather(self, layer: int, event_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Hkv, M, D) keys and values of `event_ids`, on the compute device in the model's dtype."""
        self._prefetch.wait()  # the worker fills the same caches; let it finish first
        if self.read_ahead:
            self._read_ahead(layer, event_ids)
        kv = self._layer_kv(layer, event_ids)
        blocks = [kv[event_id] for event_id in event_ids]
        if layer + 1 < self.layout.num_layers and event_ids:
            # The next layer usually recalls mostly the same events: decode them while this layer attends.
            self._prefetch.submit(self._layer_kv, layer + 1, list(event_ids))
        if not blocks:
            empty = torch.empty(self.layout.kv_heads, 0, self.layout.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        return torch.cat([k for k, _ in blocks], dim=1), torch.cat([v for _, v in blocks], dim=1)  # (Hkv, M, D)

    def drop_caches(self) -> None:
        """Empty the hot and warm tiers: the next reads come from disk (or a read-only namespace's overlay)."""
        self._prefetch.wait()
        self.hot.clear()
        self.warm.clear()

    @property
    def kv_bytes(self) -> int:
        """Bytes of event blobs (encoded KV, tokens, representatives) in this namespace."""
        return int(sum(self._columns.length))

    def tier_bytes(self) -> TierBytes:
        return TierBytes(hot=self.hot.held_bytes, warm=self.warm.bytes, disk=dir_bytes(self.dir))

    # ------------------------------------------------------------------ reading through the tiers
    def _read_ahead(self, layer: int, event_ids: list[int]) -> None:
        cold = [self.blob_ref(i) for i in event_ids
                if (i, layer) not in self.hot and i not in self.warm and i not in self._overlay]
        if len(cold) > 1:  # one blob gains nothing from being asked for twice
            try:
                self.segments.will_need(cold)
            except SegmentError as err:
                raise StoreCorruptError(f"namespace {self.namespace}: {err}") from err

    def _layer_kv(self, layer: int, event_ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """`layer` of each event, (Hkv, n, D) each: from the hot tier, the rest decoded in one call and put there."""
        kv = {e: self.hot.get((e, layer)) for e in event_ids}
        missing = [e for e, pair in kv.items() if pair is None]
        counts = [self._columns.n_tokens(e) for e in missing]
        for e, (k, v) in zip(missing, self.layout.layer_kv_each([self.blob(e) for e in missing], counts, layer)):
            kv[e] = (k.to(self.device, self.dtype, non_blocking=True), v.to(self.device, self.dtype, non_blocking=True))
            self.hot.put((e, layer), kv[e])
        return kv  # type: ignore[return-value]  # every None was replaced

    def blob(self, event_id: int) -> bytes:
        """The event's whole blob: warm tier, else read (and checksum) from the cold tier."""
        blob = self.warm.get(event_id) or self._overlay.get(event_id)
        if blob is not None:
            return blob
        blob = self._cold_part(event_id)  # a copy: the warm tier must not pin the map (recovery truncates)
        if zlib.crc32(blob) != self.blob_ref(event_id).checksum:
            raise StoreCorruptError(f"event {event_id} of {self.namespace}: checksum mismatch on disk")
        self.warm.put(event_id, blob)
        return blob

    def _cold_part(self, event_id: int, start: int = 0, size: int | None = None) -> bytes:  # [start, start + size)
        if self._closed:
            raise StoreError(f"namespace {self.namespace} is closed")
        ref = self.blob_ref(event_id)
        try:
            return self.segments.read_copy(ref) if size is None else self.segments.read_part(ref, start, size)
        except SegmentError as err:
            raise StoreCorruptError(f"event {event_id} of {self.namespace}: {err}") from err

    def _key_summaries(self, event_ids: list[int]) -> np.ndarray:  # (N, S) from the stored keys
        counts = [self._columns.n_tokens(e) for e in event_ids]
        return self.layout.key_summaries([self.blob(e) for e in event_ids], counts, self.summary_layers)

    # ------------------------------------------------------------------ commits and checkpoints
    def commit(self, snapshot: dict[str, Any], document: DocumentProgress | None = None) -> None:
        """Make everything added durable, with the stream state `snapshot` after it and `document`'s read position."""
        self._check_usable()
        if not self.writable:
            raise ReadOnlyError(f"namespace {self.namespace} is open read-only")
        n_tokens = int(snapshot["engine"]["n_tokens"])
        name = f"checkpoint-{len(self):08d}-{n_tokens:012d}.pt"
        new = [cat.StoredEvent(self.event(i), self.blob_ref(i)) for i in range(self.committed_events, len(self))]
        try:
            self.segments.sync()
            buffer = io.BytesIO()
            torch.save(snapshot, buffer)
            replace_durably(self.dir / name, buffer.getvalue())
            crc = zlib.crc32(buffer.getvalue())
            document_id = cat.commit_namespace(self.store.db, self.ns_id, new, self.codec, document, n_tokens,
                                               len(self), name, crc)
        except OSError as err:
            self._fail(err)
        except StoreError as err:  # the catalog refused the transaction: nothing of this commit counts
            self.broken = str(err)
            if name != self.checkpoint_name:  # the live checkpoint stays
                (self.dir / name).unlink(missing_ok=True)
            raise
        if document is not None:
            document.id = document_id
        self._document = document
        old = self.checkpoint_name
        self.checkpoint_name, self.checkpoint_crc = name, crc
        self.committed_events, self.committed_tokens = len(self), n_tokens
        if old and old != name:
            (self.dir / old).unlink(missing_ok=True)
        self._prefetch.wait()
        self.hot.committed()
        if len(self) - self._index_saved_at >= self.cfg.index_save_events:
            self.save_index()
        if self.cfg.release_free_memory:
            release_free_heap()

    def save_index(self) -> None:
        if self.writable and self.committed_events == len(self):
            self.indexes.save(self.dir / "index")
            self._index_saved_at = len(self)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The stream state of the last commit, or None for a namespace never committed."""
        name = self.checkpoint_name
        return None if name is None else _read_checkpoint(self.dir / name, self.checkpoint_crc)

    def refresh(self) -> int:
        """A read-only namespace takes in its writer's commits since it opened (events, indexes, checkpoint)."""
        self._check_usable()
        if self.writable or self._overlay:
            raise StoreError(f"namespace {self.namespace}: only a read-only reader with no events of its own refreshes")
        if (state := cat.namespace_state(self.store.db, self.ns_id)) is None:
            raise NamespaceError(f"namespace {self.namespace} was deleted from {self.location}")
        before = len(self)
        _load_rows(self.store.db, self.ns_id, self.layout, self._columns, stop=state.n_events)
        self.indexes.catch_up(len(self))
        self.committed_events, self.committed_tokens = len(self), state.n_tokens
        self.checkpoint_name, self.checkpoint_crc = state.checkpoint, state.checkpoint_crc
        return len(self) - before

    def last_document(self) -> DocumentProgress | None:
        """The namespace's most recent document (the only one an interrupted ingest can resume)."""
        return cat.last_document(self.store.db, self.ns_id)

    def documents(self) -> list[DocumentProgress]:
        return cat.documents(self.store.db, self.ns_id)

    def event_details(self, event_ids: Sequence[int]) -> dict[int, tuple[str | None, dt.datetime | None]]:
        """(document name, commit time) of committed events; uncommitted ones get the current document."""
        details = cat.event_details(self.store.db, self.ns_id, event_ids)
        current = self._document.name if self._document is not None else None
        return {event_id: details.get(event_id, (current, None)) for event_id in event_ids}

    def _fail(self, err: OSError) -> NoReturn:
        self.broken = str(err)
        raise _write_error(err, self.dir, self.committed_tokens) from err

    def _check_usable(self) -> None:
        if self._closed:
            raise StoreError(f"namespace {self.namespace} is closed")
        if self.broken is not None:
            raise StoreError(f"a write to this namespace failed ({self.broken}); reopen the store to recover")

    # ------------------------------------------------------------------ verification and lifecycle
    def verify(self) -> int:
        """Check every committed blob's checksum against the catalog; returns the number checked."""
        try:
            self.segments.verify_all([self.blob_ref(e) for e in range(self.committed_events)])
        except SegmentError as err:
            raise StoreCorruptError(str(err)) from err
        return self.committed_events

    def close(self) -> None:
        if self._closed:
            return
        self._prefetch.close()
        if self.writable and self.broken is None and self.committed_events == len(self):
            self.save_index()
        self.segments.close()
        self.drop_caches()
        self._closed = True
        self.store._release(self.ns_id)


def _recover(segments: SegmentLog, columns: EventColumns, directory: Path, checkpoint: str | None) -> None:
    """Cut what the last committed transaction does not point at: blob tails, newer checkpoints."""
    segments.truncate_to(columns.segment_ends())
    for path in directory.glob("checkpoint-*"):
        if path.name != checkpoint:
            path.unlink()


def _load_rows(db: Any, ns_id: int, layout: BlobLayout, columns: EventColumns, stop: int | None = None) -> None:
    """Append the namespace's catalog rows from the first `columns` lacks (to `stop`), each checked (`_check_row`)."""
    for stored in cat.load_events(db, ns_id, len(columns), stop):
        _check_row(stored, len(columns), columns, layout, f"the catalog {cat.describe(db)}")
        columns.append(stored.event, stored.ref)


def _check_row(stored: cat.StoredEvent, expected: int, before: EventColumns, layout: BlobLayout, where: str) -> None:
    """A catalog row must be the next event, after the last, with the blob size its span needs: its values carry
    no checksum of their own, so a damaged row is caught here rather than read as a wrong span of KV."""
    event, ref = stored.event, stored.ref
    if not all(isinstance(v, int) for v in (event.id, event.start, event.end, ref.segment, ref.offset, ref.length,
                                            ref.checksum)) \
            or not all(isinstance(v, (int, float)) for v in (event.surprise_mean, event.surprise_max)):
        raise StoreCorruptError(f"{where} is damaged: event {expected}'s row is not a span, blob location and surprise")
    if event.id != expected:
        raise StoreCorruptError(f"{where}: event {expected} is missing (found {event.id} in its place)")
    previous_end = before.end[expected - 1] if expected else 0
    if not (previous_end <= event.start < event.end) or ref.length != layout.nbytes(event.length):
        raise StoreCorruptError(f"{where} is damaged: event {expected} spans tokens {event.start}-{event.end} (after "
                                f"{previous_end}) with a blob of {ref.length} bytes")


def _write_error(err: OSError, where: Path, committed_tokens: int) -> StoreError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFullError(f"the disk under {where} is full; the store keeps everything up to its last commit "
                              f"({committed_tokens} tokens). Free space and run the same ingest again to resume.")
    return StoreError(f"writing to {where} failed: {err}; the store keeps its last commit")


def _read_checkpoint(path: Path, crc: int | None) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StoreCorruptError(f"checkpoint {path} named by the catalog is missing") from None
    if zlib.crc32(data) != crc:
        raise StoreCorruptError(f"checkpoint {path} fails its checksum")
    snapshot: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    return snapshot
