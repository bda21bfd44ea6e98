"""benchmarks/relabel.py: a candidate's runs moved under the shipped model's name, the superseded runs dropped,
the move recorded in the file."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import relabel  # noqa: E402


def _run(task, system, seed, score):
    return {"task": task, "system": system, "length": 4096, "seed": seed, "score": score, "commit": "a" * 40,
            "context_tokens": 4000, "ingest_s": 1.0, "first_token_s": 0.1, "decode_tokens_per_s": 10.0,
            "peak_rss_mb": 10.0}


def _write(directory, name, runs, commands):
    (directory / f"{name}.json").write_text(json.dumps({"model": "m", "commands": commands, "runs": runs}))


def test_runs_move_renamed_with_their_chat_twins_and_the_old_ones_go(tmp_path):
    into = [_run("passkey", "engram-alloc", s, 0.0) for s in range(2)]
    into += [_run("passkey", "engram-alloc-chat", s, 0.0) for s in range(2)]
    into += [_run("passkey", "rag", s, 1.0) for s in range(2)]
    into += [_run("kv", "engram-alloc", 0, 0.0)]  # another task: not dropped
    source = [_run("passkey", "engram-alloc-no-idoc", s, 1.0) for s in range(2)]
    source += [_run("passkey", "engram-alloc-no-idoc-chat", 0, 1.0)]
    source += [_run("passkey", "engram-alloc-candidate", 0, 0.5)]  # not renamed: stays where it is
    source += [_run("kv", "engram-alloc-no-idoc", 0, 1.0)]  # not a task that moves
    _write(tmp_path, "into", into, ["python benchmarks/evaluate.py --systems allocation"])
    _write(tmp_path, "src", source, ["python benchmarks/evaluate.py --systems engram-alloc-no-idoc engram-x",
                                     "python benchmarks/evaluate.py --systems engram-x"])
    relabel.main(["--into", "into", "--source", "src", "--tasks", "passkey", "--rename",
                  "engram-alloc-no-idoc=engram-alloc", "--drop", "engram-alloc", "--because", "it shipped",
                  "--remove-moved", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "into.json").read_text())
    runs = {(r["task"], r["system"], r["seed"]): r for r in payload["runs"]}
    assert runs["passkey", "engram-alloc", 0]["score"] == 1.0 and runs["passkey", "engram-alloc", 1]["score"] == 1.0
    assert runs["passkey", "engram-alloc-chat", 0]["relabelled_from"] == "engram-alloc-no-idoc-chat"
    assert ("passkey", "engram-alloc-chat", 1) not in runs  # dropped, never re-made
    assert runs["kv", "engram-alloc", 0]["score"] == 0.0 and runs["passkey", "rag", 1]["score"] == 1.0
    assert len(payload["runs"]) == 6  # 3 kept, 3 moved
    assert payload["commands"][1] == "python benchmarks/evaluate.py --systems engram-alloc-no-idoc engram-x " \
                                     "(runs relabelled from src)"
    assert payload["commands"][-1].startswith("python benchmarks/relabel.py --into into")
    assert payload["relabelled"] == ["3 runs of passkey from src: engram-alloc-no-idoc -> engram-alloc, "
                                     "engram-alloc-no-idoc-chat -> engram-alloc-chat; runs of engram-alloc, "
                                     "engram-alloc-chat dropped (it shipped)"]
    assert "Relabelled: 3 runs of passkey" in (tmp_path / "into.md").read_text()
    left = json.loads((tmp_path / "src.json").read_text())["runs"]
    assert {(r["task"], r["system"]) for r in left} == {("passkey", "engram-alloc-candidate"),
                                                       ("kv", "engram-alloc-no-idoc")}


def test_a_rename_onto_runs_not_dropped_is_refused(tmp_path):
    _write(tmp_path, "into", [_run("passkey", "engram-alloc", 0, 0.0)], [])
    _write(tmp_path, "src", [_run("passkey", "engram-alloc-no-idoc", 0, 1.0)], [])
    with pytest.raises(SystemExit, match="--drop it"):
        relabel.main(["--into", "into", "--source", "src", "--tasks", "passkey", "--rename",
                      "engram-alloc-no-idoc=engram-alloc", "--because", "x", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="nope.json does not exist"):
        relabel.main(["--into", "nope", "--tasks", "passkey", "--because", "x", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="OLD=NEW"):
        relabel.main(["--into", "into", "--tasks", "passkey", "--rename", "engram-alloc", "--because", "x",
                      "--out", str(tmp_path)])


def test_a_run_in_two_sources_is_taken_once_from_the_later(tmp_path):
    _write(tmp_path, "into", [], [])
    _write(tmp_path, "c", [_run("passkey", "engram-best-candidate", 0, 0.0)], [])
    _write(tmp_path, "d", [_run("passkey", "engram-best-candidate", 0, 1.0)], [])
    relabel.main(["--into", "into", "--source", "c", "d", "--tasks", "passkey", "--rename",
                  "engram-best-candidate=engram-best", "--because", "x", "--out", str(tmp_path)])
    (run,) = json.loads((tmp_path / "into.json").read_text())["runs"]
    assert run["score"] == 1.0 and run["relabelled_source"] == "d"


def test_lengths_limit_the_move_and_a_same_name_move_keeps_the_name(tmp_path):
    old = [{**_run("niah-single", "engram-alloc-chat", 0, 0.0), "length": n} for n in (4096, 16384)]
    old += [{**_run("niah-single", "engram-alloc", 0, 1.0), "length": 16384}]  # the prompt path: stays
    _write(tmp_path, "into", old, [])
    _write(tmp_path, "again", [{**_run("niah-single", "engram-alloc-chat", 0, 1.0), "length": 16384}],
           ["python benchmarks/evaluate.py --systems engram-alloc-chat"])
    relabel.main(["--into", "into", "--source", "again", "--tasks", "niah-single", "--lengths", "16384",
                  "--rename", "engram-alloc-chat=engram-alloc-chat", "--drop", "engram-alloc-chat",
                  "--because", "the answer start", "--remove-moved", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "into.json").read_text())
    runs = {(r["system"], r["length"]): r for r in payload["runs"]}
    assert runs["engram-alloc-chat", 4096]["score"] == 0.0  # another length: kept
    moved = runs["engram-alloc-chat", 16384]
    assert moved["score"] == 1.0 and "relabelled_from" not in moved and moved["relabelled_source"] == "again"
    assert runs["engram-alloc", 16384]["score"] == 1.0 and len(payload["runs"]) == 3
    assert payload["relabelled"][0].startswith("1 runs of niah-single at 16384 tokens from again")
    assert json.loads((tmp_path / "again.json").read_text())["runs"] == []
