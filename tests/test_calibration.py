"""`engramkv calibrate` on a tiny model: every sample answered under every theta of the design from its
store, resumable; the fit's report; coefficients a session can load."""

import json
import random

import pytest
import torch

from engramkv import EngineConfig, InputError, Theta, calibrate
from engramkv.retrieval.allocation import load_model as allocation_model
from engramkv.calibration import _best_fixed, _held_out_choice, answer_path, design, fit_observations, refeature, run
from engramkv.config import (AllocationConfig, CalibrationConfig, GenerationConfig, RecallConfig, SegmentationConfig,
                             WindowConfig)
from engramkv.retrieval import allocation
from engramkv.retrieval.allocation import AllocationModel
from engramkv.chat import cut_repeats
from engramkv.tasks import CALIBRATION_SEEDS

from conftest import VOCAB, IntTokenizer, tiny_pair


class ModTokenizer(IntTokenizer):
    """The tasks' 5- and 7-digit numbers, folded into the tiny vocabulary."""

    def encode(self, text, add_special_tokens=False):
        return [i % VOCAB for i in super().encode(text, add_special_tokens)]

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=96, answer_budget_tokens=48, answer_hits=2),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
    allocation=AllocationConfig(k=[1, 2], s=[8, 16], n=[1, 2], m=[0, 1], w=[0, 64], draft_tokens=2),
    calibration=CalibrationConfig(tasks=["passkey", "niah-single"], lengths=[300], samples=2, design_size=2,
                                  design_extra=[], holdout=2, max_new_tokens=3),
)


def test_every_sample_is_answered_under_the_design_once_and_a_rerun_resumes(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    lm.tokenizer = ModTokenizer()
    observations = tmp_path / "observations.jsonl"
    assert run(lm, CFG, tmp_path, observations, lambda line: None) == 4 * 3  # 4 samples x (default + 2)
    rows = [json.loads(line) for line in observations.read_text().splitlines()]
    assert {row["seed"] for row in rows} == {CALIBRATION_SEEDS, CALIBRATION_SEEDS + 1}  # not the evaluation's
    assert {tuple(row["theta"].values()) for row in rows} == {tuple(t.__dict__.values()) for t in design(
        CFG, Theta(2, 24, 1, 0, 64))}
    assert all(len(row["features"]) == len(allocation.FEATURES) and 0 <= row["score"] <= 1 for row in rows)
    assert all(isinstance(value, float) for row in rows for value in row["features"])  # values, not names
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # each sample's store is gone once answered
    # the same theta twice from the read-only store: the same reply (no answer sees another)
    first = {(r["sample"], json.dumps(r["theta"])): r["reply"] for r in rows}
    observations.write_text(observations.read_text()[:-40])  # a kill cut the last line short
    assert run(lm, CFG, tmp_path, observations, lambda line: None) == 1
    again = [json.loads(line) for line in observations.read_text().splitlines()]
    assert len(again) == 12
    last = again[-1]
    assert first[(last["sample"], json.dumps(last["theta"]))] == last["reply"]
    assert run(lm, CFG, tmp_path, observations, lambda line: None) == 0


def _answered_before_the_last_feature(tmp_path, first_row_zeros=False):
    """A calibration run's lm, observations file and rows, the file rewritten without each row's last feature."""
    _, lm = tiny_pair("llama", CFG)
    lm.tokenizer = ModTokenizer()
    observations = tmp_path / "observations.jsonl"
    run(lm, CFG, tmp_path, observations, lambda line: None)
    rows = [json.loads(line) for line in observations.read_text().splitlines()]
    older = [{**row, "features": row["features"][:-1]} for row in rows]
    if first_row_zeros:
        older[0]["features"] = [0.0] * (len(allocation.FEATURES) - 1)
    observations.write_text("".join(json.dumps(row) + "\n" for row in older))
    return lm, observations, rows


def test_refeature_measures_again_the_features_of_older_observations_and_keeps_their_answers(tmp_path):
    lm, observations, rows = _answered_before_the_last_feature(tmp_path, first_row_zeros=True)
    assert refeature(lm, CFG, tmp_path, observations, lambda line: None) == 4  # every sample, once
    again = [json.loads(line) for line in observations.read_text().splitlines()]
    assert [r["features"] for r in again] == [r["features"] for r in rows]  # measured as the answers were
    assert [(r["reply"], r["score"], r["theta"]) for r in again] == [(r["reply"], r["score"], r["theta"]) for r in rows]
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # the stores made for it are gone
    assert refeature(lm, CFG, tmp_path, observations, lambda line: None) == 0


def test_a_theta_added_to_the_design_is_answered_and_gives_older_rows_the_features_measured_now(tmp_path):
    lm, observations, rows = _answered_before_the_last_feature(tmp_path)
    extra = Theta(1, 8, 1, 0, 0)
    assert extra not in design(CFG, Theta(2, 24, 1, 0, 64))
    extra_cfg = CFG.calibration.model_copy(update={"design_extra": [[1, 8, 1, 0, 0]]})
    wider = CFG.model_copy(update={"calibration": extra_cfg})
    assert extra in design(wider, Theta(2, 24, 1, 0, 64))
    assert run(lm, wider, tmp_path, observations, lambda line: None) == 4  # the new theta, once per sample
    again = [json.loads(line) for line in observations.read_text().splitlines()]
    assert [r["features"] for r in again[: len(rows)]] == [r["features"] for r in rows]
    assert [(r["reply"], r["theta"]) for r in again[: len(rows)]] == [(r["reply"], r["theta"]) for r in rows]
    assert all(len(r["features"]) == len(allocation.FEATURES) for r in again)


def test_a_design_extra_off_the_grid_is_an_input_error():
    off_grid = CFG.calibration.model_copy(update={"design_extra": [[3, 8, 1, 0, 0]]})
    off = CFG.model_copy(update={"calibration": off_grid})
    with pytest.raises(InputError, match="design_extra"):
        design(off, Theta(2, 24, 1, 0, 64))


def _synthetic_observations(path, truth, n_samples=40):
    rng = random.Random(0)
    thetas = design(EngineConfig(), Theta(4, 128, 1, 0, 1024))
    with path.open("w") as out:
        for i in range(n_samples):
            features = [rng.uniform(0, 4), rng.random(), rng.randint(0, 5), rng.uniform(-0.05, 0.05),
                        rng.uniform(-2, 2), rng.randint(0, 1)]
            for theta in thetas:
                score = truth.predict(theta, torch.tensor(features, dtype=torch.float64))
                out.write(json.dumps({"sample": f"s{i}", "task": "t", "length": 0, "seed": i,
                                      "theta": theta.__dict__, "features": features, "reply": "",
                                      "score": score,
                                      "context_tokens": theta.k * theta.s * theta.n + theta.w + 40 * theta.m}) + "\n")


def test_the_fit_reports_held_out_quality_and_writes_loadable_coefficients(tmp_path):
    g = torch.Generator().manual_seed(0)
    truth = AllocationModel(a=(torch.randn(5, generator=g) * 0.3).tolist(),
                            b=(torch.randn(5, len(allocation.FEATURES), generator=g) * 0.05).tolist(), c=-0.3, eps=0.01,
                            features=list(allocation.FEATURES))
    _synthetic_observations(tmp_path / "observations.jsonl", truth)
    exact = EngineConfig(allocation=AllocationConfig(score_clip=1e-6, ridge=[0.0]))  # nothing shrinks the fit
    report = calibrate(None, exact, tmp_path / "coefficients.json", tmp_path, fit_only=True,
                       model_id="tiny-llama")
    assert set(report.fits) == {"model", "no_interaction", "linear"}
    assert report.fits["model"].r2 > 0.99  # noise-free scores from the model's own form
    assert report.fits["model"].mse <= report.fits["no_interaction"].mse
    assert report.held_out == report.observations == 40 * 19  # each sample predicted by a fit without it
    loaded = allocation_model(AllocationConfig(mode="model", coefficients=str(tmp_path / "coefficients.json")),
                              "tiny-llama")
    assert loaded == report.model
    assert report.held_out_context["model"] <= report.held_out_context["best_fixed"]


def test_the_held_out_choice_is_made_on_nominal_costs_as_a_session_makes_it():
    # (1, 128) and (4, 32) read 128 memory tokens each; measured, the k = 4 answer read 3 fewer (event
    # boundaries), which must not decide between them: a session prices both the same and takes the better
    # predicted, here k = 1 (the slope on k is negative, both within the tolerance of the best).
    cfg = EngineConfig()
    model = AllocationModel(a=[-0.1, 0.0, 0.0, 0.0, 0.0], b=[[0.0] * 6 for _ in range(5)], c=0.0, eps=0.01,
                            features=list(allocation.FEATURES))
    default, one, four = Theta(4, 128, 1, 0, 1024), Theta(1, 128, 1, 0, 0), Theta(4, 32, 1, 0, 0)
    assert model.predict(one, torch.zeros(6)) - model.predict(four, torch.zeros(6)) < cfg.allocation.tolerance
    features = [3.0, 0.5, 4.0, -1.0, 0.1, 0.0]  # the window matches far worse than memory
    rows = [{"sample": "s", "theta": theta.__dict__, "features": features, "score": score, "context_tokens": tokens}
            for theta, score, tokens in ((default, 0.0, 1700), (one, 1.0, 250), (four, 0.0, 247))]
    picked = _held_out_choice(model, rows, default, four, cfg, [0, 42, 80, 120])
    assert [row["theta"] for row in picked["model"]] == [one.__dict__]
    assert [row["theta"] for row in picked["model_as_shipped"]] == [one.__dict__]


def test_the_best_fixed_theta_is_judged_on_the_samples_every_theta_was_answered_on():
    # (2, 64) answered two samples (1.0, 0.5); (4, 64) those two (1.0, 1.0) and two hard ones (0, 0). Over each
    # theta's own samples (2, 64) leads, 0.75 to 0.5, only because it skipped the hard ones; over the shared
    # samples (4, 64) does, 1.0 to 0.75.
    cheap, wide = Theta(2, 64, 1, 0, 0), Theta(4, 64, 1, 0, 0)
    rows = [{"sample": f"s{i}", "theta": cheap.__dict__, "score": score} for i, score in enumerate((1.0, 0.5))]
    rows += [{"sample": f"s{i}", "theta": wide.__dict__, "score": score} for i, score in enumerate((1.0, 1.0, 0, 0))]
    assert _best_fixed(rows) == wide
    rows[1]["score"] = 1.0
    assert _best_fixed(rows) == cheap  # a tie over the shared samples: the fewer memory tokens
    assert _best_fixed([{"sample": "a", "theta": cheap.__dict__, "score": 0.0},
                        {"sample": "b", "theta": wide.__dict__, "score": 1.0}]) == wide  # none shared: their own


def test_a_fit_without_observations_is_an_input_error(tmp_path):
    (tmp_path / "observations.jsonl").write_text("")
    with pytest.raises(InputError):
        fit_observations(EngineConfig(), "m", tmp_path / "observations.jsonl", [0, 40, 80, 120])


def test_observations_record_their_answer_path_and_a_run_on_another_path_is_refused(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    lm.tokenizer = ModTokenizer()
    observations = tmp_path / "observations.jsonl"
    one = CFG.model_copy(update={"calibration": CFG.calibration.model_copy(update={"samples": 1, "design_size": 1})})
    run(lm, one, tmp_path, observations, lambda line: None)
    rows = [json.loads(line) for line in observations.read_text().splitlines()]
    assert rows and all(row["answer_path"] == answer_path(one) for row in rows)
    other = one.model_copy(update={"generation": GenerationConfig(answer_start="none")})
    assert answer_path(other) != answer_path(one)
    with pytest.raises(InputError, match="another answer path"):
        run(lm, other, tmp_path, observations, lambda line: None)
    assert [json.loads(line) for line in observations.read_text().splitlines()] == rows  # nothing added


def test_the_fit_records_the_answer_path_and_refuses_answers_of_two_paths(tmp_path):
    truth = AllocationModel(a=[0.1] * 5, b=[[0.0] * len(allocation.FEATURES)] * 5, c=-0.3, eps=0.01,
                            features=list(allocation.FEATURES))
    observations = tmp_path / "observations.jsonl"
    _synthetic_observations(observations, truth, n_samples=8)
    rows = [json.loads(line) for line in observations.read_text().splitlines()]
    path = answer_path(EngineConfig())
    observations.write_text("".join(json.dumps({**row, "answer_path": path}) + "\n" for row in rows))
    report = fit_observations(EngineConfig(), "m", observations, [0, 40, 80, 120])
    assert report.config["answer_path"] == path
    rows[0]["answer_path"] = {**path, "answer_start": "none"}
    observations.write_text("".join(json.dumps({**row, "answer_path": row.get("answer_path", path)}) + "\n"
                                    for row in rows))
    with pytest.raises(InputError, match="answer paths"):
        fit_observations(EngineConfig(), "m", observations, [0, 40, 80, 120])


def test_a_degenerate_reply_is_cut_at_its_repeat():
    assert cut_repeats(" The pass key is the pass key." * 8) == " The pass key is the pass key. The pass key is the pass key."
    assert cut_repeats(" 12345. Remember it. 12345.") == " 12345. Remember it. 12345."


def test_a_missing_facts_corpus_is_an_input_error_that_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAMKV_FACTS_CORPUS", str(tmp_path / "nowhere"))
    _, lm = tiny_pair("llama", CFG)
    cfg = CFG.model_copy(update={"calibration": CFG.calibration.model_copy(update={"tasks": ["facts"]})})
    with pytest.raises(InputError, match="debian-handbook"):
        run(lm, cfg, tmp_path, tmp_path / "observations.jsonl", lambda line: None)
