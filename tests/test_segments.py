"""SegmentLog: append/read, rotation, reopen, checksums, crash recovery by truncation, scanning."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest

from engramkv.storage.segments import HEADER_SIZE, BlobRef, ChecksumMismatch, SegmentError, SegmentLog, scan

RECORD = 12  # record header: u64 length + u32 crc32


def blob(i: int, n: int = 50) -> bytes:
    return bytes((i * 7 + k) % 256 for k in range(n))


def seg_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.seg"))


def seg_bytes(d: Path) -> int:
    """Bytes on disk across all segment files, headers included."""
    return sum(p.stat().st_size for p in d.glob("*.seg"))


def test_append_read_round_trip(tmp_path: Path) -> None:
    with SegmentLog(tmp_path / "s") as log:
        a = log.append(b"hello")
        b = log.append(memoryview(blob(1, 1000)))
        e = log.append(b"")
        log.sync()
        assert a == BlobRef(1, HEADER_SIZE + RECORD, 5, zlib.crc32(b"hello"))
        assert b.offset == a.offset + a.length + RECORD
        assert bytes(log.read(a)) == b"hello"
        assert bytes(log.read(b, verify=True)) == blob(1, 1000)
        assert bytes(log.read(e)) == b"" and log.verify(e)
        assert seg_bytes(tmp_path / "s") == HEADER_SIZE + 3 * RECORD + 1005
    assert seg_files(tmp_path / "s") == ["000001.seg"]


def test_rotation_across_files(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path, max_segment_bytes=HEADER_SIZE + 2 * (RECORD + 50))
    refs = [log.append(blob(i)) for i in range(5)]
    log.sync()
    assert [r.segment for r in refs] == [1, 1, 2, 2, 3]
    assert seg_files(tmp_path) == ["000001.seg", "000002.seg", "000003.seg"]
    assert all(bytes(log.read(r, verify=True)) == blob(i) for i, r in enumerate(refs))
    assert list(scan(log.directory, 2)) == refs[2:4]
    log.close()


def test_large_payload_goes_alone_into_a_fresh_file(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path, max_segment_bytes=200)
    small = log.append(blob(0))
    big = log.append(blob(1, 500))
    after = log.append(blob(2))
    assert (small.segment, big.segment, after.segment) == (1, 2, 3)
    assert big.offset == HEADER_SIZE + RECORD
    assert bytes(log.read(big, verify=True)) == blob(1, 500)
    # A first payload larger than the limit uses the (empty) first file rather than leaving it empty.
    log2 = SegmentLog(tmp_path / "other", max_segment_bytes=200)
    assert log2.append(blob(3, 500)).segment == 1
    log.close()
    log2.close()


def test_read_after_append_without_sync_and_remap_on_growth(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path)
    a = log.append(blob(0))
    view_a = log.read(a)  # maps the file at its current length
    b = log.append(blob(1, 4000))  # grows past the mapped length: read must remap
    assert bytes(log.read(b, verify=True)) == blob(1, 4000)
    assert bytes(view_a) == blob(0)  # a view into the superseded map stays valid
    reader = SegmentLog(tmp_path, writable=False)  # another handle sees unsynced appends too
    assert bytes(reader.read(b)) == blob(1, 4000)
    del view_a
    reader.close()
    log.close()


def test_reopen_continues_in_last_file(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path, max_segment_bytes=HEADER_SIZE + 3 * (RECORD + 50))
    refs = [log.append(blob(i)) for i in range(4)]
    log.sync()
    log.close()
    with SegmentLog(tmp_path, max_segment_bytes=HEADER_SIZE + 3 * (RECORD + 50)) as log:
        nxt = log.append(blob(9))
        assert nxt == BlobRef(2, refs[3].offset + 50 + RECORD, 50, zlib.crc32(blob(9)))
        assert all(bytes(log.read(r, verify=True)) == blob(i) for i, r in enumerate(refs))
        assert seg_files(tmp_path) == ["000001.seg", "000002.seg"]


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path)
    a, b = log.append(blob(0)), log.append(blob(1))
    log.sync()
    with open(tmp_path / "000001.seg", "r+b") as f:
        f.seek(b.offset + 10)
        byte = f.read(1)
        f.seek(b.offset + 10)
        f.write(bytes([byte[0] ^ 0x01]))
    assert log.verify(a) and not log.verify(b)
    with pytest.raises(ChecksumMismatch):
        log.read(b, verify=True)
    assert len(log.read(b)) == 50  # without verify the damaged bytes are still served
    log.close()


def test_truncate_to_removes_torn_tail_and_extra_segments(tmp_path: Path) -> None:
    size = HEADER_SIZE + 3 * (RECORD + 50)
    log = SegmentLog(tmp_path, max_segment_bytes=size)
    refs = [log.append(blob(i)) for i in range(7)]  # segments 1,1,1,2,2,2,3
    log.sync()
    with open(tmp_path / "000003.seg", "ab") as f:  # a torn record after the last one
        f.write(struct.pack("<QI", 50, 123) + b"partial")
    (tmp_path / "000004.seg").write_bytes(b"EKVSEG")  # a file created just before the crash, header torn
    committed = refs[:2] + refs[6:]  # seg 1 partly committed, seg 2 not at all, seg 3 committed
    before = seg_bytes(tmp_path)
    ends = {1: refs[1].offset + refs[1].length, 3: refs[6].offset + refs[6].length}
    removed = log.truncate_to(ends)
    assert removed == before - seg_bytes(tmp_path) == (RECORD + 50) + 3 * (RECORD + 50) + RECORD + 7 + 6
    assert seg_files(tmp_path) == ["000001.seg", "000002.seg", "000003.seg"]
    assert (tmp_path / "000002.seg").stat().st_size == HEADER_SIZE
    assert [r for s in (1, 2, 3) for r in scan(log.directory, s)] == committed
    nxt = log.append(blob(20))  # continues right after the last committed record
    assert nxt == BlobRef(3, ends[3] + RECORD, 50, zlib.crc32(blob(20)))
    assert list(scan(log.directory, 3)) == [refs[6], nxt]
    assert all(log.verify(r) for r in [*committed, nxt])
    log.close()
    with SegmentLog(tmp_path, max_segment_bytes=size) as again:  # and so does a fresh handle
        assert again.append(blob(21)).offset == nxt.offset + 50 + RECORD


def test_truncate_to_with_nothing_committed_deletes_everything(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path, max_segment_bytes=200)
    for i in range(5):
        log.append(blob(i))
    log.truncate_to({})
    assert seg_files(tmp_path) == []
    assert log.append(blob(0)).segment == 1
    log.close()


def test_truncate_to_refuses_bad_plans_and_held_views(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path)
    a = log.append(blob(0))
    end = a.offset + a.length
    with pytest.raises(SegmentError):
        log.truncate_to({1: end + 1})  # the catalog claims bytes the file lacks
    with pytest.raises(SegmentError):
        log.truncate_to({1: end, 2: HEADER_SIZE})  # a committed segment is missing
    view = log.read(a)
    with pytest.raises(SegmentError):
        log.truncate_to({1: end})  # truncating under a live view could fault on read
    assert bytes(view) == blob(0)
    del view
    assert log.truncate_to({1: end}) == 0
    log.close()


def test_scan_stops_at_torn_tail(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path)
    refs = [log.append(blob(i)) for i in range(2)]
    log.sync()
    path = tmp_path / "000001.seg"
    good = path.read_bytes()
    tails = [
        b"\x01\x02\x03",  # incomplete record header
        struct.pack("<QI", 1000, 0) + b"short",  # payload cut short
        struct.pack("<QI", 2**63, 0),  # garbage length
        struct.pack("<QI", 4, 0) + b"junk",  # complete but fails its crc32
    ]
    for tail in tails:
        path.write_bytes(good + tail)
        assert list(scan(log.directory, 1)) == refs
    log.close()


def test_read_only_on_missing_dir_creates_nothing(tmp_path: Path) -> None:
    d = tmp_path / "absent"
    log = SegmentLog(d, writable=False)
    assert seg_bytes(d) == 0
    with pytest.raises(SegmentError):
        log.append(b"x")
    with pytest.raises(SegmentError):
        log.read(BlobRef(1, HEADER_SIZE + RECORD, 1, 0))
    log.close()
    assert not d.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    SegmentLog(empty, writable=False).close()
    assert list(empty.iterdir()) == []


def test_foreign_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "000001.seg").write_bytes(b"NOTASEGMENTFILE!" + bytes(100))
    with pytest.raises(SegmentError, match="bad magic"):
        SegmentLog(tmp_path)
    with pytest.raises(SegmentError, match="bad magic"):
        SegmentLog(tmp_path, writable=False)
    (tmp_path / "000002.seg").write_bytes(b"EKVSEG01" + bytes(8))  # right magic, wrong version
    with pytest.raises(SegmentError, match="version"):
        SegmentLog(tmp_path)
    # Opening checks only the newest file; an older foreign one is refused when it is first touched.
    with SegmentLog(tmp_path / "ok", max_segment_bytes=200) as log:
        log.append(blob(0, 150))
        log.append(blob(1, 150))
    os.replace(tmp_path / "000001.seg", tmp_path / "ok" / "000001.seg")
    with SegmentLog(tmp_path / "ok", writable=False) as log:
        with pytest.raises(SegmentError, match="bad magic"):
            log.read(BlobRef(1, HEADER_SIZE + RECORD, 4, 0))
        with pytest.raises(SegmentError, match="bad magic"):
            list(scan(log.directory, 1))


def test_missing_segment_and_ref_past_end(tmp_path: Path) -> None:
    with SegmentLog(tmp_path) as log:
        a = log.append(blob(0))
        with pytest.raises(SegmentError, match="missing"):
            log.read(BlobRef(7, a.offset, a.length, a.checksum))
        with pytest.raises(SegmentError, match="ends at byte"):
            log.read(BlobRef(1, a.offset, a.length + 1, a.checksum))
        with pytest.raises(SegmentError):
            log.read(BlobRef(1, 0, 4, 0))  # points into the file header
    with pytest.raises(SegmentError, match="closed"):
        log.read(a)


def test_read_copy_returns_the_payload_and_gives_the_pages_back(tmp_path: Path) -> None:
    with SegmentLog(tmp_path / "segs") as log:
        refs = [log.append(blob(i, 20_000)) for i in range(8)]
        log.sync()
        held = log.read(refs[3])  # a view held across the madvise of its pages still reads right
        for i, ref in enumerate(refs):
            assert log.read_copy(ref) == blob(i, 20_000)
        assert bytes(held) == blob(3, 20_000)
        del held
        assert log.read_part(refs[2], 100, 5_000) == blob(2, 20_000)[100:5_100]  # a part alone, not mapped
        with pytest.raises(SegmentError, match="outside"):
            log.read_part(refs[2], 19_000, 2_000)
    with pytest.raises(SegmentError, match="closed"):
        log.read_part(refs[2], 0, 10)


def _mapped_rss_kb(directory: Path) -> int:
    """Resident kB of this process's maps of files under `directory` (Linux /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: range perms offset dev inode [path]
            inside = len(fields) > 5 and fields[5].startswith(str(directory))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_read_copy_leaves_no_mapped_pages_resident(tmp_path: Path) -> None:
    import random

    log = SegmentLog(tmp_path)
    rng = random.Random(0)
    refs = [log.append(os.urandom(rng.randint(500, 4000))) for _ in range(4000)]  # ~9 MB of small blobs
    log.sync()
    for ref in rng.sample(refs, 2000):
        assert zlib.crc32(log.read_copy(ref)) == ref.checksum
    # Without the fault-around margin about half of the file stayed resident (~4,500 kB here).
    assert _mapped_rss_kb(tmp_path) <= 256
    view = log.read(refs[0])  # plain reads stay zero-copy views of the map: resident once touched
    assert bytes(view[:8]) and _mapped_rss_kb(tmp_path) > 0
    view.release()
    log.close()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_will_need_fills_no_process_pages_and_refuses_bad_references(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path, max_segment_bytes=200_000)
    refs = [log.append(blob(i, 5_000)) for i in range(100)]  # three files
    log.sync()
    log.will_need([next(r for r in refs if r.segment == n) for n in (1, 2, 3)])  # maps each file
    mapped = _mapped_rss_kb(tmp_path)  # each map's header check: its first page and the pages around it
    log.will_need(refs)
    assert _mapped_rss_kb(tmp_path) == mapped  # the kernel reads into its page cache, not into this process
    assert [log.read_copy(ref) for ref in refs] == [blob(i, 5_000) for i in range(100)]
    with pytest.raises(SegmentError, match="missing"):
        log.will_need([BlobRef(99, refs[0].offset, 10, 0)])
    with pytest.raises(SegmentError, match="reference ends"):
        log.will_need([BlobRef(1, refs[0].offset, 10**9, 0)])
    log.close()
    with pytest.raises(SegmentError, match="closed"):
        log.will_need(refs[:1])


@pytest.mark.parametrize("links", [True, False], ids=["hard-link", "copy"])
def test_adopt_takes_another_logs_files_without_writing_their_blobs(tmp_path: Path, links: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with SegmentLog(tmp_path / "shard", max_segment_bytes=200) as shard:  # two files
        refs = [shard.append(blob(i, 80)) for i in range(3)]
        shard.sync()
        files = shard.segment_files()
    assert list(files) == [1, 2]
    if not links:  # a file system without hard links: the files are copied instead
        def no_link(src: object, dst: object) -> None:
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "link", no_link)
    with SegmentLog(tmp_path / "ns") as log:
        own = log.append(b"before")
        numbers = log.adopt(list(files.values()))
        assert numbers == [2, 3]
        moved = [BlobRef(numbers[r.segment - 1], r.offset, r.length, r.checksum) for r in refs]
        assert [bytes(log.read(r, verify=True)) for r in moved] == [blob(i, 80) for i in range(3)]
        assert (os.stat(files[1]).st_ino == os.stat(log.directory / "000002.seg").st_ino) == links
        after = log.append(b"after")  # never into a file the shard's directory still links
        assert after.segment == (4 if links else 3) and bytes(log.read(own)) == b"before"
        log.sync()
    with SegmentLog(tmp_path / "ns") as log:  # nothing committed the adoption: recovery drops it
        log.truncate_to({1: own.offset + own.length})
        assert seg_files(log.directory) == ["000001.seg"]
    with SegmentLog(tmp_path / "ns") as log:  # a foreign file is refused before anything is linked
        (tmp_path / "junk.seg").write_bytes(b"not a segment file")
        with pytest.raises(SegmentError):
            log.adopt([tmp_path / "junk.seg"])
        assert seg_files(log.directory) == ["000001.seg"]
