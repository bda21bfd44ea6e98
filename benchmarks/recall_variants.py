"""Question-time recall variants on passkey samples: ingest once, then ask under several recall settings.

Ingest is the expensive part (about 270 s for 64k tokens here), and the recall settings used while
reading the question and answering can be swapped afterwards: each variant asks on a fork of the
ingested session (`Session.fork(config)`: an in-RAM copy of the stream, its events and resident
state, read with another config). This finds which settings rescue a sample that the default misses;
a default still has to be confirmed with `passkey.py`, since it also changes nothing about ingest.
The samples are passkey.py's (the evaluation harness's passkey task, sample i = seed i), asked as the
harness asks them (the benchmark's prompt, its question matched against memory).

Writes benchmarks/results/recall_variants/{name}.json and .md.

    python benchmarks/recall_variants.py --length 65536 --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _common import RESULTS, write_results
from engramkv import EngineConfig, EpisodicLM
from engramkv.tasks import TASKS

VARIANTS: dict[str, dict[str, Any]] = {
    "answer budget 1024 (reading budget)": {"answer_budget_tokens": None},
    "answer budget 768": {"answer_budget_tokens": 768},
    "answer budget 512": {"answer_budget_tokens": 512},
    "answer budget 1024, contiguity 0.7": {"answer_budget_tokens": None, "contiguity_fraction": 0.7},
    "answer budget 1024, fixed positions": {"answer_budget_tokens": None, "positions": "fixed"},
    "answer budget 512, fixed positions": {"answer_budget_tokens": 512, "positions": "fixed"},
}
MAX_NEW_TOKENS = 8  # the key is the first thing the prompt asks for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="passkey samples (seeds)")
    parser.add_argument("--name", default="recall_variants")
    args = parser.parse_args()

    base = EngineConfig()
    # The variants differ in recall.answer_budget_tokens, which only the fixed default theta reads.
    base = base.with_allocation_mode("fixed")
    configs = {name: base.model_copy(update={"recall": base.recall.model_copy(update=update)})
               for name, update in VARIANTS.items()}
    lm = EpisodicLM.from_pretrained(config=base)
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        sample = TASKS["passkey"](lm.tokenizer, args.length, seed)
        session = lm.session(base)
        started = time.perf_counter()
        for piece in sample.context:
            session.ingest(piece)
        print(f"seed {seed}: ingested in {time.perf_counter() - started:.0f} s, {session.events} events", flush=True)
        for name, config in configs.items():
            fork = session.fork(config)
            answer = fork.generate(sample.prompt, max_new_tokens=MAX_NEW_TOKENS, question=sample.question)
            fork.close()
            correct = sample.score(answer) == 1.0
            rows.append({"seed": seed, "depth": round(sample.meta["depth"], 3), "key": sample.answers[0],
                         "variant": name, "answer": answer, "correct": correct})
            print(f"  {name}: {answer!r} {'correct' if correct else 'wrong'}", flush=True)
        session.close()
        report(rows, args, configs)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, configs: dict[str, EngineConfig]) -> None:
    seeds = list(dict.fromkeys(r["seed"] for r in rows))
    heads = {r["seed"]: f"seed {r['seed']} (depth {r['depth']:.2f}, key {r['key']})" for r in rows}
    lines = [f"# Question-time recall variants, passkey at {args.length} tokens (ingest with the defaults)", "",
             "| variant | " + " | ".join(heads[s] for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for name in VARIANTS:
        cells = []
        for seed in seeds:
            hit = [r for r in rows if r["variant"] == name and r["seed"] == seed]
            cells.append(("yes" if hit[0]["correct"] else f"no ({hit[0]['answer'].strip()!r})") if hit else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    write_results(RESULTS / "recall_variants", args.name, {"args": vars(args), "rows": rows},
                  "\n".join(lines) + "\n", configs)


if __name__ == "__main__":
    main()
