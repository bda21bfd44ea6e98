"""Reading documents from disk: checked before anything is written, then streamed in pieces.

A file is read twice. The first pass checks it (a regular, readable file; no NUL bytes, which
mark binary data; valid UTF-8 throughout; some non-whitespace text) and hashes it, so a bad file
is refused before the store changes and a re-run of the same ingest recognises the same file.
The second pass streams it from a byte offset (0, or where an interrupted ingest stopped) as text
pieces, never holding the whole file.
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engramkv.errors import EmptyInputError, InputError

READ_BLOCK = 1 << 20


@dataclass(frozen=True)
class CheckedDocument:
    path: Path
    size_bytes: int
    content_key: str  # sha256 of the bytes


def check_document(path: str | Path) -> CheckedDocument:
    """Refuse what cannot be ingested as text, with a message that says why; hash what can."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if p.is_dir():
        raise InputError(f"{p} is a directory; give the files inside it")
    if not p.is_file():
        raise InputError(f"{p} is not a regular file")
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    seen_text = False
    offset = 0
    try:
        with open(p, "rb") as f:
            while block := f.read(READ_BLOCK):
                if b"\x00" in block:
                    raise InputError(f"{p} looks binary (NUL byte at offset {offset + block.index(0)}); "
                                     "engramkv ingests plain text and Markdown")
                try:
                    text = decoder.decode(block)
                except UnicodeDecodeError as err:
                    raise InputError(f"{p} is not valid UTF-8 (byte offset {offset + err.start}); "
                                     "convert it first, e.g. iconv -f latin1 -t utf-8") from None
                seen_text = seen_text or not text.isspace() and bool(text)
                digest.update(block)
                offset += len(block)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise InputError(f"{p} is not valid UTF-8 (it ends inside a multi-byte character)") from None
    except PermissionError:
        raise InputError(f"{p}: permission denied") from None
    except OSError as err:
        raise InputError(f"{p}: cannot read ({err.strerror or err})") from None
    if not seen_text:
        raise EmptyInputError(f"{p} holds no text")
    return CheckedDocument(p, offset, digest.hexdigest())


def read_text(path: Path, start_byte: int = 0) -> Iterator[tuple[str, int]]:
    """Text pieces of the file from `start_byte` (a character boundary), each with its size in bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    with open(path, "rb") as f:
        f.seek(start_byte)
        while block := f.read(READ_BLOCK):
            text = decoder.decode(block)
            if text:
                yield text, len(text.encode("utf-8"))
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail, len(tail.encode("utf-8"))
