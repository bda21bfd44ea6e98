"""Sharded ingest (`engramkv.sharding`): the cut, the merge in document order, and kills of a worker and the driver.

The Ray tests start a local Ray (about 10 s each) whose workers load the tiny model through `conftest.tiny_lm`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
from conftest import IntTokenizer, tiny_lm
from crash_harness import SHARDED_CONFIG

from engramkv import EngineConfig, SessionError
from engramkv.documents import check_document, read_text, tokenize_pieces
from engramkv.sharding import plan_shards
from engramkv.storage.segments import SegmentLog

HERE = Path(__file__).resolve().parent
CONFIG = SHARDED_CONFIG


def _config() -> EngineConfig:
    return EngineConfig.model_validate(CONFIG)


def _document(path: Path, paragraphs: int = 40, seed: int = 0) -> Path:
    rng = random.Random(seed)
    paras = [" ".join(str(rng.randrange(256)) for _ in range(rng.randrange(20, 60))) for _ in range(paragraphs)]
    path.write_text("\n\n".join(paras) + "\n")
    return path


def _stream(path: Path, shards, n_sink: int) -> list[int]:
    """The merged stream's tokens: each shard's text tokenised on its own, in order."""
    ids: list[int] = []
    for shard in shards:
        texts = (text for text, _ in read_text(path, shard.start, shard.end))
        ids += [i for piece, _ in tokenize_pieces(IntTokenizer(), texts) for i in piece]
    return ids


def _events(session) -> list[tuple[int, int, int]]:
    memory = session.memory
    return [(memory.event(i).start, memory.event(i).end, zlib.crc32(memory.blob(i))) for i in range(len(memory))]


def _uninterrupted(store: Path, doc: Path, cfg: EngineConfig) -> list[tuple[int, int, int]]:
    """The events of a sharded ingest (2 workers) that nothing interrupts: what a killed one must end with."""
    with tiny_lm("llama", cfg).session(store=store) as clean:
        clean.ingest_file(doc, workers=2)
        return _events(clean)


@pytest.fixture
def ray_path(monkeypatch):
    """Ray workers import conftest (the tiny model's loader) from tests/."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def test_plan_cuts_after_paragraphs_and_covers_the_file(tmp_path):
    doc = _document(tmp_path / "doc.txt", paragraphs=60)
    data = doc.read_bytes()
    shards = plan_shards(doc, len(data), 4, 1024)
    assert len(shards) == 4
    assert shards[0].start == 0 and shards[-1].end == len(data)
    for a, b in zip(shards, shards[1:]):
        assert a.end == b.start and data[b.start - 2 : b.start] == b"\n\n"
    assert all(s.end - s.start >= 1024 for s in shards)
    assert len(plan_shards(doc, len(data), 2, len(data) // 2)) == 2  # a file of exactly two shards' worth
    assert len(plan_shards(doc, len(data), 4, len(data))) == 1  # too short to cut: one shard


def test_plan_without_breaks_cuts_at_a_character_boundary(tmp_path):
    doc = tmp_path / "dense.txt"
    doc.write_text("é" * 5000)  # two bytes each, no whitespace
    for shard in plan_shards(doc, doc.stat().st_size, 3, 1024):
        "".join(text for text, _ in read_text(doc, shard.start, shard.end))  # decodes: no character cut


def test_sharded_ingest_needs_an_empty_stored_namespace(tmp_path):
    doc = _document(tmp_path / "doc.txt")
    lm = tiny_lm("llama", _config())
    with lm.session(store=tmp_path / "store") as session:
        session.ingest("1 2 3 4 5 6 7 8 9 10")
        with pytest.raises(SessionError, match="starts a namespace"):
            session.ingest_file(doc, workers=2)
    with pytest.raises(SessionError, match="writes to a store"):
        lm.session().ingest_file(doc, workers=2)


@pytest.mark.slow
def test_sharded_ingest_merges_the_shards_in_document_order(tmp_path, ray_path, monkeypatch):
    doc = _document(tmp_path / "doc.txt")
    cfg = _config()
    lm = tiny_lm("llama", cfg)
    shards = plan_shards(doc, doc.stat().st_size, 2, cfg.shards.min_shard_bytes)
    stream = _stream(doc, shards, cfg.window.n_sink)
    seen = []
    with lm.session(store=tmp_path / "store") as session:
        def no_append(*_args: object) -> None:
            raise AssertionError("the merge wrote a blob: the shards' segments are taken as they are")
        with monkeypatch.context() as patched:  # in this process only: the driver's merge
            patched.setattr(SegmentLog, "append", no_append)
            report = session.ingest_file(doc, workers=2, progress=seen.append)
        assert report.tokens == len(stream) == session.tokens_ingested
        memory = session.memory
        assert [memory.event(i).id for i in range(len(memory))] == list(range(len(memory)))
        for i in range(len(memory)):  # every event holds the merged stream's tokens at its span, gap-free
            event = memory.event(i)
            assert memory.tokens(i) == stream[event.start : event.end]
            assert event.start == (memory.event(i - 1).end if i else cfg.window.n_sink)
        snapshot = memory.load_checkpoint()["engine"]
        assert memory.event(len(memory) - 1).end == snapshot["local_start"]  # then the window: no token lost
        assert snapshot["sink_tokens"].tolist() == stream[: cfg.window.n_sink]
        assert snapshot["tail_tokens"].tolist() == stream[snapshot["local_start"] :]
        assert seen and seen[-1].tokens == len(stream)
        assert not (tmp_path / "store" / "shards").exists()  # the shards' stores go once merged
        session.ingest("1 2 3 4 5 6 7 8 9 10 11 12")  # the stream goes on from the merged window
        assert session.recall("17 42 99", k=3)
        merged = _events(session)
    # The sequential read of the same document: a shard's local window starts cold, so events differ a little.
    with tiny_lm("llama", cfg).session(store=tmp_path / "sequential") as sequential:
        sequential.ingest_file(doc)
        assert abs(sequential.events - report.events_sealed) <= 0.05 * sequential.events
    with lm.session(store=tmp_path / "store") as again:
        assert _events(again) == merged
        assert again.ingest_file(doc, workers=2).already_ingested


@pytest.mark.slow
def test_a_worker_killed_mid_shard_is_read_again_with_the_same_events(tmp_path, ray_path):
    doc = _document(tmp_path / "doc.txt", paragraphs=80)
    cfg = _config()
    expected = _uninterrupted(tmp_path / "clean", doc, cfg)
    root = tmp_path / "store" / "shards" / f"{check_document(doc).content_key[:16]}-2"
    killed: list[int] = []

    def kill_second_shard() -> None:
        progress = root / "1.progress"
        deadline = time.monotonic() + 600  # Ray and the workers start slowly on a loaded machine
        while time.monotonic() < deadline:
            try:
                record = json.loads(progress.read_text())
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            if record["tokens"] > 0:
                os.kill(record["pid"], signal.SIGKILL)
                killed.append(record["pid"])
                return

    killer = threading.Thread(target=kill_second_shard)
    killer.start()
    with tiny_lm("llama", cfg).session(store=tmp_path / "store") as session:
        session.ingest_file(doc, workers=2)
        killer.join()
        assert killed, "the worker was not killed mid-shard"
        assert _events(session) == expected


@pytest.mark.slow
def test_the_driver_killed_mid_merge_leaves_the_old_namespace_or_the_whole_new_one(tmp_path, ray_path):
    doc = _document(tmp_path / "doc.txt", paragraphs=80)
    cfg = _config()
    expected = _uninterrupted(tmp_path / "clean", doc, cfg)
    store = tmp_path / "store"
    root = store / "shards" / f"{check_document(doc).content_key[:16]}-2"
    command = [sys.executable, str(HERE / "crash_harness.py"), "--sharded-worker", str(store), str(doc)]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None
    for line in driver.stdout:  # the merge begins once both shards are read
        if line.startswith("merging"):
            break
    time.sleep(random.Random(0).uniform(0, 0.05))
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    lm = tiny_lm("llama", cfg)
    with lm.session(store=store) as after:
        assert _events(after) in ([], expected)
        assert after.tokens_ingested in (0, len(_stream(doc, plan_shards(doc, doc.stat().st_size, 2, 1024), 8)))
    lm.close()  # the store's writer lock: the next process writes
    assert subprocess.run(command, capture_output=True, text=True).returncode == 0  # the same ingest again
    assert not root.exists()
    with tiny_lm("llama", cfg).session(store=store) as resumed:
        assert _events(resumed) == expected
