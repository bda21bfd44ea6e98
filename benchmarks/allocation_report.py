"""The allocation grid against the targets of issue 17, from the evaluation's own result files.

The grid runs as several `evaluate.py --systems allocation` processes (one per core, each on some tasks,
e.g. `--name allocation_a` and `--name allocation_b`); this merges their runs and writes
`results/evaluate/allocation.{json,md}`:

- the score per task and length of every system (n; 95% Wilson interval), with the cells short of the
  samples the issue asks for (20 at 4k-16k, 10 at 32k) marked;
- the allocation model against the best fixed theta and the fixed default, pooled over tasks per length:
  mean score and mean answer context, the paired difference on the same samples (95% bootstrap interval)
  and the samples better / worse (two-sided sign test), on both prompt paths; rows of several lengths
  resample and count questions (a task's seed asks the same question at every length);
- against RAG per task and length, with the recall-versus-reading split (the share of expected answers
  that were in the events the answer read);
- chat-path parity: the chat path's mean over the benchmark prompt's, per task and length and per task over
  all lengths (target >= 0.9), with the paired difference.

It reads result files only (no model): run it after each resume.

    python benchmarks/allocation_report.py                       # allocation_a + allocation_b
    python benchmarks/allocation_report.py --names allocation_a  # one of them
    python benchmarks/allocation_report.py --names allocation_b parity_fresh_a --tasks niah-multiquery --name mq
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from _common import RESULTS, write_results
from evalkit.stats import paired_bootstrap, sign_test, wilson

Key = tuple[str, int, int]  # (task, length, seed)
WANTED = {32768: 10}  # samples per cell the issue asks for at a length; 20 elsewhere
PARITY = 0.9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", nargs="+", default=None,
                        help="evaluation result files (results/evaluate/NAME.json) to merge (default: allocation_a and "
                        "allocation_b)")
    parser.add_argument("--dir", type=Path, default=RESULTS / "evaluate")
    parser.add_argument("--name", default="allocation", help="the report's file name (default allocation)")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                        help="only these tasks' runs (default: all)")
    args = parser.parse_args(argv)
    names = args.names or ["allocation_a", "allocation_b"]
    runs, sources = load(args.dir, names)
    runs = [r for r in runs if args.tasks is None or r["task"] in args.tasks]
    if not runs:
        raise SystemExit(f"no runs in {', '.join(names)}" + (f" of {', '.join(args.tasks)}" if args.tasks else ""))
    lines = report(runs, sources)
    write_results(args.dir, args.name, {"sources": sources, "summary": summary(runs)}, "\n".join(lines) + "\n",
                  {"sources": sources})
    print("\n".join(lines))


def load(directory: Path, names: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The runs of the named files, one per (task, system, length, seed), and what each file records."""
    by_key: dict[tuple[str, str, int, int], dict[str, Any]] = {}
    sources: dict[str, Any] = {}
    for name in names:
        path = directory / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"{path} does not exist")
        payload = json.loads(path.read_text())
        if "runs" not in payload:
            raise SystemExit(f"{path} is not an evaluation result file")
        sources[name] = {"commit": payload.get("commit"), "commands": payload.get("commands", []),
                         "model": payload.get("model"), "runs": len(payload["runs"])}
        for run in payload["runs"]:
            by_key[run["task"], run["system"], run["length"], run["seed"]] = run
    return list(by_key.values()), sources


def _scores(runs: list[dict[str, Any]], system: str) -> dict[Key, dict[str, Any]]:
    return {(r["task"], r["length"], r["seed"]): r for r in runs if r["system"] == system}


def _cell(scores: list[float], length: int) -> str:
    if not scores:
        return "-"
    mean = sum(scores) / len(scores)
    lo, hi = wilson(mean, len(scores))
    short = "*" if len(scores) < WANTED.get(length, 20) else ""
    return f"{mean:.2f} ({len(scores)}{short}; {lo:.2f}-{hi:.2f})"


def _paired(a: dict[Key, dict[str, Any]], b: dict[Key, dict[str, Any]], keys: list[Key]) -> str:
    """'+diff (lo to hi); better / worse (p)' of a against b over the keys both answered. Keys of several lengths
    count by question (task and seed: the same needles and answers at every length, kv's aside), since one
    question asked four times is not four samples: the bootstrap resamples questions and the sign test counts
    the questions a answered better / worse over their lengths together."""
    both = [k for k in keys if k in a and k in b]
    if not both:
        return "-"
    x, y = [a[k]["score"] for k in both], [b[k]["score"] for k in both]
    pooled = len({k[1] for k in both}) > 1
    units: list[object] = [(k[0], k[2]) for k in both] if pooled else list(range(len(both)))  # question or sample
    lo, hi = paired_bootstrap(x, y, clusters=units if pooled else None)
    net: dict[object, float] = defaultdict(float)
    for unit, p, q in zip(units, x, y):
        net[unit] += p - q
    better, worse = sum(d > 0 for d in net.values()), sum(d < 0 for d in net.values())
    unit = f", {len(net)} questions" if pooled else ""
    return (f"{(sum(x) - sum(y)) / len(both):+.3f} ({lo:+.3f} to {hi:+.3f}; n {len(both)}{unit}); "
            f"{better} / {worse} (p {sign_test(better, worse):.3f})")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _context(runs: list[dict[str, Any]]) -> str:
    tokens = [r["answer_context_tokens"] for r in runs if r.get("answer_context_tokens") is not None]
    return f"{_mean(tokens):,.0f}" if tokens else "-"


def report(runs: list[dict[str, Any]], sources: dict[str, Any]) -> list[str]:
    systems = sorted({r["system"] for r in runs}, key=lambda s: (s.replace("-chat", ""), s.endswith("-chat")))
    tasks = sorted({r["task"] for r in runs})
    lengths = sorted({r["length"] for r in runs})
    by = {s: _scores(runs, s) for s in systems}
    lines = ["# Recall budgets: the allocation grid (issue 17)", "",
             f"{len(runs)} runs from " + ", ".join(f"`{n}.json` ({s['runs']} runs)" for n, s in sources.items())
             + "; the commands that made them are listed in those files. Score: the share of the expected answers "
             "in the reply, averaged over the samples of a cell (n; 95% Wilson interval); `*`: fewer samples "
             "than the issue asks for (20 at 4k-16k, 10 at 32k).", "", "## Runs per system and commit", "",
             "| system | runs | commits (runs) |", "|---|---|---|"]
    for system in systems:
        commits = Counter((r.get("commit") or "unrecorded")[:7] for r in runs if r["system"] == system)
        lines.append(f"| {system} | {sum(commits.values())} | "
                     + ", ".join(f"{c} ({n})" for c, n in commits.most_common()) + " |")
    lines += ["", "## Score per task and length", "", "| task | length | " + " | ".join(systems) + " |",
              "|---|---|" + "---|" * len(systems)]
    for task in tasks:
        for length in lengths:
            cells = [_cell([r["score"] for k, r in by[s].items() if k[0] == task and k[1] == length], length)
                     for s in systems]
            if any(c != "-" for c in cells):
                lines.append(f"| {task} | {length:,} | " + " | ".join(cells) + " |")
    lines += _against_fixed(by, lengths)
    lines += _against_rag(by, tasks, lengths)
    lines += _parity(by, tasks, lengths)
    return lines


def _against_fixed(by: dict[str, dict[Key, dict[str, Any]]], lengths: list[int]) -> list[str]:
    """engram-alloc against engram-best (the best fixed theta) and the fixed default, per path and length."""
    lines = ["", "## The allocation model against fixed thetas (all tasks pooled)", "",
             "Paired on the samples both systems answered: the mean difference (95% bootstrap interval), and "
             "the samples answered better / worse (two-sided sign test); a row of several lengths counts "
             "questions (a task's seed: the same needles at every length), not samples, in both. Target: the "
             "model >= the best fixed theta at no more mean context (`all`: every length together, the held-out "
             "mean).", "",
             "| path | length | system | mean score (n) | mean context | model against it |", "|---|---|---|---|---|---|"]
    for path in ("", "-chat"):
        model = by.get(f"engram-alloc{path}", {})
        for length in [*lengths, None]:  # None: the held-out mean over every length
            keys = sorted(k for k in model if length in (None, k[1]))
            if not keys:
                continue
            for system in (f"engram-alloc{path}", f"engram-best{path}", f"engram{path}"):
                # Over the samples the model answered, so that each row's mean is of the same samples.
                runs = [r for k, r in by.get(system, {}).items() if k in model and length in (None, k[1])]
                if not runs:
                    continue
                versus = "-" if system.startswith("engram-alloc") else _paired(model, by[system], keys)
                where = "all" if length is None else f"{length:,}"
                lines.append(f"| {'chat' if path else 'prompt'} | {where} | {system} | "
                             f"{_mean([r['score'] for r in runs]):.3f} ({len(runs)}) | {_context(runs)} | {versus} |")
    return lines


def _against_rag(by: dict[str, dict[Key, dict[str, Any]]], tasks: list[str], lengths: list[int]) -> list[str]:
    lines = ["", "## Against RAG, per task and length", "",
             "Recalled: the share of expected answers that were in the events the model's answer read (its "
             "hits and their neighbours); where it is high and the score low, the events were found and misread. "
             "An answer that reads the local window instead (the window rule) recalls none. Read: the share in "
             "everything the answer attended to besides its turn (sinks, the part of the window read, memory), "
             "over the runs that recorded it (`-`: none did, runs made before it was recorded).", "",
             "| task | length | engram-alloc | recalled | read | rag | alloc against rag |",
             "|---|---|---|---|---|---|---|"]
    model, rag = by.get("engram-alloc", {}), by.get("rag", {})
    if not model or not rag:
        return []
    for task in tasks:
        for length in lengths:
            keys = sorted(k for k in model if k[0] == task and k[1] == length)
            if not keys:
                continue
            mine = [model[k] for k in keys]
            theirs = [r for k, r in rag.items() if k[0] == task and k[1] == length]
            recalled = _mean([r["answers_in_recalled"] for r in mine if r.get("answers_in_recalled") is not None])
            read = [r["answers_in_read"] for r in mine if r.get("answers_in_read") is not None]
            read_cell = f"{_mean(read):.2f} ({len(read)})" if read else "-"
            lines.append(f"| {task} | {length:,} | {_mean([r['score'] for r in mine]):.2f} ({len(mine)}) | "
                         f"{recalled:.2f} | {read_cell} | {_mean([r['score'] for r in theirs]):.2f} ({len(theirs)}) | "
                         f"{_paired(model, rag, keys)} |")
    return lines


def _parity(by: dict[str, dict[Key, dict[str, Any]]], tasks: list[str], lengths: list[int]) -> list[str]:
    lines = ["", "## Chat-path parity", "",
             f"The chat path's mean score over the benchmark prompt's on the same samples (target >= {PARITY}; "
             "`-`: both 0), per task and length and per task over all lengths (`all`), with chat's paired "
             "difference from the prompt path (95% bootstrap interval) and the samples chat answered better / "
             "worse (two-sided sign test); in `all` rows the unit of both is the question (a task's seed: the "
             "same needles at every length), since one question asked at four lengths is not four samples.", "",
             "| task | length | system | prompt | chat | ratio | chat against prompt |",
             "|---|---|---|---|---|---|---|"]
    # engram-alloc-list (a candidate answer start) differs from engram-alloc only through chat
    for system, chat_system in (("engram-alloc", "engram-alloc-chat"), ("engram-alloc", "engram-alloc-list-chat"),
                                ("engram-best", "engram-best-chat"), ("engram", "engram-chat")):
        prompt, chat = by.get(system, {}), by.get(chat_system, {})
        for task in tasks:
            for length in [*lengths, None]:  # None: every length of the task together
                keys = sorted(k for k in prompt if k in chat and k[0] == task and length in (None, k[1]))
                if not keys:
                    continue
                p, c = _mean([prompt[k]["score"] for k in keys]), _mean([chat[k]["score"] for k in keys])
                ratio = "-" if p == 0 and c == 0 else ("inf" if p == 0 else f"{c / p:.2f}")
                flag = " (below)" if p > 0 and c / p < PARITY else ""
                where = "all" if length is None else f"{length:,}"
                label = system if chat_system == f"{system}-chat" else f"{system} ({chat_system})"
                lines.append(f"| {task} | {where} | {label} | {p:.2f} ({len(keys)}) | {c:.2f} | {ratio}{flag} | "
                             f"{_paired(chat, prompt, keys)} |")
    return lines


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean score and n per system, task and length (what the tables show), for other scripts."""
    cells: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        cells[f"{r['system']}|{r['task']}|{r['length']}"].append(r["score"])
    return {key: {"mean": _mean(v), "n": len(v)} for key, v in sorted(cells.items())}


if __name__ == "__main__":
    main()
