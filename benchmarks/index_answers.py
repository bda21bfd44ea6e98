"""Do low-rank index entries change the answers? (issue 18, `store.index.rank`)

Each sample's context is read once into a store on disk with the default config (int8 cold tier, flat
indexes); the store is then opened read-only twice, with the default indexes and with `store.index.rank`
(projected on open: `--project-min-events` is lowered below the default 2,048 so that stores of 16k tokens,
~1,000 events, are projected at all), and the question is asked in each, with the benchmark's prompt and as a
chat turn. Same KV, same events: only the index that ranks them differs.

Reported per sample and path: both replies and scores, whether they are identical, and the overlap of the
events each answer attended to. Written to results/index_answers/NAME.{json,md}.

    python benchmarks/index_answers.py [--tasks passkey niah-single niah-multikey] [--length 16384] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from typing import Any

from _common import CODE, RESULTS, write_results
from engramkv import EngineConfig
from engramkv.config import ModelConfig
from engramkv.hf import load_pretrained
from engramkv.chat import cut_repeats
from engramkv.tasks import TASKS
from evalkit.stats import wilson
from evalkit.systems import Models, RssSampler, _engram_answer


def ranked_config(rank: int, project_min_events: int) -> EngineConfig:
    base = EngineConfig()
    index = base.store.index.model_copy(update={"rank": rank, "project_min_events": project_min_events})
    return base.model_copy(update={"store": base.store.model_copy(update={"index": index})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["passkey", "niah-single", "niah-multikey"], choices=list(TASKS))
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rank", type=int, default=24)
    parser.add_argument("--project-min-events", type=int, default=256)
    parser.add_argument("--name", default="index_answers")
    parser.add_argument("--resume", action="store_true", help="keep the runs in NAME.json; run only the missing samples")
    args = parser.parse_args()
    out = RESULTS / "index_answers"

    model, tokenizer, model_id = load_pretrained(ModelConfig())
    models = Models(model, tokenizer, model_id)
    configs = {"flat": EngineConfig(), f"rank{args.rank}": ranked_config(args.rank, args.project_min_events)}
    runs: list[dict[str, Any]] = []
    if args.resume and (out / f"{args.name}.json").exists():
        previous = json.loads((out / f"{args.name}.json").read_text())
        runs = [{"commit": previous["commit"], **r} for r in previous["runs"]]  # a run's own commit, if it has one
    done = {(r["task"], r["seed"]) for r in runs}
    for task in args.tasks:
        for seed in args.seeds:
            if (task, seed) in done:
                continue
            sample = TASKS[task](tokenizer, args.length, seed)
            store = tempfile.mkdtemp(prefix="engramkv-index-answers-")
            try:
                started = time.perf_counter()
                with models.lm.session(EngineConfig(), store=store) as session:
                    for piece in sample.context:
                        session.ingest(piece)
                ingest_s = time.perf_counter() - started
                models.lm.close()
                for name, config in configs.items():
                    for chat_path in (False, True):
                        session = models.lm.session(config, store=store, read_only=True)
                        kind = session.memory.indexes.kind
                        with RssSampler() as rss:
                            run = _engram_answer(models, sample, session, ingest_s, rss, chat_path)
                        runs.append({"task": task, "seed": seed, "index": name, "index_kind": kind,
                                     "path": "chat" if chat_path else "prompt", "reply": run.reply,
                                     "score": sample.score(cut_repeats(run.reply)), "answers": sample.answers,
                                     "recalled": run.recalled, "ingest_s": ingest_s, "commit": CODE["commit"]})
                        print(f"{task} {seed} {name} ({kind}) {runs[-1]['path']}: {runs[-1]['score']:.2f} "
                              f"{run.reply[:60]!r}")
                    models.lm.close()
            finally:
                models.lm.close()
                shutil.rmtree(store, ignore_errors=True)

    ranked = f"rank{args.rank}"
    lines = ["# Answers with low-rank index entries against the default indexes (issue 18)", "",
             f"{args.length:,}-token samples; one store per sample (default config, int8), opened read-only with the "
             f"default indexes and with `store.index.rank` {args.rank} (projected on open, `project_min_events` "
             f"{args.project_min_events}). Same: the replies are identical character for character.", "",
             "| task | path | n | flat | low-rank | same replies |", "|---|---|---|---|---|---|"]
    for task in args.tasks:
        for path in ("prompt", "chat"):
            pairs = [(f, r) for f in runs for r in runs if f["task"] == r["task"] == task and f["seed"] == r["seed"]
                     and f["path"] == r["path"] == path and f["index"] == "flat" and r["index"] == ranked]
            n = len(pairs)
            flat, low = sum(f["score"] for f, _ in pairs), sum(r["score"] for _, r in pairs)
            lo_f, hi_f = wilson(flat / n, n)
            lo_r, hi_r = wilson(low / n, n)
            same = sum(f["reply"] == r["reply"] for f, r in pairs)
            lines.append(f"| {task} | {path} | {n} | {flat / n:.2f} ({lo_f:.2f}-{hi_f:.2f}) | "
                         f"{low / n:.2f} ({lo_r:.2f}-{hi_r:.2f}) | {same}/{n} |")
    seeds = sorted({r["seed"] for r in runs})
    payload = {"length": args.length, "seeds": seeds, "rank": args.rank,
               "project_min_events": args.project_min_events, "runs": runs}
    _, md_path = write_results(out, args.name, payload, "\n".join(lines),
                               {name: config for name, config in configs.items()})
    print(md_path.read_text())


if __name__ == "__main__":
    main()
