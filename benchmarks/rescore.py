"""Score stored answers again after the scorer changed (`engramkv.tasks.match_share`), from their replies.

An evaluation file's runs hold their replies and expected answers: each run's `score` is computed again
(a changed run keeps its old score in `score_before_rescore`), the command and a note join the file's
`commands` and `rescored` list, and its table and plot are written again (`evaluate.save`). A calibration's
observations (`observations.jsonl`) hold replies but not answers: each row's sample is made again from its
task, length and seed (`engramkv.tasks`; the facts task needs its corpus), a changed row keeps its old score
in `score_before_rescore`, and the file is rewritten whole (not while a calibration still appends to it).

    python benchmarks/rescore.py --results allocation_a allocation_b --observations /work/cal/observations.jsonl \\
        --because "case ignored, as RULER's string_match_all"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evaluate import OUT, previous_runs, save
from engramkv import hf
from engramkv.config import ModelConfig
from engramkv.tasks import TASKS, match_share


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", default=[], metavar="NAME",
                        help="evaluation files (results/evaluate/NAME.json) to score again")
    parser.add_argument("--observations", nargs="+", default=[], type=Path, metavar="FILE",
                        help="calibration observations (JSON lines) to score again")
    parser.add_argument("--because", required=True, help="why, for each evaluation file's note")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if not args.results and not args.observations:
        raise SystemExit("nothing to score again: give --results and/or --observations")
    command = " ".join(["python benchmarks/rescore.py", *(argv if argv is not None else sys.argv[1:])])
    for name in args.results:
        path = args.out / f"{name}.json"
        model_id = json.loads(path.read_text()).get("model") if path.exists() else None
        runs, commands, notes = previous_runs(path, model_id, must_exist=True)
        changed = 0
        for run in runs:
            score = match_share(run["answers"], run["reply"] or "")
            if score != run["score"]:
                run.setdefault("score_before_rescore", run["score"])
                run["score"], changed = score, changed + 1
        if changed:
            commands.append(command)
            notes["rescored"] = [*notes.get("rescored", []), f"{changed} runs scored again ({args.because})"]
            save(argparse.Namespace(name=name, out=args.out, notes=notes), model_id, runs, commands, plot=True)
        print(f"{name}: {changed} of {len(runs)} runs changed score")
    if args.observations:
        tokenizer, _ = hf.load_tokenizer(ModelConfig())
        for path in args.observations:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            changed, answers = 0, {}  # a sample's answers, made once for all the thetas it was answered under
            for row in rows:
                key = (row["task"], row["length"], row["seed"])
                if key not in answers:
                    answers[key] = TASKS[key[0]](tokenizer, key[1], key[2]).answers
                score = match_share(answers[key], row["reply"])
                if score != row["score"]:
                    row.setdefault("score_before_rescore", row["score"])
                    row["score"], changed = score, changed + 1
            if changed:
                partial = path.with_suffix(".partial")
                partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
                partial.replace(path)
            print(f"{path}: {changed} of {len(rows)} observations changed score")


if __name__ == "__main__":
    main()
