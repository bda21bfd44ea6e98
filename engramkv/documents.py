"""Documents: file checks, streaming reads, and tokenising text in whitespace-cut pieces.

A file is read twice. The first pass checks it (a regular, readable file; no NUL bytes, which
mark binary data; valid UTF-8 throughout; some non-whitespace text) and hashes it, so a bad file
is refused before the store changes and a re-run of the same ingest recognises the same file.
The second pass streams it from a byte offset (0, or where an interrupted ingest stopped) as text
pieces, never holding the whole file. Text (from a file or given directly) is tokenised in pieces
cut at whitespace (`tokenize_pieces`), so a stream never has to be held whole.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engramkv.errors import EmptyInputError, InputError
from engramkv.memory.events import DocumentProgress
from engramkv.results import IngestProgress

READ_BLOCK = 1 << 20
# Text is tokenised in pieces of about this many characters, cut at whitespace. Not a knob: a stored
# document's resume position depends on where the cuts fall, so changing it would re-read differently.
TOKENIZE_PIECE_CHARS = 16_384


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


def read_text(path: Path, start_byte: int = 0, end_byte: int | None = None) -> Iterator[tuple[str, int]]:
    """Text pieces of the file from `start_byte` to `end_byte` (None: its end; both character boundaries), each
    with its size in bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    with open(path, "rb") as f:
        f.seek(start_byte)
        left = float("inf") if end_byte is None else end_byte - start_byte
        while left > 0 and (block := f.read(int(min(READ_BLOCK, left)))):
            left -= len(block)
            text = decoder.decode(block)
            if text:
                yield text, len(text.encode("utf-8"))
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail, len(tail.encode("utf-8"))


def tokenize_pieces(tokenizer: Any, pieces: Iterable[str]) -> Iterator[tuple[list[int], int]]:
    """Token ids of the text, piece by piece, with each piece's size in UTF-8 bytes.

    Cuts fall at whitespace about every TOKENIZE_PIECE_CHARS characters and depend only on the text
    from the previous cut, so a resumed ingest tokenises exactly as the first run did.
    """
    carry = ""
    for piece in pieces:
        if not isinstance(piece, str):
            raise InputError(f"ingest takes str or an iterable of str, got {type(piece).__name__}")
        carry += piece
        while len(carry) >= TOKENIZE_PIECE_CHARS:
            cut = _last_whitespace(carry, TOKENIZE_PIECE_CHARS)
            text, carry = carry[:cut], carry[cut:]
            yield tokenizer.encode(text, add_special_tokens=False), len(text.encode("utf-8"))
    if carry:
        yield tokenizer.encode(carry, add_special_tokens=False), len(carry.encode("utf-8"))


def _last_whitespace(text: str, limit: int) -> int:
    cut = max(text.rfind(" ", 0, limit), text.rfind("\n", 0, limit))
    return cut + 1 if cut > 0 else limit


@dataclass
class IngestRun:
    """One `ingest_file` call: the document, what has been tokenised of it, and whether Ctrl-C asked to stop."""

    path: Path
    document: DocumentProgress
    resumed_from: int = 0  # byte where this run started reading (an interrupted ingest resumes there)
    bytes_fed: int = 0
    tokens_fed: int = 0
    stop_requested: bool = False

    @classmethod
    def start(cls, checked: CheckedDocument, documents: list[DocumentProgress], token_start: int) -> IngestRun:
        """A run over `checked`, given the memory's `documents` (oldest first): it continues the latest one when
        that is the same file (by content).

        A document of the same content already complete, the latest or an earlier one, is returned as the run's
        document: nothing is left to read (a multi-file ingest run again skips what it read). An earlier one left
        with text unread is refused: its rest would follow the documents read since, in a record that says it is
        one.
        """
        same = [d for d in documents if d.content_key == checked.content_key]
        if same and same[-1] is documents[-1]:
            return cls(checked.path, same[-1], resumed_from=same[-1].bytes_done)
        # all of its text tokenised: the tokens an interruption left queued were read before the next document
        read = next((d for d in same if d.complete or d.bytes_done >= d.size_bytes), None)
        if read is not None:
            return cls(checked.path, dataclasses.replace(read, complete=True))
        if same:
            earlier, later = same[-1], documents[-1]
            raise InputError(
                f"{checked.path} was interrupted at byte {earlier.bytes_done:,} of {earlier.size_bytes:,}, and "
                f"{later.name} was read after it: only the latest document resumes. Its first part stays in the "
                f"store; to read the rest, ingest a file holding it (tail -c +{earlier.bytes_done + 1} "
                f"{checked.path} > rest.txt), and leave {checked.path} out of later ingests")
        document = DocumentProgress(name=str(checked.path.resolve()), size_bytes=checked.size_bytes,
                                    content_key=checked.content_key, token_start=token_start)
        return cls(checked.path, document)

    def token_pieces(self, tokenizer: Any) -> Iterator[list[int]]:
        """The token ids of the rest of the file, piece by piece; the document's read position follows."""
        texts = (text for text, _ in read_text(self.path, self.resumed_from))
        for ids, n_bytes in tokenize_pieces(tokenizer, texts):
            self.document.bytes_done += n_bytes
            self.bytes_fed += n_bytes
            self.tokens_fed += len(ids)
            yield ids

    def finish(self, token_end: int) -> None:
        self.document.complete = not self.stop_requested
        self.document.token_end = token_end

    def progress(self, tokens: int, events: int, queued_tokens: int) -> IngestProgress:
        """The progress record, the bytes the model has read estimated: `bytes_done` is the tokeniser's
        position, up to a piece ahead of the model, so the queued tokens are subtracted at the running rate."""
        doc = self.document
        bytes_per_token = self.bytes_fed / self.tokens_fed if self.tokens_fed else 4.0
        read = doc.bytes_done - int(queued_tokens * bytes_per_token)
        return IngestProgress(tokens=tokens, events=events, bytes_read=max(0, min(read, doc.size_bytes)),
                              size_bytes=doc.size_bytes)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Turn Ctrl-C into a request honoured between chunks (a chunk cut half-way would be lost)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(_signum: int, _frame: Any) -> None:
            if self.stop_requested:  # a second Ctrl-C: the user insists; the last commit stands
                raise KeyboardInterrupt
            self.stop_requested = True

        previous = signal.signal(signal.SIGINT, request_stop)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
