"""Sharded ingest against a sequential one (issue 20): same answers, event counts, throughput, same run.

For each task and seed, the sample's document (the evaluation's generator, `engramkv.tasks`) is written to a
file and ingested twice into fresh stores with the default config (but --segmentation) on the embedded model:

    sequential  `Session.ingest_file(path)` in this process with --threads torch threads (2 on these machines)
    sharded     `Session.ingest_file(path, workers=N)`: N Ray workers of --threads / N threads each (a local
                Ray started for the ingest and stopped after it: its start and the workers' model loads count)

then each store answers the sample's question twice, with the benchmark's prompt and through `Session.chat`
(what `engramkv ask` does), as `evaluate.py` asks it. The table gives, per sample, both replies and scores, the
event counts, and the sharded run's throughput as a ratio to the sequential one's (tokens/s of the whole
`ingest_file` call, the same tokens).

    python benchmarks/sharded_ingest.py [--tasks passkey niah-single] [--length 32768] [--seeds 0 1]
        [--workers 2] [--threads 2] [--name sharded_ingest] [--resume] [--no-write-through]

Each store's events are also counted per 2,048 tokens of the stream, where its span starts: where two reads of
the same document part ways. --no-write-through adds a third ingest, sequential with `store.hot_write_through`
off (every read of memory through the codec): how far the count moves when only the codec's rounding differs.

Writes benchmarks/results/sharded/NAME.json and .md; --resume keeps the samples already in NAME.json (with nothing
left to run, it writes the report again).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, code_state, command_line, write_results
from evalkit.systems import RssSampler, _engram_answer

from engramkv import EngineConfig, EpisodicLM, sharding
from engramkv.memory.summary import summary_layer_ids
from engramkv.storage.store import EventStore
from engramkv.tasks import TASKS

OUT = RESULTS / "sharded"


PHASES: dict[str, float] = {}  # seconds of the sharded ingest's phases, the last run's


def _timed(name: str, fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[name] = time.perf_counter() - started
    return run


# The session calls these through the module: timing them here splits a sharded ingest into its workers' reading
# (Ray's start and the model loads included) and the merge.
sharding.run_shards = _timed("read", sharding.run_shards)
sharding.merge_shards = _timed("merge", sharding.merge_shards)


def event_density(lm: EpisodicLM, store: Path, bucket: int = 2048) -> list[int]:
    """Events of the store's default namespace by the bucket of tokens their span starts in."""
    layers = summary_layer_ids(lm.spec.num_layers, lm.config.recall.summary_layers)
    with EventStore(store, lm.spec, lm.config.store, read_only=True) as opened:
        memory = opened.namespace(summary_layers=layers)
        starts = [memory.event(i).start for i in range(len(memory))]
        memory.close()
    counts = [0] * (max(starts, default=0) // bucket + 1)
    for start in starts:
        counts[start // bucket] += 1
    return counts


def one_sample(lm: EpisodicLM, task: str, length: int, seed: int, workers: int, threads: int,
               workdir: Path, no_write_through: bool) -> dict[str, Any]:
    sample = TASKS[task](lm.tokenizer, length, seed)
    doc = workdir / f"{task}-{seed}.txt"
    doc.write_text("".join(sample.context))
    # The commit and command per sample: a --resume'd file holds runs of several.
    row: dict[str, Any] = {"task": task, "length": length, "seed": seed, "answers": sample.answers,
                           **code_state(), "command": command_line()}
    kinds = [("sequential", 1), ("sharded", workers)] + [("sequential_no_write_through", 1)] * no_write_through
    for kind, n_workers in kinds:
        store = workdir / f"{kind}-{task}-{seed}"
        torch.set_num_threads(threads)
        config = lm.config.model_copy(update={"store": lm.config.store.model_copy(
            update={"hot_write_through": kind != "sequential_no_write_through"})})
        started = time.perf_counter()
        with lm.session(store=store, config=config) as session:
            report = session.ingest_file(doc, workers=n_workers)
        seconds = time.perf_counter() - started
        row[kind] = {"tokens": report.tokens, "events": report.events_sealed, "seconds": round(seconds, 1),
                     "tokens_per_s": round(report.tokens / seconds, 1), "events_per_2k_tokens": event_density(lm, store)}
        if kind == "sharded":
            if "read" not in PHASES:
                raise SystemExit(f"{task} {seed}: the document was not cut into shards (too short for --workers)")
            row[kind].update({f"{phase}_s": round(PHASES.pop(phase, 0.0), 1) for phase in ("read", "merge")})
        for path, chat in (("prompt", False), ("chat", True)):
            with RssSampler() as rss:
                run = _engram_answer(lm, sample,  # it reads lm.tokenizer alone
                                      lm.session(store=store, config=config), seconds, rss, chat_path=chat)
            row[kind][path] = {"reply": run.reply, "score": sample.score(run.reply)}
        lm.close()  # the store's lock: the next kind's store is another directory, but keep one open at a time
        shutil.rmtree(store, ignore_errors=True)
        print(f"{task} {seed} {kind}: {row[kind]}", flush=True)
    seq, shard = row["sequential"], row["sharded"]
    row["events_ratio"] = round(shard["events"] / seq["events"], 4)
    row["throughput_ratio"] = round(shard["tokens_per_s"] / seq["tokens_per_s"], 3)
    row["same_replies"] = _same(row, "sharded")
    return row


def _same(row: dict[str, Any], kind: str) -> bool:
    """Whether the `kind` store's replies are the sequential store's, on both prompt paths."""
    return all(row["sequential"][p]["reply"] == row[kind][p]["reply"] for p in ("prompt", "chat"))


def table(rows: list[dict[str, Any]], workers: int, threads: int) -> str:
    lines = ["# Sharded ingest against sequential (embedded model, default config but --segmentation)", "",
             f"Sequential: one process of {threads} threads. Sharded: {workers} Ray workers of "
             f"{max(1, threads // workers)} thread(s), the local Ray's start and the workers' model loads included. "
             "Throughput: tokens/s of the whole `ingest_file` call, sharded / sequential, the same run; the sharded "
             "call's seconds split into the workers' reading (Ray's start and the model loads included) and the merge.",
             "", "| task | length | seed | events seq / sharded (ratio) | tok/s seq / sharded (ratio) | read s / merge s "
             "| prompt reply seq / sharded | chat reply seq / sharded | same replies | commit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, h = r["sequential"], r["sharded"]
        lines.append(
            f"| {r['task']} | {r['length']:,} | {r['seed']} | {s['events']:,} / {h['events']:,} ({r['events_ratio']:.3f}) "
            f"| {s['tokens_per_s']:.0f} / {h['tokens_per_s']:.0f} ({r['throughput_ratio']:.2f}x) "
            f"| {h.get('read_s', 0):.0f} / {h.get('merge_s', 0):.1f} "
            f"| {s['prompt']['reply'][:24]!r} {s['prompt']['score']:.0f} / {h['prompt']['reply'][:24]!r} "
            f"{h['prompt']['score']:.0f} | {s['chat']['reply'][:24]!r} {s['chat']['score']:.0f} / "
            f"{h['chat']['reply'][:24]!r} {h['chat']['score']:.0f} | {'yes' if r['same_replies'] else 'no'} "
            f"| {(r.get('commit') or '?')[:7]}{'+' if r.get('dirty') else ''} |")
    if rows:
        ratios = sorted(r["throughput_ratio"] for r in rows)
        lines += ["", f"{len(rows)} samples; throughput ratio median {ratios[len(ratios) // 2]:.2f}x "
                  f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}); replies the same in "
                  f"{sum(r['same_replies'] for r in rows)} of {len(rows)}; scores sequential / sharded: prompt "
                  f"{sum(r['sequential']['prompt']['score'] for r in rows):.0f} / "
                  f"{sum(r['sharded']['prompt']['score'] for r in rows):.0f}, chat "
                  f"{sum(r['sequential']['chat']['score'] for r in rows):.0f} / "
                  f"{sum(r['sharded']['chat']['score'] for r in rows):.0f}."]
    control = [r for r in rows if "sequential_no_write_through" in r]
    if control:
        lines += ["", "The control, sequential with `store.hot_write_through` off (every read of memory through the codec: "
                  "only rounding differs), against the sequential ingest: events "
                  + ", ".join(f"{r['sequential_no_write_through']['events'] / r['sequential']['events']:.3f} (seed "
                              f"{r['seed']})" for r in control)
                  + f"; replies the same in {sum(_same(r, 'sequential_no_write_through') for r in control)} of "
                  f"{len(control)}."]
    commands = list(dict.fromkeys(r["command"] for r in rows if r.get("command")))
    if commands:
        lines += ["", "Samples made by " + "; ".join(f"`{c}`" for c in commands) + "."]
    kinds = ["sequential", "sharded", "sequential_no_write_through"]
    lines += ["", "Events by the 2,048-token stretch their span starts in (the last stretch is partial, and ends in the "
              "resident window):", "", "| task | seed | store | events | per 2k tokens |", "|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['seed']} | {kind} | {r[kind]['events']:,} | "
              f"{' '.join(str(n) for n in r[kind]['events_per_2k_tokens'])} |"
              for r in rows for kind in kinds if "events_per_2k_tokens" in r.get(kind, {})]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["passkey", "niah-single"])
    parser.add_argument("--length", type=int, default=32_768)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the sequential run, shared out "
                        "among the workers of the sharded one")
    parser.add_argument("--name", default="sharded_ingest")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--segmentation", type=json.loads, default={}, metavar="JSON",
                        help='fields of the segmentation config for every ingest, e.g. \'{"min_surprise": 0, '
                        '"predicted_event": null}\' (no surprise floor; default: the config\'s defaults)')
    parser.add_argument("--no-write-through", action="store_true", help="also ingest sequentially with "
                        "store.hot_write_through off (every read of memory through the codec): how far the event count "
                        "moves when only the codec's rounding reaches the reading")
    args = parser.parse_args()
    config = EngineConfig.model_validate({"shards": {"threads_per_worker": max(1, args.threads // args.workers)},
                                          "segmentation": args.segmentation})
    lm = EpisodicLM.from_pretrained(config=config)
    old = OUT / f"{args.name}.json"
    rows: list[dict[str, Any]] = json.loads(old.read_text())["samples"] if args.resume and old.exists() else []
    done = {(r["task"], r["seed"]) for r in rows}
    workdir = Path(tempfile.mkdtemp(prefix="engramkv-sharded-"))
    try:
        for task in args.tasks:
            for seed in args.seeds:
                if (task, seed) in done:
                    continue
                rows.append(one_sample(lm, task, args.length, seed, args.workers, args.threads, workdir,
                                        args.no_write_through))
                write_results(OUT, args.name, {"samples": rows}, table(rows, args.workers, args.threads), config)
        write_results(OUT, args.name, {"samples": rows}, table(rows, args.workers, args.threads), config)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
