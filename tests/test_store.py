"""The persistent store on tiny models: persistence, reopen, locking, fingerprints, namespaces, checksums.

Every test here runs against SQLite in a temporary directory, and again against PostgreSQL when
`catalog_url` (tests/conftest.py) finds or starts a server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from engramkv import EngineConfig
from engramkv.config import IndexConfig, RecallConfig, SegmentationConfig, StoreConfig, WindowConfig
from engramkv.errors import (
    NamespaceError,
    ReadOnlyError,
    SessionError,
    StoreCorruptError,
    StoreError,
    StoreLockedError,
    StoreMismatchError,
)
from engramkv.storage.store import EventStore

from conftest import VOCAB, tiny_pair

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
    store=StoreConfig(codec="fp16", commit_tokens=100),
)


def _text(n: int, seed: int = 0, low: int = 0, high: int = VOCAB) -> str:
    ids = torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return " ".join(map(str, ids))


@pytest.fixture
def cfg(catalog_url: str | None) -> EngineConfig:
    return CFG.model_copy(update={"store": CFG.store.model_copy(update={"catalog_url": catalog_url})})


def test_a_stored_stream_answers_like_one_in_ram_and_again_after_reopening(tmp_path, cfg):
    _, lm = tiny_pair("llama", cfg)
    in_ram = lm.session()
    in_ram.ingest(_text(900))
    in_ram_events = in_ram.events
    expected = in_ram.generate_ids([1, 2, 3], max_new_tokens=20)

    stored = lm.session(store=tmp_path / "s")
    stored.ingest(_text(900))
    assert stored.events == in_ram_events > 20
    stored.close()  # commits; what a session generated before closing would be part of the stream too
    lm.close()

    _, fresh = tiny_pair("llama", cfg)  # a new model object: nothing shared but the directory
    reopened = fresh.session(store=tmp_path / "s")
    assert reopened.tokens_ingested == 900
    assert reopened.memory is not None and reopened.memory.verify() == reopened.events
    assert reopened.generate_ids([1, 2, 3], max_new_tokens=20) == expected
    reopened.close()
    fresh.close()


def test_reopening_continues_the_stream_exactly(tmp_path, cfg):
    _, lm = tiny_pair("qwen2", cfg)
    one = lm.session()  # in RAM (float16 memory, like the fp16 codec)
    one.ingest(_text(500, seed=1))
    one.ingest(_text(400, seed=2))
    spans = [(e.start, e.end) for e in map(one.memory.event, range(one.events))]

    two = lm.session(store=tmp_path / "two")
    two.ingest(_text(500, seed=1))
    two.close()
    lm.close()
    _, lm2 = tiny_pair("qwen2", cfg)
    two = lm2.session(store=tmp_path / "two")
    two.ingest(_text(400, seed=2))
    assert [(e.start, e.end) for e in map(two.memory.event, range(two.events))] == spans
    two.close()
    lm2.close()


def test_namespaces_are_isolated_and_deletable(tmp_path, cfg):
    _, lm = tiny_pair("mistral", cfg)
    alice = lm.session(store=tmp_path, user_id="alice")
    alice.ingest(_text(600, seed=3, low=0, high=100))  # alice's tokens are < 100
    bob = lm.session(store=tmp_path, user_id="bob", agent_id="helper")
    bob.ingest(_text(600, seed=4, low=150, high=VOCAB))  # bob's are >= 150
    for query in ("1 2 3", "200 201 202"):
        assert all(t < 100 for r in alice.recall(query, k=10) for t in map(int, r.text.split()))
        assert all(t >= 150 for r in bob.recall(query, k=10) for t in map(int, r.text.split()))
    store = lm.open_store(tmp_path)
    assert {(n.user_id, n.agent_id) for n in store.namespaces()} == {("alice", "default"), ("bob", "helper")}
    bob_events = bob.events
    bob.close()
    bob_dir = store.namespace_dir(2)
    assert any(bob_dir.rglob("*.seg"))
    store.delete_namespace("bob", "helper")
    assert not bob_dir.exists()
    assert [n.user_id for n in store.namespaces()] == ["alice"]
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session as DbSession

    from engramkv.storage import catalog

    with DbSession(store.db) as db:
        assert db.scalar(select(func.count()).select_from(catalog.EventRow)) == alice.events
    assert bob_events > 0
    # Recreated, the namespace starts empty.
    again = lm.session(store=tmp_path, user_id="bob", agent_id="helper")
    assert again.events == 0 and again.tokens_ingested == 0
    again.close()
    alice.close()
    lm.close()


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden", "x" * 129, "a\x00b", "..", "/abs"])
def test_namespace_names_cannot_escape_the_store(tmp_path, cfg, name):
    _, lm = tiny_pair("llama", cfg)
    with pytest.raises(NamespaceError):
        lm.session(store=tmp_path / "s", session_id=name)
    assert not (tmp_path / "escape").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    lm.close()


def test_a_store_of_another_model_is_refused(tmp_path, cfg):
    _, llama = tiny_pair("llama", cfg)
    llama.session(store=tmp_path).close()
    llama.close()
    _, qwen = tiny_pair("qwen2", cfg)
    with pytest.raises(StoreMismatchError, match="tiny-llama"):
        qwen.session(store=tmp_path)
    qwen.close()


def test_one_writer_at_a_time_readers_allowed(tmp_path, cfg):
    _, lm = tiny_pair("llama", cfg)
    writer = lm.session(store=tmp_path)
    writer.ingest(_text(400))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import tiny_pair
        from engramkv import EngineConfig
        from engramkv.errors import StoreLockedError
        _, lm = tiny_pair("llama", EngineConfig.model_validate_json({cfg.model_dump_json()!r}))
        try:
            lm.session(store={str(tmp_path)!r})
        except StoreLockedError as err:
            print("LOCKED", err)
        reader = lm.session(store={str(tmp_path)!r}, read_only=True)
        print("READER", reader.tokens_ingested, reader.events)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    # SQLite: one writer per store; PostgreSQL: per namespace. Either way the message names the holder.
    assert "LOCKED" in out.stdout and "one writer" in out.stdout and f"pid {os.getpid()}" in out.stdout, out.stderr
    assert f"READER 400 {writer.events}" in out.stdout, out.stderr
    writer.close()
    lm.close()


def test_a_read_only_session_keeps_its_additions_in_ram(tmp_path, cfg):
    _, lm = tiny_pair("llama", cfg)
    with lm.session(store=tmp_path) as s:
        s.ingest(_text(300))
        events = s.events
    reader = lm.session(store=tmp_path, read_only=True, config=cfg)
    reader.ingest(_text(300, seed=9))
    assert reader.events > events
    with pytest.raises(ReadOnlyError):
        reader.commit()
    reader.close()
    lm.close()
    _, lm2 = tiny_pair("llama", cfg)
    with lm2.session(store=tmp_path) as s:
        assert s.events == events and s.tokens_ingested == 300
    lm2.close()


def test_a_read_only_session_refreshes_to_the_writers_later_commits(tmp_path, cfg):
    _, lm = tiny_pair("llama", cfg)
    writer = lm.session(store=tmp_path, config=cfg)
    writer.ingest(_text(300))
    reader = lm.session(store=tmp_path, read_only=True, config=cfg)
    assert reader.refresh() == 0 and reader.events == writer.events
    before = reader.events
    writer.ingest(_text(500, seed=3))  # commits every 100 tokens and at the end
    assert reader.events == before  # not seen until asked
    assert reader.refresh() == writer.events - before
    assert (reader.events, reader.tokens_ingested) == (writer.events, writer.tokens_ingested)
    _, fresh_lm = tiny_pair("llama", cfg)
    fresh = fresh_lm.session(store=tmp_path, read_only=True, config=cfg)  # what a reader opened now sees
    query = _text(12, seed=3)
    assert [h.event_id for h in reader.recall(query, k=5)] == [h.event_id for h in fresh.recall(query, k=5)]
    assert reader.generate(" 1 2 3", max_new_tokens=4) == fresh.generate(" 1 2 3", max_new_tokens=4)
    with pytest.raises(StoreError, match="read-only reader"):
        writer.refresh()
    with pytest.raises(SessionError, match="RAM"):
        lm.session(config=cfg).refresh()
    for session in (reader, fresh, writer):
        session.close()
    lm.close()
    fresh_lm.close()


def test_a_flipped_byte_is_caught_by_the_checksum(tmp_path, cfg):
    _, lm = tiny_pair("llama", cfg)
    with lm.session(store=tmp_path) as s:
        s.ingest(_text(400))
    lm.close()
    segment = next(tmp_path.rglob("*.seg"))
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    _, lm2 = tiny_pair("llama", cfg)
    s = lm2.session(store=tmp_path)
    assert s.memory is not None
    with pytest.raises(StoreCorruptError):
        s.memory.verify()
    s.memory.close()
    lm2.close()


def test_open_trims_what_no_commit_points_at(tmp_path, cfg):
    _, lm = tiny_pair("llama", cfg)
    with lm.session(store=tmp_path) as s:
        s.ingest(_text(400))
        committed = s.events
    lm.close()
    ns_dir = next((tmp_path / "ns").iterdir())
    segment = sorted((ns_dir / "segments").glob("*.seg"))[-1]
    size = segment.stat().st_size
    with open(segment, "ab") as f:
        f.write(b"\x07" * 5000)  # a torn append
    (ns_dir / "segments" / "000099.seg").write_bytes(b"EKVSEG01")  # a segment created, never committed
    (ns_dir / "checkpoint-99999999-000000000000.pt.tmp").write_bytes(b"half a checkpoint")
    _, lm2 = tiny_pair("llama", cfg)
    with lm2.session(store=tmp_path) as s:
        assert s.events == committed
        assert segment.stat().st_size == size
        assert not (ns_dir / "segments" / "000099.seg").exists()
        assert len(list(ns_dir.glob("checkpoint-*"))) == 1
        assert s.memory is not None and s.memory.verify() == committed
    lm2.close()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_compressed_codecs_store_less_and_keep_the_stream_working(tmp_path, codec):
    cfg = CFG.model_copy(update={"store": StoreConfig(codec=codec)})
    sizes = {}
    for name, c in (("fp16", CFG), (codec, cfg)):
        _, lm = tiny_pair("llama", c)
        with lm.session(store=tmp_path / name) as s:
            s.ingest(_text(600))
            assert len(s.generate_ids([1, 2], max_new_tokens=5)) == 5
            assert s.memory is not None
            sizes[name] = s.memory.kv_bytes / s.events
        lm.close()
    # Blobs also hold token ids and representatives, a large share on a tiny model; test_codec.py
    # checks the KV ratios themselves.
    assert sizes[codec] < (0.75 if codec == "int8" else 0.55) * sizes["fp16"]


def test_index_files_catch_up_with_the_catalog(tmp_path, cfg):
    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"index_save_events": 10})})
    _, lm = tiny_pair("llama", cfg)
    s = lm.session(store=tmp_path)
    s.ingest(_text(400))
    expected = s.recall("5 6 7", k=5)
    s.close()
    lm.close()
    manifest = next(tmp_path.rglob("manifest.json"))
    manifest.unlink()  # as if the index had never been saved: it is rebuilt from the blobs
    _, lm2 = tiny_pair("llama", cfg)
    with lm2.session(store=tmp_path) as s:
        assert s.recall("5 6 7", k=5) == expected
    lm2.close()


def test_past_the_ivf_threshold_a_reopened_store_recalls_as_before(tmp_path, cfg):
    index = IndexConfig(ivf_min_events=16, ivf_lists_per_sqrt=1.0, ivf_nprobe=64)  # every list probed
    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"index": index})})
    _, lm = tiny_pair("llama", cfg)
    s = lm.session(store=tmp_path)
    s.ingest(_text(600))
    indexes = s.memory.indexes
    assert indexes.kind == "ivf" and indexes.centres is not None and s.events > 16
    expected = s.recall("5 6 7", k=5)  # recall does not move the stream (generating would)
    s.close()
    lm.close()
    manifest = json.loads(next(tmp_path.rglob("manifest.json")).read_text())
    assert manifest["kind"] == "ivf" and len(manifest["centres"]) == lm.spec.num_layers  # one mean per layer
    _, lm2 = tiny_pair("llama", cfg)
    with lm2.session(store=tmp_path) as s:
        assert np.array_equal(s.memory.indexes.centres, indexes.centres)
        assert s.recall("5 6 7", k=5) == expected
    lm2.close()


def test_store_is_refused_on_a_file(tmp_path, cfg):
    from engramkv.errors import StoreError

    (tmp_path / "f").write_text("x")
    _, lm = tiny_pair("llama", cfg)
    with pytest.raises(StoreError, match="not a directory"):
        lm.session(store=tmp_path / "f")
    with pytest.raises(StoreError):
        lm.session(store=tmp_path / "missing", read_only=True)
    lm.close()


def test_event_store_locks_within_a_process_too(tmp_path, cfg):
    _, lm = tiny_pair("llama", cfg)
    first = EventStore(tmp_path, lm.spec, cfg.store)
    if cfg.store.catalog_url is None:  # one writer per store directory
        with pytest.raises(StoreLockedError):
            EventStore(tmp_path, lm.spec, cfg.store)
    else:  # PostgreSQL: one writer per namespace, whichever store object asks
        held = first.namespace("a", summary_layers=[0])
        second = EventStore(tmp_path, lm.spec, cfg.store)
        second.namespace("b", summary_layers=[0]).close()
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            second.namespace("a", summary_layers=[0])
        held.close()
        second.namespace("a", summary_layers=[0]).close()
        second.close()
    first.close()
    EventStore(tmp_path, lm.spec, cfg.store).close()


def test_prefetching_the_next_layer_changes_nothing(tmp_path):
    answers = []
    for prefetch in ("off", "on"):
        cfg = CFG.model_copy(update={"store": CFG.store.model_copy(update={"prefetch": prefetch, "hot_bytes": 4096})})
        _, lm = tiny_pair("llama", cfg)
        with lm.session(store=tmp_path / prefetch) as s:
            s.ingest(_text(700))
            answers.append(s.generate_ids([1, 2, 3], max_new_tokens=10))
            assert s.memory._prefetch.on == (prefetch == "on")
        lm.close()
    assert answers[0] == answers[1]


def test_read_ahead_asks_for_the_cold_blobs_only_and_changes_nothing(tmp_path, monkeypatch):
    answers, asked = [], []
    for read_ahead in (False, True):
        cfg = CFG.model_copy(update={"store": CFG.store.model_copy(update={"read_ahead": read_ahead})})
        _, lm = tiny_pair("llama", cfg)
        with lm.session(store=tmp_path / str(read_ahead)) as s:
            s.ingest(_text(700))
            memory = s.memory
            real = memory.segments.will_need

            def spy(refs, real=real, memory=memory):
                refs = list(refs)
                # every asked-for blob is on disk and in no cache
                cached = {(memory.blob_ref(i).segment, memory.blob_ref(i).offset)
                          for i in range(len(memory)) if i in memory.warm}
                assert refs and not {(r.segment, r.offset) for r in refs} & cached
                asked.append(len(refs))
                real(refs)

            monkeypatch.setattr(memory.segments, "will_need", spy)
            memory.drop_caches()
            answers.append(s.generate_ids([1, 2, 3], max_new_tokens=10))
        lm.close()
        assert bool(asked) == read_ahead
    assert answers[0] == answers[1]


def test_each_commit_hands_free_heap_back_unless_turned_off(tmp_path, monkeypatch):
    for release in (True, False):
        calls = []
        monkeypatch.setattr("engramkv.storage.namespace.release_free_heap", lambda calls=calls: calls.append(1))
        cfg = CFG.model_copy(update={"store": CFG.store.model_copy(update={"release_free_memory": release})})
        _, lm = tiny_pair("llama", cfg)
        with lm.session(store=tmp_path / str(release)) as s:
            s.ingest(_text(300))
            s.commit()
            s.commit()
        lm.close()
        if release:
            assert len(calls) >= 2  # the two explicit commits at least
        else:
            assert calls == []


def test_the_checkpoint_holds_the_resident_state_and_not_the_last_chunks_logits(tmp_path, cfg):
    _, lm = tiny_pair("llama", cfg)
    with lm.session(store=tmp_path / "s") as session:
        session.ingest(_text(500))
    (checkpoint,) = (tmp_path / "s").rglob("checkpoint-*.pt")
    logits = torch.load(checkpoint, weights_only=False)["engine"]["last_logits"]
    # A view of the chunk's (C, V) logits would write all C rows (71 of a 124 MB checkpoint on the embedded model).
    assert logits.shape == (VOCAB,) and logits.untyped_storage().nbytes() == VOCAB * logits.element_size()
    lm.close()
