"""RAM of the FAISS indexes as events are added, with and without handing the freed heap back.

The indexes are the part of a store's RAM that grows with the stream: one entry per event in every
layer index and in the key-summary index, flat until `store.index.ivf_min_events`, then IVF. Each entry
added to an IVF inverted list may regrow that list (a reallocation that frees the old one); glibc keeps
the freed memory inside the process. A store commit calls `malloc_trim` (`store.release_free_memory`);
this measures what that does to the indexes alone, without the model, engine or caches around them.

Two child processes add the same random representatives one event at a time (as an ingest does) to a
`LayerIndexes` of the given sizes (default: the scale benchmark's model, 4 layers x 64 dims, a 256-dim
summary), one releasing the free heap every --every events (the scale model commits about every 600),
one never. Reported at each checkpoint: resident MB over the child's start, its peak (VmHWM), and the
indexes' content (the bytes of their codes and ids, without the lists' spare capacity).

Writes benchmarks/results/index_memory/{name}.json and .md (the config recorded: the default
`store.index`, the only settings the indexes read).

    python benchmarks/index_memory.py [--events 268000] [--every 600]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from _common import RESULTS, write_results


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024


def content_bytes(index: Any) -> int:
    """Bytes of an index's entries (codes and ids), without spare capacity.

    Counted, not serialized: serializing grows a buffer to the index's size, and glibc then serves
    blocks up to 32 MB from the heap (its mmap threshold follows the largest block freed), which would
    change what is measured.
    """
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    if isinstance(faiss.downcast_index(index), faiss.IndexScalarQuantizer):  # low-rank codes: no ids
        return int(index.ntotal) * int(faiss.downcast_index(index).code_size)
    if ivf is None:  # IndexIDMap over IndexFlatIP: float32 vectors and an int64 id each
        return int(index.ntotal) * (int(index.d) * 4 + 8)
    lists = ivf.invlists
    return sum(lists.list_size(i) for i in range(lists.nlist)) * (int(lists.code_size) + 8)


def child(events: int, layers: int, dim: int, every: int, checkpoints: list[int]) -> None:
    import numpy as np

    from engramkv.config import IndexConfig
    from engramkv.storage.heap import release_free_heap
    from engramkv.storage.index import LayerIndexes

    indexes = LayerIndexes(layers, dim, IndexConfig(), list(range(layers)))
    rng = np.random.default_rng(0)
    start = _status_mb("VmRSS")
    released_s, rows = 0.0, []
    for event_id in range(events):
        representatives = rng.standard_normal((layers, dim), dtype=np.float32)  # (layers, dim)
        summary = rng.standard_normal(layers * dim, dtype=np.float32)  # (layers * dim,)
        indexes.add(event_id, representatives, summary)
        if every and (event_id + 1) % every == 0:
            started = time.perf_counter()
            release_free_heap()
            released_s += time.perf_counter() - started
        if event_id + 1 in checkpoints:
            content = sum(content_bytes(index) for index in [*indexes.indexes, indexes.summary])
            rows.append({"events": event_id + 1, "index": indexes.kind,
                         "rss_mb": round(_status_mb("VmRSS") - start, 1),
                         "peak_mb": round(_status_mb("VmHWM") - start, 1),
                         "content_mb": round(content / 2**20, 1), "release_s": round(released_s, 2)})
    print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=268_000, help="events added (default: the scale run's 10M)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="dims of a layer representative")
    parser.add_argument("--every", type=int, default=600, help="events between two releases of the free heap")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[28_000, 49_000, 80_000, 150_000, 268_000])
    parser.add_argument("--name", default="index_memory")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    checkpoints = sorted(c for c in args.checkpoints if c <= args.events)
    if args.child:
        child(args.events, args.layers, args.dim, args.every, checkpoints)
        return

    started = time.perf_counter()
    measured = {}
    for label, every in (("released", args.every), ("kept", 0)):
        command = [sys.executable, __file__, "--child", "--events", str(args.events), "--layers", str(args.layers),
                   "--dim", str(args.dim), "--every", str(every), "--checkpoints", *map(str, checkpoints)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        measured[label] = json.loads(out.strip().splitlines()[-1])
    lines = [
        f"# FAISS index RAM while adding events ({args.layers} layer indexes x {args.dim} dims + a "
        f"{args.layers * args.dim}-dim summary index; free heap released every {args.every} events or never)",
        "",
        "| events | index | content MB | resident MB: released / kept | peak MB: released / kept | release s |",
        "|---|---|---|---|---|---|",
    ]
    for released, kept in zip(measured["released"], measured["kept"], strict=True):
        lines.append(f"| {released['events']:,} | {released['index']} | {released['content_mb']} | "
                     f"{released['rss_mb']} / {kept['rss_mb']} | {released['peak_mb']} / {kept['peak_mb']} | "
                     f"{released['release_s']} |")
    last_released, last_kept = measured["released"][-1], measured["kept"][-1]
    lines += ["", f"At {last_released['events']:,} events: resident {last_released['rss_mb'] / last_kept['rss_mb']:.2f}x "
              f"and peak {last_released['peak_mb'] / last_kept['peak_mb']:.2f}x of the run that keeps the free heap; "
              f"resident {last_released['rss_mb'] / last_released['content_mb']:.2f}x of the indexes' content "
              f"(kept: {last_kept['rss_mb'] / last_kept['content_mb']:.2f}x).",
              "", f"Run time {time.perf_counter() - started:.0f} s.", ""]
    table = "\n".join(lines)
    from engramkv.config import IndexConfig

    write_results(RESULTS / "index_memory", args.name, {"args": vars(args), "runs": measured}, table,
                  {"index": IndexConfig()})
    print(table)


if __name__ == "__main__":
    main()
