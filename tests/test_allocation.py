"""The recall budget model: fitting, choosing under a limit, sharing one limit among questions."""

import itertools
import json
import random

import pytest
import torch

from engramkv.config import AllocationConfig
from engramkv.errors import ConfigError, InputError
from engramkv.retrieval.allocation import (
    FEATURES,
    AllocationModel,
    Theta,
    allocate,
    asks_for_several,
    choose,
    cost,
    design_row,
    fit,
    informativeness,
    load_model,
    select_ridge,
)

CFG = AllocationConfig()
GRID = [Theta(*values) for values in itertools.product([1, 2, 4, 8], [32, 128], [1, 2], [0, 1], [256, 1024])]


def _cost(theta):
    return cost(theta, fixed_tokens=20, demonstration_tokens=60)


def _known_model():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(5, 5, generator=g, dtype=torch.float64) * 0.1
    return AllocationModel(a=a.tolist(), b=b.tolist(), c=-0.5, eps=CFG.eps)


def test_the_fit_recovers_known_coefficients_from_synthetic_data():
    truth = _known_model()
    rng = random.Random(1)
    thetas, infos, scores = [], [], []
    for _ in range(600):
        theta = rng.choice(GRID)
        info = torch.tensor([rng.uniform(0, 4), rng.uniform(0, 1), rng.randint(0, 5), rng.uniform(-0.05, 0.05),
                             rng.uniform(-2, 2)], dtype=torch.float64)
        thetas.append(theta)
        infos.append(info)
        scores.append(truth.predict(theta, info))  # noise-free: exact recovery up to the clip and the ridge
    fitted = fit(thetas, infos, scores, AllocationConfig(score_clip=1e-6), ridge=0.0)
    assert torch.allclose(torch.tensor(fitted.a), torch.tensor(truth.a), atol=1e-6)
    assert torch.allclose(torch.tensor(fitted.b), torch.tensor(truth.b), atol=1e-6)
    assert abs(fitted.c - truth.c) < 1e-6
    plain = fit(thetas, infos, scores, CFG, ridge=1.0, with_interaction=False)  # the ablation: B = 0
    assert torch.count_nonzero(torch.tensor(plain.b)) == 0


def test_a_fit_on_named_features_recovers_them_and_ignores_the_others():
    # Scores made by a model of four features (no window margin, no i_doc): fitted on those four by name, it is
    # recovered; the other features measured beside them move nothing; a name out of order is refused.
    used = ["margin", "entropy", "above", "several"]
    g = torch.Generator().manual_seed(2)
    truth = AllocationModel(a=(torch.randn(5, generator=g, dtype=torch.float64) * 0.3).tolist(),
                            b=(torch.randn(5, 4, generator=g, dtype=torch.float64) * 0.1).tolist(), c=-0.5,
                            eps=CFG.eps, features=used)
    rng = random.Random(3)
    thetas, infos, scores = [], [], []
    for _ in range(600):
        thetas.append(rng.choice(GRID))
        infos.append(torch.tensor([rng.uniform(0, 4), rng.uniform(0, 1), rng.randint(0, 5), rng.uniform(-0.05, 0.05),
                                   rng.uniform(-2, 2), rng.randint(0, 1)], dtype=torch.float64))
        scores.append(truth.predict(thetas[-1], infos[-1]))
    fitted = fit(thetas, infos, scores, AllocationConfig(score_clip=1e-6, features=used), ridge=0.0)
    assert fitted.features == used
    assert torch.allclose(torch.tensor(fitted.b), torch.tensor(truth.b), atol=1e-6)
    moved = infos[0].clone()
    moved[FEATURES.index("i_doc")] += 5.0
    assert fitted.predict(thetas[0], moved) == fitted.predict(thetas[0], infos[0])
    with pytest.raises(InputError, match="in that order"):
        fit(thetas, infos, scores, AllocationConfig(features=["entropy", "margin"]), ridge=0.0)
    with pytest.raises(InputError, match="in that order"):
        fit(thetas, infos, scores, AllocationConfig(features=["margin", "nonsense"]), ridge=0.0)


def _synthetic(truth, n, seed, noise_only=False):
    rng = random.Random(seed)
    thetas, infos, scores, groups = [], [], [], []
    for i in range(n):
        theta = rng.choice(GRID)
        info = torch.tensor([rng.uniform(0, 4), rng.uniform(0, 1), rng.randint(0, 5), rng.uniform(-0.05, 0.05),
                             rng.uniform(-2, 2)], dtype=torch.float64)
        thetas.append(theta)
        infos.append(info)
        scores.append(float(rng.random() < 0.5) if noise_only else truth.predict(theta, info))
        groups.append(i // 20)  # twenty answers per "sample"
    return thetas, infos, scores, groups


def test_the_ridge_kept_is_none_for_exact_data_and_the_strongest_for_noise():
    cfg = AllocationConfig(score_clip=1e-6, ridge=[0.0, 1e4])
    exact = _synthetic(_known_model(), 400, seed=4)
    assert select_ridge(*exact, cfg, folds=4) == 0.0
    noise = _synthetic(_known_model(), 400, seed=5, noise_only=True)  # scores owe nothing to theta or i
    assert select_ridge(*noise, cfg, folds=4) == 1e4
    fitted = fit(*exact[:3], cfg, ridge=0.0)
    assert fitted.ridge == 0.0


def test_features_outside_the_fitted_range_predict_as_at_its_edge():
    thetas, infos, scores, _ = _synthetic(_known_model(), 300, seed=6)
    fitted = fit(thetas, infos, scores, CFG, ridge=1.0)
    edge = torch.tensor(fitted.high, dtype=torch.float64)
    far = edge + torch.tensor([40.0, 3.0, 50.0, 1.0, 9.0], dtype=torch.float64)
    theta = Theta(4, 128, 2, 1, 1024)
    assert fitted.logit(theta, far) == fitted.logit(theta, edge)
    assert fitted.logit(theta, torch.tensor(fitted.low, dtype=torch.float64) - 10) == fitted.logit(
        theta, torch.tensor(fitted.low, dtype=torch.float64))


def test_the_design_row_is_the_model_written_out():
    model, theta = _known_model(), Theta(4, 128, 2, 1, 1024)
    info = torch.tensor([1.0, 0.5, 2.0, 0.01, -0.3], dtype=torch.float64)
    coef = torch.tensor([*model.a, *torch.tensor(model.b, dtype=torch.float64).flatten().tolist(), model.c],
                        dtype=torch.float64)
    assert abs(float(design_row(theta, info, CFG.eps) @ coef) - model.logit(theta, info)) < 1e-9


def test_the_chooser_never_exceeds_the_limit_and_takes_the_best_that_fits():
    model = _known_model()
    info = torch.tensor([2.0, 0.3, 1.0, 0.0, 0.5], dtype=torch.float64)
    for limit in [0, 300, 800, 2000, 5000, 100_000]:
        chosen = choose(model, GRID, info, limit, _cost)
        feasible = [t for t in GRID if _cost(t) <= limit]
        if not feasible:
            assert chosen is None
            continue
        assert _cost(chosen) <= limit
        assert model.logit(chosen, info) == max(model.logit(t, info) for t in feasible)


def test_with_a_tolerance_the_cheapest_near_best_theta_is_taken():
    model = _known_model()
    info = torch.tensor([2.0, 0.3, 1.0, 0.0, 0.5], dtype=torch.float64)
    for tolerance in [0.0, 0.01, 0.05, 0.2, 1.0]:
        chosen = choose(model, GRID, info, 5000, _cost, tolerance)
        feasible = [t for t in GRID if _cost(t) <= 5000]
        best = max(model.predict(t, info) for t in feasible)
        near = [t for t in feasible if model.predict(t, info) >= best - tolerance]
        assert chosen in near and _cost(chosen) == min(_cost(t) for t in near)
    assert choose(model, GRID, info, 5000, _cost, 1.0) == min(GRID, key=_cost)  # everything is near: cheapest


def test_questions_sharing_a_limit_spend_at_most_it():
    model = _known_model()
    rng = random.Random(2)
    infos = [torch.tensor([rng.uniform(0, 4), rng.random(), rng.randint(0, 4), 0.0, rng.uniform(-1, 1)],
                          dtype=torch.float64) for _ in range(6)]
    for total in [0, 500, 3000, 12_000, 60_000]:
        chosen = allocate(model, [GRID] * len(infos), infos, total, _cost)
        assert sum(_cost(t) for t in chosen if t is not None) <= total
        if total >= 6 * min(_cost(t) for t in GRID):
            assert all(t is not None for t in chosen)  # everyone is answered before anyone gets more


def test_each_question_sharing_a_limit_takes_a_theta_of_its_own_grid():
    model = _known_model()
    infos = [torch.tensor([1.0, 0.5, 2.0, 0.0, 0.1], dtype=torch.float64)] * 3
    wide = [t for t in GRID if t.w == max(g.w for g in GRID)]
    chosen = allocate(model, [GRID, wide, GRID], infos, 60_000, _cost)
    assert chosen[1] in wide and all(t is not None for t in chosen)
    with pytest.raises(ValueError):
        allocate(model, [GRID], infos, 60_000, _cost)


def test_a_clear_match_is_given_fewer_events_than_a_flat_score_profile():
    # A model in which more events help only when the match is unclear: the slope on log k falls with the
    # margin feature (B[k, margin] < 0) and more events cost nothing else.
    a = [0.9, 0.0, 0.0, 0.0, 0.0]
    b = [[-0.4] + [0.0] * (len(FEATURES) - 1)] + [[0.0] * len(FEATURES) for _ in range(4)]
    model = AllocationModel(a=a, b=b, c=0.0, eps=CFG.eps, features=list(FEATURES))
    grid = [Theta(k, 64, 1, 0, 512) for k in (1, 2, 4, 8)]
    g = torch.Generator().manual_seed(3)
    flat_scores = torch.rand(200, generator=g) * 0.01
    clear_scores = flat_scores.clone()
    clear_scores[17] = 1.0
    clear, flat = (informativeness(s, window_margin=0.0, i_doc=0.0, several=0.0) for s in (clear_scores, flat_scores))
    assert clear[0] > flat[0] and clear[1] < flat[1]  # margin up, entropy down
    limit = 10_000
    assert choose(model, grid, clear, limit, _cost).k < choose(model, grid, flat, limit, _cost).k


def test_a_question_after_several_things_is_told_by_its_words():
    several = ["What are all the special magic numbers for cedar-pebble?", "List my hobbies.",
               "Who were the speakers?", "What are the numbers for yonder-raven and meadow-yonder?",
               "Which of Paris, Rome or Oslo is the capital?"]
    one = ["What is the pass key?", "On which afternoon does the team meet each week?", "What is my sister called?",
           'What is the value associated with the key "7de7f508-b327"?', "Is the count 12,345?", "Who is Allan?"]
    assert [asks_for_several(q) for q in several] == [1.0] * len(several)
    assert [asks_for_several(q) for q in one] == [0.0] * len(one)


def test_a_question_after_several_things_is_given_more_events_where_the_fit_says_they_help():
    # More events help only a question after several things (B[k, several] > 0), and cost as few tokens each.
    a = [-0.2, 0.0, 0.0, 0.0, 0.0]
    b = [[0.0] * (len(FEATURES) - 1) + [1.0]] + [[0.0] * len(FEATURES) for _ in range(4)]
    model = AllocationModel(a=a, b=b, c=0.0, eps=CFG.eps, features=list(FEATURES))
    grid = [Theta(1, 128, 1, 0, 0), Theta(2, 64, 1, 0, 0), Theta(4, 32, 1, 0, 0)]
    scores = torch.rand(50, generator=torch.Generator().manual_seed(0))
    info = [informativeness(scores, window_margin=0.0, i_doc=0.0, several=asks_for_several(q))
            for q in ("What is the number for cedar-pebble?", "What are all the numbers for cedar-pebble?")]
    assert choose(model, grid, info[0], 10_000, _cost).k == 1
    assert choose(model, grid, info[1], 10_000, _cost).k == 4


def test_coefficients_fitted_before_a_feature_was_added_answer_with_the_features_they_know(tmp_path):
    old = AllocationModel(a=[0.1] * 5, b=[[0.2] * 5 for _ in range(5)], c=0.0, eps=CFG.eps)  # five features
    info = torch.tensor([1.0, 0.5, 3.0, 0.0, 0.2, 1.0], dtype=torch.float64)  # today's, "several" last
    assert old.features == list(FEATURES[:5])
    assert old.predict(Theta(2, 64, 1, 0, 0), info) == old.predict(Theta(2, 64, 1, 0, 0), info[:5])
    path = tmp_path / "coefficients.json"
    path.write_text(json.dumps({"model_id": "m", "model": old.model_dump()}))
    assert load_model(AllocationConfig(mode="model", coefficients=str(path)), "m") == old
    wrong = old.model_copy(update={"features": ["several", "margin", "entropy", "above", "i_doc"]})  # not in order
    path.write_text(json.dumps({"model_id": "m", "model": wrong.model_dump()}))
    with pytest.raises(ConfigError, match="features"):
        load_model(AllocationConfig(mode="model", coefficients=str(path)), "m")


@pytest.mark.parametrize("mode", ["model", "auto"])
def test_coefficients_that_are_not_a_file_are_named_as_such(tmp_path, mode):
    with pytest.raises(ConfigError, match=f"mode '{mode}'.*is a directory, not a file"):
        load_model(AllocationConfig(mode=mode, coefficients=str(tmp_path)), "m")
    with pytest.raises(ConfigError, match=f"mode '{mode}'.*no file "):
        load_model(AllocationConfig(mode=mode, coefficients=str(tmp_path / "none.json")), "m")
