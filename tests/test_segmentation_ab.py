"""benchmarks/segmentation_ab.py: an opt-in segmentation against the default on the same grid samples."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import segmentation_ab  # noqa: E402

FLOOR = {"min_surprise": 1.0, "predicted_event": 32}


def _run(system, seed, score, length=4096, segmentation=None):
    run = {"task": "passkey", "system": system, "length": length, "seed": seed, "score": score,
           "answer_context_tokens": 250}
    return {**run, "segmentation": segmentation} if segmentation else run


def _write(directory, name, runs):
    (directory / f"{name}.json").write_text(json.dumps({"commit": "a" * 40, "commands": ["python x"],
                                                         "model": "m", "runs": runs}))


def test_pairs_the_same_samples_and_counts_who_won(tmp_path):
    _write(tmp_path, "default", [_run("engram", s, 1.0 if s < 15 else 0.0) for s in range(20)]
           + [_run("engram", s, 1.0, length=8192) for s in range(20)] + [_run("engram-chat", 0, 1.0)])
    _write(tmp_path, "floor", [_run("engram", s, 1.0 if s != 3 else 0.0, segmentation=FLOOR) for s in range(22)])
    segmentation_ab.main(["--setting", "floor", "--default", "default", "--dir", str(tmp_path), "--name", "ab"])
    written = json.loads((tmp_path / "ab.json").read_text())
    assert written["segmentation"] == FLOOR and written["commit"]
    (row,) = [r for r in written["rows"] if r["length"] == "4,096"]
    assert row["n"] == 20 and row["default_mean"] == 0.75 and row["setting_mean"] == 0.95  # seeds 20, 21 unpaired
    assert "5 / 1" in row["paired"]  # seeds 15-19 better, seed 3 worse
    assert {r["system"] for r in written["rows"]} == {"engram"}  # engram-chat was answered one way only
    assert "| passkey | engram | 4,096 |" in (tmp_path / "ab.md").read_text()


def test_refuses_files_of_mixed_or_no_settings(tmp_path):
    _write(tmp_path, "default", [_run("engram", 0, 1.0)])
    _write(tmp_path, "plain", [_run("engram", 0, 1.0)])
    _write(tmp_path, "mixed", [_run("engram", 0, 1.0, segmentation=FLOOR),
                               _run("engram", 1, 1.0, segmentation={"min_surprise": 2.0})])
    for name in ("plain", "mixed"):
        with pytest.raises(SystemExit, match="one --segmentation setting"):
            segmentation_ab.main(["--setting", name, "--default", "default", "--dir", str(tmp_path), "--name", "x"])


def test_default_runs_may_set_the_grids_own_segmentation_but_no_other(tmp_path):
    grid = {"min_surprise": 0, "predicted_event": None}
    _write(tmp_path, "floor", [_run("engram", 0, 1.0, segmentation=FLOOR)])
    _write(tmp_path, "grid", [_run("engram", 0, 0.0), _run("engram", 1, 1.0, segmentation=grid)])
    segmentation_ab.main(["--setting", "floor", "--default", "grid", "--dir", str(tmp_path), "--name", "ab"])
    _write(tmp_path, "other", [_run("engram", 0, 0.0, segmentation=FLOOR)])
    with pytest.raises(SystemExit, match="other than the grid's"):
        segmentation_ab.main(["--setting", "floor", "--default", "other", "--dir", str(tmp_path), "--name", "x"])
