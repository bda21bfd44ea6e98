"""What one existing store costs: disk bytes per token by file kind, index RAM per event, RSS of a reader.

For a store built by hand with the CLI (the 1M-token run of issue 18: `engramkv ingest` of a passkey
document), measured where it lies, read-only. The file kinds are `store_size.py`'s (segments, index,
checkpoint, catalog, bases, other); fp16 KV, the reference, is layers x 2 x KV heads x head dim x 2 bytes
per token. Index RAM: the entries of the per-layer and key-summary FAISS indexes a reader holds (codes
and ids, counted as `index_memory.py` counts them). RSS: the process before and after opening the store
(the model loaded in both), and after `--recalls` recalls of pieces of the stored text, with their p50.
`--ingest-log` adds the ingest's own figures (`/usr/bin/time -v` output: wall time, peak RSS).

    python benchmarks/store_report.py STORE [--recalls 20] [--ingest-log LOG] [--name store_1m]

Writes benchmarks/results/store_size/NAME.json and .md.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, write_results
from index_memory import content_bytes
from store_size import KINDS, bytes_by_kind


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def ingest_figures(log: Path) -> dict[str, Any]:
    """Wall time and peak RSS from `/usr/bin/time -v`, tokens and rate from the CLI's last line."""
    text = log.read_text(errors="replace")
    out: dict[str, Any] = {}
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    done = re.search(r": ([\d,]+) tokens in (\d+) s \(([\d,]+) tok/s\)", text)
    if peak:
        out["peak_rss_bytes"] = int(peak.group(1)) * 1024
    if wall:
        seconds = 0.0
        for part in wall.group(1).split(":"):
            seconds = seconds * 60 + float(part)
        out["wall_s"] = seconds
    if done:
        out["tokens"], out["seconds"], out["tokens_per_s"] = (int(done.group(i).replace(",", "")) for i in (1, 2, 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--recalls", type=int, default=20, help="recalls timed on the store (pieces of its text)")
    parser.add_argument("--ingest-log", type=Path, default=None, help="the ingest's `/usr/bin/time -v` output")
    parser.add_argument("--name", default="store_report")
    args = parser.parse_args()

    from engramkv import EpisodicLM

    lm = EpisodicLM.from_pretrained()
    spec = lm.spec
    fp16 = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
    sizes = bytes_by_kind(args.store)
    rss_model = rss_bytes()
    started = time.perf_counter()
    session = lm.session(store=args.store, read_only=True)
    open_s = time.perf_counter() - started
    rss_open = rss_bytes()
    stats = session.stats()
    tokens, events = stats.tokens, stats.events
    indexes = session.memory.indexes
    layer_ram = sum(content_bytes(index) for index in indexes.indexes)
    summary_ram = content_bytes(indexes.summary)
    rng = random.Random(1)
    queries = []
    for event_id in rng.sample(range(events), min(args.recalls, events)):
        queries.append(lm.tokenizer.decode(session.memory.tokens(event_id)))
    times = []
    for query in queries:
        started = time.perf_counter()
        session.recall(query)
        times.append(time.perf_counter() - started)
    rss_recalled = rss_bytes()
    session.close()
    lm.close()

    total = sum(sizes.values())
    row = {"tokens": tokens, "events": events, "codec": stats.codec, "index_kind": indexes.kind,
           "bytes": sizes, "bytes_per_token": {k: v / tokens for k, v in sizes.items()},
           "total_bytes": total, "total_bytes_per_token": total / tokens, "of_fp16_kv": total / tokens / fp16,
           "index_ram_bytes_per_event": {"layers": layer_ram / events, "summaries": summary_ram / events,
                                         "total": (layer_ram + summary_ram) / events},
           "rss_bytes": {"model_loaded": rss_model, "store_open": rss_open, "after_recalls": rss_recalled},
           "open_s": open_s, "recall_p50_s": statistics.median(times) if times else None,
           "ingest": ingest_figures(args.ingest_log) if args.ingest_log else None}
    per = row["bytes_per_token"]
    ram = row["index_ram_bytes_per_event"]
    lines = [f"# A store on disk: {args.store.name} ({spec.model_id}, {tokens:,} tokens, {events:,} events, "
             f"codec {stats.codec.split(':')[0]}, {indexes.kind} indexes)", "",
             f"fp16 KV is {fp16:,} B per token.", "",
             "| " + " | ".join(KINDS) + " | total B/token | of fp16 KV | total bytes |",
             "|" + "---|" * (len(KINDS) + 3),
             "| " + " | ".join(f"{per[k]:,.0f}" for k in KINDS) +
             f" | {row['total_bytes_per_token']:,.0f} | {row['of_fp16_kv']:.3f} | {total:,} |", "",
             f"Index RAM per event (entries): layers {ram['layers']:,.0f} B, key summaries {ram['summaries']:,.0f} B, "
             f"total **{ram['total']:,.0f} B**.", "",
             f"Reader RSS: {rss_model / 2**20:,.0f} MiB with the model loaded, {rss_open / 2**20:,.0f} MiB with the "
             f"store open ({open_s:.1f} s), {rss_recalled / 2**20:,.0f} MiB after {len(times)} recalls "
             f"(p50 {row['recall_p50_s'] or 0:.2f} s)."]
    if row["ingest"]:
        ing = row["ingest"]
        lines += ["", f"Ingest (`--ingest-log`): {ing.get('tokens', 0):,} tokens in {ing.get('seconds', 0):,} s "
                  f"({ing.get('tokens_per_s', 0):,} tok/s), peak RSS {ing.get('peak_rss_bytes', 0) / 2**20:,.0f} MiB."]
    table = "\n".join(lines)
    write_results(RESULTS / "store_size", args.name, {"args": {k: str(v) for k, v in vars(args).items()}, **row},
                  table, lm.config)
    print(table)


if __name__ == "__main__":
    main()
