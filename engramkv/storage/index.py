"""One FAISS inner-product index per layer over the events' representative keys; ids are event ids.

An index starts flat (exact, `IndexIDMap` over `IndexFlatIP`). Past `ivf_min_events` it is rebuilt once as IVF with
scalar quantisation (`IndexConfig.ivf_codec`; trained on the vectors it already holds; the event ids live in its
inverted lists), which keeps search time sub-linear and RAM under one byte per dimension and event.

The layer indexes are built over *centred* representatives (minus their mean at the rebuild, kept in the manifest):
a key representative shares a large common direction with every other, and inner-product k-means over raw ones puts
most of them in a few lists, so 32 probed lists held a quarter to two fifths of the exact top 10 (default model, 8k
natural-text events); centred, three quarters. Subtracting a constant from every indexed vector shifts all scores of
one query by the same amount: the ranking of a search is unchanged, only the partition improves. (The key summaries,
averages of unit vectors, gained nothing from it and are indexed as they are.) No id-to-position map is kept
(`IndexIDMap2` costs ~50 B per event and index): a flat index holds them in id order (a merge reads them so).

Indexes are saved beside the catalog with the number of events they hold; on open, an index that lags the catalog is
caught up from the representatives stored in the event blobs, and one that is ahead (saved, then the catalog commit
was lost) is rebuilt.

Beside them, one index over the events' key summaries (`memory.summary`): what questions are matched against
(`retrieval.question`). It is derived from the stored keys, so a store without it gets it rebuilt on open.

With `IndexConfig.rank`, past `project_min_events` the indexes hold low-rank codes (`storage.projection`): no ids,
no IVF, searches re-scored exactly (`layer_representatives_of`, else `representatives_of`; `summaries_of`).

With a GPU build of FAISS (`IndexConfig.device`), searches run on a GPU copy of each index that every add also
updates; the CPU indexes stay the ones that are saved, rebuilt and caught up.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from engramkv.config import IndexConfig
from engramkv.errors import ConfigError
from engramkv.storage.durable import replace_durably, replace_durably_with
from engramkv.storage.projection import CODECS, Projection, fit_codes, search_codes


def _gpu_resources(device: str) -> Any:
    """FAISS GPU resources when searches should run on the GPU, else None."""
    if device == "cpu":
        return None
    available = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    if not available:
        if device == "gpu":
            raise ConfigError("index.device='gpu' needs a GPU build of FAISS (e.g. faiss-gpu-cu12) and a GPU")
        return None
    return faiss.StandardGpuResources()  # only in GPU builds


class LayerIndexes:
    """The per-layer indexes of one namespace, and the index of the events' key summaries."""

    def __init__(self, num_layers: int, dim: int, cfg: IndexConfig, summary_layers: list[int],
                 representatives_of: Callable[[int], np.ndarray] | None = None,
                 summaries_of: Callable[[list[int]], np.ndarray] | None = None,
                 layer_representatives_of: Callable[[list[int], int], np.ndarray] | None = None):
        if cfg.rank is not None and cfg.rank >= dim:
            raise ConfigError(f"index.rank {cfg.rank} must be below the representatives' width {dim}")
        self.num_layers, self.dim, self.cfg = num_layers, dim, cfg
        self.representatives_of = representatives_of  # for catching up from the blobs
        self.summaries_of = summaries_of  # for catching up, and re-scoring low-rank hits
        self.layer_representatives_of = layer_representatives_of or (None if representatives_of is None else (
            lambda ids, layer: np.stack([representatives_of(event_id)[layer] for event_id in ids])))
        self.summary_layers = summary_layers
        self.summary_dim = len(summary_layers) * dim
        self.indexes: list[faiss.Index] = [_flat(dim) for _ in range(num_layers)]
        self.summary: faiss.Index = _flat(self.summary_dim)
        self.kind: str = "flat"  # "ivf" or "projected" once rebuilt
        self.centres: np.ndarray | None = None  # (layers, dim) subtracted before adding to an IVF layer index
        self.projection: Projection | None = None  # the layers' projections once "projected"
        self.summary_projection: Projection | None = None  # the summaries' (one "layer")
        self.saved_events = 0  # events whose every index entry was read from disk by `load`
        self._gpu = _gpu_resources(cfg.device)
        self._mirrors: list[faiss.Index] = []  # GPU copies of [*indexes, summary], searched instead
        self._mirror()

    def __len__(self) -> int:
        return int(self.indexes[0].ntotal)

    def add(self, event_id: int, representatives: np.ndarray, summary: np.ndarray) -> None:
        """representatives: (layers, dim) float32; summary: (summary_dim,) float32."""
        if self.kind == "projected":
            self._add_projected(event_id, representatives, summary)
            return
        ids = np.array([event_id], dtype=np.int64)
        if self.centres is not None:
            representatives = representatives - self.centres
        for layer, index in enumerate(self.indexes):
            index.add_with_ids(representatives[layer : layer + 1], ids)
        self.summary.add_with_ids(summary.reshape(1, -1), ids)
        if self._mirrors:
            for layer, mirror in enumerate(self._mirrors[:-1]):
                mirror.add_with_ids(representatives[layer : layer + 1], ids)
            self._mirrors[-1].add_with_ids(summary.reshape(1, -1), ids)
        if self.kind == "flat" and self.cfg.rank is not None and len(self) >= self.cfg.project_min_events:
            self._to_projected()
        elif self.kind == "flat" and self.cfg.rank is None and len(self) >= self.cfg.ivf_min_events:
            self._to_ivf()

    def catch_up(self, end: int) -> None:
        """Index events len(self)..end-1 from their blobs (their summaries decoded 256 events at a time)."""
        assert self.representatives_of is not None and self.summaries_of is not None
        for ids in _batches(len(self), end):
            for event_id, summary in zip(ids, self.summaries_of(ids)):
                self.add(event_id, self.representatives_of(event_id), summary)

    def flat_entries(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(representatives (count, layers, F), summaries (count, S)) of events first.. as indexed; None unless flat."""
        if self.kind != "flat" or self.centres is not None:
            return None
        rows = [faiss.downcast_index(index.index).reconstruct_n(first, count)  # type: ignore[attr-defined]
                for index in [*self.indexes, self.summary]]
        return np.stack(rows[:-1], axis=1), rows[-1]

    def _add_projected(self, event_id: int, representatives: np.ndarray, summary: np.ndarray) -> None:
        assert self.projection is not None and self.summary_projection is not None
        if event_id != len(self):  # positions are the ids
            raise ValueError(f"a low-rank index takes consecutive event ids: expected {len(self)}, got {event_id}")
        for layer, index in enumerate(self.indexes):
            index.add(self.projection.project(layer, representatives[layer : layer + 1]))
        self.summary.add(self.summary_projection.project(0, summary.reshape(1, -1)))

    @property
    def on_gpu(self) -> bool:
        return bool(self._mirrors)

    def search(self, layer: int, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        if self.kind == "projected":
            exact_of = self.layer_representatives_of
            return self._search_projected(self.indexes[layer], self.projection, layer, query, k,
                                          None if exact_of is None else lambda ids: exact_of(ids, layer))
        return _search(self._mirrors[layer] if self._mirrors else self.indexes[layer], query, k)

    def search_summary(self, summary: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        if self.kind == "projected":
            return self._search_projected(self.summary, self.summary_projection, 0, summary, k, self.summaries_of)
        return _search(self._mirrors[-1] if self._mirrors else self.summary, summary, k)

    def _search_projected(self, index: faiss.Index, projection: Projection | None, layer: int, query: torch.Tensor,
                          k: int, exact_of: Callable[[list[int]], np.ndarray] | None) -> tuple[list[int], list[float]]:
        if projection is None or exact_of is None:
            raise ConfigError("a low-rank index re-scores its hits from the events' stored vectors: build it with "
                              "representatives_of and summaries_of")
        q = query.detach().float().cpu().numpy().reshape(-1)  # (F,)
        return search_codes(index, projection, layer, q, k, max(k, self.cfg.rerank), exact_of)

    def _mirror(self) -> None:
        """(Re)build the GPU copies after load or the IVF rebuild (low-rank codes stay: FAISS has no GPU flat SQ)."""
        self._mirrors = [] if self._gpu is None or self.kind == "projected" else [
            faiss.index_cpu_to_gpu(self._gpu, 0, index) for index in [*self.indexes, self.summary]]

    def _to_ivf(self) -> None:
        """Rebuild the flat indexes as IVF, one at a time, layer indexes over centred representatives.

        Each flat index is dropped before its IVF is trained: holding it beside its own vectors was the
        largest transient of a long ingest (measured at 50k events of the scale model: peak RSS +79 MB
        over the RSS before the rebuild with it held, +57 MB without). An interruption keeps the index
        being rebuilt flat and whole; the layers done stay IVF with their row of `centres` (zeros while
        flat), and the next add finishes the rebuild.
        """
        if self.centres is None:
            self.centres = np.zeros((self.num_layers, self.dim), dtype=np.float32)
        for layer in range(self.num_layers):
            if _is_flat(self.indexes[layer]):
                ids, vectors = _vectors(self.indexes[layer])
                centre = vectors.mean(axis=0, dtype=np.float64).astype(np.float32)  # (F,)
                vectors -= centre
                try:
                    self.indexes[layer] = _flat(self.dim)  # frees the flat copy of `vectors`
                    self.indexes[layer], self.centres[layer] = self._ivf(ids, vectors), centre
                except BaseException:
                    self.indexes[layer] = _flat_of(ids, vectors + centre)
                    raise
        if _is_flat(self.summary):
            ids, vectors = _vectors(self.summary)
            try:
                self.summary = _flat(self.summary_dim)
                self.summary = self._ivf(ids, vectors)
            except BaseException:
                self.summary = _flat_of(ids, vectors)
                raise
        self.kind = "ivf"
        self._mirror()

    def _to_projected(self) -> None:
        """Fit the projections on the events held and replace every flat index by low-rank codes, all at once:
        an interruption leaves the flat indexes whole, and the next add fits again."""
        layers = []
        for index in self.indexes:
            ids, vectors = _vectors(index)
            if not np.array_equal(ids, np.arange(len(ids))):
                raise ValueError("a low-rank index takes consecutive event ids from 0")
            layers.append(vectors)
        indexes, projection = fit_codes(layers, self.cfg.rank or 0, self.cfg.ivf_codec)
        del layers
        summary, summary_projection = self._projected_summary(_vectors(self.summary)[1])
        self.indexes, self.summary, self.kind = indexes, summary, "projected"
        self.projection, self.summary_projection = projection, summary_projection
        self._mirror()

    def _projected_summary(self, summaries: np.ndarray) -> tuple[faiss.Index, Projection]:
        """(codes index, projection) of the summaries (n, S), the projection fitted on them."""
        rank = min((self.cfg.rank or 0) * len(self.summary_layers), self.summary_dim - 1)  # rank per summary layer
        (summary,), projection = fit_codes([summaries], rank, self.cfg.ivf_codec)
        return summary, projection

    def _ivf(self, ids: np.ndarray, vectors: np.ndarray) -> faiss.Index:
        """An IVF index of `vectors` (n, F) under `ids` (n,)."""
        nlist = max(16, int(self.cfg.ivf_lists_per_sqrt * math.sqrt(len(ids))))
        quantizer = faiss.IndexFlatIP(vectors.shape[1])
        ivf = faiss.IndexIVFScalarQuantizer(
            quantizer, vectors.shape[1], nlist, CODECS[self.cfg.ivf_codec], faiss.METRIC_INNER_PRODUCT)
        ivf.cp.seed = 1234  # a resumed ingest must rebuild the same index
        ivf.train(vectors)
        ivf.nprobe = self.cfg.ivf_nprobe
        ivf.add_with_ids(vectors, ids)
        return ivf

    # ------------------------------------------------------------------ persistence
    def save(self, directory: Path) -> None:
        """Write every index, then the manifest that names their size (a torn save is detected on load)."""
        directory.mkdir(parents=True, exist_ok=True)
        named = [(f"layer-{layer:03d}.faiss", index) for layer, index in enumerate(self.indexes)]
        checksums = {}
        if self.projection is not None and self.summary_projection is not None:
            for name, projection in [("projection.npz", self.projection),
                                     ("summary_projection.npz", self.summary_projection)]:
                replace_durably(directory / name, projection.to_bytes())
                checksums[name] = _crc32(directory / name)
        for name, index in [*named, ("summary.faiss", self.summary)]:
            # Streamed to the file: serialising in memory held two copies of the index at every save.
            replace_durably_with(directory / name, lambda path: faiss.write_index(index, str(path)))
            checksums[name] = _crc32(directory / name)
        body = {"events": len(self), "kind": self.kind, "layers": self.num_layers,
                "summary_layers": self.summary_layers,
                "centres": None if self.centres is None else self.centres.tolist(), "crc32": checksums}
        replace_durably(directory / "manifest.json",
                        json.dumps({**body, "manifest_crc32": _manifest_crc(body)}).encode())

    @classmethod
    def load(cls, directory: Path, num_layers: int, dim: int, cfg: IndexConfig, summary_layers: list[int],
             committed_events: int, representatives_of: Callable[[int], np.ndarray],
             summaries_of: Callable[[list[int]], np.ndarray],
             layer_representatives_of: Callable[[list[int], int], np.ndarray] | None = None) -> LayerIndexes:
        """Open the saved indexes and bring them to exactly `committed_events` events (a flat store opened with
        `rank` is projected now, past `project_min_events`).

        representatives_of(event_id) -> (layers, dim) float32, read from the event's blob; summaries_of(ids) ->
        (len(ids), summary_dim) float32, computed from their keys (for catching up, rebuilding and re-scoring low-rank
        searches); layer_representatives_of(ids, layer) -> (len(ids), dim) float32, for re-scoring low-rank searches
        (default: from representatives_of). A store saved with other summary layers (or before summaries existed)
        gets its summary index rebuilt. The indexes are derived data: a damaged file (unreadable, or not the
        checksum its manifest records) is rebuilt from the blobs, which carry checksums of their own.
        """
        def empty() -> LayerIndexes:
            return cls(num_layers, dim, cfg, summary_layers, representatives_of, summaries_of, layer_representatives_of)

        try:
            loaded, start = LayerIndexes._load(directory, empty(), committed_events, summaries_of)
        except _Damaged:
            loaded, start = empty(), 0
        loaded.catch_up(committed_events)
        if loaded.kind == "flat" and cfg.rank is not None and len(loaded) >= cfg.project_min_events:
            loaded._to_projected()
        return loaded

    @staticmethod
    def _load(directory: Path, loaded: LayerIndexes, committed_events: int,
              summaries_of: Callable[[list[int]], np.ndarray]) -> tuple[LayerIndexes, int]:
        """(`loaded`, new and empty, filled from the saved files; the events they held)."""
        cfg, summary_layers, num_layers = loaded.cfg, loaded.summary_layers, loaded.num_layers
        manifest = directory / "manifest.json"
        start = 0
        if manifest.exists():
            try:
                info = json.loads(manifest.read_text())
            except (UnicodeDecodeError, ValueError) as err:
                raise _Damaged(f"{manifest}: {err}") from err
            if not isinstance(info, dict) or not isinstance(info.get("crc32", {}), dict) \
                    or not isinstance(info.get("events"), int) or info.get("kind") not in ("flat", "ivf", "projected"):
                raise _Damaged(f"{manifest}: not an index manifest")
            stated = info.pop("manifest_crc32", None)  # absent in stores saved before it
            if stated is not None and stated != _manifest_crc(info):
                raise _Damaged(f"{manifest}: checksum mismatch")
            files = [directory / f"layer-{layer:03d}.faiss" for layer in range(num_layers)]
            if info.get("layers") == num_layers and all(f.exists() for f in files):
                indexes = [_read(f, info.get("crc32", {})) for f in files]
                sizes = {int(index.ntotal) for index in indexes}
                if sizes == {info["events"]} and info["events"] <= committed_events:
                    loaded.indexes, loaded.kind, start = indexes, str(info["kind"]), int(info["events"])
                    if info.get("centres") is not None:  # absent: flat, or IVF built before centring
                        loaded.centres = np.asarray(info["centres"], dtype=np.float32)
                    if loaded.kind == "projected":
                        loaded.projection = _read_projection(directory / "projection.npz", info["crc32"])
                    summary_file = directory / "summary.faiss"
                    if info.get("summary_layers") == summary_layers and summary_file.exists():
                        loaded.summary = _read(summary_file, info.get("crc32", {}))
                        if loaded.kind == "projected":
                            loaded.summary_projection = _read_projection(directory / "summary_projection.npz",
                                                                         info["crc32"])
                    if int(loaded.summary.ntotal) == start:
                        loaded.saved_events = start
                    else:  # missing, stale or torn: rebuild from the blobs
                        loaded.summary = _flat(loaded.summary_dim)
                        for ids in _batches(0, start):
                            loaded.summary.add_with_ids(summaries_of(ids), np.array(ids))
                        if loaded.kind == "ivf":
                            loaded.summary = loaded._ivf(*_vectors(loaded.summary))
                        elif loaded.kind == "projected":
                            loaded.summary, loaded.summary_projection = loaded._projected_summary(
                                _vectors(loaded.summary)[1])
                    if loaded.kind == "ivf":
                        for index in [*loaded.indexes, loaded.summary]:
                            faiss.extract_index_ivf(index).nprobe = cfg.ivf_nprobe
                    loaded._mirror()
        return loaded, start


class _Damaged(Exception):
    """A saved index file that cannot be trusted: the indexes are rebuilt from the blobs."""


def _read_projection(path: Path, checksums: dict[str, Any]) -> Projection:
    expected = checksums.get(path.name)
    try:
        if expected is None or _crc32(path) != expected:
            raise _Damaged(f"{path}: missing from the manifest or checksum mismatch")
        return Projection.from_bytes(path.read_bytes())
    except (OSError, ValueError, KeyError) as err:
        raise _Damaged(f"{path}: {err}") from err


def _manifest_crc(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _read(path: Path, checksums: dict[str, Any]) -> faiss.Index:
    """A saved index, checked against the manifest's checksum (stores saved before checksums: unchecked)."""
    expected = checksums.get(path.name)
    if expected is not None and _crc32(path) != expected:
        raise _Damaged(f"{path}: checksum mismatch")
    try:
        return faiss.read_index(str(path))
    except RuntimeError as err:  # FAISS's own error for a file it cannot parse
        raise _Damaged(f"{path}: {err}") from err



def _batches(start: int, end: int, size: int = 256) -> Iterator[list[int]]:
    """Event ids start..end-1 in lists of `size`: summaries are decoded many events at a time."""
    for first in range(start, end, size):
        yield list(range(first, min(first + size, end)))


def _vectors(flat: faiss.Index) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n,), vectors (n, F)) of a flat IndexIDMap, in add order."""
    ids = faiss.vector_to_array(flat.id_map).astype(np.int64)  # type: ignore[attr-defined]
    return ids, faiss.downcast_index(flat.index).reconstruct_n(0, int(flat.ntotal))  # type: ignore[attr-defined]


def _is_flat(index: faiss.Index) -> bool:
    return faiss.try_extract_index_ivf(index) is None


def _flat_of(ids: np.ndarray, vectors: np.ndarray) -> faiss.Index:
    flat = _flat(vectors.shape[1])
    flat.add_with_ids(vectors, ids)
    return flat


def _flat(dim: int) -> faiss.Index:
    return faiss.IndexIDMap(faiss.IndexFlatIP(dim))


def _search(index: faiss.Index, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    n = int(index.ntotal)
    if n == 0 or k <= 0:
        return [], []
    q = query.detach().float().cpu().numpy().reshape(1, int(index.d))  # (1, F)
    scores, ids = index.search(q, min(k, n))
    keep = ids[0] >= 0  # IVF can return fewer than k hits (-1 padding)
    return ids[0][keep].tolist(), scores[0][keep].tolist()
