"""benchmarks/allocation_report.py: the allocation grid merged from its result files, against the issue's
targets (paired differences, RAG with the recall split, chat-path parity)."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import allocation_report  # noqa: E402
from evalkit.stats import paired_bootstrap, sign_test  # noqa: E402


def _run(task, system, seed, score, length=4096, recalled=None, context=300, read=None):
    return {"task": task, "system": system, "length": length, "seed": seed, "score": score, "commit": "a" * 40,
            "answers_in_recalled": recalled, "answer_context_tokens": context, "answers_in_read": read}


def _write(directory, name, runs):
    (directory / f"{name}.json").write_text(json.dumps({"commit": "a" * 40, "commands": ["python x"],
                                                         "model": "m", "runs": runs}))


def test_the_report_merges_files_and_checks_the_targets(tmp_path):
    one = [_run("passkey", "engram-alloc", s, 1.0, recalled=1.0, read=1.0 if s < 5 else None) for s in range(20)]
    one += [_run("passkey", "engram-alloc-chat", s, 1.0 if s < 16 else 0.0) for s in range(20)]  # 0.8 of it
    one += [_run("passkey", "engram-best", s, 1.0 if s < 10 else 0.0, context=280) for s in range(20)]
    two = [_run("passkey", "rag", s, 1.0 if s % 2 else 0.0) for s in range(20)]
    two += [_run("kv", "engram-alloc", s, 0.0, recalled=0.0) for s in range(3)]
    _write(tmp_path, "a", one)
    _write(tmp_path, "b", two)
    allocation_report.main(["--dir", str(tmp_path), "--names", "a", "b", "--name", "out"])
    md = (tmp_path / "out.md").read_text()
    assert "| passkey | 4,096 | engram-alloc | 1.00 (20) | 0.80 | 0.80 (below) | -0.200 (" in md  # parity missed
    assert "| passkey | all | engram-alloc | 1.00 (20) | 0.80 | 0.80 (below) | -0.200 (" in md  # the task pooled
    assert "; n 20); 0 / 4 (p 0.125) |" in md
    assert "| kv | 4,096 | 0.00 (3) |" in md  # three samples: short of 20
    assert "0.00 (3*; " in md
    lo, hi = paired_bootstrap([1.0] * 20, [1.0 if s < 10 else 0.0 for s in range(20)])
    assert f"+0.500 ({lo:+.3f} to {hi:+.3f}; n 20); 10 / 0 (p {sign_test(10, 0):.3f})" in md  # against best
    assert "| passkey | 4,096 | 1.00 (20) | 1.00 | 1.00 (5) | 0.50 (20) |" in md  # against RAG, recall split
    assert "| kv | 4,096 | 0.00 (3) | 0.00 | - |" in md  # runs that did not record what they read
    payload = json.loads((tmp_path / "out.json").read_text())
    assert payload["summary"]["engram-alloc|passkey|4096"] == {"mean": 1.0, "n": 20}
    assert set(payload["sources"]) == {"a", "b"} and payload["commit"]


def test_a_missing_or_foreign_file_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        allocation_report.main(["--dir", str(tmp_path), "--names", "nope"])
    (tmp_path / "other.json").write_text(json.dumps({"figure": 1}))
    with pytest.raises(SystemExit, match="not an evaluation result file"):
        allocation_report.main(["--dir", str(tmp_path), "--names", "other"])


def test_sign_test_and_bootstrap():
    assert sign_test(0, 0) == 1.0 and sign_test(5, 5) == 1.0
    assert round(sign_test(10, 0), 4) == round(2 / 2**10, 4)
    lo, hi = paired_bootstrap([1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0])
    assert -1.0 <= lo <= 0.5 <= hi <= 1.0


def test_the_held_out_mean_pools_every_length(tmp_path):
    runs = [_run("passkey", "engram-alloc", s, 1.0, length=n) for s in range(4) for n in (4096, 8192)]
    runs += [_run("passkey", "engram-best", s, 0.0 if n == 8192 else 1.0, length=n) for s in range(4)
             for n in (4096, 8192)]
    _write(tmp_path, "a", runs)
    allocation_report.main(["--dir", str(tmp_path), "--names", "a", "--name", "out"])
    md = (tmp_path / "out.md").read_text()
    assert "| prompt | 8,192 | engram-best | 0.000 (4) | 300 | +1.000 (" in md
    assert "| prompt | all | engram-best | 0.500 (8) | 300 | +0.500 (" in md  # both lengths' samples
    assert "| prompt | all | engram-alloc | 1.000 (8) | 300 | - |" in md


def test_a_row_of_several_lengths_counts_questions_not_samples(tmp_path):
    # 10 questions (seeds) at two lengths: chat loses question 0 at both lengths and wins question 1 at one.
    runs = [_run("passkey", "engram-alloc", s, 1.0, length=n) for s in range(10) for n in (4096, 8192)]
    runs += [_run("passkey", "engram-alloc-chat", s, 0.0 if s == 0 else 1.0, length=n) for s in range(10)
             for n in (4096, 8192)]
    runs[1]["score"] = runs[2]["score"] = 0.0  # seed 0 at 8k and seed 1 at 4k: the prompt path misses
    _write(tmp_path, "a", runs)
    allocation_report.main(["--dir", str(tmp_path), "--names", "a", "--name", "out"])
    md = (tmp_path / "out.md").read_text()
    # seed 0: chat -1 at 4k, 0 at 8k (both missed); seed 1: chat +1 at 4k: one question each way
    assert "| passkey | all | engram-alloc | 0.90 (20) | 0.90 | 1.00 | +0.000 (" in md
    assert "; n 20, 10 questions); 1 / 1 (p 1.000) |" in md
    assert "; n 10); 1 / 1 (p 1.000) |" in md  # one length: samples are the unit


def test_the_clustered_bootstrap_is_wider_where_clusters_repeat_one_outcome():
    a, b = [1.0] * 8 + [0.0] * 8, [0.0] * 16  # two clusters of 8 identical pairs and 8 of none: (1, 0) per pair
    clusters = [0] * 8 + [1] * 8
    assert paired_bootstrap(a, b, clusters=clusters) == (0.0, 1.0)  # two questions: either may be drawn twice
    lo, hi = paired_bootstrap(a, b)
    assert 0.2 < lo < 0.5 < hi < 0.8  # sixteen independent pairs
    assert paired_bootstrap(a, b, clusters=list(range(16))) != (0.0, 1.0)


def test_tasks_narrow_the_report_and_a_grid_without_rag_has_no_rag_section(tmp_path):
    runs = [_run(task, system, s, 1.0) for task in ("passkey", "kv") for system in ("engram-alloc", "engram-alloc-chat")
            for s in range(3)]
    _write(tmp_path, "a", runs)
    allocation_report.main(["--dir", str(tmp_path), "--names", "a", "--name", "out", "--tasks", "passkey"])
    md = (tmp_path / "out.md").read_text()
    assert "| passkey | 4,096 | engram-alloc |" in md and "| kv |" not in md
    assert "Against RAG" not in md
    with pytest.raises(SystemExit, match="no runs in a of facts"):
        allocation_report.main(["--dir", str(tmp_path), "--names", "a", "--tasks", "facts"])


def test_the_list_candidate_is_paired_with_the_models_prompt_answers(tmp_path):
    runs = [_run("niah-multiquery", "engram-alloc", s, 1.0) for s in range(4)]
    runs += [_run("niah-multiquery", "engram-alloc-list-chat", s, 1.0 if s else 0.0) for s in range(4)]
    _write(tmp_path, "a", runs)
    allocation_report.main(["--dir", str(tmp_path), "--names", "a", "--name", "out"])
    md = (tmp_path / "out.md").read_text()
    assert "| niah-multiquery | 4,096 | engram-alloc (engram-alloc-list-chat) | 1.00 (4) | 0.75 | 0.75 (below) |" in md
