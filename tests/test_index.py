"""Per-layer FAISS indexes and the key-summary index: exact while flat, IVF-SQ8 past the threshold,
saved and caught up on load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engramkv.config import IndexConfig
from engramkv.storage.index import LayerIndexes

LAYERS, DIM = 2, 16
SUMMARY_LAYERS = [1]


def _vectors(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, LAYERS, DIM)).astype(np.float32)  # (n, layers, F)


def _summary(vectors: np.ndarray) -> np.ndarray:  # (layers, F) -> (S * F,): any fixed function of the event will do
    return -vectors[SUMMARY_LAYERS].reshape(-1)


def _filled(n: int, cfg: IndexConfig) -> tuple[LayerIndexes, np.ndarray]:
    vectors = _vectors(n)
    index = LayerIndexes(LAYERS, DIM, cfg, SUMMARY_LAYERS)
    for event_id in range(n):
        index.add(event_id, vectors[event_id], _summary(vectors[event_id]))
    return index, vectors


def test_flat_search_is_exact():
    index, vectors = _filled(50, IndexConfig())
    for layer in range(LAYERS):
        query = torch.from_numpy(vectors[:, layer].sum(axis=0))
        ids, scores = index.search(layer, query, k=5)
        expected = np.argsort(-(vectors[:, layer] @ query.numpy()))[:5]
        assert ids == expected.tolist()
        assert scores == sorted(scores, reverse=True)
    query = torch.from_numpy(vectors[:, 1].sum(axis=0))
    ids, _ = index.search_summary(query, k=5)
    assert ids == np.argsort(vectors[:, 1] @ query.numpy())[:5].tolist()  # the summary is minus layer 1
    assert index.kind == "flat"


def test_flat_entries_give_back_what_was_indexed_by_position_and_nothing_once_ivf():
    index, vectors = _filled(50, IndexConfig())
    representatives, summaries = index.flat_entries(10, 7)
    assert np.array_equal(representatives, vectors[10:17])
    assert np.array_equal(summaries, np.stack([_summary(v) for v in vectors[10:17]]))
    ivf, _ = _filled(400, IndexConfig(ivf_min_events=200, ivf_lists_per_sqrt=1.0))
    assert ivf.kind == "ivf" and ivf.flat_entries(0, 10) is None  # centred and quantised: not what was added


def test_past_the_threshold_it_becomes_ivf_and_still_finds_the_best():
    cfg = IndexConfig(ivf_min_events=200, ivf_lists_per_sqrt=1.0, ivf_nprobe=16)
    index, vectors = _filled(400, cfg)
    assert index.kind == "ivf" and len(index) == 400
    hits = 0
    for event_id in range(0, 400, 20):
        query = torch.from_numpy(vectors[event_id, 0] * 10)
        ids, _ = index.search(0, query, k=10)
        hits += event_id in ids
        summary_ids, _ = index.search_summary(torch.from_numpy(_summary(vectors[event_id]) * 10), k=10)
        hits += event_id in summary_ids
    assert hits >= 36  # approximate search: its own vector is in the top 10 almost always


def test_ivf_layer_indexes_are_centred_and_keep_the_exact_ranking(tmp_path):
    # Representatives share a large common direction; the IVF stores them minus their mean, which must
    # not change what a search ranks first (with every list probed, IVF equals exact search up to the codec).
    n = 600
    vectors = _vectors(n, seed=3)
    vectors[:, :, 0] += 20.0
    cfg = IndexConfig(ivf_min_events=400, ivf_lists_per_sqrt=1.0, ivf_nprobe=1000, ivf_codec="sq8")
    index = LayerIndexes(LAYERS, DIM, cfg, SUMMARY_LAYERS)
    for event_id in range(n):
        index.add(event_id, vectors[event_id], _summary(vectors[event_id]))
    assert index.kind == "ivf" and index.centres is not None
    assert np.allclose(index.centres, vectors[:400].mean(axis=0), atol=1e-4)  # the mean at the rebuild

    def overlap(indexes: LayerIndexes) -> float:
        found = 0
        for event_id in range(0, n, 20):
            query = vectors[event_id, 1] * np.linspace(0.5, 1.5, DIM, dtype=np.float32)
            exact = set(np.argsort(-(vectors[:, 1] @ query))[:10].tolist())
            found += len(exact & set(indexes.search(1, torch.from_numpy(query), 10)[0]))
        return found / (10 * len(range(0, n, 20)))

    assert overlap(index) >= 0.9
    index.save(tmp_path)
    reloaded = LayerIndexes.load(tmp_path, LAYERS, DIM, cfg, SUMMARY_LAYERS, n + 50,
                                 lambda e: vectors[e % n], lambda ids: np.stack([_summary(vectors[e % n]) for e in ids]))
    assert np.array_equal(reloaded.centres, index.centres) and len(reloaded) == n + 50
    assert overlap(reloaded) >= 0.9  # events added after the reload are centred the same way


def test_an_interrupted_ivf_rebuild_loses_nothing_and_the_next_add_finishes_it(tmp_path, monkeypatch):
    # Each flat index is dropped before its IVF is trained (RAM); Ctrl-C during the training of layer 1
    # must leave that layer flat and whole, layer 0 IVF, and every event findable.
    n = 600
    vectors = _vectors(n, seed=3)
    vectors[:, :, 0] += 20.0
    cfg = IndexConfig(ivf_min_events=400, ivf_lists_per_sqrt=1.0, ivf_nprobe=1000, ivf_codec="sq8")
    index = LayerIndexes(LAYERS, DIM, cfg, SUMMARY_LAYERS)
    for event_id in range(399):
        index.add(event_id, vectors[event_id], _summary(vectors[event_id]))
    real_ivf, calls = LayerIndexes._ivf, []

    def interrupted(self, ids, vecs):
        calls.append(len(ids))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_ivf(self, ids, vecs)

    monkeypatch.setattr(LayerIndexes, "_ivf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        index.add(399, vectors[399], _summary(vectors[399]))
    assert index.kind == "flat" and len(index) == 400 and int(index.indexes[1].ntotal) == 400
    assert not np.any(index.centres[1]) and np.any(index.centres[0])  # the layer not rebuilt is not shifted

    def overlap(indexes: LayerIndexes, layer: int, events: int) -> float:  # share of the exact top 10 found
        found = 0
        for event_id in range(0, events, 20):
            query = vectors[event_id, layer] * np.linspace(0.5, 1.5, DIM, dtype=np.float32)
            exact = set(np.argsort(-(vectors[:events, layer] @ query))[:10].tolist())
            found += len(exact & set(indexes.search(layer, torch.from_numpy(query), 10)[0]))
        return found / (10 * len(range(0, events, 20)))

    assert overlap(index, 0, 400) >= 0.9 and overlap(index, 1, 400) == 1.0  # IVF (all lists probed) and flat
    index.save(tmp_path)  # saved half-rebuilt, reloaded, and finished by the next add
    reloaded = LayerIndexes.load(tmp_path, LAYERS, DIM, cfg, SUMMARY_LAYERS, 400,
                                 lambda e: vectors[e], lambda ids: np.stack([_summary(vectors[e]) for e in ids]))
    monkeypatch.setattr(LayerIndexes, "_ivf", real_ivf)
    reloaded.add(400, vectors[400], _summary(vectors[400]))
    assert reloaded.kind == "ivf" and len(reloaded) == 401
    assert np.allclose(reloaded.centres[0], vectors[:400, 0].mean(axis=0), atol=1e-4)  # rebuilt before Ctrl-C
    assert np.allclose(reloaded.centres[1], vectors[:401, 1].mean(axis=0), atol=1e-4)  # rebuilt by the next add
    assert overlap(reloaded, 0, 401) >= 0.9 and overlap(reloaded, 1, 401) >= 0.9


def test_save_load_and_catch_up(tmp_path):
    cfg = IndexConfig()
    index, vectors = _filled(30, cfg)
    index.save(tmp_path)
    more = _vectors(40, seed=1)

    def representatives_of(event_id: int) -> np.ndarray:
        return vectors[event_id] if event_id < 30 else more[event_id]

    summaries_computed = []

    def summaries_of(ids: list[int]) -> np.ndarray:
        summaries_computed.extend(ids)
        return np.stack([_summary(representatives_of(e)) for e in ids])

    def load(committed: int, summary_layers: list[int] = SUMMARY_LAYERS) -> LayerIndexes:
        summaries_computed.clear()
        return LayerIndexes.load(tmp_path, LAYERS, DIM, cfg, summary_layers, committed, representatives_of, summaries_of)

    loaded = load(40)
    assert len(loaded) == 40 and int(loaded.summary.ntotal) == 40
    assert summaries_computed == list(range(30, 40))  # only the events the saved index lacked
    assert loaded.saved_events == 30  # the other ten are saved at the next commit
    query = torch.from_numpy(more[35, 1])
    assert loaded.search(1, query, k=1)[0][0] in range(40)
    summaries = np.stack([_summary(representatives_of(e)) for e in range(40)])  # (40, S * F)
    query = torch.from_numpy(_summary(more[35]))
    assert loaded.search_summary(query, k=1)[0] == [int(np.argmax(summaries @ query.numpy()))]
    # An index saved ahead of the catalog (commit lost) is rebuilt from the blobs.
    ahead = load(20)
    assert len(ahead) == 20 and int(ahead.summary.ntotal) == 20


def test_indexes_saved_as_idmap2_by_earlier_versions_load_grow_and_become_ivf(tmp_path):
    import json

    import faiss

    cfg = IndexConfig(ivf_min_events=60, ivf_lists_per_sqrt=1.0, ivf_nprobe=16)
    vectors = _vectors(100)
    old = [faiss.IndexIDMap2(faiss.IndexFlatIP(d)) for d in [DIM] * LAYERS + [DIM * len(SUMMARY_LAYERS)]]
    for event_id in range(40):
        for layer in range(LAYERS):
            old[layer].add_with_ids(vectors[event_id, layer][None], np.array([event_id]))
        old[-1].add_with_ids(_summary(vectors[event_id])[None], np.array([event_id]))
    for layer in range(LAYERS):
        faiss.write_index(old[layer], str(tmp_path / f"layer-{layer:03d}.faiss"))
    faiss.write_index(old[-1], str(tmp_path / "summary.faiss"))
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"events": 40, "kind": "flat", "layers": LAYERS, "summary_layers": SUMMARY_LAYERS}))
    loaded = LayerIndexes.load(tmp_path, LAYERS, DIM, cfg, SUMMARY_LAYERS, 100,
                               lambda e: vectors[e], lambda ids: np.stack([_summary(vectors[e]) for e in ids]))
    assert loaded.saved_events == 40 and loaded.kind == "ivf" and len(loaded) == 100
    assert all(isinstance(index, faiss.IndexIVFScalarQuantizer) for index in [*loaded.indexes, loaded.summary])
    found = sum(event_id in loaded.search(0, torch.from_numpy(vectors[event_id, 0] * 10), k=5)[0]
                for event_id in range(100))
    assert found >= 90
    loaded.save(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_summary_of_other_layers_or_a_missing_one_is_rebuilt(tmp_path):
    cfg = IndexConfig()
    index, vectors = _filled(12, cfg)
    index.save(tmp_path)
    computed = []

    def summaries_of(ids: list[int]) -> np.ndarray:
        computed.extend(ids)
        return vectors[ids][:, 0]

    loaded = LayerIndexes.load(tmp_path, LAYERS, DIM, cfg, [0], 12, lambda e: vectors[e], summaries_of)
    assert computed == list(range(12)) and loaded.summary_layers == [0]
    assert loaded.saved_events == 0  # a rebuilt summary index must be written again
    query = vectors[5][0]
    assert loaded.search_summary(torch.from_numpy(query), k=1)[0] == [int(np.argmax(vectors[:, 0] @ query))]
    (tmp_path / "summary.faiss").unlink()
    computed.clear()
    LayerIndexes.load(tmp_path, LAYERS, DIM, cfg, SUMMARY_LAYERS, 12, lambda e: vectors[e], summaries_of)
    assert computed == list(range(12))


def test_index_device_gpu_without_a_gpu_build_is_a_clear_error_and_auto_stays_on_cpu():
    import faiss

    from engramkv.errors import ConfigError

    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        pytest.skip("a GPU build of FAISS with a GPU is present")
    with pytest.raises(ConfigError, match="GPU build of FAISS"):
        LayerIndexes(LAYERS, DIM, IndexConfig(device="gpu"), SUMMARY_LAYERS)
    assert not LayerIndexes(LAYERS, DIM, IndexConfig(device="auto"), SUMMARY_LAYERS).on_gpu


def test_gpu_mirror_finds_what_the_cpu_index_finds():
    import faiss

    if not (hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0):
        pytest.skip("needs a GPU build of FAISS and a GPU")
    rng = np.random.default_rng(0)
    cfg = {"ivf_min_events": 64}
    cpu = LayerIndexes(LAYERS, DIM, IndexConfig(device="cpu", **cfg), SUMMARY_LAYERS)
    gpu = LayerIndexes(LAYERS, DIM, IndexConfig(device="gpu", **cfg), SUMMARY_LAYERS)
    assert gpu.on_gpu
    for event_id in range(100):  # crosses the IVF rebuild at 64
        reps = rng.standard_normal((LAYERS, DIM)).astype(np.float32)
        summary = rng.standard_normal(DIM * len(SUMMARY_LAYERS)).astype(np.float32)
        cpu.add(event_id, reps, summary)
        gpu.add(event_id, reps, summary)
    query = torch.from_numpy(rng.standard_normal(DIM).astype(np.float32))
    assert gpu.kind == cpu.kind == "ivf"
    assert gpu.search(1, query, 5)[0] == cpu.search(1, query, 5)[0]
    assert gpu.search_summary(query, 5)[0] == cpu.search_summary(query, 5)[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
@pytest.mark.parametrize("name", ["layer-000.faiss", "layer-001.faiss", "summary.faiss", "manifest.json"])
def test_a_damaged_index_file_is_rebuilt_from_the_blobs(tmp_path, name, damage):
    cfg = IndexConfig()
    index, vectors = _filled(25, cfg)
    index.save(tmp_path)
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(len(name) + len(damage))
    if damage == "flip":  # one bit, anywhere
        at = int(rng.integers(len(data)))
        data[at] ^= 1 << int(rng.integers(8))
    elif damage == "truncate":
        data = data[: int(rng.integers(len(data)))]
    else:
        data = bytearray(rng.integers(0, 256, len(data), dtype=np.uint8).tobytes())
    path.write_bytes(bytes(data))
    summaries_computed = []

    def summaries_of(ids: list[int]) -> np.ndarray:
        summaries_computed.extend(ids)
        return np.stack([_summary(vectors[e]) for e in ids])

    loaded = LayerIndexes.load(tmp_path, LAYERS, DIM, cfg, SUMMARY_LAYERS, 25, lambda e: vectors[e], summaries_of)
    assert len(loaded) == 25 and int(loaded.summary.ntotal) == 25
    assert summaries_computed == list(range(25)) and loaded.saved_events == 0  # rebuilt; saved at the next commit
    for event_id in (0, 12, 24):  # the rebuilt indexes are exact again
        assert loaded.search(1, torch.from_numpy(vectors[event_id, 1] * 10), k=1)[0] == [event_id]
        query = torch.from_numpy(_summary(vectors[event_id]))
        assert loaded.search_summary(query, k=1)[0] == [event_id]
