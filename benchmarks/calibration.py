"""The allocation model's calibration as a result file: fit (or run and fit) `engramkv calibrate`'s
observations and write results/calibration/NAME.{json,md,observations.jsonl}.

    python benchmarks/calibration.py --work-dir /work/calwork --fit-only --ship \\
        --ran "engramkv calibrate --tasks passkey niah-single niah-multikey --work-dir /work/calwork"

The table gives, per theta of the design, the mean score over the calibration samples with its n and
95% Wilson interval, per task, and the fit's R^2 and MSE on the held-out samples beside its ablations.
`--ship` also writes the coefficients into the package (engramkv/coefficients/), where
`allocation.mode = "model"` reads them for the model. `--ran` records the commands that wrote the
observations (a calibration is often run in several processes, one per group of tasks).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from _common import RESULTS, write_results
from evalkit.stats import paired_bootstrap, sign_test, wilson
from engramkv import EngineConfig, calibrate
from engramkv.retrieval.allocation import coefficients_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, required=True, help="the calibration's work directory")
    parser.add_argument("--fit-only", action="store_true", help="fit the observations there; run nothing")
    parser.add_argument("--ship", action="store_true", help="write the coefficients into engramkv/coefficients/")
    parser.add_argument("--ran", action="append", default=[], help="a command that wrote the observations")
    parser.add_argument("--name", default="calibration")
    parser.add_argument("--same-observations-as", default=None, metavar="NAME",
                        help="the work dir's observations are those of results/calibration/NAME (another fit of the "
                        "same answers): they are checked equal and not copied again")
    parser.add_argument("--features", nargs="+", default=None, metavar="FEATURE",
                        help="the informativeness features the fit uses (allocation.features; default: all)")
    parser.add_argument("--tolerances", nargs="+", type=float, default=[], metavar="T",
                        help="also refit under each allocation.tolerance and report the model's out-of-fold choice")
    args = parser.parse_args()

    cfg = EngineConfig()
    cfg = cfg.model_copy(update={"allocation": cfg.allocation.model_copy(update={"features": args.features})})
    lm = None
    if not args.fit_only:
        from engramkv import EpisodicLM

        lm = EpisodicLM.from_pretrained()
    out = RESULTS / "calibration"
    coefficients = out / f"{args.name}.coefficients.json"
    report = calibrate(lm, cfg, coefficients, args.work_dir, fit_only=args.fit_only, progress=print)
    observations = out / f"{args.same_observations_as or args.name}.observations.jsonl"
    if args.same_observations_as is None:
        shutil.copyfile(args.work_dir / "observations.jsonl", observations)
    elif observations.read_bytes() != (args.work_dir / "observations.jsonl").read_bytes():
        raise SystemExit(f"{args.work_dir / 'observations.jsonl'} differs from {observations}")
    rows = [json.loads(line) for line in observations.read_text().splitlines() if line.strip()]
    if args.ship:
        target = coefficients_path(report.model_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(coefficients, target)

    by_theta: dict[str, list[float]] = defaultdict(list)
    by_task: dict[tuple[str, int], list[float]] = defaultdict(list)
    for row in rows:
        by_theta[json.dumps(row["theta"])].append(row["score"])
        by_task[row["task"], row["length"]].append(row["score"])
    samples = sorted({row["sample"] for row in rows})
    per_sample = Counter(row["sample"] for row in rows)
    designs = ", ".join(f"{count} samples under {size}" for size, count in
                        sorted(Counter(per_sample.values()).items(), reverse=True))
    lines = [f"# Calibration of the allocation model ({report.model_id})", "",
             f"{len(rows)} answers: {len(samples)} calibration samples (seeds from 100000, disjoint from the "
             f"evaluation's) under {len(by_theta)} thetas ({designs}: the n of each theta below), each asked as a "
             "chat turn from the sample's store opened read-only. Observations written by: "
             + "; ".join(f"`{c}`" for c in args.ran or ["(this script)"])
             + f". Cross-validated over samples in {cfg.calibration.holdout} folds: each sample's answers "
             "predicted, and answered by the model's choice among its own thetas, from a fit without its fold; "
             "the coefficients shipped are fitted on all of them.", "",
             "## Fit, out of fold", "",
             "`model`: logit(P) = (a + B i)^T log(theta + eps) + c; `no_interaction`: B = 0 (the paper's ablation); "
             f"`linear`: the same regressors fitted to P itself; i: the features {report.model.features}. Per "
             "cell: predicted and observed scores averaged over the samples of one task, length and theta. The "
             "paper reports R^2 0.903 for its generator's averaged metrics. Ridge: the term each fit on all "
             f"samples kept (of {cfg.allocation.ridge}, by the least held-out MSE; inside each fold, chosen on "
             "that fold's training samples alone).", "",
             "| fit | R^2 per answer | MSE per answer | R^2 per cell | MSE per cell | ridge |",
             "|---|---|---|---|---|---|"]
    for name, fit in report.fits.items():
        lines.append(f"| {name} | {fit.r2:+.3f} | {fit.mse:.4f} | {fit.r2_cells:+.3f} | {fit.mse_cells:.4f} | "
                     f"{fit.ridge:g} |")
    lines += ["", "## The model's choice against fixed thetas, out of fold", "",
              "Per sample: the answer under the default theta, under the best fixed theta of the other folds, and "
              "under the choice of the other folds' model among the design, made as a session makes it: `model` "
              "within the best fixed theta's context, `model_as_shipped` as the config answers by default "
              f"(`allocation.default_limit` = {report.config['allocation']['default_limit']!r}: 'best_fixed' is the "
              "same limit, 'none' no limit). Against default: the mean paired difference from the default "
              "theta's answer to the same sample (95% interval: 10,000 bootstrap resamples of the samples), and "
              "the samples answered better / worse (the two-sided sign test's p).", "",
              "| theta | mean score (n; 95% interval) | mean context tokens | against default |",
              "|---|---|---|---|"]
    base = report.held_out_per_sample["default"]
    for name in report.held_out_scores:
        mean, per_sample = report.held_out_scores[name], report.held_out_per_sample[name]
        lo, hi = wilson(mean, len(per_sample))
        better = sum(x > y for x, y in zip(per_sample, base))
        worse = sum(x < y for x, y in zip(per_sample, base))
        lo_d, hi_d = paired_bootstrap(per_sample, base)
        versus = "-" if name == "default" else (
            f"{mean - _mean(base):+.3f} ({lo_d:+.3f} to {hi_d:+.3f}); {better} / {worse} "
            f"(p {sign_test(better, worse):.3f})")
        lines.append(f"| {name} | {mean:.3f} ({len(per_sample)}; {lo:.2f}-{hi:.2f}) | "
                     f"{report.held_out_context[name]:,.0f} | {versus} |")
    lines += ["", f"Default theta {report.default_theta}; best fixed theta {report.best_fixed_theta}.", ""]
    if args.tolerances:
        lines += _tolerances(cfg, args.work_dir, args.tolerances)
    lines += [
              "## Score per theta (all samples)", "", "| k | s | n | m | w | score (n; 95% interval) |",
              "|---|---|---|---|---|---|"]
    for theta, scores in sorted(by_theta.items(), key=lambda kv: -sum(kv[1]) / len(kv[1])):
        t = json.loads(theta)
        mean = sum(scores) / len(scores)
        lo, hi = wilson(mean, len(scores))
        lines.append(f"| {t['k']} | {t['s']} | {t['n']} | {t['m']} | {t['w']} | {mean:.2f} ({len(scores)}; "
                     f"{lo:.2f}-{hi:.2f}) |")
    lines += ["", "## Score per task (all thetas)", "", "| task | length | score (n; 95% interval) |", "|---|---|---|"]
    for (task, length), scores in sorted(by_task.items()):
        mean = sum(scores) / len(scores)
        lo, hi = wilson(mean, len(scores))
        lines.append(f"| {task} | {length:,} | {mean:.2f} ({len(scores)}; {lo:.2f}-{hi:.2f}) |")
    payload = {"report": report.model_dump(mode="json"), "ran": args.ran,
               "observations": observations.name, "coefficients": coefficients.name}
    write_results(out, args.name, payload, "\n".join(lines) + "\n", cfg)


def _tolerances(cfg: EngineConfig, work_dir: Path, tolerances: list[float]) -> list[str]:
    """The model's out-of-fold choice refitted under each `allocation.tolerance` (the fit is the same; the
    choice takes the cheapest theta predicted within the tolerance of the best)."""
    lines = ["## The model's choice per tolerance, out of fold", "",
             f"`model` as above, refitted with `allocation.tolerance` each of {tolerances} "
             f"(the coefficients shipped use {cfg.allocation.tolerance:g}).", "",
             "| tolerance | model: mean score (n; 95% interval) | mean context tokens |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        for tolerance in tolerances:
            tolerant = cfg.model_copy(update={"allocation": cfg.allocation.model_copy(update={"tolerance": tolerance})})
            report = calibrate(None, tolerant, Path(scratch) / "coefficients.json", work_dir, fit_only=True)
            mean, n = report.held_out_scores["model"], len(report.held_out_per_sample["model"])
            lo, hi = wilson(mean, n)
            lines.append(f"| {tolerance:g} | {mean:.3f} ({n}; {lo:.2f}-{hi:.2f}) | "
                         f"{report.held_out_context['model']:,.1f} |")
    return lines + [""]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


if __name__ == "__main__":
    main()
