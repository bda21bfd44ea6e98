"""A store on disk per codec, on the embedded model: bytes per token by file kind, index size per event,
ingest speed and recall latency as ratios to the int8 store's in the same run.

The same token ids (the evaluation's haystack: Python's language reference) are ingested into one fresh
store per codec, in a temporary directory, with the default config (`store.codec` set; a lowrank store
takes the bases shipped for the model, or `--bases`). After the commit, every file of the store is
counted under one of: segments (event KV, token ids and representatives), index (the FAISS layer and
key-summary indexes: what a reader holds in RAM), checkpoint (the resident window), catalog, bases
(a lowrank store's copy of its bases) and other. fp16 KV, the reference, is layers x 2 x KV heads x
head dim x 2 bytes per token (23,040 on the embedded model). Recall latency: `Session.recall` of
--recalls queries (pieces of the same text) on the store opened read-only, p50.

Speed is a ratio per round: every round builds one store per codec, in turns whose order reverses each
round (int8 first, then last, ...), so drift on a shared machine falls on all codecs alike; the table gives
the median of the rounds' ratios and their range (a single pass moved by +-5% between runs). Sizes are the
first round's (the same ids give the same files).

    python benchmarks/store_size.py [--tokens 32768] [--codecs int8 lowrank] [--rounds 3] [--index-rank 24]
        [--project-min-events 256] [--name store_size]

Writes benchmarks/results/store_size/NAME.json and .md.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, write_results

KINDS = ("segments", "index", "checkpoint", "catalog", "bases", "other")


def file_kind(path: Path) -> str:
    """Which part of a store `path` (relative to the store directory) belongs to."""
    parts = path.parts
    if "segments" in parts:
        return "segments"
    if "index" in parts:
        return "index"
    if path.name.startswith("checkpoint"):
        return "checkpoint"
    if path.name.startswith("catalog"):
        return "catalog"
    if path.name == "LOWRANK_BASES":
        return "bases"
    return "other"


def bytes_by_kind(store: Path) -> dict[str, int]:
    sizes = dict.fromkeys(KINDS, 0)
    for path in store.rglob("*"):
        if path.is_file():
            sizes[file_kind(path.relative_to(store))] += path.stat().st_size
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32_768, help="tokens ingested into each store")
    parser.add_argument("--codecs", nargs="+", default=["int8", "lowrank"],
                        choices=["fp16", "int8", "int4", "int2", "lowrank"], help="codecs measured (int8 is added)")
    parser.add_argument("--bases", default=None, help="lowrank bases file (default: the ones shipped for the model)")
    parser.add_argument("--recalls", type=int, default=20, help="recall queries timed per store")
    parser.add_argument("--rounds", type=int, default=3, help="stores built per codec, in alternating turns")
    parser.add_argument("--index-rank", type=int, default=None,
                        help="store.index.rank of every store (low-rank index entries; default: off)")
    parser.add_argument("--project-min-events", type=int, default=None,
                        help="store.index.project_min_events (default: the config's, 2,048)")
    parser.add_argument("--name", default="store_size")
    args = parser.parse_args()
    codecs = ["int8", *(c for c in args.codecs if c != "int8")]

    from engramkv import EngineConfig, EpisodicLM
    from engramkv.tasks import haystack

    lm = EpisodicLM.from_pretrained()
    spec = lm.spec
    rng = random.Random(0)
    ids = lm.tokenizer.encode("\n\n".join(haystack(lm.tokenizer, args.tokens + 2_000, rng)),
                              add_special_tokens=False)[: args.tokens]
    queries = [lm.tokenizer.decode(ids[at : at + 24]) for at in
               random.Random(1).sample(range(0, len(ids) - 24), args.recalls)]
    fp16 = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2

    def config(codec: str) -> EngineConfig:
        lowrank = {"bases": args.bases} if codec == "lowrank" and args.bases else {}
        index: dict[str, Any] = {"rank": args.index_rank}
        if args.project_min_events is not None:
            index["project_min_events"] = args.project_min_events
        return EngineConfig.model_validate({"store": {"codec": codec, "lowrank": lowrank, "index": index}})

    def build(codec: str, measure_size: bool) -> dict[str, Any]:
        """One fresh store of `codec`: ingest and recall times, and (if `measure_size`) its files."""
        cfg = config(codec)
        directory = Path(tempfile.mkdtemp(prefix=f"engramkv-size-{codec}-"))
        try:
            session = lm.session(cfg, store=directory)
            started = time.perf_counter()
            session.ingest_ids(ids)
            session.commit()
            out: dict[str, Any] = {"ingest_s": time.perf_counter() - started, "events": session.events}
            session.close()
            lm.close()
            if measure_size:
                out["sizes"] = bytes_by_kind(directory)
            reader = lm.session(cfg, store=directory, read_only=True)
            # what the segments hold besides KV: token ids and representatives
            out["representative_bytes"] = out["events"] * reader.memory.layout.num_layers * \
                reader.memory.layout.representative_bytes
            reader.recall(queries[0])  # the first pays for opening the indexes
            times = []
            for query in queries:
                started = time.perf_counter()
                reader.recall(query)
                times.append(time.perf_counter() - started)
            out["recall_p50_s"] = statistics.median(times)
            reader.close()
            lm.close()
            return out
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    runs: dict[str, list[dict[str, Any]]] = {codec: [] for codec in codecs}
    for round_ in range(args.rounds):
        for codec in (codecs if round_ % 2 == 0 else codecs[::-1]):
            runs[codec].append(build(codec, measure_size=round_ == 0))
            print(f"round {round_ + 1}/{args.rounds} {codec}: ingest {runs[codec][-1]['ingest_s']:.1f} s, "
                  f"recall p50 {runs[codec][-1]['recall_p50_s'] * 1e3:.0f} ms", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    configs = {codec: config(codec).model_dump() for codec in codecs}
    for codec in codecs:
        first = runs[codec][0]
        sizes, events = first["sizes"], first["events"]
        total = sum(sizes.values())
        parts = {"token_ids": 4 * len(ids), "representatives": first["representative_bytes"]}
        parts["kv_and_record_overhead"] = sizes["segments"] - sum(parts.values())
        # per round: int8's time over this codec's (speed) and this codec's recall over int8's
        ingest_ratios = [a["ingest_s"] / b["ingest_s"] for a, b in zip(runs["int8"], runs[codec])]
        recall_ratios = [b["recall_p50_s"] / a["recall_p50_s"] for a, b in zip(runs["int8"], runs[codec])]
        rows[codec] = {"events": events, "segment_parts_per_token": {k: v / len(ids) for k, v in parts.items()},
                       "ingest_s": [r["ingest_s"] for r in runs[codec]],
                       "recall_p50_s": [r["recall_p50_s"] for r in runs[codec]],
                       "ingest_speed_vs_int8": ingest_ratios, "recall_p50_vs_int8": recall_ratios,
                       "bytes": sizes, "bytes_per_token": {k: v / len(ids) for k, v in sizes.items()},
                       "total_bytes_per_token": total / len(ids), "of_fp16_kv": total / len(ids) / fp16,
                       "index_bytes_per_event": sizes["index"] / max(events, 1)}

    def spread(ratios: list[float]) -> str:
        return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"

    lines = [f"# Stores on disk per codec ({spec.model_id}, {len(ids):,} tokens)", "",
             f"fp16 KV is {fp16:,} B per token. Bytes per token by file kind after the commit; ingest speed and "
             f"recall p50 as ratios to the int8 store's, same round: the median of {args.rounds} rounds "
             "[lowest, highest].", "",
             "Segments hold each event's KV, token ids (4 B/token) and representatives (one per layer); `reps` "
             "is the last per token.", "",
             "| codec | events | " + " | ".join(KINDS) + " | reps | total B/token | of fp16 KV | index B/event | "
             "ingest speed / int8 | recall p50 / int8 |",
             "|---|---|" + "---|" * len(KINDS) + "---|---|---|---|---|---|"]
    for codec, row in rows.items():
        per = row["bytes_per_token"]
        lines.append(f"| {codec} | {row['events']:,} | " + " | ".join(f"{per[k]:,.0f}" for k in KINDS) +
                     f" | {row['segment_parts_per_token']['representatives']:,.0f} | {row['total_bytes_per_token']:,.0f} | {row['of_fp16_kv']:.3f} | "
                     f"{row['index_bytes_per_event']:,.0f} | {spread(row['ingest_speed_vs_int8'])} | "
                     f"{spread(row['recall_p50_vs_int8'])} |")
    table = "\n".join(lines)
    write_results(RESULTS / "store_size", args.name, {"args": vars(args), "tokens": len(ids), "fp16_kv_bytes": fp16,
                                                      "codecs": rows}, table, configs)
    print(table)


if __name__ == "__main__":
    main()
