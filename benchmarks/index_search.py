"""Recall search time and index RAM per event of a store: full-width indexes against low-rank ones (issue 18).

Three stores of the embedded model's shape (30 layers, 3 KV heads x 64; no model is loaded: random KV and
representatives, the int8 codec) receive the same events: one with the default indexes (flat at this
size), one rebuilt as IVF (`ivf_min_events` lowered to `--rebuild-at`), one with low-rank entries
(`index.rank`, fitted at `--rebuild-at`). Then the same reading queries are searched in all three,
alternating, as recall searches while reading: every layer, k = `recall.budget_tokens // min_event`
candidates. A low-rank search re-scores its pool from the events' stored representatives, so its time
includes those reads (from the warm tier or the segment files in the page cache).

Reported: search time per chunk (all layers) as a ratio to the flat store's, the bytes per event the
indexes hold (codes and ids, without spare capacity), and the index files on disk. Random vectors are
not low-rank: what the projection keeps of the ranking is measured on real searches by
`index_projection.py`, not here.

    python benchmarks/index_search.py [--events 8192] [--rebuild-at 2048] [--rank 24]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import RESULTS, write_results
from index_memory import content_bytes
from engramkv.config import EngineConfig, IndexConfig, StoreConfig
from engramkv.memory.events import Event
from engramkv.spec import ModelSpec
from engramkv.storage.store import EventStore

SPEC = ModelSpec(model_id="HuggingFaceTB/SmolLM2-135M-Instruct (shape only)", model_type="llama", num_layers=30,
                 num_heads=9, num_kv_heads=3, head_dim=64, rope={"rope_theta": 100000.0}, trained_length=8192,
                 dtype="float32")
SUMMARY_LAYERS = [1, 4, 7, 10, 13, 16, 19, 22, 25, 28]
EVENT_TOKENS = 16


def fill(path: Path, index_cfg: IndexConfig, events: int) -> tuple[EventStore, Any]:
    """(the store, its namespace) holding `events` random events, committed."""
    store = EventStore(path, SPEC, StoreConfig(codec="int8", index=index_cfg))
    memory = store.namespace("bench", summary_layers=SUMMARY_LAYERS)
    g = torch.Generator().manual_seed(0)
    heads, dim = SPEC.num_kv_heads, SPEC.head_dim
    for event_id in range(events):
        start = event_id * EVENT_TOKENS
        memory.add([Event(event_id, start, start + EVENT_TOKENS, surprise_mean=1.0, surprise_max=2.0)],
                   keys=torch.randn(SPEC.num_layers, heads, EVENT_TOKENS, dim, generator=g),
                   values=torch.randn(SPEC.num_layers, heads, EVENT_TOKENS, dim, generator=g),
                   representatives=torch.randn(1, SPEC.num_layers, heads * dim, generator=g),
                   key_summaries=torch.randn(1, len(SUMMARY_LAYERS) * heads * dim, generator=g),
                   token_ids=torch.zeros(EVENT_TOKENS, dtype=torch.long))
        if (event_id + 1) % 1000 == 0:
            memory.commit({"engine": {"n_tokens": start + EVENT_TOKENS}})
    memory.commit({"engine": {"n_tokens": events * EVENT_TOKENS}})
    return store, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=8192)
    parser.add_argument("--rebuild-at", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=24)
    parser.add_argument("--chunks", type=int, default=40, help="reading chunks searched per store (alternating)")
    parser.add_argument("--name", default="index_search")
    args = parser.parse_args()

    config = EngineConfig()
    k = config.recall.budget_tokens // config.segmentation.min_event
    kinds = {"flat": IndexConfig(), "ivf": IndexConfig(ivf_min_events=args.rebuild_at),
             "low-rank": IndexConfig(rank=args.rank, project_min_events=args.rebuild_at)}
    work = Path(tempfile.mkdtemp(prefix="engramkv-index-search-"))
    try:
        memories, stores = {}, []
        for name, cfg in kinds.items():
            started = time.perf_counter()
            store, memories[name] = fill(work / name, cfg, args.events)
            stores.append(store)
            print(f"{name}: {args.events} events in {time.perf_counter() - started:.0f} s, "
                  f"indexes {memories[name].indexes.kind}")
        queries = torch.randn(args.chunks, SPEC.num_layers, SPEC.num_kv_heads * SPEC.head_dim,
                              generator=torch.Generator().manual_seed(1))  # (chunks, L, F)
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for chunk in range(args.chunks):
            for name, memory in memories.items():
                started = time.perf_counter()
                for layer in range(SPEC.num_layers):
                    memory.search(layer, queries[chunk, layer], k)
                times[name].append(time.perf_counter() - started)
        rows = {}
        for name, memory in memories.items():
            indexes = memory.indexes
            layer_bytes = sum(content_bytes(index) for index in indexes.indexes) / args.events
            summary_bytes = content_bytes(indexes.summary) / args.events
            disk = sum(f.stat().st_size for f in (work / name).rglob("index/*") if f.is_file())
            rows[name] = {"kind": indexes.kind, "chunk_ms": 1000 * statistics.median(times[name]),
                          "layer_bytes_per_event": layer_bytes, "summary_bytes_per_event": summary_bytes,
                          "index_disk_bytes_per_event": disk / args.events}
        for store in stores:
            store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    flat_ms = rows["flat"]["chunk_ms"]
    lines = [
        "# Recall search time and index RAM: full-width against low-rank indexes (issue 18)", "",
        f"{args.events:,} events of {EVENT_TOKENS} tokens, the embedded model's shape, random vectors; "
        f"{SPEC.num_layers} layer searches of k = {k} per chunk, {args.chunks} chunks per store, alternating; "
        f"IVF and low-rank (rank {args.rank}, `{IndexConfig().ivf_codec}` codes) rebuilt at {args.rebuild_at:,} "
        "events. Time: median per chunk.", "",
        "| indexes | search per chunk, ms | vs flat | layer indexes, B/event | key summaries, B/event | "
        "index files on disk, B/event |", "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['chunk_ms']:.1f} | {row['chunk_ms'] / flat_ms:.2f} | "
                     f"{row['layer_bytes_per_event']:,.0f} | {row['summary_bytes_per_event']:,.0f} | "
                     f"{row['index_disk_bytes_per_event']:,.0f} |")
    payload = {"events": args.events, "event_tokens": EVENT_TOKENS, "rebuild_at": args.rebuild_at, "rank": args.rank,
               "k": k, "chunks": args.chunks, "results": rows,
               "index_configs": {name: cfg.model_dump() for name, cfg in kinds.items()}}
    _, md_path = write_results(RESULTS / "index_search", args.name, payload, "\n".join(lines), config)
    print(md_path.read_text())


if __name__ == "__main__":
    main()
