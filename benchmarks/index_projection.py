"""Does the ranking of recall searches hold in a low-rank projection of the representatives? (issue 18)

A store's indexes hold, for every event, one representative per layer (Hkv * D = 192 floats for the
embedded model) and one key summary (S * Hkv * D = 1,920): about 31 KB per event while flat, 6 KB once IVF
with 6-bit codes. Issue 18 asks for at most 1 KB per event, which leaves ~30 bytes per layer: the vectors
must be projected (and quantised) before they are indexed. Inner products survive a projection onto the
leading principal directions of the indexed vectors when the queries' weight lies there too; this measures
whether it does, on the embedded model's own searches.

The model reads text made of evaluation-style samples (calibration-range seeds, so disjoint from the
evaluation's) into a session whose in-RAM memory records every search it is asked: the per-layer
reading queries of every chunk and decode step, and the key summaries of questions (each sample's
question is asked once, one token generated). Then, per layer, a projection (mean and the top r principal
directions) is fitted on the first `--fit-share` of the events, as an index would fit it at its rebuild,
and every recorded search is repeated over the events that existed when it was made:

    exact      scores = reps @ q                              (what the in-RAM memory and a flat index rank by)
    projected  scores = ((reps - mean) @ P_r) @ (P_r^T q)     (a constant q.mean apart: ranks as reps @ P_r P_r^T q)
    quantised  the projected codes through FAISS's scalar quantiser (8, 6 or 4 bits per dimension)

And, for the store's two-stage search (projection at rank 24 in sq6, the best 50 re-scored) and for a flat
search, re-scoring from the representatives as a store writes them (`storage.blob`: f32, f16, i8 per KV head):

    stored     scores = decode(encode(reps)) @ q

Reported: the share of the exact top 10 that each variant's top 10 keeps (mean over searches; searches
over fewer than 40 events are left out), and the bytes per event an index of that kind holds (codes +
an 8-byte id; 30 layer indexes plus the summary index).

    python benchmarks/index_projection.py [--tokens-per-sample 4096] [--name index_projection]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import faiss
import numpy as np
import torch

from _common import RESULTS, write_results
from engramkv import EngineConfig, EpisodicLM
from engramkv.memory.events import InMemoryEventMemory
from engramkv.storage.blob import (REPRESENTATIVE_FORMATS, decode_representatives, encode_representatives,
                                  representative_nbytes)
from engramkv.tasks import TASKS

TOP = 10
MIN_EVENTS = 40  # a top 10 of fewer candidates says little
POOL = 50  # candidates a two-stage search would re-score exactly
SAMPLES = [("niah-multikey", 100100), ("facts", 100100), ("passkey", 100100), ("niah-multivalue", 100100),
           ("conversation", 100100), ("niah-single", 100101)]
RANKS = [8, 16, 24, 32, 48, 64]
SUMMARY_RANKS = [16, 32, 64, 128, 256]
CODECS = {"fp32": None, "sq8": faiss.ScalarQuantizer.QT_8bit, "sq6": faiss.ScalarQuantizer.QT_6bit,
          "sq4": faiss.ScalarQuantizer.QT_4bit}
BITS = {"fp32": 32, "sq8": 8, "sq6": 6, "sq4": 4}


class RecordingMemory(InMemoryEventMemory):
    """The in-RAM memory, recording every search: (layer or -1 for summaries, query, events at the time)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.searches: list[tuple[int, np.ndarray, int]] = []

    def search(self, layer: int, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        self.searches.append((layer, query.float().numpy().copy(), len(self)))
        return super().search(layer, query, k)

    def search_keys(self, summary: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        self.searches.append((-1, summary.float().numpy().copy(), len(self)))
        return super().search_keys(summary, k)

    def vectors(self, layer: int) -> np.ndarray:  # (N, F): representatives of `layer`, or summaries for -1
        vectors = self._summaries.view() if layer < 0 else self._reps.view()[layer]
        return vectors.cpu().numpy().copy()


def principal(vectors: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean (F,), P (F, rank)): the leading principal directions of `vectors` (N, F)."""
    mean = vectors.mean(axis=0)
    _, _, vt = np.linalg.svd(vectors - mean, full_matrices=False)  # vt (min(N, F), F)
    return mean, vt[:rank].T


def quantised(codes: np.ndarray, fit: np.ndarray, codec: str) -> np.ndarray:
    """`codes` (N, r) through FAISS's scalar quantiser trained on `fit` (M, r), decoded back."""
    if CODECS[codec] is None:
        return codes
    sq = faiss.ScalarQuantizer(codes.shape[1], CODECS[codec])
    sq.train(np.ascontiguousarray(fit, dtype=np.float32))
    return sq.decode(sq.compute_codes(np.ascontiguousarray(codes, dtype=np.float32)))


def overlap(exact: np.ndarray, approx: np.ndarray, pool: int = TOP) -> float:
    """Share of the top 10 by `exact` scores found in the top `pool` by `approx` scores."""
    k, pool = min(TOP, len(exact)), min(pool, len(exact))
    return len(set(np.argpartition(-exact, k - 1)[:k]) & set(np.argpartition(-approx, pool - 1)[:pool])) / k


def measure(vectors: np.ndarray, searches: list[tuple[np.ndarray, int]], ranks: list[int], fit_share: float
            ) -> dict[str, dict[str, float]]:
    """{f"r{rank}": {codec: mean top-10 overlap}} for one layer (or the summaries), plus the unprojected codecs."""
    n_fit = max(MIN_EVENTS, int(fit_share * len(vectors)))
    fit = vectors[:n_fit]
    out: dict[str, dict[str, float]] = {}
    full_dim = vectors.shape[1]
    for rank in [*ranks, full_dim]:
        if rank > min(full_dim, n_fit):
            continue
        if rank == full_dim:  # no projection: what today's indexes hold (centred as the IVF rebuild centres)
            mean, basis = fit.mean(axis=0), np.eye(full_dim, dtype=np.float32)
        else:
            mean, basis = principal(fit, rank)
        codes = (vectors - mean) @ basis  # (N, r)
        fit_codes = (fit - mean) @ basis
        row: dict[str, float] = {}
        for codec in CODECS:
            stored = quantised(codes, fit_codes, codec)
            pairs = [(vectors[:n] @ q, stored[:n] @ (basis.T @ q)) for q, n in searches]
            row[codec] = float(np.mean([overlap(exact, approx) for exact, approx in pairs]))
            row[f"{codec}_pool"] = float(np.mean([overlap(exact, approx, POOL) for exact, approx in pairs]))
        out["full" if rank == full_dim else f"r{rank}"] = row
    return out


def stored_formats(vectors: np.ndarray, searches: list[tuple[np.ndarray, int]], fit_share: float, kv_heads: int,
                   rank: int = 24, codec: str = "sq6") -> dict[str, dict[str, float]]:
    """{fmt: {"flat": top-10 kept scoring the stored representatives, "two_stage": the same after a projected
    search's best POOL are re-scored from them}} for one layer."""
    n_fit = max(MIN_EVENTS, int(fit_share * len(vectors)))
    mean, basis = principal(vectors[:n_fit], rank)
    codes = quantised((vectors - mean) @ basis, (vectors[:n_fit] - mean) @ basis, codec)
    head_dim = vectors.shape[1] // kv_heads
    out: dict[str, dict[str, float]] = {}
    for fmt in REPRESENTATIVE_FORMATS:
        stored = decode_representatives(fmt, encode_representatives(fmt, vectors, kv_heads), len(vectors), kv_heads,
                                        head_dim)
        flat, two_stage = [], []
        for q, n in searches:
            exact = vectors[:n] @ q
            flat.append(overlap(exact, stored[:n] @ q))
            pool = min(POOL, n)
            candidates = np.argpartition(-(codes[:n] @ (basis.T @ q)), pool - 1)[:pool]
            rescored = np.full(n, -np.inf, dtype=np.float32)
            rescored[candidates] = stored[candidates] @ q
            two_stage.append(overlap(exact, rescored))
        out[fmt] = {"flat": float(np.mean(flat)), "two_stage": float(np.mean(two_stage))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-sample", type=int, default=4096)
    parser.add_argument("--fit-share", type=float, default=0.5,
                        help="share of the events (the first ones) the projection is fitted on (default 0.5)")
    parser.add_argument("--name", default="index_projection")
    args = parser.parse_args()

    config = EngineConfig()
    lm = EpisodicLM.from_pretrained(config=config)
    spec = lm.spec
    memory = RecordingMemory(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float16)
    session = lm.session(memory=memory)
    started = time.perf_counter()
    samples = [TASKS[task](lm.tokenizer, args.tokens_per_sample, seed) for task, seed in SAMPLES]
    for sample in samples:
        session.ingest("".join(sample.context) + "\n\n")
    for sample in samples:  # a fork answers (the stream stays as read); its memory is a copy that records on
        twin = session.fork()
        twin.generate(sample.prompt, max_new_tokens=1, question=sample.question)
        memory.searches += twin.memory.searches[len(memory.searches):]
    ingest_s = time.perf_counter() - started
    print(f"{len(memory)} events, {len(memory.searches)} searches, {ingest_s:.0f} s")

    results: dict[str, Any] = {"layers": {}, "summary": None}
    for layer in range(-1, spec.num_layers):
        searches = [(q, n) for l, q, n in memory.searches if l == layer and n >= MIN_EVENTS]
        if not searches:
            continue
        measured = measure(memory.vectors(layer), searches, SUMMARY_RANKS if layer < 0 else RANKS, args.fit_share)
        entry = {"searches": len(searches), "overlap": measured}
        if layer >= 0:
            entry["stored"] = stored_formats(memory.vectors(layer), searches, args.fit_share, spec.num_kv_heads)
        if layer < 0:
            results["summary"] = entry
        else:
            results["layers"][layer] = entry
        print(layer, len(searches), {k: round(v["sq8"], 2) for k, v in measured.items()})

    layers = list(results["layers"].values())
    dim = spec.num_kv_heads * spec.head_dim
    summary_dim = memory.vectors(-1).shape[1]
    lines = [
        "# Recall searches in a low-rank projection of the indexed vectors (issue 18)", "",
        f"{len(memory)} events of the embedded model ({sum(s.length for s in samples):,} tokens: "
        + ", ".join(f"{t} {s}" for t, s in SAMPLES) + f", {args.tokens_per_sample} tokens each); "
        f"{len(memory.searches)} searches recorded, those over at least {MIN_EVENTS} events repeated. "
        f"Projection: the top r principal directions of the first {args.fit_share:.0%} of the events; `full`: "
        "none (the vectors centred on the same events' mean). Cells: the share of the exact top 10 found in the "
        f"variant's top 10 (and, `pool`, in its top {POOL}: what a two-stage search that re-scores that many "
        "candidates exactly would keep); mean over searches, for the layer indexes also over layers, with the "
        "worst layer's mean in brackets.", "",
        "## Layer indexes (reading recall)", "",
        "| projection | " + " | ".join(f"{c}" for c in CODECS) + f" | sq8 pool {POOL} | sq4 pool {POOL} "
        "| bytes per event, 30 layers, sq8 / sq6 / sq4 |",
        "|---|" + "---|" * (len(CODECS) + 3),
    ]
    for key in layers[0]["overlap"]:
        rank = dim if key == "full" else int(key[1:])
        cells = [f"{np.mean([l['overlap'][key][c] for l in layers]):.3f} "
                 f"({min(l['overlap'][key][c] for l in layers):.2f})"
                 for c in [*CODECS, "sq8_pool", "sq4_pool"]]
        size = " / ".join(f"{spec.num_layers * (rank * BITS[c] // 8 + 8):,}" for c in ("sq8", "sq6", "sq4"))
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {size} |")
    lines += ["", "## Re-scoring from the stored representatives (layer indexes)", "",
              "Share of the exact top 10 in the top 10 of a flat search over the representatives as stored, and "
              f"of the two-stage search (rank 24, sq6, best {POOL} re-scored from them); mean over layers (worst).",
              "", "| stored as | bytes per layer per event | flat | two-stage |", "|---|---|---|---|"]
    for fmt in REPRESENTATIVE_FORMATS:
        size = representative_nbytes(fmt, spec.num_kv_heads, spec.head_dim)
        cells = [f"{np.mean([l['stored'][fmt][k] for l in layers]):.3f} ({min(l['stored'][fmt][k] for l in layers):.2f})"
                 for k in ("flat", "two_stage")]
        lines.append(f"| {fmt} | {size} | " + " | ".join(cells) + " |")
    summary = results["summary"]
    if summary:
        lines += ["", f"## Key-summary index (questions; {summary['searches']} searches)", "",
                  "| projection | " + " | ".join(CODECS) + f" | sq8 pool {POOL} | sq4 pool {POOL} "
                  "| bytes per event, sq8 / sq6 / sq4 |",
                  "|---|" + "---|" * (len(CODECS) + 3)]
        for key, row in summary["overlap"].items():
            rank = summary_dim if key == "full" else int(key[1:])
            size = " / ".join(f"{rank * BITS[c] // 8 + 8:,}" for c in ("sq8", "sq6", "sq4"))
            lines.append(f"| {key} | " + " | ".join(f"{row[c]:.3f}" for c in [*CODECS, "sq8_pool", "sq4_pool"])
                         + f" | {size} |")
    payload = {"events": len(memory), "searches": len(memory.searches), "samples": SAMPLES,
               "tokens_per_sample": args.tokens_per_sample, "fit_share": args.fit_share, "ingest_s": ingest_s,
               "results": results}
    json_path, md_path = write_results(RESULTS / "index_projection", args.name, payload, "\n".join(lines), config)
    print(md_path.read_text())


if __name__ == "__main__":
    main()
