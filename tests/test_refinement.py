"""Boundary refinement: prefix-sum scores equal networkx's modularity and conductance."""

import networkx as nx
import numpy as np
import pytest
import torch
from networkx.algorithms.community import modularity

from engramkv.config import EngineConfig, SegmentationConfig
from engramkv.engine.sealing import Stream
from engramkv.memory.refinement import refine_boundary, similarity_graph, split_scores


def _graph(adjacency):
    g = nx.Graph()
    n = adjacency.shape[0]
    g.add_nodes_from(range(n))
    for i in range(n):
        for j in range(i + 1, n):
            if adjacency[i, j] > 0:
                g.add_edge(i, j, weight=float(adjacency[i, j]))
    return g


@pytest.fixture
def adjacency():
    keys = torch.randn(24, 8, generator=torch.Generator().manual_seed(3))
    return similarity_graph(keys)


def test_graph_is_symmetric_non_negative_without_self_loops(adjacency):
    assert np.array_equal(adjacency, adjacency.T)
    assert (adjacency >= 0).all()
    assert (adjacency.diagonal() == 0).all()


def test_modularity_matches_networkx(adjacency):
    g = _graph(adjacency)
    scores = split_scores(adjacency, "modularity")
    n = adjacency.shape[0]
    for p in range(1, n):
        expected = modularity(g, [set(range(p)), set(range(p, n))], weight="weight")
        assert scores[p].item() == pytest.approx(expected, abs=1e-9), p


def test_conductance_matches_networkx(adjacency):
    g = _graph(adjacency)
    scores = split_scores(adjacency, "conductance")
    n = adjacency.shape[0]
    for p in range(1, n):
        expected = nx.conductance(g, set(range(p)), weight="weight")
        assert -scores[p].item() == pytest.approx(expected, abs=1e-9), p


@pytest.mark.parametrize("metric", ["modularity", "conductance"])
def test_refinement_finds_the_planted_split(metric):
    # Two clusters of keys: tokens 0..12 point one way, 13..29 another. The raw boundary is off by 5.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    keys = torch.cat([a + 0.1 * torch.randn(13, 16, generator=gen), b + 0.1 * torch.randn(17, 16, generator=gen)])
    graph = similarity_graph(keys)
    assert refine_boundary(graph, boundary=18, min_split=4, metric=metric) == 13


def test_refinement_respects_the_candidate_range():
    graph = similarity_graph(torch.randn(30, 8))
    for boundary in (5, 12, 20):
        p = refine_boundary(graph, boundary=boundary, min_split=4, metric="modularity")
        assert 4 <= p <= boundary
    assert refine_boundary(graph, boundary=3, min_split=4, metric="modularity") == 3  # no candidate: unchanged


@pytest.mark.parametrize("min_surprise, moved", [(1.0, False), (0.0, True)])
def test_a_cut_in_predicted_text_is_not_refined(min_surprise, moved):
    # Repeated text: an 8-token period in the keys, every token predicted (0.02 nats) but the one at 100.
    cfg = EngineConfig(segmentation=SegmentationConfig(min_surprise=min_surprise))
    stream = Stream(cfg, summary_layers=[0])
    period = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    keys = period.repeat(25, 1) + 0.01 * torch.randn(200, 16, generator=torch.Generator().manual_seed(1))
    stream.tail_tokens = torch.zeros(200, dtype=torch.int32)
    stream.local_surprise = torch.full((200,), 0.02)
    stream.local_surprise[100] = 5.0
    stream.boundaries = [44, 100, 150]
    first = stream._refined_end(keys, 0)
    assert (first != 44) == moved
    surprising = stream._refined_end(keys, first)  # a surprise boundary is refined either way
    min_split = max(cfg.segmentation.min_event, (150 - first) - cfg.segmentation.max_event)
    expected = refine_boundary(similarity_graph(keys[first:150]), 100 - first, min_split, "modularity")
    assert surprising == first + expected
