"""Question recall by key matching: summaries, re-ranking, and the events a chat answer attends to."""

import pytest
import torch
import torch.nn.functional as F

from engramkv import EngineConfig
from engramkv.config import RecallConfig, SegmentationConfig, WindowConfig
from engramkv import chat
from engramkv.errors import InputError
from engramkv.memory.events import Event, InMemoryEventMemory
from engramkv.memory.summary import key_summaries, key_summary, summary_layer_ids
from engramkv.retrieval.question import answer_events, match_question, span_scores

from conftest import VOCAB, tiny_pair

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64, answer_budget_tokens=48, answer_hits=2),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
)
LAYERS, HEADS, DIM = 2, 2, 8


def test_summary_layers_are_evenly_spread():
    assert summary_layer_ids(30, 10) == [1, 4, 7, 10, 13, 16, 19, 22, 25, 28]
    assert summary_layer_ids(4, 0) == [0, 1, 2, 3]
    assert summary_layer_ids(4, 9) == [0, 1, 2, 3]
    assert summary_layer_ids(12, 3) == [2, 6, 10]


def test_key_summary_ignores_key_norms():
    keys = torch.randn(2, HEADS, 5, DIM)
    scaled = keys * torch.rand(2, HEADS, 5, 1) * 100
    assert torch.allclose(key_summary(keys), key_summary(scaled), atol=1e-5)
    assert key_summary(keys).shape == (2 * HEADS * DIM,)


def test_key_summaries_of_joined_events_are_each_ones_key_summary():
    events = [torch.randn(2, HEADS, n, DIM) for n in (4, 1, 6)]
    joined = key_summaries(torch.cat(events, dim=2), [4, 1, 6])
    assert torch.allclose(joined, torch.stack([key_summary(k) for k in events]), atol=1e-6)


def _memory(event_keys: list[torch.Tensor], surprise_max: list[float] | None = None) -> InMemoryEventMemory:
    """Events whose keys (HEADS, n, DIM) are given for every layer (and their largest surprise, default 1)."""
    memory = InMemoryEventMemory(LAYERS, HEADS, DIM, torch.float32)
    start = 0
    for i, keys in enumerate(event_keys):
        n = keys.shape[1]
        per_layer = keys[None].expand(LAYERS, -1, -1, -1)  # (layers, Hkv, n, D)
        reps = torch.zeros(LAYERS, HEADS * DIM)
        peak = 1.0 if surprise_max is None else surprise_max[i]
        memory.add([Event(i, start, start + n, 1.0, peak)], per_layer, per_layer, reps[None],
                   key_summary(per_layer)[None], torch.zeros(n, dtype=torch.int32))
        start += n
    return memory


def test_the_event_holding_the_question_words_wins_over_a_long_near_miss():
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn(HEADS, 10, DIM, generator=g) for _ in range(30)]
    question = torch.randn(HEADS, 3, DIM, generator=g)  # three question tokens
    # Event 7 holds the three question tokens among filler; event 12 holds a blur of all three in every token.
    noise[7] = torch.cat([noise[7][:, :7], question], dim=1)
    noise[12] = question.mean(dim=1, keepdim=True).expand(-1, 10, -1) + 0.05 * noise[12]
    memory = _memory(noise)
    question_keys = question[None].expand(LAYERS, -1, -1, -1)  # (S, Hkv, C, D)
    ranked = match_question(memory, question_keys, list(range(LAYERS)), k=3, candidates=10)
    assert ranked[0][0] == 7  # exact token matches beat the blur after re-ranking
    assert ranked[0][1] == pytest.approx(1.0, abs=1e-4)  # every question token has a cosine-1 match
    assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)
    scores = span_scores(memory, [7, 12], question_keys, list(range(LAYERS)), neighbours=0)[0]
    assert scores[0] > scores[1]


def test_answer_events_take_hits_then_neighbours_in_time_order():
    memory = _memory([torch.randn(HEADS, 10, DIM) for _ in range(20)])
    # 9, 3, then 10, 8, 4 by distance
    assert answer_events(memory, [9, 3], budget=50, max_distance=8) == [3, 4, 8, 9, 10]
    assert answer_events(memory, [9, 3], budget=5, max_distance=8) == []  # nothing fits
    assert answer_events(memory, [19], budget=30, max_distance=8) == [17, 18, 19]  # no event past the end


def test_predicted_text_after_a_hit_ends_its_context_there_but_not_before_it():
    # Event 5 matched; 7 and 4 are filler the model predicted whole (largest surprise under the floor).
    peaks = [5.0, 5.0, 5.0, 5.0, 0.2, 8.0, 3.0, 0.3, 6.0, 6.0]
    memory = _memory([torch.randn(HEADS, 10, DIM) for _ in range(10)], peaks)
    assert answer_events(memory, [5], budget=60, max_distance=8) == [3, 4, 5, 6, 7, 8]  # no floor: nearest first
    # With the floor: nothing at or past the filler after the hit (the model would read on into it), while the
    # filler before it is context like any other.
    assert answer_events(memory, [5], budget=60, max_distance=8, surprise_floor=1.0) == [1, 2, 3, 4, 5, 6]


def _stream(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _planted_session():
    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    planted = [7, 77, 177, 17, 71, 170, 107, 7]
    tokens = _stream(300) + planted + _stream(400, seed=1)
    session.ingest(" ".join(map(str, tokens)))
    return session, planted, 300


def test_recall_finds_the_event_that_holds_the_query():
    session, planted, at = _planted_session()
    results = session.recall(" ".join(map(str, planted)), k=3)
    top = session.memory.event(results[0].event_id)
    assert top.start < at + len(planted) and top.end > at  # the best match overlaps the planted span
    assert results[0].score >= results[1].score >= results[2].score
    assert session.recall(" ".join(map(str, planted)), k=3) == results  # recall does not move the stream


def test_a_chat_answer_attends_to_the_matched_events_in_every_layer(monkeypatch):
    session, planted, at = _planted_session()
    seen: list[list[list[int]]] = []
    layers = session.state.layers
    plans = _spy_on_plans(monkeypatch, session, lambda: seen.append([list(layer.recalled_ids) for layer in layers]))
    session.chat(" ".join(map(str, planted)), max_new_tokens=4)
    hits = [r.event_id for r in session.last_recalled]
    assert len(hits) == 2
    top = session.memory.event(hits[0])
    assert top.start < at + len(planted) and top.end > at
    pinned = answer_events(session.memory, hits, budget=48, max_distance=8)
    assert seen and all(layers == [pinned] * len(layers) for layers in seen)  # every layer, every step
    plans.clear()
    session.ingest(" ".join(map(str, _stream(40, seed=5))))
    assert plans and all(plan is None for plan in plans)  # the plan was only for the turn


def _spy_on_plans(monkeypatch, session, on_answer_step):
    """Record the plan of every engine step; call `on_answer_step` after each step read with a plan."""
    plans = []
    state = session.state
    step, decode = state.step, state.decode

    def spied_step(token_ids, plan=None, seal=True):
        logits = step(token_ids, plan, seal)
        plans.append(plan)
        if plan is not None:
            on_answer_step()
        return logits

    def spied_decode(token_id, plan, seal=True):
        logits = decode(token_id, plan, seal)
        plans.append(plan)
        on_answer_step()
        return logits

    monkeypatch.setattr(state, "step", spied_step)
    monkeypatch.setattr(state, "decode", spied_decode)
    return plans


def test_attention_mode_reports_what_the_layers_recalled():
    cfg = CFG.model_copy(update={"recall": CFG.recall.model_copy(update={"question_match": "attention"})})
    _, lm = tiny_pair("llama", cfg)
    session = lm.session()
    session.ingest(" ".join(map(str, _stream(600))))
    session.chat("1 2 3", max_new_tokens=2)
    assert session.last_recalled
    scores = [r.score for r in session.last_recalled]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1  # share of layers
    results = session.recall("1 2 3", k=3)
    assert len(results) == 3


def test_a_store_reopened_matches_questions_like_the_live_session(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    planted = [7, 77, 177, 17, 71, 170, 107, 7]
    with lm.session(store=tmp_path / "store") as session:
        session.ingest(" ".join(map(str, _stream(300) + planted + _stream(400, seed=1))))
        live = [r.event_id for r in session.recall(" ".join(map(str, planted)), k=3)]
    # The summary index is derived data: delete it and it is rebuilt from the stored keys.
    for path in (tmp_path / "store").rglob("summary.faiss"):
        path.unlink()
    with lm.session(store=tmp_path / "store", read_only=True) as session:
        reopened = [r.event_id for r in session.recall(" ".join(map(str, planted)), k=3)]
    assert reopened[0] == live[0]


def test_cosine_helper_matches_torch():  # guards the einsum in span_scores against a transposed head axis
    keys = torch.randn(HEADS, 4, DIM)
    question = torch.randn(HEADS, 2, DIM)
    memory = _memory([keys])
    got = span_scores(memory, [0], question[None].expand(LAYERS, -1, -1, -1), list(range(LAYERS)), neighbours=0)[0][0]
    cos = torch.stack([F.cosine_similarity(keys[h][:, None], question[h][None], dim=-1) for h in range(HEADS)])
    assert got == pytest.approx(cos.mean(0).max(0).values.mean().item(), abs=1e-5)


def test_candidates_from_the_reading_recall_are_re_ranked_too():
    g = torch.Generator().manual_seed(1)
    question = torch.randn(HEADS, 2, DIM, generator=g)
    filler = question.mean(dim=1, keepdim=True).expand(-1, 6, -1).clone()  # a blur: high summary score
    needle = torch.cat([question, torch.randn(HEADS, 8, DIM, generator=g) * 3], dim=1)  # exact words, diluted
    memory = _memory([filler] * 20 + [needle] + [filler] * 20)
    question_keys = question[None].expand(LAYERS, -1, -1, -1)
    layers = list(range(LAYERS))
    crowded = match_question(memory, question_keys, layers, k=3, candidates=5)
    assert 20 not in [event_id for event_id, _ in crowded]  # 40 identical blurs fill the candidates
    rescued = match_question(memory, question_keys, layers, k=3, candidates=5, also=[20, 3])
    assert rescued[0][0] == 20


def test_a_question_answered_by_the_window_recalls_nothing(monkeypatch):
    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    planted = [7, 77, 177, 17, 71, 170, 107, 7]
    session.ingest(" ".join(map(str, _stream(600) + planted + _stream(20, seed=1))))  # planted: in the local window
    assert session.state.stream.local_start < session.state.n_tokens - 28
    seen: list[list[int]] = []
    _spy_on_plans(monkeypatch, session, lambda: seen.extend(list(layer.recalled_ids) for layer in session.state.layers))
    session.chat(" ".join(map(str, planted)), max_new_tokens=3)
    assert seen and all(ids == [] for ids in seen)  # memory would only crowd the window
    assert session.last_recalled == []


def test_generate_with_a_question_matches_it_like_chat(monkeypatch):
    session, planted, at = _planted_session()
    question = " ".join(map(str, planted))
    session.generate(f"9 9 {question} 7", max_new_tokens=2, question=question)
    hits = [r.event_id for r in session.last_recalled]
    assert len(hits) == 2
    top = session.memory.event(hits[0])
    assert top.start < at + len(planted) and top.end > at  # the question's span was matched, not "9 9" or "7"
    with pytest.raises(InputError, match="part of prompt"):
        session.generate("1 2 3", question="4 5")
    session.generate("1 2 3", max_new_tokens=1)  # no question: per-layer recall, nothing reported
    assert session.last_recalled == []


def test_a_sentence_cut_in_two_by_a_boundary_beats_a_whole_sentence_about_something_else():
    g = torch.Generator().manual_seed(3)
    lead_in = torch.randn(HEADS, 4, DIM, generator=g)  # "One of the magic numbers for"
    key = torch.randn(HEADS, 2, DIM, generator=g)  # "nimbus-brisk"
    other_key = key + 0.9 * torch.randn(HEADS, 2, DIM, generator=g)  # "pebble-meadow": a little alike
    filler = [torch.randn(HEADS, 6, DIM, generator=g) for _ in range(12)]
    events = [*filler[:3], lead_in, key, *filler[3:7], torch.cat([lead_in, other_key], dim=1), *filler[7:]]
    memory = _memory(events)  # the asked sentence is events 3 + 4; the other one is event 9, whole
    question = torch.cat([lead_in, key], dim=1)[None].expand(LAYERS, -1, -1, -1)  # (S, Hkv, C, D)
    alone = match_question(memory, question, list(range(LAYERS)), k=2, candidates=16, neighbours=0)
    assert alone[0][0] == 9  # scored event by event, the whole wrong sentence wins
    together = match_question(memory, question, list(range(LAYERS)), k=2, candidates=16, neighbours=1)
    assert together[0][0] in (3, 4) and together[0][1] == pytest.approx(1.0, abs=1e-4)
    assert abs(together[1][0] - together[0][0]) > 1  # the second hit is another stretch, not a neighbour


def test_before_question_layout_puts_the_answer_events_between_the_text_and_the_prompt(monkeypatch):
    import engramkv.engine.state as engine

    seen: dict[str, list[tuple[int, int, int]]] = {}  # layout -> (memory_at, local text before the prompt, local)
    real = engine.assemble
    for layout in ["before_window", "before_question"]:
        session, planted, _ = _planted_session()
        session.cfg.recall.answer_layout = layout
        calls = seen[layout] = []

        current = {}
        real_attend = session.state.attend

        def attend(layer, query, key, value, scaling, forward, current=current, real_attend=real_attend):
            current["plan"] = forward.plan
            return real_attend(layer, query, key, value, scaling, forward)

        def spy(sink, local, memory, new, memory_at, calls=calls, state=session.state, current=current):
            plan = current.get("plan")
            if plan is not None and memory.shape[1]:
                prompt_start = plan.memory_at if plan.memory_at is not None else state.n_tokens
                calls.append((memory_at, prompt_start - state.stream.local_start, local.shape[1]))
            return real(sink, local, memory, new, memory_at)

        monkeypatch.setattr(session.state, "attend", attend)
        monkeypatch.setattr(engine, "assemble", spy)
        question = " ".join(map(str, planted))
        session.generate(f"9 {question} 7", max_new_tokens=3, question=question)
    assert seen["before_window"] and {at for at, _, _ in seen["before_window"]} == {0}
    assert seen["before_question"] and all(at == before > 0 for at, before, _ in seen["before_question"])
    assert any(at < n for at, _, n in seen["before_question"])  # prompt tokens came after the memory


def test_a_context_limit_per_answer_bounds_what_it_reads():
    question = " ".join(map(str, [7, 77, 177, 17, 71, 170, 107, 7]))
    session, _, _ = _planted_session()
    session.chat(question, max_new_tokens=2)
    unlimited = session.last_plan
    assert unlimited.events and unlimited.budget == 48  # the answer budget of CFG
    stream = session.state.stream
    resident = stream.sink_len + session.tokens_ingested - stream.local_start
    prompt = len(chat.chat_turn(session.lm.tokenizer, session.cfg.generation, [], question).prompt_ids)
    for limit in (resident + prompt + 20, resident + prompt + 30):
        session.chat(question, max_new_tokens=2, budget_tokens=limit)
        plan = session.last_plan
        recalled = sum(session.memory.event(e).length for e in plan.events or ())
        assert plan.budget == limit - resident - prompt and recalled <= plan.budget
        resident = stream.sink_len + session.tokens_ingested - stream.local_start  # the turn joined the window
    session.chat(question, max_new_tokens=2, budget_tokens=10)  # less than the window itself: no memory
    assert session.last_plan.budget == 0 and not session.last_plan.events
    with pytest.raises(InputError, match="budget_tokens"):
        session.chat(question, budget_tokens=-1)
    tokens = session.tokens_ingested
    for none in (0, -1):  # an answer of no tokens is a mistake, not an empty answer
        with pytest.raises(InputError, match="max_new_tokens"):
            session.chat(question, max_new_tokens=none)
    assert session.tokens_ingested == tokens  # refused before the turn was read


def test_centred_reading_reads_the_budget_around_the_best_match_across_event_boundaries():
    from engramkv.retrieval.question import centred_parts

    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    session.ingest(" ".join(str(i % VOCAB) for i in range(7, 900, 3)))
    memory, layers = session.memory, session.state.summary_layers
    hit = len(memory) // 2
    # The question: the keys of 3 tokens of the hit's preceding event, so the best matches lie there.
    before = hit - 1
    keys = torch.stack([memory.gather(layer, [before])[0][:, :3] for layer in layers])  # (S, Hkv, 3, D)
    cfg = CFG.recall.model_copy(update={"max_neighbour_distance": 3})
    events, parts = centred_parts(memory, [(hit, keys)], layers, 20, cfg)
    assert sum(b - a for a, b in parts) == 20  # the budget, exactly
    assert before in events and list(events) == sorted(events)
    read = {e: p for e, p in zip(events, parts)}
    assert read[before][0] < 3  # the matched tokens are read
    for event_id, (a, b) in read.items():
        assert 0 <= a < b <= memory.event(event_id).length
    # Two hits whose windows overlap read the union once; no hits, nothing.
    events2, parts2 = centred_parts(memory, [(hit, keys), (hit - 1, keys)], layers, 40, cfg)
    assert sum(b - a for a, b in parts2) <= 40
    assert centred_parts(memory, [], layers, 40, cfg) == ((), ())
    lm.close()
