"""benchmarks/calibration_compare.py: two calibration runs paired answer by answer."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import calibration_compare  # noqa: E402


def _observations(path, scores):
    rows = [{"sample": f"passkey-4096-{seed}", "task": "passkey", "length": 4096, "seed": seed,
             "theta": {"k": k, "s": 128, "n": 1, "m": 0, "w": 0}, "score": score, "context_tokens": 250 + k}
            for (seed, k), score in scores.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_answers_are_paired_by_sample_and_theta(tmp_path):
    base = _observations(tmp_path / "a.jsonl", {(s, k): 0.0 for s in range(5) for k in (1, 2)})
    other = _observations(tmp_path / "b.jsonl", {(s, k): float(s < 3) for s in range(6) for k in (1, 2)})
    calibration_compare.main(["--base", str(base), "--other", str(other), "--base-label", "events",
                              "--other-label", "centred", "--name", "cmp", "--out", str(tmp_path), "--ran", "x"])
    md = (tmp_path / "cmp.md").read_text()
    assert "10 answers (5 samples" in md  # the sixth sample is in one run only
    assert "| all | 10 | 0.000 (0.00-0.28) | 0.600 (" in md and "| 6 / 0 (p 0.031) |" in md
    summary = json.loads((tmp_path / "cmp.json").read_text())["summary"]
    assert summary["all"] == {"n": 10, "events": 0.0, "centred": 0.6}


def test_runs_with_nothing_in_common_are_refused(tmp_path):
    base = _observations(tmp_path / "a.jsonl", {(0, 1): 1.0})
    other = _observations(tmp_path / "b.jsonl", {(1, 1): 1.0})
    with pytest.raises(SystemExit, match="share no"):
        calibration_compare.main(["--base", str(base), "--other", str(other), "--out", str(tmp_path)])
