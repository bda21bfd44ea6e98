"""A segmentation setting against the grid's on the same samples, from evaluation result files.

A segmentation (`evaluate.py --segmentation JSON`: the surprise floor, measured so before it became the default)
is set against the samples the grid already answered (the allocation grid read them without the floor, the
default of its time); this pairs the two by (task, system, length, seed) and
writes `results/evaluate/{name}.{json,md}`: per task, length and engramkv system, the score both ways
(n; 95% Wilson interval), the paired difference (95% bootstrap interval) with the samples better / worse
(two-sided sign test), and the mean answer context both ways; then per task and system over all lengths
(questions, not samples, resampled and counted: a task's seed asks the same question at every length).

It reads result files only (no model).

    python benchmarks/segmentation_ab.py --setting floor_passkey_a floor_passkey_b --name floor_passkey
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _common import RESULTS, write_results
from allocation_report import Key, _cell, _context, _paired, load
from evaluate import run_settings

# The grid's segmentation, the defaults before the floor: runs measured again since it became the default set it
# explicitly (the kv chat cells of c0a7fa5), and they stand for the grid as its other runs do.
GRID_SEGMENTATION = {"min_surprise": 0, "predicted_event": None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", nargs="+", required=True, metavar="NAME",
                        help="result files (results/evaluate/NAME.json) read with one --segmentation setting")
    parser.add_argument("--default", nargs="+", default=["allocation_a", "allocation_b"], metavar="NAME",
                        help="result files read with the default segmentation of their commit (default: the allocation "
                             "grid's)")
    parser.add_argument("--dir", type=Path, default=RESULTS / "evaluate")
    parser.add_argument("--name", required=True, help="the report's file name")
    args = parser.parse_args(argv)
    setting_runs, setting_sources = load(args.dir, args.setting)
    default_runs, default_sources = load(args.dir, args.default)
    settings = run_settings(setting_runs)
    if len(settings) != 1 or settings == {"{}"}:
        raise SystemExit(f"--setting files must share one --segmentation setting (found {sorted(settings)})")
    if any(r.get("segmentation") not in (None, {}, GRID_SEGMENTATION) for r in default_runs):
        raise SystemExit("--default files hold runs read with a --segmentation setting other than the grid's "
                         f"({GRID_SEGMENTATION})")
    setting = json.loads(settings.pop())
    lines, rows = report(setting_runs, default_runs, setting)
    sources = {"setting": setting_sources, "default": default_sources}
    write_results(args.dir, args.name, {"segmentation": setting, "sources": sources, "rows": rows},
                  "\n".join(lines) + "\n", {"sources": sources, "segmentation": setting})
    print("\n".join(lines))


def report(setting_runs: list[dict[str, Any]], default_runs: list[dict[str, Any]],
           setting: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The markdown lines and one row per (task, system, length or 'all') of the paired comparison."""
    keys = {(r["task"], r["system"], r["length"], r["seed"]) for r in setting_runs}
    pairs = keys & {(r["task"], r["system"], r["length"], r["seed"]) for r in default_runs}
    if not pairs:
        raise SystemExit("no (task, system, length, seed) answered both ways")
    tasks = sorted({k[0] for k in pairs})
    systems = sorted({k[1] for k in pairs})
    lengths = sorted({k[2] for k in pairs})
    lines = [f"# Segmentation {setting} against the default, on the same samples", "",
             f"{len(pairs)} pairs: every (task, engramkv system, length, seed) answered both ways; the setting's "
             "runs read each document with these segmentation fields (`evaluate.py --segmentation`), the "
             "default's are the grid's. Paired: the setting minus the default (95% bootstrap interval; n); "
             "samples better / worse (two-sided sign test). Rows 'all' pool the lengths by question.", "",
             "| task | system | length | default | setting | setting - default; better / worse | context tokens "
             "default / setting |", "|---|---|---|---|---|---|---|"]
    rows = []
    for task in tasks:
        for system in systems:
            setting_by = _by(setting_runs, task, system, pairs)
            default_by = _by(default_runs, task, system, pairs)
            for length in [*lengths, None]:
                cell = [k for k in setting_by if length is None or k[1] == length]
                if not cell:
                    continue
                label = "all" if length is None else f"{length:,}"
                d, s = [default_by[k]["score"] for k in cell], [setting_by[k]["score"] for k in cell]
                shown_length = 0 if length is None else length
                paired = _paired(setting_by, default_by, cell)
                context = f"{_context([default_by[k] for k in cell])} / {_context([setting_by[k] for k in cell])}"
                lines.append(f"| {task} | {system} | {label} | {_cell(d, shown_length)} | {_cell(s, shown_length)} "
                             f"| {paired} | {context} |")
                rows.append({"task": task, "system": system, "length": label, "n": len(cell),
                             "default_mean": sum(d) / len(d), "setting_mean": sum(s) / len(s), "paired": paired,
                             "context": context})
    return lines, rows


def _by(runs: list[dict[str, Any]], task: str, system: str, pairs: set[tuple[str, str, int, int]]) -> dict[Key, Any]:
    return {(r["task"], r["length"], r["seed"]): r for r in runs
            if r["task"] == task and r["system"] == system and (task, system, r["length"], r["seed"]) in pairs}


if __name__ == "__main__":
    main()
