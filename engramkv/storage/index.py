"""One FAISS inner-product index per layer over the events' representative keys; ids are event ids.

An index starts flat (exact, `IndexIDMap2` over `IndexFlatIP`). Past `ivf_min_events` it is rebuilt
once as IVF with 8-bit scalar quantisation (trained on the vectors it already holds), which keeps
search time and RAM from growing linearly with the document. Indexes are saved beside the catalog
with the number of events they hold; on open, an index that lags the catalog is caught up from the
representatives stored in the event blobs, and one that is ahead (saved, then the catalog commit was
lost) is rebuilt.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np
import torch

from engramkv.config import IndexConfig


def _gpu_available() -> bool:
    return hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0


class LayerIndexes:
    """The per-layer indexes of one namespace."""

    def __init__(self, num_layers: int, dim: int, cfg: IndexConfig):
        self.num_layers, self.dim, self.cfg = num_layers, dim, cfg
        self.indexes: list[faiss.Index] = [self._flat() for _ in range(num_layers)]
        self.kind: str = "flat"

    def _flat(self) -> faiss.Index:
        return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))

    def __len__(self) -> int:
        return int(self.indexes[0].ntotal)

    def add(self, event_id: int, representatives: np.ndarray) -> None:
        """representatives: (layers, dim) float32."""
        ids = np.array([event_id], dtype=np.int64)
        for layer, index in enumerate(self.indexes):
            index.add_with_ids(representatives[layer : layer + 1], ids)
        if self.kind == "flat" and len(self) >= self.cfg.ivf_min_events:
            self._to_ivf()

    def search(self, layer: int, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        if len(self) == 0 or k <= 0:
            return [], []
        q = query.detach().float().cpu().numpy().reshape(1, self.dim)  # (1, F)
        scores, ids = self.indexes[layer].search(q, min(k, len(self)))
        keep = ids[0] >= 0  # IVF can return fewer than k hits (-1 padding)
        return ids[0][keep].tolist(), scores[0][keep].tolist()

    def _to_ivf(self) -> None:
        n = len(self)
        nlist = max(16, int(self.cfg.ivf_lists_per_sqrt * math.sqrt(n)))
        for layer in range(self.num_layers):
            flat = self.indexes[layer]
            ids = faiss.vector_to_array(flat.id_map).astype(np.int64)  # type: ignore[attr-defined]  # (n,)
            vectors = flat.reconstruct_n(0, n)  # (n, F): IndexIDMap2 stores them in add order
            quantizer = faiss.IndexFlatIP(self.dim)
            ivf = faiss.IndexIVFScalarQuantizer(
                quantizer, self.dim, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT
            )
            ivf.cp.seed = 1234  # a resumed ingest must rebuild the same index
            ivf.train(vectors)
            ivf.nprobe = self.cfg.ivf_nprobe
            wrapped = faiss.IndexIDMap2(ivf)
            wrapped.add_with_ids(vectors, ids)
            self.indexes[layer] = wrapped
        self.kind = "ivf"

    # ------------------------------------------------------------------ persistence
    def save(self, directory: Path) -> None:
        """Write every layer, then the manifest that names their size (a torn save is detected on load)."""
        directory.mkdir(parents=True, exist_ok=True)
        for layer, index in enumerate(self.indexes):
            tmp = directory / f"layer-{layer:03d}.faiss.tmp"
            faiss.write_index(index, str(tmp))
            _fsync_file(tmp)
            os.replace(tmp, directory / f"layer-{layer:03d}.faiss")
        manifest = directory / "manifest.json"
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps({"events": len(self), "kind": self.kind, "layers": self.num_layers}))
        _fsync_file(tmp)
        os.replace(tmp, manifest)

    @classmethod
    def load(
        cls,
        directory: Path,
        num_layers: int,
        dim: int,
        cfg: IndexConfig,
        committed_events: int,
        representatives_of: Callable[[int], np.ndarray],
    ) -> LayerIndexes:
        """Open the saved indexes and bring them to exactly `committed_events` events.

        representatives_of(event_id) -> (layers, dim) float32, read from the event's blob.
        """
        loaded = cls(num_layers, dim, cfg)
        manifest = directory / "manifest.json"
        usable = False
        if manifest.exists():
            info = json.loads(manifest.read_text())
            files = [directory / f"layer-{layer:03d}.faiss" for layer in range(num_layers)]
            if info.get("layers") == num_layers and all(f.exists() for f in files):
                indexes = [faiss.read_index(str(f)) for f in files]
                sizes = {int(index.ntotal) for index in indexes}
                if sizes == {info["events"]} and info["events"] <= committed_events:
                    loaded.indexes, loaded.kind, usable = indexes, str(info["kind"]), True
                    if loaded.kind == "ivf":
                        for index in indexes:
                            faiss.extract_index_ivf(index).nprobe = cfg.ivf_nprobe
        start = len(loaded) if usable else 0
        for event_id in range(start, committed_events):  # catch up from the blobs
            loaded.add(event_id, representatives_of(event_id))
        return loaded


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
