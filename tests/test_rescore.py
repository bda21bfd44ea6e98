"""The scorer matches answers as RULER's does (case ignored), and benchmarks/rescore.py scores stored
answers again from their replies: evaluation runs and calibration observations."""

import json
import sys
from pathlib import Path

from engramkv import hf
from engramkv.config import ModelConfig
from engramkv.tasks import TASKS, match_share

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import rescore  # noqa: E402


def test_an_answer_is_matched_with_case_ignored_in_the_reply_cut_at_its_repeat():
    assert match_share(["blue"], "The answer is: Blue") == 1.0
    assert match_share(["Turku", "27"], "turku, of course") == 0.5
    assert match_share(["7"], "No. No. No. 7") == 0.0  # cut where a sentence comes back a third time


def _run(seed, reply, answers, score):
    return {"task": "facts", "system": "rag", "length": 4096, "seed": seed, "score": score, "reply": reply,
            "answers": answers, "commit": "a" * 40, "context_tokens": 4000, "ingest_s": 1.0, "first_token_s": 0.1,
            "decode_tokens_per_s": 10.0, "peak_rss_mb": 10.0}


def test_evaluation_runs_are_scored_again_and_the_file_says_so(tmp_path):
    runs = [_run(0, "The answer is: Juniper", ["juniper"], 0.0), _run(1, "juniper", ["juniper"], 1.0),
            _run(2, "oak", ["juniper"], 0.0)]
    (tmp_path / "grid.json").write_text(json.dumps({"model": "m", "commands": ["python evaluate.py"], "runs": runs}))
    rescore.main(["--results", "grid", "--because", "case ignored", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "grid.json").read_text())
    assert [r["score"] for r in payload["runs"]] == [1.0, 1.0, 0.0]
    assert payload["runs"][0]["score_before_rescore"] == 0.0
    assert "score_before_rescore" not in payload["runs"][1] and "score_before_rescore" not in payload["runs"][2]
    assert payload["rescored"] == ["1 runs scored again (case ignored)"]
    assert payload["commands"][-1].startswith("python benchmarks/rescore.py --results grid")
    assert "Rescored: 1 runs scored again" in (tmp_path / "grid.md").read_text()


def test_calibration_observations_are_scored_again_from_their_samples(tmp_path):
    tokenizer, _ = hf.load_tokenizer(ModelConfig())
    sample = TASKS["conversation"](tokenizer, 2048, 100_000)
    reply = sample.answers[0].upper()
    rows = [{"sample": "s", "task": "conversation", "length": 2048, "seed": 100_000, "reply": reply, "score": 0.0},
            {"sample": "s", "task": "conversation", "length": 2048, "seed": 100_000, "reply": "no idea", "score": 0.0}]
    observations = tmp_path / "observations.jsonl"
    observations.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rescore.main(["--observations", str(observations), "--because", "case ignored"])
    again = [json.loads(line) for line in observations.read_text().splitlines()]
    assert again[0]["score"] == 1.0 and again[0]["score_before_rescore"] == 0.0
    assert again[1] == rows[1]
