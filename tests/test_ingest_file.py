"""Ingesting files into a store: bad files change nothing; Ctrl-C and a full disk resume exactly."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch

from engramkv import EngineConfig
from engramkv.config import RecallConfig, SegmentationConfig, StoreConfig, WindowConfig
from engramkv.errors import EmptyInputError, InputError, SessionError, StoreFullError
from engramkv.storage.segments import SegmentLog

from conftest import VOCAB, tiny_pair

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
    store=StoreConfig(codec="int8", commit_tokens=96),
)


def _doc(path, n=1500, seed=0):
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    path.write_text(" ".join(map(str, ids)) + "\n")
    return path


def _spans(session):
    return [(e.start, e.end) for e in map(session.memory.event, range(session.events))]


def _ctrl_c_at(chunk):
    """A progress callback that presses Ctrl-C at the `chunk`-th report (to the handler ingest_file installs)."""
    calls = [0]

    def press(record):
        calls[0] += 1
        if calls[0] == chunk:
            os.kill(os.getpid(), signal.SIGINT)

    return press


def _reference(tmp_path, doc):
    _, lm = tiny_pair("llama", CFG)
    with lm.session(store=tmp_path / "reference") as s:
        s.ingest_file(doc)
        spans = _spans(s)
    lm.close()
    return spans


@pytest.mark.parametrize("content, error, match", [
    (b"12 13 \x00\x01\x02 14", InputError, "binary"),
    (b"12 13 \xff\xfe 14", InputError, "UTF-8"),
    (b"12 13 \xc3", InputError, "UTF-8"),
    (b"", EmptyInputError, "no text"),
    (b" \n\t \n", EmptyInputError, "no text"),
])
def test_bad_files_are_refused_and_change_nothing(tmp_path, content, error, match):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    _, lm = tiny_pair("llama", CFG)
    s = lm.session(store=tmp_path / "store")
    with pytest.raises(error, match=match):
        s.ingest_file(bad)
    assert s.tokens_ingested == 0 and s.events == 0
    assert s.memory is not None and s.memory.documents() == []
    assert not list((tmp_path / "store").rglob("*.seg"))
    s.close()
    lm.close()


def test_missing_files_and_directories_are_refused(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    s = lm.session()
    with pytest.raises(InputError, match="no such file"):
        s.ingest_file(tmp_path / "nope.txt")
    with pytest.raises(InputError, match="directory"):
        s.ingest_file(tmp_path)
    lm.close()


def test_a_complete_document_is_not_ingested_twice(tmp_path):
    doc = _doc(tmp_path / "doc.txt")
    _, lm = tiny_pair("llama", CFG)
    with lm.session(store=tmp_path / "s") as s:
        first = s.ingest_file(doc)
        again = s.ingest_file(doc)
        assert first.tokens == 1500 and not first.already_ingested
        assert again.already_ingested and again.tokens == 0 and again.document_tokens == 1500
        assert [d.complete for d in s.memory.documents()] == [True]
    lm.close()


def test_a_document_read_before_the_latest_is_not_ingested_again(tmp_path):
    """A multi-file ingest run again (`engramkv ingest a.txt b.txt` twice, or after a Ctrl-C in b.txt) skips every
    file already complete, not only the latest."""
    a, b = _doc(tmp_path / "a.txt", n=300, seed=1), _doc(tmp_path / "b.txt", n=200, seed=2)
    _, lm = tiny_pair("llama", CFG)
    with lm.session(store=tmp_path / "s") as s:
        s.ingest_file(a)
        s.ingest_file(b)
        tokens, events = s.tokens_ingested, s.events
        again = s.ingest_file(a)
        assert again.already_ingested and again.tokens == 0 and again.document_tokens == 300
        assert s.ingest_file(b).already_ingested
        assert (s.tokens_ingested, s.events) == (tokens, events)
        assert [d.complete for d in s.memory.documents()] == [True, True]
    lm.close()


def test_an_earlier_interrupted_document_whose_text_was_all_queued_counts_as_read(tmp_path):
    """Interrupted after its last piece was tokenised, a document's queued tokens are read before the next
    document's, so asked again it is skipped, not refused."""
    a, b = _doc(tmp_path / "a.txt", n=2000, seed=1), _doc(tmp_path / "b.txt", n=200, seed=2)
    _, lm = tiny_pair("llama", CFG)
    with lm.session(store=tmp_path / "s") as s:
        with pytest.raises(KeyboardInterrupt):
            s.ingest_file(a, progress=_ctrl_c_at(20))
        assert s.memory.documents()[0].bytes_done == a.stat().st_size
        s.ingest_file(b)
        tokens = s.tokens_ingested
        assert s.ingest_file(a).already_ingested and s.tokens_ingested == tokens == 2200
    lm.close()


def test_an_earlier_interrupted_document_is_refused_with_how_to_read_its_rest(tmp_path):
    """Only the latest document resumes: an earlier one's rest would follow the documents read since. Refused,
    with the byte to read from; the store keeps what it had."""
    # longer than one tokenised piece (TOKENIZE_PIECE_CHARS), so the interruption leaves text unread
    a, b = _doc(tmp_path / "a.txt", n=6000, seed=1), _doc(tmp_path / "b.txt", n=200, seed=2)
    _, lm = tiny_pair("llama", CFG)
    s = lm.session(store=tmp_path / "s")
    with pytest.raises(KeyboardInterrupt):
        s.ingest_file(a, progress=_ctrl_c_at(20))
    s.ingest_file(b)
    tokens = s.tokens_ingested
    done = s.memory.documents()[0].bytes_done
    assert 0 < done < a.stat().st_size
    with pytest.raises(InputError, match=f"interrupted at byte {done:,}.*tail -c \\+{done + 1} "):
        s.ingest_file(a)
    assert s.tokens_ingested == tokens and [d.complete for d in s.memory.documents()] == [False, True]
    rest = tmp_path / "rest.txt"
    rest.write_bytes(a.read_bytes()[done:])
    assert s.ingest_file(rest).tokens > 0  # the command the error gives reads the rest
    s.close()
    lm.close()


def test_ctrl_c_commits_and_the_same_call_resumes_exactly(tmp_path):
    doc = _doc(tmp_path / "doc.txt", n=2000)
    expected = _reference(tmp_path, doc)
    _, lm = tiny_pair("llama", CFG)
    s = lm.session(store=tmp_path / "s")
    with pytest.raises(KeyboardInterrupt):
        s.ingest_file(doc, progress=_ctrl_c_at(20))
    committed = s.memory.committed_tokens
    assert 0 < committed < 2000
    s.close()
    lm.close()
    _, lm2 = tiny_pair("llama", CFG)
    with lm2.session(store=tmp_path / "s") as s:
        report = s.ingest_file(doc)
        assert report.document_tokens == 2000
        assert _spans(s) == expected
    lm2.close()


def test_a_full_disk_keeps_the_last_commit_and_resumes(tmp_path, monkeypatch):
    doc = _doc(tmp_path / "doc.txt", n=2000)
    expected = _reference(tmp_path, doc)
    real_append = SegmentLog.append
    calls = [0]

    def append_until_full(self, payload):
        calls[0] += 1
        if calls[0] > 60:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(self, payload)

    monkeypatch.setattr(SegmentLog, "append", append_until_full)
    _, lm = tiny_pair("llama", CFG)
    s = lm.session(store=tmp_path / "s")
    with pytest.raises(StoreFullError, match="resume"):
        s.ingest_file(doc)
    with pytest.raises(SessionError):  # the resident state stopped half-way: this session is done
        s.generate_ids([1], max_new_tokens=1)
    s.memory.close()
    lm.close()
    monkeypatch.setattr(SegmentLog, "append", real_append)
    _, lm2 = tiny_pair("llama", CFG)
    with lm2.session(store=tmp_path / "s") as s:
        assert s.memory.verify() == s.events
        s.ingest_file(doc)
        assert _spans(s) == expected
    lm2.close()


def test_unreadable_paths_get_a_clear_message(tmp_path, monkeypatch):
    blocker = tmp_path / "plain-file"
    blocker.write_text("x")
    _, lm = tiny_pair("llama", CFG)
    s = lm.session()
    with pytest.raises(InputError):
        s.ingest_file(blocker / "inside.txt")  # a path through a file: not readable as anything
    doc = _doc(tmp_path / "doc.txt", n=50)
    real_open = open

    def denied(path, *args, **kwargs):
        if str(path) == str(doc):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", denied)  # root reads anything, so deny it by hand
    with pytest.raises(InputError, match="permission denied"):
        s.ingest_file(doc)
    assert s.tokens_ingested == 0
    lm.close()


def test_file_progress_records_count_the_bytes_the_model_has_read(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(str(i % 200) for i in range(3000)))
    _, lm = tiny_pair("llama", CFG)
    records = []
    lm.session().ingest_file(doc, progress=records.append)
    assert records[0].tokens == 0 and records[0].bytes_read == 0  # reported before the first chunk
    read = [r.bytes_read for r in records]
    assert read == sorted(read) and read[-1] == doc.stat().st_size == records[-1].size_bytes


def test_a_catalog_with_no_space_left_is_a_full_store_and_keeps_the_last_commit(tmp_path, monkeypatch):
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from engramkv.errors import StoreError
    from engramkv.storage import catalog

    doc = _doc(tmp_path / "doc.txt", n=2000)
    expected = _reference(tmp_path, doc)
    real_commit = catalog._commit_namespace
    calls = [0]

    def commit_until_full(*args):
        calls[0] += 1
        if calls[0] > 3:  # SQLite's own words for SQLITE_FULL, wrapped as SQLAlchemy raises them
            raise OperationalError("UPDATE namespaces ...", {}, sqlite3.OperationalError("database or disk is full"))
        return real_commit(*args)

    monkeypatch.setattr(catalog, "_commit_namespace", commit_until_full)
    _, lm = tiny_pair("llama", CFG)
    s = lm.session(store=tmp_path / "s")
    with pytest.raises(StoreFullError, match="no space left.*resume"):
        s.ingest_file(doc)
    with pytest.raises(StoreError, match="reopen"):  # the namespace is done; a reopen recovers
        s.generate_ids([1], max_new_tokens=1)
    s.memory.close()
    lm.close()
    monkeypatch.setattr(catalog, "_commit_namespace", real_commit)
    _, lm2 = tiny_pair("llama", CFG)
    with lm2.session(store=tmp_path / "s") as s:
        assert s.memory.verify() == s.events
        assert len(list((tmp_path / "s").rglob("checkpoint-*.pt"))) == 1  # the refused commit's file is gone
        s.ingest_file(doc)
        assert _spans(s) == expected
    lm2.close()


def test_a_catalog_that_refuses_a_commit_otherwise_is_a_store_error(tmp_path, monkeypatch):
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from engramkv.errors import StoreError
    from engramkv.storage import catalog

    def refuse(*args):
        raise OperationalError("UPDATE namespaces ...", {}, sqlite3.OperationalError("disk I/O error"))

    _, lm = tiny_pair("llama", CFG)
    s = lm.session(store=tmp_path / "s")
    monkeypatch.setattr(catalog, "_commit_namespace", refuse)
    with pytest.raises(StoreError, match="refused a commit") as caught:
        s.ingest(" ".join(["7"] * 300))
    assert not isinstance(caught.value, StoreFullError)
    s.memory.close()
    lm.close()
