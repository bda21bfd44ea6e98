"""Two calibration runs answer by answer: the same samples under the same thetas, two configurations.

`engramkv calibrate` writes every answer to `observations.jsonl` (sample, theta, score, context tokens). Run
it twice with the same tasks, lengths and samples and another `--config`, and this pairs the answers of the
two runs: the mean score of each (n; 95% Wilson interval), the paired difference (95% bootstrap interval
over answers and over samples), answers better / worse (two-sided sign test), per task and per theta, and
the mean context tokens. Writes `results/calibration/NAME.{json,md}`.

    python benchmarks/calibration_compare.py --base /work/calwork/observations.jsonl \\
        --other /work/calwork_centred/a/observations.jsonl /work/calwork_centred/b/observations.jsonl \\
        --base-label events --other-label centred --name answer_reading --ran "engramkv calibrate ..."
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from _common import RESULTS, write_results
from evalkit.stats import paired_bootstrap, sign_test, wilson

Key = tuple[str, str]  # (sample, theta as JSON)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", nargs="+", type=Path, required=True, help="observations.jsonl of the first run")
    parser.add_argument("--other", nargs="+", type=Path, required=True, help="observations.jsonl of the second")
    parser.add_argument("--base-label", default="base")
    parser.add_argument("--other-label", default="other")
    parser.add_argument("--name", default="compare", help="results/calibration/NAME.{json,md}")
    parser.add_argument("--ran", action="append", default=[], help="the commands that made the runs (recorded)")
    parser.add_argument("--out", type=Path, default=RESULTS / "calibration")
    args = parser.parse_args(argv)
    base, other = read(args.base), read(args.other)
    pairs = sorted(set(base) & set(other))
    if not pairs:
        raise SystemExit("the two runs share no (sample, theta) answer: same tasks, lengths, samples and design?")
    lines, summary = compare(base, other, pairs, args.base_label, args.other_label)
    if args.ran:
        lines += ["", "Runs: " + "; ".join(f"`{c}`" for c in args.ran) + "."]
    payload = {"base": [str(p) for p in args.base], "other": [str(p) for p in args.other], "ran": args.ran,
               "labels": [args.base_label, args.other_label], "summary": summary}
    write_results(args.out, args.name, payload, "\n".join(lines) + "\n", {"compare": [args.base_label, args.other_label]})
    print("\n".join(lines))


def read(paths: list[Path]) -> dict[Key, dict[str, Any]]:
    rows: dict[Key, dict[str, Any]] = {}
    for path in paths:
        if not path.exists():
            raise SystemExit(f"{path} does not exist")
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["sample"], json.dumps(row["theta"], sort_keys=True)] = row
    return rows


def _row(label: str, a: list[float], b: list[float], ctx_a: list[float], ctx_b: list[float]) -> str:
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    lo, hi = paired_bootstrap(b, a)
    better, worse = sum(y > x for x, y in zip(a, b)), sum(y < x for x, y in zip(a, b))
    cell_a, cell_b = wilson(mean_a, len(a)), wilson(mean_b, len(b))
    return (f"| {label} | {len(a)} | {mean_a:.3f} ({cell_a[0]:.2f}-{cell_a[1]:.2f}) | "
            f"{mean_b:.3f} ({cell_b[0]:.2f}-{cell_b[1]:.2f}) | {mean_b - mean_a:+.3f} ({lo:+.3f} to {hi:+.3f}) | "
            f"{better} / {worse} (p {sign_test(better, worse):.3f}) | {sum(ctx_a) / len(ctx_a):,.0f} / "
            f"{sum(ctx_b) / len(ctx_b):,.0f} |")


def compare(base: dict[Key, dict[str, Any]], other: dict[Key, dict[str, Any]], pairs: list[Key],
            base_label: str, other_label: str) -> tuple[list[str], dict[str, Any]]:
    groups: dict[str, list[Key]] = defaultdict(list)
    for key in pairs:
        groups["all"].append(key)
        groups[f"task {base[key]['task']}"].append(key)
        groups[f"theta {key[1]}"].append(key)
    samples = sorted({s for s, _ in pairs})
    per_sample_a = [sum(base[k]["score"] for k in pairs if k[0] == s) / sum(k[0] == s for k in pairs) for s in samples]
    per_sample_b = [sum(other[k]["score"] for k in pairs if k[0] == s) / sum(k[0] == s for k in pairs) for s in samples]
    lo, hi = paired_bootstrap(per_sample_b, per_sample_a)
    lines = [f"# Calibration answers paired: {base_label} against {other_label}", "",
             f"{len(pairs)} answers ({len(samples)} samples x their thetas) answered under both. Difference: "
             f"{other_label} minus {base_label}, paired on the same sample and theta (95% bootstrap interval over "
             "answers); better / worse: answers where the second scores higher / lower (two-sided sign test). "
             f"Over samples (each sample's mean over its thetas, resampled by sample): "
             f"{(sum(per_sample_b) - sum(per_sample_a)) / len(samples):+.3f} ({lo:+.3f} to {hi:+.3f}).", "",
             f"| answers | n | {base_label} (95%) | {other_label} (95%) | difference | better / worse | "
             f"context tokens |", "|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    for name in ["all", *sorted(g for g in groups if g.startswith("task")), *sorted(g for g in groups if g.startswith("theta"))]:
        keys = groups[name]
        a, b = [base[k]["score"] for k in keys], [other[k]["score"] for k in keys]
        ctx_a = [base[k]["context_tokens"] for k in keys]
        ctx_b = [other[k]["context_tokens"] for k in keys]
        label = name if not name.startswith("theta") else "theta " + ", ".join(
            f"{p}={v}" for p, v in json.loads(name[6:]).items())
        lines.append(_row(label, a, b, ctx_a, ctx_b))
        summary[name] = {"n": len(keys), base_label: sum(a) / len(a), other_label: sum(b) / len(b)}
    return lines, summary


if __name__ == "__main__":
    main()
