"""Boundary refinement: prefix-sum scores equal networkx's modularity and conductance."""

import networkx as nx
import pytest
import torch
from networkx.algorithms.community import modularity

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
    assert torch.equal(adjacency, adjacency.T)
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
