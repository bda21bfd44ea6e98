"""The streaming engine on tiny models: sealing, event coverage, stored keys, bounded window, errors."""

import pytest
import torch

from engramkv import EmptyInputError, EngineConfig, InputError
from engramkv.config import RecallConfig, SegmentationConfig, WindowConfig

from conftest import VOCAB, EndingTokenizer, tiny_model, tiny_pair

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
)


def _stream(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mode", ["surprise", "uniform"])
def test_events_tile_the_stream_without_gaps(mode):
    cfg = CFG.model_copy(update={"segmentation": CFG.segmentation.model_copy(update={"mode": mode, "uniform_size": 16})})
    _, lm = tiny_pair("llama", cfg)
    session = lm.session()
    session.ingest(" ".join(map(str, _stream(700))))
    events = [session.memory.event(i) for i in range(len(session.memory))]
    assert events[0].start == 8  # right after the sinks
    for before, after in zip(events, events[1:]):
        assert before.end == after.start
    assert all(4 <= e.length <= 24 for e in events)
    assert session.state.stream.local_start == events[-1].end
    local = session.state.n_tokens - session.state.stream.local_start
    assert local <= cfg.window.n_local + cfg.segmentation.max_event
    if mode == "uniform":
        assert {e.length for e in events} == {16}


def test_stored_keys_are_the_models_pre_rope_keys():
    reference, lm = tiny_pair("llama", CFG)
    tokens = _stream(300, seed=4)
    session = lm.session()
    session.ingest_ids(tokens)
    event = session.memory.event(3)
    keys, _ = session.memory.gather(0, [3])  # (Hkv, L, D), layer 0: k_proj(norm(embed(x)))
    ids = torch.tensor([tokens[event.start : event.end]])
    layer = reference.model.layers[0]
    with torch.no_grad():
        hidden = layer.input_layernorm(reference.model.embed_tokens(ids))
        expected = layer.self_attn.k_proj(hidden).view(1, event.length, 2, 16).transpose(1, 2)[0]
    torch.testing.assert_close(keys.float(), expected, atol=2e-3, rtol=2e-3)  # stored in float16


def test_recall_returns_events_with_spans_and_text():
    _, lm = tiny_pair("qwen2", CFG)
    session = lm.session()
    session.ingest(" ".join(map(str, _stream(500))))
    results = session.recall("1 2 3", k=3)
    assert len(results) == 3
    assert results[0].score >= results[1].score >= results[2].score
    for r in results:
        assert r.text.split() == [str(t) for t in session.memory.tokens(r.event_id)]
        assert len(session.memory.tokens(r.event_id)) == r.token_end - r.token_start
    assert session.recall("1 2 3", k=3) == results  # recall does not move the stream
    assert results[0].model_dump_json()


def test_generation_past_the_window_keeps_the_window_bounded():
    _, lm = tiny_pair("mistral", CFG)
    session = lm.session()
    session.ingest(" ".join(map(str, _stream(1000))))
    out = session.generate_ids([1, 2, 3], max_new_tokens=40)
    assert len(out) == 40
    for st in session.state.layers:
        recalled = st.recalled_kv[0].shape[1] if st.recalled_kv is not None else 0
        assert recalled <= CFG.recall.budget_tokens


def test_bad_input_is_refused_clearly():
    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    with pytest.raises(EmptyInputError):
        session.ingest("")
    with pytest.raises(EmptyInputError):
        session.ingest(iter(["", "   "]))
    with pytest.raises(InputError, match="bytes"):
        session.ingest([b"1 2 3"])  # type: ignore[list-item]
    assert session.tokens_ingested == 0
    with pytest.raises(EmptyInputError):
        session.generate_ids([], max_new_tokens=3)


def test_stream_pieces_equal_one_string():
    _, lm = tiny_pair("llama", CFG)
    text = " ".join(map(str, _stream(200)))
    a, b = lm.session(), lm.session()
    a.ingest(text)
    b.ingest(iter([text[:101], text[101:333], text[333:]]))
    assert _all_tokens(a) == _all_tokens(b)
    assert len(_all_tokens(a)) == a.state.n_tokens


def _all_tokens(session):
    sealed = [t for i in range(len(session.memory)) for t in session.memory.tokens(i)]
    return session.state.stream.sink_tokens.tolist() + sealed + session.state.stream.tail_tokens.tolist()


def test_recall_runs_for_the_prompt_and_every_decode_interval(monkeypatch):
    from engramkv.engine import memory_section as engine

    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    session.ingest(" ".join(map(str, _stream(600))))
    calls = []
    original = engine.select_events
    monkeypatch.setattr(engine, "select_events", lambda *a, **k: calls.append(a[1]) or original(*a, **k))
    session.generate_ids([5, 6, 7], max_new_tokens=40)  # prompt chunk, then decode steps 16 and 32
    layers = len(session.state.layers)
    assert len(calls) == 3 * layers
    assert sorted(set(calls)) == list(range(layers))


@pytest.mark.parametrize("positions", ["contiguous", "fixed"])
def test_window_positions_stay_inside_the_trained_length(monkeypatch, positions):
    from engramkv.engine import state as engine

    cfg = CFG.model_copy(update={"recall": CFG.recall.model_copy(update={"positions": positions})})
    _, lm = tiny_pair("llama", cfg)
    seen = []  # the largest position of each window attended
    original = engine.EpisodicState._cos_sin

    def spy(self, n_sink, n_mem, n_local, n_new, like, used=None):  # used: padded memory, at most n_mem filled
        seen.append(int(engine.window_positions(n_sink, n_mem, n_local, n_new, positions).max()))
        return original(self, n_sink, n_mem, n_local, n_new, like, used)

    monkeypatch.setattr(engine.EpisodicState, "_cos_sin", spy)
    lm.session().ingest(" ".join(map(str, _stream(3000))))
    assert max(seen) < cfg.attention_span()  # 3000 tokens read, positions stay small


def test_long_generation_seals_events_and_keeps_the_window_bounded():
    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    session.ingest(" ".join(map(str, _stream(200))))
    before = len(session.memory)
    session.generate_ids([9], max_new_tokens=300)
    assert len(session.memory) > before
    assert session.state.n_tokens - session.state.stream.local_start <= CFG.window.n_local + CFG.segmentation.max_event


def test_a_busy_session_refuses_a_second_call():
    from engramkv import SessionError

    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    reply = session.chat("4 5 6", stream=True, max_new_tokens=10)
    next(reply)  # a streamed reply is half consumed: the stream is in use
    with pytest.raises(SessionError, match="busy"):
        session.ingest("1 2 3")
    rest = list(reply)
    assert len(rest) == 9
    session.ingest("1 2 3")  # free again once the reply is done


@pytest.mark.parametrize("message", ["4 5 6", "What are all the pass keys?"])  # the second is drafted as a list
def test_a_streamed_turn_holds_the_session_until_its_last_piece(message):
    from engramkv import SessionError

    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    session.ingest(" ".join(str(i % 50 + 1) for i in range(300)))
    pieces = 0
    for _ in session.chat(message, stream=True, max_new_tokens=12):
        pieces += 1
        with pytest.raises(SessionError, match="busy"):  # nothing may come between the reply and the turn's record
            session.ingest("1 2 3")
    assert pieces and session._reader.chat_history[-2] == {"role": "user", "content": message}
    session.ingest("1 2 3")


@pytest.mark.parametrize("message", ["4 5 6", "What are all the pass keys?"])
def test_a_streamed_turn_closed_early_joins_the_chat_as_far_as_it_was_shown(message):
    from engramkv import EpisodicLM

    config = CFG.model_copy(update={"generation": CFG.generation.model_copy(update={"chat_format": "template"})})
    lm = EpisodicLM(tiny_model("llama"), EndingTokenizer(), "tiny-llama", config)
    session = lm.session()
    session.ingest(" ".join(str(i % 50 + 4) for i in range(300)))
    reply = session.chat(message, stream=True, max_new_tokens=12)
    shown = next(reply)
    reply.close()  # as a caller who has read enough
    assert session._reader.chat_history == [{"role": "user", "content": message},
                                            {"role": "assistant", "content": shown}]
    assert session.state.stream.last_token == EndingTokenizer.eos_token_id  # the turn ended as the template ends one
    session.chat("7 8", max_new_tokens=5)  # the session is free, and the next turn follows a whole one
    assert session._reader.chat_history[-2] == {"role": "user", "content": "7 8"}
    assert session.state.stream.last_token == EndingTokenizer.eos_token_id


@pytest.mark.parametrize("chat_format", ["qa", "template"])
def test_chat_turns_join_the_stream(chat_format):
    config = CFG.model_copy(update={"generation": CFG.generation.model_copy(update={"chat_format": chat_format})})
    _, lm = tiny_pair("llama", config)
    session = lm.session()
    first = session.chat("4 5 6", max_new_tokens=5)
    assert len(first.split()) == 5
    n = session.tokens_ingested
    session.chat("7 8", max_new_tokens=5)
    # the second turn adds only its own rendering plus the reply: "Question: 7 8 Answer:" in the qa
    # format, " 1 7 8 2" (user role, message, assistant role) after the first reply in the template
    assert session.tokens_ingested == n + 4 + 5


def test_a_qa_reply_ends_at_a_blank_line(monkeypatch):
    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    pieces = {1: "\n", 2: "\n", 3: " Marj", 4: "atta", 5: ".\n", 6: "\nQuestion", 7: " more"}
    monkeypatch.setattr(lm.tokenizer, "decode", lambda ids, skip_special_tokens=False: "".join(pieces[i] for i in ids))

    def fake_generate(prompt_ids, max_new_tokens, *rest):
        yield from [1, 2, 3, 4, 5, 6, 7]

    monkeypatch.setattr(session, "_generate", fake_generate)
    streamed = list(session.chat("who?", stream=True))
    assert "".join(streamed) == "\n\n Marjatta."  # leading blank lines are not the end of a reply
    assert all("\n\n" not in p for p in streamed[1:])


def test_a_blank_line_after_a_colon_does_not_end_a_qa_reply(monkeypatch):
    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    pieces = {1: " The numbers are", 2: ":\n", 3: "\n1. 42", 4: "\n2. 7\n", 5: "\nQuestion", 6: " more"}
    monkeypatch.setattr(lm.tokenizer, "decode", lambda ids, skip_special_tokens=False: "".join(pieces[i] for i in ids))

    def fake_generate(prompt_ids, max_new_tokens, *rest):
        yield from [1, 2, 3, 4, 5, 6]

    monkeypatch.setattr(session, "_generate", fake_generate)
    assert session.chat("which numbers?") == " The numbers are:\n\n1. 42\n2. 7"


def test_a_reply_is_never_empty_unless_configured():
    from engramkv import sampling
    from engramkv.config import GenerationConfig

    eos = 0
    first = torch.tensor([5.0, 4.0, 1.0])  # the stop token is the first pick
    after = torch.tensor([[9.0, 1.0, 2.0]])  # then the stop token again

    def reply(cfg):
        return list(sampling.sample(first, lambda token: after, 8, {eos}, cfg))

    assert reply(GenerationConfig(min_new_tokens=0)) == []
    assert reply(GenerationConfig()) == [1]  # default 1: the next best token, then the stop token ends it
    assert reply(GenerationConfig(min_new_tokens=3)) == [1, 2, 2]
    assert torch.equal(first, torch.tensor([5.0, 4.0, 1.0]))  # the caller's logits are not masked in place


def test_a_closed_session_refuses_every_call():
    from engramkv import SessionError

    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    session.ingest(" ".join(map(str, _stream(100))))
    session.close()
    session.close()  # a second close is harmless
    for call in (lambda: session.ingest("1 2"), lambda: session.chat("1 2"), lambda: session.recall("1 2"),
                 lambda: session.generate_ids([1]), session.commit):
        with pytest.raises(SessionError, match="closed"):
            call()


def test_a_fork_continues_the_stream_and_leaves_the_original_untouched():
    from engramkv import ConfigError

    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    session.ingest(" ".join(map(str, _stream(400))))
    twin = session.fork()
    assert twin.tokens_ingested == session.tokens_ingested and twin.events == session.events
    assert twin.generate_ids([5, 6, 7], max_new_tokens=6) == session.generate_ids([5, 6, 7], max_new_tokens=6)
    other = CFG.model_copy(update={"recall": CFG.recall.model_copy(update={"answer_hits": 1})})
    variant = session.fork(other)
    variant.generate_ids([1], max_new_tokens=4)
    assert variant.tokens_ingested == session.tokens_ingested + 5  # the variant moved on, not the original
    with pytest.raises(ConfigError, match="same"):
        session.fork(CFG.model_copy(update={"window": CFG.window.model_copy(update={"n_local": 96})}))


def test_ingest_reports_progress_records():
    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    records = []
    session.ingest(" ".join(map(str, _stream(200))), progress=records.append)
    assert [r.tokens for r in records] == sorted(r.tokens for r in records) and records[-1].tokens == 200
    assert records[-1].events == session.events
    assert all(r.bytes_read is None and r.size_bytes is None for r in records)  # text given directly: no file


def test_a_failed_seal_leaves_the_window_holding_exactly_what_memory_lacks():
    """Sealing cuts a chunk's events from one slice of the window; when memory refuses one, the events before it
    have left the window and the rest are still there, so no token is lost or held twice."""
    from engramkv.memory.events import InMemoryEventMemory

    class Refusing(InMemoryEventMemory):  # takes events one at a time, as a store does, and refuses the sixth
        def add(self, events, keys, values, representatives, key_summaries, token_ids):
            start = 0
            for i, event in enumerate(events):
                if len(self) == 5:
                    raise OSError("disk full")
                part = slice(start, start + event.length)
                super().add([event], keys[:, :, part], values[:, :, part], representatives[i : i + 1],
                            key_summaries[i : i + 1], token_ids[part])
                start += event.length

    _, lm = tiny_pair("llama", CFG)
    session = lm.session(memory=Refusing(lm.spec.num_layers, lm.spec.num_kv_heads, lm.spec.head_dim, torch.float32))
    with pytest.raises(OSError, match="disk full"):
        session.ingest_ids(_stream(400))
    memory, state = session.memory, session.state
    assert len(memory) == 5
    stream = state.stream
    assert stream.local_start == memory.event(4).end
    for layer in state.layers:
        assert layer.local_k.shape[1] == layer.local_attention.shape[1] == stream.n_tokens - stream.local_start
    assert stream.tail_tokens.numel() == stream.local_surprise.numel() == stream.n_tokens - stream.local_start
