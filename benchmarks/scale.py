"""Scale: ingest millions of tokens through engine, segmentation, store and index; report how cost grows.

The default model reads ~240 tokens/s on these CPUs (10M tokens would take about 12 hours), so
this runs the whole pipeline on a small random Llama (documented in the results: 4 layers,
hidden 128, 4 heads, 2 KV heads, head_dim 32, vocab 4096) with the default window, recall and
store settings (int8 cold tier unless --codec) and the default segmentation except min_event 32
(a random model's surprise is noise: its events would all sit at the 8-token floor). The stream is token ids drawn from a
Zipf-like distribution with a seed, fed through `Session.ingest_ids`.

At each checkpoint (default 100k, 1M, 10M tokens) it reports ingest tokens/s over the last
interval, peak RSS, disk bytes per token (and as a fraction of the fp16 KV it stands for), and the
latency of one recall (index search + fetch of the chosen events' KV for every layer, caches
emptied first so the disk tier is read), p50 and p99 over --recalls queries, with the p99 of the
search and the fetch parts apart, and what the slowest 1% of recalls waited on: major page faults
(reads the page cache could not serve) and Python's garbage collector. Then --cold-recalls recalls
from a store evicted from the page cache (as after a reboot, or a store larger than RAM), with the
cold tier's read-ahead (`store.read_ahead`) on and off in turns on the same queries.

Writes benchmarks/results/scale/{name}.json and .md (rewritten at every checkpoint).

    python benchmarks/scale.py --tokens 10000000
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from _common import RESULTS, peak_rss_mb, rss_split_mb, write_results
from engramkv import EngineConfig, EpisodicLM
from engramkv.config import SegmentationConfig, StoreConfig
from engramkv.retrieval.recall import select_events

VOCAB = 4096


class IdTokenizer:
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=8192)
    return LlamaForCausalLM(cfg).eval()


def token_stream(total: int, seed: int, piece: int = 65536):
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, VOCAB + 1)
    probs = (1 / ranks) / (1 / ranks).sum()
    for start in range(0, total, piece):
        yield rng.choice(VOCAB, size=min(piece, total - start), p=probs).tolist()


def recall_latency(session: Any, n: int, seed: int) -> dict[str, float]:
    """p50/p99 ms of whole recalls, and p99 of their two parts: index search and KV fetch from disk."""
    memory, cfg = session.memory, session.cfg
    rng = np.random.default_rng(seed)
    total, search, fetch, faults, collecting = [], [], [], [], []
    gc_seconds = [0.0, 0.0]  # [pause so far, start of the running collection]

    def gc_clock(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_seconds[1] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - gc_seconds[1]

    gc.callbacks.append(gc_clock)
    for _ in range(n):
        target = int(rng.integers(len(memory)))
        queries = [torch.from_numpy(q) for q in memory.representatives(target)]  # a stored event's own keys
        memory.drop_caches()  # hot and warm tiers emptied: the recall reads the cold tier
        t_search = t_fetch = 0.0
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        gc_before = gc_seconds[0]
        for layer, query in enumerate(queries):  # one representative per layer
            t0 = time.perf_counter()
            ids = select_events(memory, layer, query, cfg.recall, cfg.segmentation.min_event)
            t1 = time.perf_counter()
            memory.gather(layer, ids)
            t_search, t_fetch = t_search + t1 - t0, t_fetch + time.perf_counter() - t1
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults_before)
        collecting.append(gc_seconds[0] - gc_before)
        total.append(t_search + t_fetch)
        search.append(t_search)
        fetch.append(t_fetch)

    gc.callbacks.remove(gc_clock)
    slowest = [i for i, t in enumerate(total) if t >= np.percentile(total, 99)]

    return {"recall_ms_p50": _ms(total, 50), "recall_ms_p99": _ms(total, 99),
            "search_ms_p99": _ms(search, 99), "fetch_ms_p99": _ms(fetch, 99),
            # what the slowest 1% of recalls waited on: the disk (major faults) or Python's garbage collector
            "major_faults_mean": round(float(np.mean(faults)), 2),
            "major_faults_slowest": round(float(np.mean([faults[i] for i in slowest])), 2),
            "gc_ms_slowest": round(float(np.mean([collecting[i] for i in slowest])) * 1000, 2)}


def _ms(values: list[float], q: int) -> float:
    """The q-th percentile of `values` (seconds) in milliseconds."""
    return round(float(np.percentile(values, q)) * 1000, 2)


def evict_from_page_cache(directory: Path) -> None:
    """Drop the store's segment files from the kernel's page cache (clean pages: a commit has synced them)."""
    for path in directory.rglob("*.seg"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_recall_latency(session: Any, n: int, seed: int, store: Path) -> dict[str, float]:
    """p50/p99 ms of recalls from a store out of the page cache (after a reboot, or larger than RAM),
    with the cold tier's read-ahead on and off in turns on the same queries."""
    memory, cfg = session.memory, session.cfg
    rng = np.random.default_rng(seed)
    total: dict[bool, list[float]] = {True: [], False: []}
    for pair in range(n):
        target = int(rng.integers(len(memory)))
        queries = [torch.from_numpy(q) for q in memory.representatives(target)]
        for read_ahead in ((True, False) if pair % 2 == 0 else (False, True)):
            memory.drop_caches()
            evict_from_page_cache(store)
            memory.read_ahead = read_ahead
            t0 = time.perf_counter()
            for layer, query in enumerate(queries):
                memory.gather(layer, select_events(memory, layer, query, cfg.recall, cfg.segmentation.min_event))
            total[read_ahead].append(time.perf_counter() - t0)
    memory.read_ahead = cfg.store.read_ahead

    return {"cold_ms_p50": _ms(total[True], 50), "cold_ms_p99": _ms(total[True], 99),
            "cold_no_read_ahead_ms_p50": _ms(total[False], 50), "cold_no_read_ahead_ms_p99": _ms(total[False], 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument("--codec", default="int8", choices=["fp16", "int8", "int4", "int2"])
    parser.add_argument("--recalls", type=int, default=200)
    parser.add_argument("--cold-recalls", type=int, default=50,
                        help="recalls from a store evicted from the page cache, each with read-ahead on and off")
    parser.add_argument("--hot-mib", type=int, default=None, help="store.hot_bytes in MiB (default: the config's)")
    parser.add_argument("--warm-mib", type=int, default=None, help="store.warm_bytes in MiB (default: the config's)")
    parser.add_argument("--min-event", type=int, default=32)
    parser.add_argument("--store", type=Path, default=None, help="store directory (default: a temporary one)")
    parser.add_argument("--keep-free-heap", action="store_true",
                        help="store.release_free_memory=False: leave freed C heap in the process (for comparison)")
    parser.add_argument("--name", default="scale")
    args = parser.parse_args()

    # A random model's surprise is noise, so its events would sit at the 8-token floor; real text on a
    # trained model gives events of tens of tokens. min_event=32 keeps the event count per token realistic.
    defaults = StoreConfig()
    store_config = StoreConfig(
        codec=args.codec,
        hot_bytes=defaults.hot_bytes if args.hot_mib is None else args.hot_mib * 2**20,
        warm_bytes=defaults.warm_bytes if args.warm_mib is None else args.warm_mib * 2**20,
        release_free_memory=not args.keep_free_heap,
    )
    config = EngineConfig(store=store_config, segmentation=SegmentationConfig(min_event=args.min_event))
    lm = EpisodicLM(small_model(), IdTokenizer(), "scale-llama-4x128", config)
    store = args.store or Path(tempfile.mkdtemp(prefix="engramkv-scale-"))
    session = lm.session(store=store)
    spec = lm.spec
    fp16_bytes_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
    rows: list[dict[str, Any]] = []
    checkpoints = sorted(c for c in args.checkpoints if c <= args.tokens)
    done, last_t, last_n = 0, time.perf_counter(), 0
    started = last_t
    anon_max = 0.0  # sampled after every piece, as a check that peak RSS is the process's own memory
    cache_max = 0.0  # hot + warm tier bytes, sampled likewise: they fill up to their caps as the store grows
    memory = session.memory
    # Ctrl-C or a kill (SIGTERM) still removes a temporary store of up to a few GB.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        for ids in token_stream(args.tokens, seed=0):
            session.ingest_ids(ids)
            done += len(ids)
            anon_max = max(anon_max, rss_split_mb()[0])
            tiers = memory.tier_bytes()
            cache_max = max(cache_max, (tiers.hot + tiers.warm) / 2**20)
            if checkpoints and done >= checkpoints[0]:
                checkpoints.pop(0)
                session.commit()
                now = time.perf_counter()
                latency = recall_latency(session, args.recalls, seed=done)
                if args.cold_recalls:
                    latency |= cold_recall_latency(session, args.cold_recalls, done, store)
                disk = _dir_bytes(store)  # the whole store: catalog, segments, indexes, checkpoint
                anon, file_backed = rss_split_mb()
                anon_max = max(anon_max, anon)
                row = {
                    "tokens": done, "events": session.events, "tokens_per_s": round((done - last_n) / (now - last_t), 1),
                    "peak_rss_mb": round(peak_rss_mb(), 1), "anon_rss_max_mb": round(anon_max, 1),
                    "file_rss_mb": round(file_backed, 1), "cache_max_mb": round(cache_max, 1),
                    "disk_bytes_per_token": round(disk / done, 1),
                    "disk_vs_fp16_kv": round(disk / done / fp16_bytes_per_token, 3),
                    **latency,
                    "index": session.memory.indexes.kind, "elapsed_s": round(now - started, 1),
                }
                rows.append(row)
                print(row, flush=True)
                report(rows, args, spec, config, fp16_bytes_per_token, started)
                last_t, last_n = time.perf_counter(), done
        session.close()
        lm.close()
    finally:
        if args.store is None:
            for stop in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C or kill must not cut the removal short
                signal.signal(stop, signal.SIG_IGN)
            shutil.rmtree(store, ignore_errors=True)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def report(rows: list[dict[str, Any]], args: argparse.Namespace, spec: Any, config: EngineConfig, fp16: int,
           started: float) -> None:
    lines = [
        f"# Scale ({spec.model_id}: {spec.num_layers} layers, {spec.num_kv_heads} KV heads x {spec.head_dim}; "
        f"codec {args.codec}; fp16 KV = {fp16} B/token; caches hot {args.hot_mib or 'default'} MiB, "
        f"warm {args.warm_mib or 'default'} MiB; free heap {'kept' if args.keep_free_heap else 'released'} at commits)",
        "",
        "| tokens | events | tokens/s | peak RSS MB | anonymous RSS max MB | of which hot + warm caches max MB |"
        " file-backed RSS MB | disk B/token | disk / fp16 KV | recall p50 ms | recall p99 ms | search / fetch p99 ms |"
        " major faults per recall: mean / slowest 1% | GC ms in the slowest 1% |"
        " cold store, recall p50 / p99 ms: read-ahead | without | index |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['tokens']:,} | {r['events']:,} | {r['tokens_per_s']} | {r['peak_rss_mb']} | "
                     f"{r.get('anon_rss_max_mb', 'n/a')} | {r.get('cache_max_mb', 'n/a')} | {r.get('file_rss_mb', 'n/a')} | "
                     f"{r['disk_bytes_per_token']} | {r['disk_vs_fp16_kv']} | {r['recall_ms_p50']} | "
                     f"{r['recall_ms_p99']} | {r.get('search_ms_p99', 'n/a')} / {r.get('fetch_ms_p99', 'n/a')} | "
                     f"{r.get('major_faults_mean', 'n/a')} / {r.get('major_faults_slowest', 'n/a')} | "
                     f"{r.get('gc_ms_slowest', 'n/a')} | {r.get('cold_ms_p50', 'n/a')} / {r.get('cold_ms_p99', 'n/a')} | "
                     f"{r.get('cold_no_read_ahead_ms_p50', 'n/a')} / {r.get('cold_no_read_ahead_ms_p99', 'n/a')} | "
                     f"{r['index']} |")
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        # The targets: RSS against the row nearest a tenth of the length (1M for 10M), latency against the first.
        tenth = min(rows[:-1], key=lambda r: abs(math.log(r["tokens"] * 10 / last["tokens"])))
        anon = (f"; anonymous RSS max {last['anon_rss_max_mb'] / tenth['anon_rss_max_mb']:.2f}x"
                if "anon_rss_max_mb" in last else "")
        lines += ["", f"Peak RSS {last['tokens']:,} / {tenth['tokens']:,} tokens: "
                      f"{last['peak_rss_mb'] / tenth['peak_rss_mb']:.2f}x{anon}; recall p50 / p99 {last['tokens']:,} / "
                      f"{first['tokens']:,}: {last['recall_ms_p50'] / first['recall_ms_p50']:.2f}x / "
                      f"{last['recall_ms_p99'] / first['recall_ms_p99']:.2f}x."]
    lines += ["", f"Run time {time.perf_counter() - started:.0f} s.", ""]
    write_results(RESULTS / "scale", args.name, {"rows": rows, "args": {k: str(v) for k, v in vars(args).items()},
                                                 "model": spec.model_dump()}, "\n".join(lines), config)


if __name__ == "__main__":
    main()
