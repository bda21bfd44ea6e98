"""Writes that survive a crash: fsync of a directory, and replace-by-rename of a whole file; bytes on disk."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (files created, renamed, removed) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes) -> None:
    """Write to a temp file, fsync, rename over `path`, fsync the directory: all or nothing after a crash."""

    def write(tmp: Path) -> None:
        tmp.write_bytes(data)

    replace_durably_with(path, write)


def replace_durably_with(path: Path, write: Callable[[Path], None]) -> None:
    """`replace_durably` for a writer that streams to a file itself (no copy of the whole content in RAM)."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
