"""Inference parameters theta in the answer path, on tiny models: the window an answer attends to, pinned
events and tokens, demonstrations, recall rounds, the limit, questions sharing one total, fitted coefficients."""

import json

import pytest
import torch

from engramkv import ConfigError, EngineConfig, InputError, Theta
from engramkv.answering import DEMONSTRATIONS, Answerer, Assessment
from engramkv.config import AllocationConfig, RecallConfig, SegmentationConfig, WindowConfig
from engramkv.retrieval.allocation import FEATURES, PARAMETERS, AllocationModel
from engramkv.retrieval.allocation import load_model as allocation_model
from engramkv.retrieval.question import QuestionMatch, RecallPlan

from conftest import VOCAB, tiny_pair

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=96, answer_budget_tokens=48, answer_hits=2),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
    allocation=AllocationConfig(k=[1, 2, 4], s=[8, 16, 32], n=[1, 2], m=[0, 1], w=[0, 16, 64], draft_tokens=3),
)


def _text(n, seed=0):
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return " ".join(map(str, ids))


def _session(config=CFG, seed=0, n=600):
    _, lm = tiny_pair("llama", config)
    session = lm.session()
    session.ingest(_text(n, seed))
    return lm, session


def test_a_window_from_the_turn_skips_every_local_token():
    # Recall off: with the whole local window skipped, a step reads the sinks and its own tokens only, so
    # two streams with the same first tokens (the sinks) and different text after give the same logits.
    cfg = CFG.model_copy(update={"recall": CFG.recall.model_copy(update={"enabled": False})})
    head = _text(8, 9)
    one, two = tiny_pair("llama", cfg)[1].session(), tiny_pair("llama", cfg)[1].session()
    one.ingest(head + " " + _text(300, 1))
    two.ingest(head + " " + _text(300, 2))
    assert torch.equal(one.state.layers[0].sink_k, two.state.layers[0].sink_k)
    prompt = torch.tensor([5, 6, 7, 8])
    skip_one = one.state.step(prompt, RecallPlan(None, 0, window_from=one.state.n_tokens))
    skip_two = two.state.step(prompt, RecallPlan(None, 0, window_from=two.state.n_tokens))
    torch.testing.assert_close(skip_one, skip_two)
    whole_one = one.state.step(prompt, RecallPlan(None, 0))
    whole_two = two.state.step(prompt, RecallPlan(None, 0))
    assert not torch.allclose(whole_one, whole_two)  # with the window attended, the local text matters


def test_a_window_from_before_the_local_window_changes_nothing():
    _, one = _session(seed=3)
    _, two = _session(seed=3)
    prompt = torch.tensor([9, 10, 11])
    plain = one.state.step(prompt, RecallPlan(None, 40))
    early = two.state.step(prompt, RecallPlan(None, 40, window_from=two.state.stream.local_start - 5))
    torch.testing.assert_close(plain, early, rtol=0, atol=0)


def test_the_default_theta_is_the_fixed_recall():
    _, session = _session()
    session.chat("1 2 3")
    default = Answerer.default_for(CFG)
    assert default == Theta(k=2, s=24, n=1, m=0, w=64)
    assert session.last_plan.theta == default
    assert len(session.last_plan.hits) <= 2
    assert session.last_plan.budget == 48


@pytest.mark.parametrize("theta", [Theta(1, 8, 1, 0, 0), Theta(4, 32, 1, 0, 16), Theta(2, 16, 2, 0, 64),
                                   Theta(2, 16, 1, 1, 64)])
def test_an_answer_takes_the_theta_it_is_given(theta):
    _, session = _session()
    before = session.tokens_ingested
    session.chat("4 5 6", theta=theta, max_new_tokens=4)
    plan = session.last_plan
    assert plan.theta == theta
    assert len(plan.hits) <= theta.k * theta.n
    if plan.events:
        assert sum(session.memory.event(e).length for e in plan.events) <= min(theta.k * theta.s * theta.n, 96)
    if theta.w < 64:
        assert plan.window_from is not None
    demo_tokens = len(session._answerer.demonstration_ids[theta.m])
    assert session.tokens_ingested - before >= demo_tokens + 3  # the demonstrations and the turn join the stream
    assert len(plan.features) == len(FEATURES)


def test_a_limit_bounds_the_context_of_any_theta():
    _, session = _session()
    for limit in (120, 200, 400):
        session.chat("7 8 9", theta=Theta(4, 32, 2, 1, 64), budget_tokens=limit, max_new_tokens=2)
        assert session.last_plan.context_tokens <= limit


def test_a_theta_outside_its_ranges_is_an_input_error():
    _, session = _session()
    with pytest.raises(InputError):
        session.chat("1 2", theta=Theta(0, 8, 1, 0, 0))
    with pytest.raises(InputError):
        session.chat("1 2", theta=Theta(1, 8, 1, len(DEMONSTRATIONS) + 1, 0))


def _coefficients(tmp_path, model_id="tiny-llama", a=None, best_fixed=None, features=FEATURES):
    model = AllocationModel(a=a or [0.5, 0.2, 0.0, 0.0, -0.1], b=[[0.0] * len(features) for _ in PARAMETERS],
                            c=-1.0, eps=0.01, best_fixed=best_fixed, features=list(features))
    path = tmp_path / "coefficients.json"
    path.write_text(json.dumps({"model_id": model_id, "model": model.model_dump()}))
    return path


def test_the_model_mode_chooses_theta_within_the_limit(tmp_path):
    cfg = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
        update={"mode": "model", "coefficients": str(_coefficients(tmp_path))})})
    _, session = _session(cfg)
    session.chat("1 2 3", budget_tokens=180, max_new_tokens=2)
    plan = session.last_plan
    assert plan.theta in session._answerer.grid
    assert plan.context_tokens <= 180
    # more events and tokens per event help under these coefficients: with room, it takes more
    session.chat("1 2 3", budget_tokens=5000, max_new_tokens=2)
    assert session.last_plan.theta.k * session.last_plan.theta.s >= plan.theta.k * plan.theta.s


def test_a_model_fitted_without_i_doc_spends_no_probes_on_it(tmp_path, monkeypatch):
    without = [name for name in FEATURES if name != "i_doc"]
    probes, reported = [], []
    for features in (FEATURES, without):
        cfg = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
            update={"mode": "model", "coefficients": str(_coefficients(tmp_path, features=features))})})
        _, session = _session(cfg)
        calls = []
        measure = session._answerer._i_doc
        monkeypatch.setattr(session._answerer, "_i_doc", lambda *args: calls.append(1) or measure(*args))
        session.chat("1 2 3", max_new_tokens=2)
        probes.append(len(calls))
        reported.append(session.last_plan.features["i_doc"])
        assert session.last_plan.theta in session._answerer.grid
    assert probes == [1, 0]
    assert isinstance(reported[0], float) and reported[1] is None  # not measured is not reported as 0


def test_by_default_the_model_reads_no_more_than_the_best_fixed_theta_would(tmp_path):
    # Coefficients under which more of everything helps: only the limit holds the choice back.
    path = _coefficients(tmp_path, a=[0.5, 0.5, 0.3, 0.0, 0.2], best_fixed=[1, 16, 1, 0, 0])
    limited = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
        update={"mode": "model", "coefficients": str(path)})})
    assert limited.allocation.default_limit == "best_fixed"
    _, session = _session(limited)
    answerer = session._answerer
    session.chat("1 2 3", max_new_tokens=2)
    plan = session.last_plan
    fixed = plan.context_tokens - plan.theta.k * plan.theta.s * plan.theta.n  # w = 0 here: sinks and the turn
    assert plan.theta.w == 0 and plan.context_tokens <= fixed + 16
    unlimited = limited.model_copy(update={"allocation": limited.allocation.model_copy(
        update={"default_limit": "none"})})
    _, session = _session(unlimited)
    session.chat("1 2 3", max_new_tokens=2)
    assert session.last_plan.context_tokens > plan.context_tokens  # without it, the dearest theta
    # A theta that reads the window's best piece costs that piece, not the window it would read whole.
    theta = Theta(1, 16, 1, 0, 64)
    assert answerer.cost_of(theta, 40, 64, piece=True) == 40 + 16
    assert answerer.cost_of(theta, 40, 64) == 40 + 64 + 16


def test_ask_many_spends_at_most_its_total(tmp_path):
    for mode in ("fixed", "model"):
        cfg = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
            update={"mode": mode, "coefficients": str(_coefficients(tmp_path))})})
        _, session = _session(cfg)
        questions = ["1 2 3", "40 41", "7 7 7 7"]
        answers = session.ask_many(questions, total_tokens=1200, max_new_tokens=2)
        assert [a.question for a in answers] == questions
        assert sum(a.context_tokens for a in answers) <= 1200
        assert all(a.theta is not None for a in answers)
        with pytest.raises(InputError):
            session.ask_many(questions, total_tokens=30)
        with pytest.raises(InputError):
            session.ask_many([], total_tokens=1000)


def test_ask_many_keeps_the_window_rule(tmp_path, monkeypatch):
    from engramkv.retrieval import question

    cfg = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
        update={"mode": "model", "coefficients": str(_coefficients(tmp_path, a=[0.0, 0.0, 0.0, 0.0, -3.0]))})})
    _, session = _session(cfg)
    monkeypatch.setattr(question, "window_answers", lambda matched, recall: True)
    answers = session.ask_many(["1 2 3", "40 41"], total_tokens=1200, max_new_tokens=2)
    assert all(a.theta["w"] == max(cfg.allocation.w) for a in answers)  # against coefficients that want w = 0
    assert sum(a.context_tokens for a in answers) <= 1200
    plan = session.last_plan
    assert plan.events == () and plan.window_from is not None  # read as the model's choice: the best piece


def test_coefficients_of_another_model_or_shape_are_refused(tmp_path):
    cfg = AllocationConfig(mode="model", coefficients=str(_coefficients(tmp_path, model_id="other/model")))
    with pytest.raises(ConfigError, match="fitted for other/model"):
        allocation_model(cfg, "tiny-llama")
    with pytest.raises(ConfigError, match="no file"):
        allocation_model(AllocationConfig(mode="model", coefficients=str(tmp_path / "missing.json")), "tiny-llama")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a coefficients file"):
        allocation_model(AllocationConfig(mode="model", coefficients=str(bad)), "tiny-llama")
    short = _coefficients(tmp_path, a=[0.1, 0.2])
    with pytest.raises(ConfigError, match="shape"):
        allocation_model(AllocationConfig(mode="model", coefficients=str(short)), "tiny-llama")
    assert allocation_model(AllocationConfig(mode="fixed"), "tiny-llama") is None  # mode "fixed" reads nothing


def test_auto_mode_answers_with_shipped_coefficients_and_fixed_without(tmp_path):
    assert allocation_model(AllocationConfig(mode="auto"), "tiny-llama") is None  # none ships for it
    shipped = allocation_model(AllocationConfig(mode="auto"), "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert shipped is not None and shipped.thetas
    given = allocation_model(AllocationConfig(mode="auto", coefficients=str(_coefficients(tmp_path))), "tiny-llama")
    assert given is not None and given.a == [0.5, 0.2, 0.0, 0.0, -0.1]
    with pytest.raises(ConfigError, match="no file"):  # a file given must exist, even in auto
        allocation_model(AllocationConfig(mode="auto", coefficients=str(tmp_path / "missing.json")), "tiny-llama")


def test_a_fit_with_its_calibrated_thetas_chooses_among_those_alone(tmp_path):
    calibrated = [[1, 8, 1, 0, 0], [2, 16, 1, 1, 64]]
    model = AllocationModel(a=[0.5, 0.2, 0.0, 0.0, -0.1], b=[[0.0] * len(FEATURES) for _ in PARAMETERS], c=-1.0,
                            eps=0.01, thetas=calibrated, features=list(FEATURES))
    path = tmp_path / "coefficients.json"
    path.write_text(json.dumps({"model_id": "tiny-llama", "model": model.model_dump()}))
    cfg = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
        update={"mode": "model", "coefficients": str(path)})})
    _, session = _session(cfg)
    session.chat("1 2 3", max_new_tokens=2)
    assert [*session.last_plan.theta.__dict__.values()] in calibrated


def test_where_the_window_matches_better_the_model_reads_its_best_piece(tmp_path, monkeypatch):
    # Coefficients that want no window at all (w's slope strongly negative): the window rule overrides them.
    path = _coefficients(tmp_path, a=[0.0, 0.0, 0.0, 0.0, -3.0])
    cfg = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
        update={"mode": "model", "coefficients": str(path)})})
    _, session = _session(cfg)
    session.chat("1 2 3", max_new_tokens=2)
    assert session.last_plan.theta.w == 0  # memory matches better (or as well): the fitted choice stands
    from engramkv.retrieval import question

    monkeypatch.setattr(question, "window_answers", lambda matched, recall: True)
    _, session = _session(cfg)  # a fresh one: after a turn, its own tokens can be the window's best piece
    turn_start = session.state.n_tokens
    local_start = session.state.stream.local_start
    session.chat("1 2 3", max_new_tokens=2)
    plan = session.last_plan
    theta = plan.theta
    assert theta.w == max(cfg.allocation.w) and plan.events == ()  # chosen among whole-window thetas, no memory
    # Of the window, one piece widened to the theta's memory budget, then (a gap) the turn.
    assert plan.window_from is not None and plan.window_from >= local_start
    read_to = turn_start if plan.window_gap is None else plan.window_gap[0]
    assert plan.window_gap is None or plan.window_gap[1] == turn_start
    assert min(theta.k * theta.s * theta.n, plan.budget) <= read_to - plan.window_from < turn_start - local_start


def test_a_piece_longer_than_the_budget_is_read_to_the_budget_around_its_match():
    _, session = _session()
    answerer, turn_start, first = session._answerer, session.state.n_tokens, session.state.stream.local_start
    matched = QuestionMatch((), (), 0.0)

    def read(piece, centre, budget):  # [a, b) of the local window the plan reads before the turn
        plan = answerer.window_piece_plan(Assessment(matched, torch.zeros(len(FEATURES)), piece, centre),
                                          Theta(1, 16, 1, 0, 64), turn_start, budget)
        return plan.window_from, turn_start if plan.window_gap is None else plan.window_gap[0]

    assert turn_start - first >= 48
    assert read((first + 4, first + 44), first + 36, 16) == (first + 28, first + 44)  # cut around the match
    assert read((first + 4, first + 44), first + 5, 16) == (first + 4, first + 20)  # and within the piece
    assert read((first + 4, first + 44), None, 16) == (first + 16, first + 32)  # no match known: its middle
    assert read((first + 4, first + 14), first + 8, 16) == (first + 1, first + 17)  # a shorter one is widened
    assert read((first + 4, first + 44), first + 36, 0) == (turn_start, turn_start)  # no budget: none of it


def test_the_model_reading_the_windows_piece_stays_within_the_limit(tmp_path, monkeypatch):
    path = _coefficients(tmp_path, a=[0.0, 0.0, 0.0, 0.0, -3.0])
    cfg = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
        update={"mode": "model", "coefficients": str(path)})})
    from engramkv.retrieval import question

    monkeypatch.setattr(question, "window_answers", lambda matched, recall: True)
    for limit in (30, 45, 60, 90):
        _, session = _session(cfg)
        session.chat("1 2 3", max_new_tokens=2, budget_tokens=limit)
        assert session.last_plan.events == () and session.last_plan.context_tokens <= limit


def test_the_models_piece_reads_no_more_than_the_best_fixed_theta_does(tmp_path, monkeypatch):
    # The best fixed theta's nominal 32 memory tokens, but with no neighbours it reads one event (<= 24
    # tokens): the piece the model chooses (more of everything helps here) is bounded by that, not by 32.
    path = _coefficients(tmp_path, a=[0.5, 0.5, 0.3, 0.0, 0.0], best_fixed=[1, 32, 1, 0, 0])
    cfg = CFG.model_copy(update={
        "recall": CFG.recall.model_copy(update={"max_neighbour_distance": 0, "match_neighbours": 0}),
        "allocation": CFG.allocation.model_copy(update={"mode": "model", "coefficients": str(path), "tolerance": 0.0})})
    from engramkv.retrieval import question

    monkeypatch.setattr(question, "window_answers", lambda matched, recall: True)
    _, session = _session(cfg)
    session.chat("1 2 3", max_new_tokens=2)
    chosen = session.last_plan
    _, again = _session(cfg)
    again.chat("1 2 3", max_new_tokens=2, theta=Theta(1, 32, 1, 0, 0))
    best = again.last_plan  # what the best fixed theta reads for the same question
    read = sum(end - first for first, end in best.event_tokens) if best.event_tokens else sum(
        again.memory.event(e).length for e in best.events)
    assert chosen.events == () and chosen.theta.w == 64 and 0 < read < 32
    assert chosen.context_tokens <= best.context_tokens


def test_a_caller_theta_where_the_window_matches_better_reads_the_whole_window(tmp_path, monkeypatch):
    path = _coefficients(tmp_path, a=[0.0, 0.0, 0.0, 0.0, -3.0])
    cfg = CFG.model_copy(update={"allocation": CFG.allocation.model_copy(
        update={"mode": "model", "coefficients": str(path)})})
    _, session = _session(cfg)
    from engramkv.retrieval import question

    monkeypatch.setattr(question, "window_answers", lambda matched, recall: True)
    session.chat("1 2 3", max_new_tokens=2, theta=Theta(2, 16, 1, 0, 64))  # as calibrated: the whole window
    plan = session.last_plan
    assert plan.window_from is None and plan.window_gap is None and plan.events == ()


def test_a_gap_over_the_whole_window_skips_it_like_a_window_from_the_turn():
    _, one = _session(seed=5)
    _, two = _session(seed=5)
    prompt = torch.tensor([9, 10, 11])
    end = one.state.n_tokens
    skipped = one.state.step(prompt, RecallPlan((), 0, window_from=end))
    gap = two.state.step(prompt, RecallPlan((), 0, window_gap=(two.state.stream.local_start, end)))
    torch.testing.assert_close(skipped, gap, rtol=0, atol=1e-6)


def test_an_empty_gap_changes_nothing_and_skipped_tokens_receive_no_attention():
    _, one = _session(seed=6)
    _, two = _session(seed=6)
    prompt = torch.tensor([9, 10, 11])
    mid = one.state.stream.local_start + 10
    plain = one.state.step(prompt, RecallPlan(None, 40))
    empty = two.state.step(prompt, RecallPlan(None, 40, window_gap=(mid, mid)))
    torch.testing.assert_close(plain, empty, rtol=0, atol=0)
    _, three = _session(seed=6)
    before = three.state.layers[0].local_attention.clone()
    three.state.step(prompt, RecallPlan(None, 40, window_gap=(mid, mid + 5)))
    after = three.state.layers[0].local_attention
    gap = slice(10, 15)
    torch.testing.assert_close(after[:, gap], before[:, gap], rtol=0, atol=0)
    assert (after[:, :10] > before[:, :10]).all() and after.shape[1] == before.shape[1] + 3


def test_a_plan_that_reads_parts_of_events_attends_to_those_tokens_alone():
    # Reading events 3 and 4 whole equals reading them as parts covering all their tokens; a part that
    # leaves tokens out changes the answer's logits.
    _, one = _session(seed=7)
    _, two = _session(seed=7)
    _, three = _session(seed=7)
    lengths = [one.memory.event(e).length for e in (3, 4)]
    prompt = torch.tensor([9, 10, 11])
    whole = one.state.step(prompt, RecallPlan((3, 4), 64))
    parts = two.state.step(prompt, RecallPlan((3, 4), 64, event_tokens=((0, lengths[0]), (0, lengths[1]))))
    torch.testing.assert_close(whole, parts, rtol=0, atol=0)
    cut = three.state.step(prompt, RecallPlan((3, 4), 64, event_tokens=((1, lengths[0]), (0, 2))))
    assert not torch.allclose(whole, cut)
    assert three.state.layers[0].recalled_kv[0].shape[1] == lengths[0] - 1 + 2


@pytest.mark.parametrize("theta", [Theta(1, 8, 1, 0, 0), Theta(2, 16, 2, 0, 16)])
def test_centred_reading_reads_parts_within_the_budget(theta):
    cfg = CFG.model_copy(update={"recall": CFG.recall.model_copy(update={"answer_reading": "centred"})})
    _, session = _session(cfg)
    session.chat("1 2 3", max_new_tokens=2, theta=theta)
    plan = session.last_plan
    assert plan.events and plan.event_tokens is not None and len(plan.event_tokens) == len(plan.events)
    read = sum(b - a for a, b in plan.event_tokens)
    assert 0 < read <= theta.k * theta.s * theta.n
    assert session.state.layers[0].recalled_kv[0].shape[1] == read


def test_a_question_the_sinks_answer_better_than_memory_recalls_nothing():
    # The sinks are part of the window a question may match better than memory. A conversation's first turns
    # sit in the sinks; scoring the local window alone recalled events beside them, and through chat the
    # conversation task at 4k answered 3 and 4 fewer of 20 (benchmarks/README.md, "The sinks stay in the window").
    from engramkv import chat
    from engramkv.retrieval import question

    head = _text(CFG.window.n_sink, 7)
    session = tiny_pair("llama", CFG)[1].session()
    session.ingest(head + " " + _text(600, 8))
    ids, span = chat.encode_prompt(session.lm.tokenizer, head, head)
    state, recall = session.state, session.cfg.recall
    matched = session._answerer.assess(ids, span, False).matched
    assert matched.window_piece is not None and matched.window_piece[0] < state.stream.sink_len
    assert question.window_answers(matched, recall)
    session.generate(head, 2, question=head)
    assert session.last_plan.events == ()  # no memory: the window, sinks and all, answers
