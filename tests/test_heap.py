"""Handing the C heap's free pages back to the OS (`engramkv.storage.heap`)."""

import ctypes.util
import sys

import pytest

from engramkv.storage.heap import release_free_heap


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux") or "libc.so" not in (ctypes.util.find_library("c") or ""),
                    reason="malloc_trim is glibc's")
def test_freed_heap_between_live_blocks_leaves_the_resident_set():
    # 4 KB blocks come from the heap (not mmap); keeping every 16th leaves holes that free() cannot
    # give back on its own, only trimming can.
    blocks = [bytearray(4000) for _ in range(40_000)]  # ~160 MB, every page touched
    kept = blocks[::16]
    del blocks
    before = _rss_mb()
    assert release_free_heap() is True
    after = _rss_mb()
    assert before - after > 60, (before, after)
    assert len(kept) == 2_500  # the live blocks stayed alive through the measurement
