"""The evaluation harness: every task makes a sample of its length; --quick runs every default system."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from evalkit.systems import DEFAULT_SYSTEMS as SYSTEMS  # noqa: E402
from evalkit.tasks import TASKS  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("length", [2048, 8192])
def test_every_task_makes_a_sample_of_about_its_length_with_its_answers_in_it(default_lm, length):
    tokenizer = default_lm.tokenizer
    for name, make in TASKS.items():
        sample = make(tokenizer, length, 3)
        text = "".join(sample.context)
        n = len(tokenizer.encode(text + sample.prompt, add_special_tokens=False))
        assert sample.question in sample.prompt and text == text.rstrip(), name  # no lone trailing space token
        assert 0.85 * length <= n <= 1.1 * length, (name, n)
        assert sample.answers and all(answer in text for answer in sample.answers), name
        assert sample.score(" and ".join(sample.answers)) == 1.0 and sample.score("no idea") == 0.0
        assert make(tokenizer, length, 3) == sample  # seeded
        assert make(tokenizer, length, 4).answers != sample.answers, name


def test_quick_runs_every_system_and_writes_table_json_and_plot(tmp_path):
    subprocess.run([sys.executable, "evaluate.py", "--quick", "--out", str(tmp_path), "--name", "quick"],
                   cwd=BENCHMARKS, check=True, capture_output=True, text=True, timeout=1800)
    runs = json.loads((tmp_path / "quick.json").read_text())["runs"]
    assert {(r["task"], r["system"]) for r in runs} == {
        (task, system) for task in ("passkey", "niah-multikey", "conversation") for system in SYSTEMS
    }
    for r in runs:
        assert 0 <= r["score"] <= 1 and r["first_token_s"] >= 0 and r["peak_rss_mb"] > 0, r
    for system in SYSTEMS:  # each system answered something
        assert any(r["reply"].strip() for r in runs if r["system"] == system), system
    passkey = {r["system"]: r["score"] for r in runs if r["task"] == "passkey"}
    assert passkey["engram"] == 1.0 and passkey["full"] == 1.0  # 2k tokens: both must find it
    table = (tmp_path / "quick.md").read_text()
    assert all(f"| {system} |" in table for system in SYSTEMS)
    assert (tmp_path / "quick.png").stat().st_size > 10_000

    # --resume runs only what the results lack: drop one run, and only that one comes back
    path = tmp_path / "quick.json"
    payload = json.loads(path.read_text())
    dropped = next(r for r in payload["runs"] if r["task"] == "passkey" and r["system"] == "streaming")
    payload["runs"].remove(dropped)
    path.write_text(json.dumps(payload))
    out = subprocess.run([sys.executable, "evaluate.py", "--quick", "--resume", "--out", str(tmp_path), "--name",
                          "quick"], cwd=BENCHMARKS, check=True, capture_output=True, text=True, timeout=600).stdout
    assert out.count("seed 0: score") == 1 and "passkey          streaming" in out
    resumed = json.loads(path.read_text())
    # the same command run again (quick mode records no --resume) is listed once in the header
    assert len(resumed["runs"]) == len(runs) and len(resumed["commands"]) == 1
    assert {(r["task"], r["system"]) for r in resumed["runs"]} == {(r["task"], r["system"]) for r in runs}

    # --merge folds in the runs of another process's results: split them, and merging runs nothing new
    moved = [r for r in resumed["runs"] if r["task"] == "conversation"]
    (tmp_path / "other.json").write_text(json.dumps({**resumed, "runs": moved, "commands": ["other command"]}))
    path.write_text(json.dumps({**resumed, "runs": [r for r in resumed["runs"] if r not in moved]}))
    out = subprocess.run([sys.executable, "evaluate.py", "--quick", "--resume", "--merge", "other", "--out",
                          str(tmp_path), "--name", "quick"], cwd=BENCHMARKS, check=True, capture_output=True,
                         text=True, timeout=600).stdout
    merged = json.loads(path.read_text())
    assert "seed 0: score" not in out and len(merged["runs"]) == len(runs)
    assert "other command" in merged["commands"] and "`other command`" in (tmp_path / "quick.md").read_text()
