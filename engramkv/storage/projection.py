"""Low-rank index entries: representatives projected, quantised, held without ids, re-scored exactly.

Issue 18 asks for at most 1 KB of index RAM per event; a flat entry of the embedded model is 30 layers x
192 float32 plus an 8-byte id (~23 KB), an IVF one with 6-bit codes ~4.6 KB. Per layer l, a projection is
fitted once on the events the index holds when it starts (`IndexConfig.project_min_events`):

    m_l = mean of those representatives (F,)      P_l = their top R principal directions (F, R)

An event's representative r is held as the scalar-quantised code of z = P_l^T (r - m_l) (R dims,
`IndexConfig.ivf_codec` bits each) at the position of its event id: ids are consecutive from 0, so none is
stored. A search for a query q (F,) scores every code against P_l^T q, which approximates q . (r - m_l), the
exact score less q . m_l (the same for every event), takes the `rerank` best and scores them again exactly,
q . r, from the events' own stored representatives (`representatives_of`), keeping the best k.

Why re-score: on the embedded model's own recall searches the projection alone keeps 0.58 of the exact top 10
at R = 24, while the exact top 10 lies in its top 50 0.95 of the time
(`benchmarks/results/index_projection/`). The key summaries are handled the same way, as one "layer" of
rank `rank` per summary layer.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import faiss
import numpy as np

# What IndexConfig.ivf_codec names, for IVF entries and low-rank codes alike.
CODECS = {"sq8": faiss.ScalarQuantizer.QT_8bit, "sq6": faiss.ScalarQuantizer.QT_6bit,
          "sq4": faiss.ScalarQuantizer.QT_4bit}
RANGE_STD = 4.0


@dataclass(frozen=True, eq=False)  # arrays: compare their fields with numpy
class Projection:
    """Per layer: the mean and the orthonormal basis the layer's entries are projected onto."""

    means: np.ndarray  # (L, F) float32
    bases: np.ndarray  # (L, F, R) float32

    @classmethod
    def fit(cls, vectors: Sequence[np.ndarray], rank: int) -> Projection:
        """vectors: one (n, F) array per layer; the top `rank` principal directions of each."""
        means, bases = [], []
        for layer_vectors in vectors:
            mean = layer_vectors.mean(axis=0, dtype=np.float64)  # (F,)
            centred = layer_vectors - mean  # (n, F)
            _, _, vt = np.linalg.svd(centred, full_matrices=False)  # vt (min(n, F), F)
            basis = np.zeros((layer_vectors.shape[1], rank))  # (F, R): zero columns where n < R
            basis[:, : min(rank, len(vt))] = vt[:rank].T
            means.append(mean)
            bases.append(basis)
        return cls(np.stack(means).astype(np.float32), np.stack(bases).astype(np.float32))

    def project(self, layer: int, vectors: np.ndarray) -> np.ndarray:  # (n, F) -> (n, R)
        return np.ascontiguousarray((vectors - self.means[layer]) @ self.bases[layer], dtype=np.float32)

    def project_query(self, layer: int, query: np.ndarray) -> np.ndarray:  # (F,) -> (1, R)
        return np.ascontiguousarray((query @ self.bases[layer]).reshape(1, -1), dtype=np.float32)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, means=self.means, bases=self.bases)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Projection:
        """ValueError (or KeyError) for bytes that are not a projection."""
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            means, bases = arrays["means"], arrays["bases"]
        if means.ndim != 2 or bases.ndim != 3 or bases.shape[:2] != means.shape:
            raise ValueError(f"projection of shapes {means.shape} and {bases.shape}")
        return cls(means.astype(np.float32), bases.astype(np.float32))


def fit_codes(vectors: Sequence[np.ndarray], rank: int, codec: str) -> tuple[list[faiss.Index], Projection]:
    """(one codes index per layer, the projection): `vectors` (n, F) per layer, projected on their own top
    `rank` principal directions, then scalar-quantised with `codec` (positions are the ids)."""
    projection = Projection.fit(vectors, rank)
    return [codes_index(projection.project(layer, v), codec) for layer, v in enumerate(vectors)], projection


def codes_index(codes: np.ndarray, codec: str) -> faiss.Index:
    """An index of `codes` (n, R), scalar-quantised with `codec` trained on them; positions are the ids."""
    index = faiss.IndexScalarQuantizer(codes.shape[1], CODECS[codec], faiss.METRIC_INNER_PRODUCT)
    # Each dimension's range: its mean +- 4 std of these codes, not their min-max: entries added later
    # outside the range are clipped, and the clipped ones are the extremes a search wants first.
    index.sq.rangestat, index.sq.rangestat_arg = faiss.ScalarQuantizer.RS_meanstd, RANGE_STD
    index.train(codes)
    index.add(codes)
    return index


def search_codes(index: faiss.Index, projection: Projection, layer: int, query: np.ndarray, k: int, pool: int,
                 exact_of: Callable[[list[int]], np.ndarray]) -> tuple[list[int], list[float]]:
    """The best `k` events for `query` (F,): the `pool` best by their codes, re-scored by exact_of(ids) (c, F)."""
    n = int(index.ntotal)
    if n == 0 or k <= 0:
        return [], []
    _, candidates = index.search(projection.project_query(layer, query), min(pool, n))  # (1, pool)
    candidates = [int(i) for i in candidates[0] if i >= 0]
    exact = exact_of(candidates)  # (c, F)
    scores = exact @ query  # (c,)
    order = np.argsort(-scores, kind="stable")[:k]
    return [candidates[i] for i in order], [float(scores[i]) for i in order]
