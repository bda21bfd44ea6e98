"""Graph-theoretic refinement of event boundaries (EM-LLM).

The graph: tokens are nodes, edge weights are A = relu(K K^T) with a zero diagonal,
where K concatenates the pre-RoPE keys of the upper layers and all KV heads (so A is the
sum over those layers and heads of per-head key similarity). Negative similarities are
clipped because modularity and conductance are defined for non-negative weights, and
the diagonal is zeroed so no self-loop conventions leak in.

For a boundary b between the previous (already refined) boundary a and the next
boundary c, each candidate split p in [a + min_event, b] (and no earlier than c - max_event, so
the next event stays within max_event) cuts the nodes [a, c) into
[a, p) and [p, c). We score every candidate with 2-D prefix sums over A, O(1) each:

    modularity(p)  = (W11 + W22) / 2m - (d1 / 2m)^2 - (d2 / 2m)^2     (maximised)
    conductance(p) = W12 / min(d1, d2)                                   (minimised)

with W_ij the block sums of A, d_i the degree sums and 2m = sum(A). These are exactly
networkx's `modularity` and `conductance` for the two communities (tests check it).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch


def similarity_graph(keys: torch.Tensor) -> np.ndarray:  # keys (T, F) -> (T, T) float64
    """The graph's weights; the rest of the refinement is NumPy on the host: each boundary is a few dozen
    operations on a small matrix, where NumPy's per-operation cost is a fraction of PyTorch's."""
    keys = keys.float()
    a = (keys @ keys.T).clamp(min=0).double().numpy()  # (T, T); float64 only for the prefix sums downstream
    np.fill_diagonal(a, 0)
    return a


def split_scores(adjacency: np.ndarray, metric: Literal["modularity", "conductance"]) -> np.ndarray:
    """Score of cutting nodes [0, n) into [0, p) and [p, n), for every p in 0..n (higher is better)."""
    prefix = adjacency.cumsum(0).cumsum(1)  # prefix[i, j] = sum A[:i+1, :j+1]
    total = prefix[-1, -1]
    w11 = np.concatenate(([0.0], prefix.diagonal()))  # block [0,p) x [0,p)
    d1 = np.concatenate(([0.0], prefix[:, -1]))  # rows [0,p), all columns
    d2 = total - d1
    w12 = d1 - w11  # [0,p) x [p,n)
    w22 = total - 2 * w12 - w11
    if metric == "modularity":
        two_m = max(total, 1e-12)
        return (w11 + w22) / two_m - (d1 / two_m) ** 2 - (d2 / two_m) ** 2
    smaller = np.minimum(d1, d2)
    conductance = np.where(smaller > 0, w12 / np.maximum(smaller, 1e-12), np.inf)
    return -conductance


def refine_boundary(
    adjacency: np.ndarray,  # (n, n) over nodes [a, c)
    boundary: int,  # b - a, the current split inside the node range
    min_split: int,
    metric: Literal["modularity", "conductance"],
) -> int:
    """Best split p in [min_split, boundary] (relative to a); the boundary itself if there is no candidate."""
    n = adjacency.shape[0]
    lo = max(1, min_split)
    hi = min(boundary, n - 1)
    if hi < lo:
        return boundary
    scores = split_scores(adjacency, metric)[lo : hi + 1]  # (hi - lo + 1,)
    if not np.isfinite(scores).any():
        return boundary
    return lo + int(np.argmax(np.nan_to_num(scores, neginf=-1e300)))
