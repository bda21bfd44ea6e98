"""Long-context evaluation: every task against every system, on one model, at several lengths.

    python benchmarks/evaluate.py                          # all tasks and systems, 4k-32k, 1 sample per cell
    python benchmarks/evaluate.py --tasks passkey --lengths 65536 131072 --systems engram streaming
    python benchmarks/evaluate.py --quick                  # a few minutes: three tasks, every default system, 2k

Tasks (`engramkv/tasks.py`): passkey, kv, niah-single, niah-multikey, niah-multivalue, niah-multiquery,
conversation, facts (needs the debian-handbook package). Systems (`evalkit/systems.py`): full, streaming, rag, infllm, engram-surprise,
engram-refined, engram. The model is the embedded default unless --model names another.

Writes benchmarks/results/evaluate/{name}.json (every run: reply, score, speed, memory, the commit it
ran at; the file also records the configuration of every system, the machine and the commands),
{name}.md (accuracy per task, system and length; speed and memory per system) and {name}.png
(accuracy against context length, one line per system, one panel per task). The JSON is rewritten
after every run, so an interrupted evaluation keeps what it measured, and `--resume` runs only the
cells it lacks (the full grid takes hours on a CPU: it can be built up over several invocations, each
adding its command). `passkey.py` is a preset of this harness (the passkey task, 5 samples, 4k-64k).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from _common import CODE, RESULTS, ROOT, write_results
from engramkv.config import EngineConfig, ModelConfig
from engramkv.hf import load_pretrained
from evalkit.stats import wilson
from evalkit.systems import ALLOCATION_SYSTEMS, DEFAULT_SYSTEMS, OPTIONAL_SYSTEMS, SYSTEMS, Models, system_config
from engramkv.tasks import CALIBRATION_SEEDS, TASKS

QUICK_LENGTH = 2048
QUICK_TASKS = ["passkey", "niah-multikey", "conversation"]
OUT = RESULTS / "evaluate"
# What older results files record about their own provenance, kept when a grid is resumed or merged.
FILE_NOTES = ("commit_of_file", "commit_note", "relabelled", "rescored")  # relabel.py, rescore.py


def build_parser(description: str | None = __doc__) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=None, choices=list(TASKS), metavar="TASK",
                        help="default: all (with --quick: " + ", ".join(QUICK_TASKS) + ")")
    parser.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS, choices=[*SYSTEMS, "allocation"],
                        metavar="SYSTEM", help="default: " + " ".join(DEFAULT_SYSTEMS) + " (also: " +
                        " ".join(OPTIONAL_SYSTEMS) + "; 'allocation': " + " ".join(ALLOCATION_SYSTEMS) + ")")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--samples", type=int, default=1, help="samples per task and length (default 1)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the samples' seeds are FIRST_SEED ... FIRST_SEED + samples - 1 (default 0): fresh "
                             "questions beside a grid's; they stay below the calibration's seeds")
    parser.add_argument("--full-max", type=int, default=16384,
                        help="longest context for full attention (its cost is quadratic; default 16384)")
    parser.add_argument("--model", default=None, help="hub id or local path (default: the embedded model)")
    parser.add_argument("--quick", action="store_true",
                        help=f"one sample of three tasks on every default system at {QUICK_LENGTH} tokens (a few minutes)")
    parser.add_argument("--segmentation", type=json.loads, default={}, metavar="JSON",
                        help='fields of the segmentation config every engramkv system reads with, e.g. '
                             '\'{"min_surprise": 0, "predicted_event": null}\' (no surprise floor, the default before '
                             'it was measured; recorded in each run; default: none, the config\'s defaults)')
    parser.add_argument("--name", default="eval")
    parser.add_argument("--out", type=Path, default=OUT, help="results directory (default: benchmarks/results/evaluate)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in {name}.json and run only the missing ones")
    parser.add_argument("--merge", nargs="+", default=[], metavar="NAME",
                        help="also keep the runs of {NAME}.json (an evaluation run in another process, on other "
                             "tasks or lengths): they count as done and are saved under --name")
    parser.add_argument("--rerun", nargs="+", default=[], metavar="SYSTEM",
                        help="with --resume or --merge: the runs of these systems made at another commit are "
                             "dropped and run again (after a change that moves only them, such as new "
                             "allocation coefficients); runs made at this commit are kept, so a resume at the same "
                             "commit goes on. Leave it off once the code moves on, or it reruns them again")
    parser.add_argument("--rerun-empty", nargs="+", default=[], metavar="SYSTEM",
                        help="with --resume or --merge: the runs of these systems whose reply was empty are run "
                             "again (after a change that moves only such replies, as generation.min_new_tokens "
                             "did: greedy decoding picks the same tokens wherever the first was not the stop token)")
    parser.add_argument("--rerun-piece", nargs="+", default=[], metavar="SYSTEM",
                        help="with --resume or --merge: the runs of these systems whose chosen theta read the "
                             "window's best piece (the model's thetas of the whole window read only that piece) are "
                             "run again (after a change that moves only such answers, as cutting a piece to its "
                             "budget did)")
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> None:
    args = (parser or build_parser()).parse_args(argv)
    if args.quick:
        args.lengths, args.samples = [QUICK_LENGTH], 1
    args.tasks = args.tasks or (QUICK_TASKS if args.quick else list(TASKS))
    if not 0 <= args.first_seed <= CALIBRATION_SEEDS - args.samples:
        raise SystemExit(f"--first-seed {args.first_seed}: the seeds must lie in 0 ... {CALIBRATION_SEEDS - 1}, "
                         "below the calibration's (tasks.CALIBRATION_SEEDS)")
    if "allocation" in args.systems:
        args.systems = list(dict.fromkeys(s for name in args.systems
                                          for s in (ALLOCATION_SYSTEMS if name == "allocation" else [name])))

    unknown = sorted(set(args.rerun + args.rerun_empty + args.rerun_piece) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"--rerun / --rerun-empty / --rerun-piece: unknown systems {unknown}")
    outside = sorted(set(args.rerun + args.rerun_empty + args.rerun_piece) - set(args.systems))
    if outside:  # their runs would be dropped and never run again
        raise SystemExit(f"--rerun / --rerun-empty / --rerun-piece: {outside} not in --systems")
    model, tokenizer, model_id = load_pretrained(ModelConfig(name_or_path=args.model))
    models = Models(model, tokenizer, model_id, args.segmentation)
    runs, commands, notes = previous_runs(args.out / f"{args.name}.json", model_id) if args.resume else ([], [], {})
    args.notes = notes
    for name in args.merge:
        merged, merged_commands, _ = previous_runs(args.out / f"{name}.json", model_id, must_exist=True)
        done = {_key(r) for r in runs}
        runs += [r for r in merged if _key(r) not in done]
        commands += [c for c in merged_commands if c not in commands]
    runs = kept_runs(args, runs)
    check_segmentation(runs, args.segmentation)
    command = " ".join(["python benchmarks/evaluate.py", *_argv(args)])
    if command not in commands:  # the same command run again (a resume, a merge) is listed once
        commands.append(command)
    try:
        run_grid(args, models, model_id, runs, commands)
    except KeyboardInterrupt:
        save(args, model_id, runs, commands, plot=True)
        raise SystemExit(f"\ninterrupted: {len(runs)} runs saved in {args.out / args.name}.json; "
                         "add --resume to the same command to go on") from None
    save(args, model_id, runs, commands, plot=True)


def run_grid(args: argparse.Namespace, models: Models, model_id: str, runs: list[dict[str, Any]],
             commands: list[str]) -> None:
    """Every missing (length, task, seed, system) run, shortest length first; results saved after each."""
    tokenizer = models.tokenizer
    done = {_key(r) for r in runs}
    for length in sorted(args.lengths):
        for task in args.tasks:
            for seed in seeds(args):
                todo = [s for s in args.systems if (task, s, length, seed) not in done and _runs(args, task, s, length)]
                if not todo:
                    continue
                sample = TASKS[task](tokenizer, length, seed)
                for system in todo:
                    started = time.perf_counter()
                    run = SYSTEMS[system](models, sample)
                    runs.append({"task": task, "system": system, "length": length, "seed": seed,
                                 "score": sample.score(run.reply), "answers": sample.answers, "meta": sample.meta,
                                 **dataclasses.asdict(run), "wall_s": round(time.perf_counter() - started, 1),
                                 "commit": CODE["commit"], "dirty": CODE["dirty"],
                                 **({"segmentation": args.segmentation} if args.segmentation else {})})
                    print(f"{task:16s} {system:16s} {length:>7,} seed {seed}: score {runs[-1]['score']:.2f} "
                          f"reply {run.reply[:60]!r}", flush=True)
                    save(args, model_id, runs, commands)


def run_settings(runs: list[dict[str, Any]]) -> set[str]:
    """The `--segmentation` settings the runs were read with, as sorted JSON ('{}': the default)."""
    return {run_setting(r) for r in runs}


def run_setting(run: dict[str, Any]) -> str:
    """The `--segmentation` fields one run was read with, as sorted JSON ('{}': the default of its commit)."""
    return json.dumps(run.get("segmentation", {}), sort_keys=True)


def segmentation_lines(runs: list[dict[str, Any]]) -> list[str]:
    """What the report says of the runs' `--segmentation` fields. From the runs, not args: relabel.py and rescore.py
    save files they did not run, and relabel.py can move runs read with the fields set explicitly (as the grid's
    segmentation, the defaults before the floor, once the floor became the default) into a file of defaults."""
    counts = Counter(run_setting(r) for r in runs)
    if not counts or list(counts) == ["{}"]:
        return []
    if len(counts) == 1:
        return [f"Every engramkv system read its documents with these segmentation fields: {next(iter(counts))} "
                "(`--segmentation`; the configurations in the JSON have them).", ""]
    explicit = "; ".join(f"{n} runs with {setting}" for setting, n in sorted(counts.items()) if setting != "{}")
    return [f"The runs read their documents with the segmentation defaults of their commit, except {explicit} "
            "(`--segmentation`, recorded in each such run).", ""]


def check_segmentation(runs: list[dict[str, Any]], segmentation: dict[str, Any]) -> None:
    """Refuse to keep runs read with other `--segmentation` fields than this command's: one file, one setting."""
    other = run_settings(runs) - {json.dumps(segmentation, sort_keys=True)}
    if other:
        raise SystemExit(f"the runs kept were read with --segmentation {', '.join(sorted(other))}, not "
                         f"{json.dumps(segmentation)}: use another --name")


def length_label(tokens: int) -> str:
    """A context length as a column head: 4096 -> "4k", 512 -> "512"."""
    return f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)


def kept_runs(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`runs` less those --rerun, --rerun-empty and --rerun-piece ask to measure again. Only runs inside this
    command's grid are dropped, since only those it runs again: `--tasks kv --rerun X` leaves X's runs of the
    other tasks alone."""
    def in_grid(run: dict[str, Any]) -> bool:
        return (run["task"] in args.tasks and run["system"] in args.systems and run["length"] in args.lengths
                and run["seed"] in seeds(args) and _runs(args, run["task"], run["system"], run["length"]))

    def to_rerun(run: dict[str, Any]) -> bool:
        return ((run["system"] in args.rerun and run.get("commit") != CODE["commit"])
                or (run["system"] in args.rerun_empty and not run["reply"].strip())
                or (run["system"] in args.rerun_piece and _read_piece(run)))

    return [run for run in runs if not (in_grid(run) and to_rerun(run))]


def seeds(args: argparse.Namespace) -> range:
    """The seeds of the grid's samples."""
    return range(args.first_seed, args.first_seed + args.samples)


def _runs(args: argparse.Namespace, task: str, system: str, length: int) -> bool:
    """Whether the grid runs `system` on `task` at `length` at all."""
    return not (system == "full" and length > args.full_max) and not (system == "full-around-fact" and task != "facts")


def _key(run: dict[str, Any]) -> tuple[str, str, int, int]:
    return run["task"], run["system"], run["length"], run["seed"]


def previous_runs(path: Path, model_id: str, must_exist: bool = False
                  ) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """The runs, commands and file notes (FILE_NOTES) of an earlier evaluation (for --resume and --merge)."""
    if not path.exists():
        if must_exist:
            raise SystemExit(f"{path} does not exist (--merge names a results file without .json)")
        return [], [], {}
    payload = json.loads(path.read_text())
    if "runs" not in payload:
        raise SystemExit(f"{path} was written by another script or an older harness: use another --name")
    if payload.get("model") != model_id:
        raise SystemExit(f"{path} holds runs of {payload.get('model')}, not {model_id}: use another --name")
    notes = {key: payload[key] for key in FILE_NOTES if key in payload}
    return payload["runs"], list(dict.fromkeys(payload.get("commands", []))), notes  # older files repeat a merge


def save(args: argparse.Namespace, model_id: str, runs: list[dict[str, Any]], commands: list[str],
         plot: bool = False) -> None:
    accuracy: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for r in runs:
        accuracy[r["task"], r["system"], r["length"]].append(r["score"])
    lengths = sorted({r["length"] for r in runs})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in runs)]
    tasks = [t for t in TASKS if any(r["task"] == t for r in runs)]
    hours = sum(r.get("wall_s", 0.0) for r in runs) / 3600
    lines = [f"# Long-context evaluation ({model_id})", "",
             f"{len(runs)} runs, {hours:.1f} hours of system time, from " + "; ".join(f"`{c}`" for c in commands)
             + ". Score: share of the expected answers in the reply, averaged over the samples of a cell "
             "(in brackets: n; the 95% Wilson interval of the mean score over n); `-`: not run.", ""]
    notes = getattr(args, "notes", {})
    lines += segmentation_lines(runs)
    if "commit_of_file" in notes:  # a grid begun before runs recorded their commit
        lines += [f"Runs without a `commit` in {args.name}.json ran before commits were recorded; the file was "
                        f"added in commit {notes['commit_of_file'][:7]}.", ""]
    for note in notes.get("relabelled", []):  # runs moved under another system name (benchmarks/relabel.py)
        lines += [f"Relabelled: {note}; each such run names its old system in `relabelled_from`.", ""]
    for note in notes.get("rescored", []):  # runs scored again after the scorer changed (benchmarks/rescore.py)
        lines += [f"Rescored: {note}; each such run keeps its old score in `score_before_rescore`.", ""]
    for task in tasks:
        lines += [f"## {task}", "", "| system | " + " | ".join(length_label(n) for n in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for system in systems:
            cells = []
            for n in lengths:
                scores = accuracy.get((task, system, n))
                cells.append(_cell(scores) if scores else "-")
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Speed and memory (means over all runs of a system at each length)", "",
              "Added RSS: the process's peak during the run minus its resident memory when the run began (the "
              "process holds the model twice, the embedding model and the harness, so its total says little).", "",
              "Answer context: the effective context an engramkv answer attended to (sinks, attended window, "
              "turn, recalled tokens; `RecallPlan.context_tokens`).", "",
              "| system | length | ingest tok/s | first token s | decode tok/s | added RSS MB | answer context |",
              "|---|---|---|---|---|---|---|"]
    for system in systems:
        for n in lengths:
            mine = [r for r in runs if r["system"] == system and r["length"] == n]
            if not mine:
                continue
            ingest = [r["context_tokens"] / r["ingest_s"] for r in mine if r["ingest_s"] > 0]
            ingest_cell = f"{_mean(ingest):,.0f}" if ingest else "-"  # full attention reads no stream first
            lines.append(
                f"| {system} | {n:,} | {ingest_cell} | {_mean([r['first_token_s'] for r in mine]):.2f} | "
                f"{_mean([r['decode_tokens_per_s'] for r in mine]):.1f} | "
                f"{max(r['peak_rss_mb'] - r.get('rss_before_mb', 0.0) for r in mine):,.0f} | "
                f"{_context_cell(mine)} |"
            )
    recalling = [s for s in systems if any(r.get("answers_in_recalled") is not None for r in runs if r["system"] == s)]
    if recalling:
        lines += ["", "## Recall or reading (engramkv systems, all tasks)", "",
                  "Share of the expected answers present in the events the answer attended to, beside the score: "
                  "where the first is high and the second low, the events were found but the model did not read "
                  "the answer from them. An answer still in the local window needs no recall (the window rule "
                  "recalls nothing then).", "",
                  "| system | length | score | answers in recalled events |", "|---|---|---|---|"]
        for system in recalling:
            for n in lengths:
                mine = [r for r in runs if r["system"] == system and r["length"] == n
                        and r.get("answers_in_recalled") is not None]
                if mine:
                    lines.append(f"| {system} | {n:,} | {_mean([r['score'] for r in mine]):.2f} | "
                                 f"{_mean([r['answers_in_recalled'] for r in mine]):.2f} |")
    payload = {**notes, "model": model_id, "commands": commands, "runs": runs}
    segmentation = json.loads(max(run_settings(runs), key=len, default="{}"))  # the explicit fields, where set
    configs = {system: system_config(system, segmentation) for system in systems}
    write_results(args.out, args.name, payload, "\n".join(lines) + "\n", configs)
    if plot:
        plot_accuracy(args.out / f"{args.name}.png", tasks, systems, lengths, accuracy)


def plot_accuracy(path: Path, tasks: list[str], systems: list[str], lengths: list[int],
                  accuracy: dict[tuple[str, str, int], list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    columns = min(4, len(tasks))
    rows = math.ceil(len(tasks) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.2 * rows), squeeze=False, sharey=True)
    markers = "osD^vP*X"
    for ax, task in zip(axes.flat, tasks):
        for i, system in enumerate(systems):
            points = [(n, sum(s) / len(s)) for n in lengths if (s := accuracy.get((task, system, n)))]
            if points:
                # Systems often score the same: a small vertical offset and a marker each keep every line visible.
                offset = (i - (len(systems) - 1) / 2) * 0.012
                ax.plot([p[0] for p in points], [p[1] + offset for p in points], marker=markers[i % len(markers)],
                        markersize=5, linewidth=1.2, alpha=0.85, label=system)
        ax.set_title(task)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(n) for n in lengths])
        ax.set_ylim(-0.08, 1.08)
        ax.set_xlabel("context tokens")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes[0][0].set_ylabel("score (lines offset slightly to stay apart)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(7, len(labels)), fontsize="small")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(scores: list[float]) -> str:
    """Mean score, n and its 95% Wilson interval (scores of 0..1 per sample, counted as successes)."""
    n, mean = len(scores), sum(scores) / len(scores)
    lo, hi = wilson(mean, n)
    return f"{mean:.2f} ({n}; {lo:.2f}-{hi:.2f})"


def _context_cell(runs: list[dict[str, Any]]) -> str:
    tokens = [r["answer_context_tokens"] for r in runs if r.get("answer_context_tokens") is not None]
    return f"{_mean(tokens):,.0f}" if tokens else "-"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _read_piece(run: dict) -> bool:
    """Whether a run's theta, chosen by the allocation model, read the window's best piece: the model chooses
    a theta of the whole window only where the window answers, and then reads that piece of it
    (`Answerer.window_piece_plan`). A fixed theta of the whole window reads all of it."""
    config = system_config(run["system"])
    engine = config if isinstance(config, EngineConfig) else EngineConfig.model_validate(config.get("engine", {}))
    return (engine.allocation.mode != "fixed" and bool(run.get("theta"))  # "auto" chooses where coefficients ship
            and run["theta"]["w"] >= engine.window.n_local)


def _argv(args: argparse.Namespace) -> list[str]:
    """The evaluate.py arguments that give this grid (a preset such as passkey.py is spelt out)."""
    name = [] if args.name == "eval" else ["--name", args.name]
    if args.out.resolve() != OUT.resolve():
        out = args.out.resolve()
        name += ["--out", str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(args.out)]
    segmentation = ["--segmentation", json.dumps(args.segmentation)] if args.segmentation else []
    if args.quick:
        return ["--quick", *name, *segmentation]
    return [*name, *segmentation, "--tasks", *args.tasks, "--systems", *args.systems, "--lengths", *map(str, args.lengths),
            "--samples", str(args.samples), *(["--first-seed", str(args.first_seed)] if args.first_seed else []),
            "--full-max", str(args.full_max), *(["--resume"] if args.resume else []),
            *(["--merge", *args.merge] if args.merge else []), *(["--rerun", *args.rerun] if args.rerun else []),
            *(["--rerun-empty", *args.rerun_empty] if args.rerun_empty else []),
            *(["--rerun-piece", *args.rerun_piece] if args.rerun_piece else [])]


if __name__ == "__main__":
    main()
