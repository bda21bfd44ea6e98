"""Append-only segment files holding large binary blobs, memory-mapped for reading.

`directory/000001.seg`, `000002.seg`, ... each open with a 16-byte header (magic, format
version) followed by records: payload length u64 + crc32 u32 (little-endian), then the payload.
Crash safety is shared with the catalog: `append` + `sync` finish before the catalog row for a
blob commits, so after a crash the catalog is the truth and `truncate_to` cuts what no committed
row points at. One writer per directory; appends are not thread-safe.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import struct
import weakref
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from engramkv.storage.durable import fsync_dir

MAGIC = b"EKVSEG01"
FORMAT_VERSION = 1
_FILE_HEADER = struct.Struct("<8sI4x")  # magic, version, 4 reserved bytes
_RECORD = struct.Struct("<QI")  # payload length, crc32 of payload
HEADER_SIZE = _FILE_HEADER.size
_FAULT_AROUND = 64 * 1024  # bytes the kernel may map around a faulting page (a multiple of the page size)
_HEADER_BYTES = _FILE_HEADER.pack(MAGIC, FORMAT_VERSION)
_NAME = re.compile(r"^(\d{6,})\.seg$")


class SegmentError(Exception):
    """A segment file is missing, foreign or too short, or the log cannot do what was asked."""


class ChecksumMismatch(SegmentError):
    """A payload's crc32 differs from the one in its reference."""


@dataclass(frozen=True)
class BlobRef:
    segment: int  # segment file number
    offset: int  # byte offset of the payload inside the segment file
    length: int  # payload length in bytes
    checksum: int  # zlib.crc32 of the payload


def _check_header(data: bytes, path: Path, allow_torn: bool = False) -> None:
    # A crash while creating the newest file can leave a prefix of the header. That file holds
    # no blob, so opening and scanning accept it, and recovery deletes it.
    if allow_torn and len(data) < HEADER_SIZE and _HEADER_BYTES.startswith(data):
        return
    if len(data) < HEADER_SIZE or data[:8] != MAGIC:
        raise SegmentError(f"{path} is not an engramkv segment file (bad magic)")
    if (version := _FILE_HEADER.unpack(data[:HEADER_SIZE])[1]) != FORMAT_VERSION:
        raise SegmentError(f"{path} has unsupported segment format version {version}")


def _read_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEADER_SIZE)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:  # os.write may write less than asked
        view = view[os.write(fd, view) :]


def scan(directory: Path, segment: int) -> Iterator[BlobRef]:
    """Walk one segment file's records, stopping quietly at a torn tail or at the first record failing its
    crc32 (without the catalog, damage and a torn tail look alike). A diagnostic: reads go through SegmentLog."""
    path = directory / f"{segment:06d}.seg"
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise SegmentError(f"segment file {path} is missing") from None
    with f:
        _check_header(f.read(HEADER_SIZE), path, allow_torn=True)
        size, offset = os.fstat(f.fileno()).st_size, HEADER_SIZE + _RECORD.size
        while offset <= size:
            length, crc = _RECORD.unpack(f.read(_RECORD.size))
            # Size first: a torn length may be garbage, and reading it whole could exhaust memory.
            if offset + length > size or zlib.crc32(f.read(length)) != crc:
                return
            yield BlobRef(segment, offset, length, crc)
            offset += length + _RECORD.size


class SegmentLog:
    """Blobs appended to numbered segment files; reads are zero-copy views of cached mmaps."""

    def __init__(self, directory: Path, max_segment_bytes: int = 256 * 2**20, writable: bool = True) -> None:
        if max_segment_bytes <= HEADER_SIZE + _RECORD.size:
            raise ValueError(f"max_segment_bytes must exceed {HEADER_SIZE + _RECORD.size}")
        self.directory, self.max_segment_bytes, self.writable = Path(directory), max_segment_bytes, writable
        self._maps: dict[int, mmap.mmap] = {}
        self._read_fds: dict[int, int] = {}  # segment -> fd for `read_part`
        self._stale: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # superseded maps kept alive by views
        self._fd: int | None = None  # file being appended to; opened on first append so recovery can run first
        self._segment = self._size = 0
        self._dirty = self._dir_dirty = self._closed = False
        self._retired: list[int] = []  # rotated-out fds awaiting the next sync's fsync
        if writable:
            self.directory.mkdir(parents=True, exist_ok=True)
        if numbers := self._numbers():  # refuse a foreign directory now rather than at first use
            _check_header(_read_header(self._path(numbers[-1])), self._path(numbers[-1]), allow_torn=True)

    def append(self, payload: bytes | memoryview) -> BlobRef:
        """Write one record and return its reference. Visible to `read` at once; durable after `sync`."""
        self._check(write=True)
        data = memoryview(payload).cast("B")
        fd = self._writer()
        if self._size + _RECORD.size + data.nbytes > self.max_segment_bytes and self._size > HEADER_SIZE:
            fd = self._open_new(self._segment + 1)
        crc = zlib.crc32(data)
        try:
            _write_all(fd, _RECORD.pack(data.nbytes, crc))
            _write_all(fd, data)
        except OSError:
            os.ftruncate(fd, self._size)  # drop the torn record so later appends follow the last good one
            raise
        ref = BlobRef(self._segment, self._size + _RECORD.size, data.nbytes, crc)
        self._size, self._dirty = ref.offset + ref.length, True
        return ref

    def sync(self) -> None:
        """fsync the files written since the last sync, and the directory if a file was created."""
        self._check(write=True)
        while self._retired:
            os.fsync(self._retired[-1])
            os.close(self._retired.pop())
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        if self._dir_dirty:
            fsync_dir(self.directory)
            self._dir_dirty = False

    def read(self, ref: BlobRef, verify: bool = False) -> memoryview:
        """Zero-copy view of a payload; verify=True raises ChecksumMismatch on a wrong crc32."""
        self._check()
        if ref.offset < HEADER_SIZE + _RECORD.size or ref.length < 0:
            raise SegmentError(f"invalid reference {ref}")
        end = ref.offset + ref.length
        view = memoryview(self._mapped(ref.segment, end))[ref.offset : end]
        if verify and zlib.crc32(view) != ref.checksum:
            raise ChecksumMismatch(f"checksum mismatch for {ref}")
        return view

    def read_copy(self, ref: BlobRef) -> bytes:
        """A copy of a payload; the mapped pages it touched leave this process's resident set.

        Pages read through a map count in the reader's RSS until the kernel reclaims them, so a
        process recalling across a 10M-token store would look as large as the part of the store it
        has touched. MADV_DONTNEED on a read-only file map only drops this process's page-table
        entries: the data stays in the kernel's page cache for the next read, and a view still held
        elsewhere faults its page back in.
        """
        view = self.read(ref)
        try:
            data = bytes(view)
        finally:
            view.release()
        mm = self._maps[ref.segment]
        if hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED") and ref.length > 0:
            # A fault maps the pages around it too (Linux "fault-around", 64 KiB by default): dropping only
            # the blob's own pages left about half of a store of small blobs resident (measured).
            start = max(0, ref.offset - _FAULT_AROUND) // _FAULT_AROUND * _FAULT_AROUND
            end = min(len(mm), (ref.offset + ref.length) // _FAULT_AROUND * _FAULT_AROUND + 2 * _FAULT_AROUND)
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        return data

    def read_part(self, ref: BlobRef, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of a payload, read with pread: many small reads (a few hundred bytes
        each) cost a map's page faults and a madvise each through `read_copy`, and nothing is mapped here."""
        self._check()
        if not 0 <= start <= start + length <= ref.length or ref.offset < HEADER_SIZE + _RECORD.size:
            raise SegmentError(f"bytes [{start}, {start + length}) are outside {ref}")
        fd = self._read_fds.get(ref.segment)
        if fd is None:
            try:
                fd = self._read_fds[ref.segment] = os.open(self._path(ref.segment), os.O_RDONLY)
            except FileNotFoundError:
                raise SegmentError(f"segment file {self._path(ref.segment)} is missing") from None
        data = os.pread(fd, length, ref.offset + start)
        if len(data) != length:
            raise SegmentError(f"{ref} ends past the end of its segment file")
        return data

    def will_need(self, refs: Iterable[BlobRef]) -> None:
        """Start reading these payloads into the kernel's page cache, all at once, without waiting.

        Reading cold blobs one after another waits for the disk once per blob, and a recall reads tens
        of them. MADV_WILLNEED on a file map queues the reads now (page cache only: nothing enters this
        process's resident set), so the reads that follow wait about once.
        """
        self._check()
        if not hasattr(mmap, "MADV_WILLNEED"):
            return
        for ref in refs:
            end = ref.offset + ref.length
            mm = self._mapped(ref.segment, end)
            start = ref.offset // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                mm.madvise(mmap.MADV_WILLNEED, start, end - start)

    def verify(self, ref: BlobRef) -> bool:
        """True if the payload's crc32 matches the reference; SegmentError if it cannot be read at all."""
        return zlib.crc32(self.read(ref)) == ref.checksum

    def verify_all(self, refs: Sequence[BlobRef]) -> None:
        """SegmentError naming the first of `refs` (event i: the i-th) that cannot be read or fails its crc32."""
        for i, ref in enumerate(refs):
            try:
                ok = self.verify(ref)
            except SegmentError as err:
                raise SegmentError(f"event {i}: {err}") from err
            if not ok:
                raise SegmentError(f"event {i}: checksum mismatch")

    def truncate_to(self, committed_ends: dict[int, int]) -> int:
        """Recovery: cut every byte past the committed ends and return how many bytes went.

        A segment in `committed_ends` keeps bytes up to its end; one absent from it keeps only its
        header if numbered below the highest committed segment, and is deleted otherwise.
        """
        self._check(write=True)
        numbers = self._numbers()
        if missing := sorted(set(committed_ends) - set(numbers)):
            raise SegmentError(f"committed segments missing from {self.directory}: {missing}")
        top = max(committed_ends, default=0)
        plan: list[tuple[Path, int, int | None]] = []  # (file, size, bytes to keep; None deletes it)
        for n in numbers:  # validate everything before changing anything
            path, keep = self._path(n), committed_ends.get(n, HEADER_SIZE if n < top else None)
            size = path.stat().st_size
            if keep is not None:
                _check_header(_read_header(path), path)
                if not HEADER_SIZE <= keep <= size:
                    raise SegmentError(f"committed end {keep} of segment {n} lies outside its {size} bytes")
            plan.append((path, size, keep))
        self._close_maps(strict=True)
        self._close_writer()
        removed = 0
        for path, size, keep in plan:
            if keep is None:
                path.unlink()
                self._dir_dirty = True
            elif size != keep:
                with open(path, "r+b") as f:
                    f.truncate(keep)
                    os.fsync(f.fileno())
            removed += size - (keep or 0)
        if self._dir_dirty:
            fsync_dir(self.directory)
            self._dir_dirty = False
        return removed

    def segment_files(self) -> dict[int, Path]:
        """{segment number: file} of every segment in the directory."""
        return {n: self._path(n) for n in self._numbers()}

    def adopt(self, files: Sequence[Path]) -> list[int]:
        """Take another log's whole segment files (the same format) as this log's next segments, in order, and
        return their numbers here. Hard links where the file system has them (no bytes copied), else copies.
        Durable on return; until a catalog commit points into them they lie past every committed end, and
        recovery (`truncate_to`) deletes them. No append goes into a file another directory still links
        (`_writer`)."""
        self._check(write=True)
        for src in files:  # all of them before any is taken
            _check_header(_read_header(src), src)
        self.sync()
        self._close_writer()
        first = max(self._numbers(), default=0) + 1
        numbers = list(range(first, first + len(files)))
        for number, src in zip(numbers, files):
            try:
                os.link(src, self._path(number))
            except OSError:  # another file system, or one without hard links
                shutil.copyfile(src, self._path(number))
                with open(self._path(number), "rb") as f:
                    os.fsync(f.fileno())
        self._dir_dirty = True
        self.sync()
        return numbers

    def close(self) -> None:
        """Release files and maps. Does not fsync: call `sync` first for durability."""
        if not self._closed:
            self._close_writer()
            self._close_maps()
            self._closed = True

    def __enter__(self) -> SegmentLog:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _check(self, write: bool = False) -> None:
        if self._closed:
            raise SegmentError("segment log is closed")
        if write and not self.writable:
            raise SegmentError("segment log was opened read-only")

    def _path(self, segment: int) -> Path:
        return self.directory / f"{segment:06d}.seg"  # as `scan` names them

    def _numbers(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for name in os.listdir(self.directory) if (m := _NAME.match(name)))

    def _mapped(self, segment: int, need: int) -> mmap.mmap:
        """The cached map of `segment`, mapped again if the file grew past it since (`need`: bytes required)."""
        mm = self._maps.get(segment)
        if mm is None or len(mm) < need:
            mm = self._map(segment, need)
        return mm

    def _map(self, segment: int, need: int) -> mmap.mmap:
        path = self._path(segment)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise SegmentError(f"segment file {path} is missing") from None
        try:
            if (size := os.fstat(fd).st_size) < need:  # also keeps mmap away from an empty file
                raise SegmentError(f"reference ends at byte {need} but {path} has {size}")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)  # the map holds its own handle
        _check_header(mm[:HEADER_SIZE], path)
        if (old := self._maps.get(segment)) is not None:
            self._stale.add(old)  # callers may hold views into it; it unmaps itself once they are gone
        self._maps[segment] = mm
        return mm

    def _close_maps(self, strict: bool = False) -> None:
        for fd in self._read_fds.values():
            os.close(fd)
        self._read_fds.clear()
        held = 0
        for mm in [*self._maps.values(), *self._stale]:
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the map closes itself once it is released
                self._stale.add(mm)
                held += 1
        self._maps.clear()
        # Truncating a file under a live view makes reading that view fault (SIGBUS), hence strict.
        if strict and held:
            raise SegmentError(f"callers still hold views into {held} segment map(s); release them first")

    def _writer(self) -> int:
        if self._fd is not None:
            return self._fd
        if not (numbers := self._numbers()):
            return self._open_new(1)
        path = self._path(numbers[-1])
        _check_header(_read_header(path), path)  # a torn header here means recovery was skipped
        if os.stat(path).st_nlink > 1:  # adopted, and the shard's store still links it: its bytes are not ours alone
            return self._open_new(numbers[-1] + 1)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._fd, self._segment, self._size = fd, numbers[-1], os.fstat(fd).st_size
        return fd

    def _open_new(self, segment: int) -> int:
        if self._fd is not None and self._dirty:
            self._retired.append(self._fd)  # appends never fsync: the next sync does
        elif self._fd is not None:
            os.close(self._fd)
        fd = os.open(self._path(segment), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        self._fd, self._segment, self._size, self._dirty, self._dir_dirty = fd, segment, HEADER_SIZE, True, True
        _write_all(fd, _HEADER_BYTES)
        return fd

    def _close_writer(self) -> None:
        # No fsync: durability is `sync`'s job, and bytes never synced are never committed.
        for fd in self._retired + ([] if self._fd is None else [self._fd]):
            os.close(fd)
        self._retired, self._fd, self._dirty = [], None, False
