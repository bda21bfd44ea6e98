"""Low-rank index entries (`storage.projection`, `IndexConfig.rank`): codes without ids, re-scored exactly,
saved, caught up and rebuilt like the full-width indexes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engramkv.config import IndexConfig
from engramkv.errors import ConfigError
from engramkv.storage.index import LayerIndexes
from engramkv.storage.projection import Projection
from tiny_store import SPEC, add_events, open_namespace, open_store

LAYERS, DIM, RANK = 2, 16, 4
SUMMARY_LAYERS = [1]
CFG = IndexConfig(rank=RANK, project_min_events=64, rerank=20)


def _low_rank(n: int, seed: int = 0) -> np.ndarray:  # (n, layers, F): rank RANK around a mean, per layer
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((LAYERS, RANK, DIM))
    mean = rng.standard_normal((LAYERS, DIM)) * 3
    return (np.einsum("nlr,lrf->nlf", rng.standard_normal((n, LAYERS, RANK)), basis) + mean).astype(np.float32)


def _summary(vectors: np.ndarray) -> np.ndarray:  # (layers, F) -> (S * F,)
    return -vectors[SUMMARY_LAYERS].reshape(-1)


def _filled(vectors: np.ndarray, cfg: IndexConfig = CFG) -> LayerIndexes:
    index = LayerIndexes(LAYERS, DIM, cfg, SUMMARY_LAYERS, lambda e: vectors[e], lambda ids: np.stack([_summary(vectors[e]) for e in ids]))
    for event_id in range(len(vectors)):
        index.add(event_id, vectors[event_id], _summary(vectors[event_id]))
    return index


def _exact_top(vectors: np.ndarray, query: np.ndarray, k: int) -> list[int]:  # vectors (n, F)
    return np.argsort(-(vectors @ query), kind="stable")[:k].tolist()


def test_the_projection_keeps_inner_products_of_low_rank_vectors_up_to_one_shift_per_query():
    vectors = _low_rank(100)
    projection = Projection.fit([vectors[:, layer] for layer in range(LAYERS)], RANK)
    query = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)
    for layer in range(LAYERS):
        approx = projection.project(layer, vectors[:, layer]) @ projection.project_query(layer, query)[0]  # (n,)
        shift = query @ projection.means[layer]
        np.testing.assert_allclose(approx + shift, vectors[:, layer] @ query, rtol=1e-4, atol=1e-3)
    again = Projection.from_bytes(projection.to_bytes())
    assert np.array_equal(again.means, projection.means) and np.array_equal(again.bases, projection.bases)


def test_past_the_threshold_entries_become_codes_without_ids_and_searches_stay_exact():
    vectors = _low_rank(200)
    index = _filled(vectors[:63])
    assert index.kind == "flat"
    index = _filled(vectors)
    assert index.kind == "projected" and len(index) == 200
    for layer in range(LAYERS):
        assert int(index.indexes[layer].code_size) == RANK * 6 // 8 + (RANK * 6 % 8 > 0)  # sq6, nothing else
    rng = np.random.default_rng(2)
    for _ in range(20):
        query = rng.standard_normal(DIM).astype(np.float32)
        for layer in range(LAYERS):
            ids, scores = index.search(layer, torch.from_numpy(query), k=5)
            assert ids == _exact_top(vectors[:, layer], query, 5)
            np.testing.assert_allclose(scores, vectors[ids, layer] @ query, rtol=1e-5)
        summaries = np.stack([_summary(v) for v in vectors])  # (n, S)
        summary_query = rng.standard_normal(summaries.shape[1]).astype(np.float32)
        assert index.search_summary(torch.from_numpy(summary_query), k=3)[0] == _exact_top(summaries, summary_query, 3)


def test_a_low_rank_index_is_saved_loaded_caught_up_and_rebuilt_when_damaged(tmp_path):
    vectors = _low_rank(150)
    index = _filled(vectors[:100])
    index.save(tmp_path)
    assert (tmp_path / "projection.npz").exists()

    def load() -> LayerIndexes:
        return LayerIndexes.load(tmp_path, LAYERS, DIM, CFG, SUMMARY_LAYERS, 150, lambda e: vectors[e],
                                 lambda ids: np.stack([_summary(vectors[e]) for e in ids]))

    loaded = load()
    assert loaded.kind == "projected" and len(loaded) == 150 and loaded.saved_events == 100
    query = np.random.default_rng(3).standard_normal(DIM).astype(np.float32)
    assert loaded.search(0, torch.from_numpy(query), k=5)[0] == _exact_top(vectors[:, 0], query, 5)
    (tmp_path / "projection.npz").write_bytes(b"not a projection")
    rebuilt = load()
    assert rebuilt.saved_events == 0 and rebuilt.kind == "projected"
    assert rebuilt.search(0, torch.from_numpy(query), k=5)[0] == _exact_top(vectors[:, 0], query, 5)


def test_a_rank_as_wide_as_the_vectors_or_a_search_with_nothing_to_rescore_from_is_a_clear_error():
    with pytest.raises(ConfigError, match="index.rank"):
        LayerIndexes(LAYERS, DIM, IndexConfig(rank=DIM), SUMMARY_LAYERS)
    vectors = _low_rank(80)
    index = LayerIndexes(LAYERS, DIM, CFG, SUMMARY_LAYERS)
    for event_id in range(80):
        index.add(event_id, vectors[event_id], _summary(vectors[event_id]))
    with pytest.raises(ConfigError, match="re-scores"):
        index.search(0, torch.zeros(DIM), k=3)


def test_a_store_with_low_rank_indexes_recalls_what_its_representatives_rank_first(tmp_path):
    # Random representatives are not low-rank: a pool of every event makes the plumbing, not the projection,
    # what decides the order (re-scored from the blobs)
    cfg = IndexConfig(rank=3, project_min_events=16, rerank=64)
    dim = SPEC.num_kv_heads * SPEC.head_dim
    query = torch.randn(dim, generator=torch.Generator().manual_seed(5))

    def check(memory) -> None:
        for layer in range(SPEC.num_layers):
            reps = np.stack([memory.representatives(e)[layer] for e in range(len(memory))])  # (n, F)
            assert memory.search(layer, query, k=4)[0] == _exact_top(reps, query.numpy(), 4)

    with open_store(tmp_path, index=cfg) as store:
        memory = open_namespace(store)
        add_events(memory, 40)
        assert memory.indexes.kind == "projected"
        check(memory)
        memory.commit({"engine": {"n_tokens": 200}})
        memory.drop_caches()  # one layer's representative read alone from the segment, as from the warm tier
        for layer in range(SPEC.num_layers):
            np.testing.assert_array_equal(memory.layer_representatives([0, 17, 39], layer),
                                          np.stack([memory.representatives(e)[layer] for e in (0, 17, 39)]))
    with open_store(tmp_path, index=cfg) as store:
        memory = open_namespace(store)
        assert memory.indexes.kind == "projected" and memory.indexes.saved_events == 40
        add_events(memory, 10, seed=1)
        check(memory)


def test_a_flat_index_opened_with_a_rank_is_projected_on_open_and_searches_as_before(tmp_path):
    vectors = _low_rank(100)
    flat = _filled(vectors, IndexConfig())
    flat.save(tmp_path)
    loaded = LayerIndexes.load(tmp_path, LAYERS, DIM, CFG, SUMMARY_LAYERS, 100, lambda e: vectors[e],
                               lambda ids: np.stack([_summary(vectors[e]) for e in ids]))
    assert flat.kind == "flat" and loaded.kind == "projected"
    query = torch.from_numpy(np.random.default_rng(4).standard_normal(DIM).astype(np.float32))
    for layer in range(LAYERS):
        assert loaded.search(layer, query, k=5)[0] == flat.search(layer, query, k=5)[0]
