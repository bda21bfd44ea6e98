"""NamespaceMemory without a model: the EventMemory protocol with persistence, tiers, commits, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engramkv.errors import ReadOnlyError, StoreError
from engramkv.memory.events import DocumentProgress, Event, EventMemory, TierBytes
from engramkv.storage.segments import BlobRef, scan

from tiny_store import SPEC, SUMMARY_LAYERS, add_events, open_namespace, open_store, snapshot


def test_it_reports_what_the_protocol_asks(tmp_path, catalog_url):
    with open_store(tmp_path / "s", catalog_url) as store:
        memory: EventMemory = store.namespace("alice", "helper", "s1", summary_layers=[1])
        assert memory.persistent and memory.writable
        assert memory.location == str((tmp_path / "s").resolve())
        assert memory.namespace == "alice/helper/s1"
        assert memory.codec == "fp16" and memory.committed_tokens == 0
        assert memory.load_checkpoint() is None and memory.last_document() is None and memory.documents() == []
        assert memory.tier_bytes() == TierBytes(hot=0, warm=0, disk=0)
        memory.close()


def test_a_commit_keeps_events_document_and_checkpoint(tmp_path, catalog_url):
    doc = DocumentProgress(name="notes.txt", size_bytes=100, content_key="k", token_start=0)
    with open_store(tmp_path, catalog_url) as store:
        memory = open_namespace(store)
        add_events(memory, 4)
        doc.bytes_done, doc.token_end = 60, 20
        memory.commit(snapshot(memory), doc)
        assert doc.id is not None and memory.committed_tokens == 20
        add_events(memory, 2, seed=1)  # sealed after the commit: they belong to the current document
        details = memory.event_details([0, 3, 4, 5])
        assert [details[i][0] for i in (0, 3, 4, 5)] == ["notes.txt"] * 4
        assert details[0][1] is not None and details[4][1] is None  # only committed events have a time
        memory.commit(snapshot(memory), None)  # a commit without a document: its events have none
        assert memory.event_details([4])[4][0] is None
        expected = [memory.tokens(i) for i in range(6)], [memory.event(i) for i in range(6)]
        memory.close()
    with open_store(tmp_path, catalog_url, read_only=True) as store:
        memory = open_namespace(store)
        assert not memory.writable and len(memory) == 6 and memory.verify() == 6
        assert ([memory.tokens(i) for i in range(6)], [memory.event(i) for i in range(6)]) == expected
        assert memory.load_checkpoint() == {"engine": {"n_tokens": 30}}
        assert [(d.name, d.bytes_done, d.token_end) for d in memory.documents()] == [("notes.txt", 60, 20)]
        assert memory.last_document() == memory.documents()[0]
        memory.close()


def test_the_shortest_event_is_known_before_and_after_a_reopen(tmp_path, catalog_url):
    with open_store(tmp_path, catalog_url) as store:
        memory = open_namespace(store)
        assert memory.shortest_event == 0
        add_events(memory, 2, length=7)
        add_events(memory, 1, length=3, seed=1)
        add_events(memory, 1, length=9, seed=2)
        assert memory.shortest_event == 3
        memory.commit(snapshot(memory), None)
        memory.close()
    with open_store(tmp_path, catalog_url, read_only=True) as store:
        memory = open_namespace(store)
        assert memory.shortest_event == 3  # from the catalog's rows
        memory.close()


def test_drop_caches_sends_reads_to_the_cold_tier(tmp_path):
    with open_store(tmp_path, hot_write_through=False) as store:  # hot: what was decoded, as the cold tier gives it
        memory = open_namespace(store)
        add_events(memory, 3)
        keys, values = memory.gather(1, [2, 0])  # (Hkv, M, D) each
        reps = memory.representatives(1)
        tiers = memory.tier_bytes()
        assert tiers.hot > 0 and tiers.warm > 0 and tiers.disk > 0
        memory.drop_caches()
        assert memory.tier_bytes().hot == memory.tier_bytes().warm == 0
        again = memory.gather(1, [2, 0])
        assert torch.equal(again[0], keys) and torch.equal(again[1], values)
        assert keys.shape == (SPEC.num_kv_heads, 10, SPEC.head_dim)
        assert np.array_equal(memory.representatives(1), reps) and reps.shape == (SPEC.num_layers, 16)
        memory.close()


@pytest.mark.parametrize("write_through", [True, False])
def test_a_new_events_exact_kv_is_read_while_hot_when_written_through(tmp_path, write_through):
    with open_store(tmp_path, codec="int8", hot_write_through=write_through) as store:
        memory = open_namespace(store)
        g = torch.Generator().manual_seed(3)
        keys, values = (torch.randn(SPEC.num_layers, SPEC.num_kv_heads, 6, SPEC.head_dim, generator=g) for _ in "kv")
        memory.add([Event(0, 0, 6, surprise_mean=1.0, surprise_max=2.0)], keys, values,
                   torch.randn(1, SPEC.num_layers, SPEC.num_kv_heads * SPEC.head_dim, generator=g),
                   torch.randn(1, len(SUMMARY_LAYERS) * SPEC.num_kv_heads * SPEC.head_dim, generator=g),
                   torch.arange(6))
        exact = keys[1].to(memory.dtype, copy=True), values[1].to(memory.dtype, copy=True)
        first = memory.gather(1, [0])
        keys[:], values[:] = 0.0, 0.0  # the caller's buffers move on: the hot tier holds copies
        assert all(torch.equal(a, b) for a, b in zip(memory.gather(1, [0]), first))
        memory.drop_caches()
        decoded = memory.gather(1, [0])  # through the int8 codec
        assert not torch.equal(decoded[0], exact[0]) and not torch.equal(decoded[1], exact[1])
        expected = exact if write_through else decoded
        assert torch.equal(first[0], expected[0]) and torch.equal(first[1], expected[1])
        memory.close()


def test_written_through_kv_outlives_the_lru_until_the_commit(tmp_path):
    """A hot tier far smaller than what is written through between two commits keeps every new event exact
    until the commit (before, the LRU evicted the oldest and they were read through the codec again)."""
    with open_store(tmp_path, codec="int8", hot_bytes=64) as store:  # 64 bytes: no decoded block fits
        memory = open_namespace(store)
        g = torch.Generator().manual_seed(4)
        exact = []
        for event in range(4):
            keys, values = (torch.randn(SPEC.num_layers, SPEC.num_kv_heads, 5, SPEC.head_dim, generator=g) for _ in "kv")
            memory.add([Event(event, 5 * event, 5 * event + 5, surprise_mean=1.0, surprise_max=2.0)], keys, values,
                       torch.randn(1, SPEC.num_layers, SPEC.num_kv_heads * SPEC.head_dim, generator=g),
                       torch.randn(1, len(SUMMARY_LAYERS) * SPEC.num_kv_heads * SPEC.head_dim, generator=g),
                       torch.arange(5))
            exact.append(keys[2].to(memory.dtype))
        assert all(torch.equal(memory.gather(2, [e])[0], exact[e]) for e in range(4))
        assert memory.tier_bytes().hot >= 4 * exact[0].nbytes * 2 * SPEC.num_layers
        memory.commit(snapshot(memory))
        assert memory.tier_bytes().hot == 0
        assert not torch.equal(memory.gather(2, [0])[0], exact[0])  # read through the codec from now on
        memory.close()


def test_blob_refs_point_at_the_segment_records(tmp_path):
    with open_store(tmp_path) as store:
        memory = open_namespace(store)
        add_events(memory, 3)
        refs = [memory.blob_ref(i) for i in range(3)]
        assert all(isinstance(r, BlobRef) for r in refs) and refs == list(scan(memory.segments.directory, 1))
        assert memory.kv_bytes == sum(r.length for r in refs)
        memory.close()


def test_a_read_only_namespace_keeps_new_events_in_ram(tmp_path):
    with open_store(tmp_path) as store:
        memory = open_namespace(store)
        add_events(memory, 2)
        memory.commit(snapshot(memory), None)
        memory.close()
    with open_store(tmp_path, read_only=True) as store:
        memory = open_namespace(store)
        add_events(memory, 2, seed=5)
        memory.drop_caches()
        assert len(memory) == 4 and len(memory.tokens(3)) == 5  # read back from RAM, not from disk
        assert memory.blob_ref(3).segment == -1
        with pytest.raises(ReadOnlyError):
            memory.commit(snapshot(memory), None)
        memory.close()
    with open_store(tmp_path) as store:
        assert len(open_namespace(store)) == 2


def test_misuse_is_a_store_error(tmp_path):
    with open_store(tmp_path) as store:
        memory = open_namespace(store)
        add_events(memory, 1)
        keys = torch.zeros(SPEC.num_layers, SPEC.num_kv_heads, 5, SPEC.head_dim)  # (L, Hkv, T, D)
        reps, summary, tokens = torch.zeros(1, SPEC.num_layers, 16), torch.zeros(1, 16), torch.arange(5)
        with pytest.raises(StoreError, match="consecutive"):
            memory.add([Event(5, 5, 10, 0.0, 0.0)], keys, keys, reps, summary, tokens)
        with pytest.raises(StoreError, match="float16"):
            memory.add([Event(1, 5, 10, 0.0, 0.0)], keys + float("nan"), keys, reps, summary, tokens)
        with pytest.raises(StoreError, match="do not match"):
            memory.add([Event(1, 5, 10, 0.0, 0.0)], keys, keys, reps, summary, tokens[:4])
        assert len(memory) == 1
        memory.close()
        memory.close()  # twice is fine
        with pytest.raises(StoreError, match="closed"):
            memory.commit(snapshot(memory), None)
        with pytest.raises(StoreError, match="closed"):
            memory.tokens(0)
        open_namespace(store)  # a closed namespace can be opened again, once
        with pytest.raises(StoreError, match="already open"):
            open_namespace(store)
