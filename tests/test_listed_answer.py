"""A question for all of something is answered as a list drafted on a copy of the stream, its items one sentence."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engramkv import EngineConfig, EpisodicLM, chat
from engramkv.config import GenerationConfig, RecallConfig, SegmentationConfig, WindowConfig

from conftest import EndingTokenizer, IntTokenizer, tiny_model, tiny_pair

OPENER = " The numbers are" + chat.LIST_OPENER


@pytest.mark.parametrize("question, asks", [
    ("What are all the special magic numbers for a-b and c-d mentioned in the provided text?", True),
    ("what are all of my cats' names?", True),
    ("What are the names of my cats?", False),
    ("What is all the fuss about?", True),  # asks for all, but is not echoed: no list (below)
    ("Tell me all the numbers.", False),
])
def test_a_question_for_all_of_something_is_recognised(question, asks):
    assert chat.asks_for_all(question) is asks


def test_the_items_become_one_sentence_each_named_once():
    assert "".join(chat.joined(OPENER, [" 7007071\n* 4664860\n* 4664860.\n* 7007071"])) == \
        " The numbers are: 7007071, 4664860."
    # an item made only of earlier ones is not new; the list ends at a line that is not an item
    assert "".join(chat.joined(OPENER, [" Miso\n- Pepper\n2. Miso and Pepper\nThe numbers are:\n* 5"])) == \
        " The numbers are: Miso, Pepper."
    assert "".join(chat.joined(OPENER, [" Miso\n* Pepper\n* Miso, AND Pepper"])) == " The numbers are: Miso, Pepper."
    assert "".join(chat.joined(OPENER, ["\n*\n"])) == " The numbers are:"  # no items: the start alone


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["* ", "- ", "1. ", "42", "7", "Miso", " and ", ".", ",", "\n", "x y"]), max_size=30),
       st.data())
def test_the_sentence_does_not_depend_on_how_the_list_is_streamed(tokens, data):
    text = "".join(tokens)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert "".join(chat.joined(OPENER, pieces)) == "".join(chat.joined(OPENER, [text]))


@pytest.mark.parametrize("chat_format, lead", [("qa", " "), ("template", "")])
def test_only_an_echoed_question_for_all_is_listed(chat_format, lead):
    echo = GenerationConfig(chat_format=chat_format, answer_start="echo")
    turn = chat.chat_turn(IntTokenizer(), echo, [], "What are all the pass keys?")
    assert turn.reply_start == lead + "The pass keys are" + chat.LIST_OPENER
    assert turn.prompt_ids[turn.listed:] == IntTokenizer().encode(turn.reply_start)
    assert chat.chat_turn(IntTokenizer(), echo, [], "What are the pass keys?").listed is None
    assert chat.chat_turn(IntTokenizer(), echo, [], "What is all the fuss about?").listed is None
    # a turn too long to read twice is only echoed
    long = chat.chat_turn(IntTokenizer(), echo, [], "What are all the pass keys?", list_room=3)
    assert (long.listed, long.reply_start) == (None, lead + "The pass keys are")
    for start in ("none", "list"):  # "list" lists every plural answer, as the model writes it
        other = GenerationConfig(chat_format=chat_format, answer_start=start)
        assert chat.chat_turn(IntTokenizer(), other, [], "What are all the pass keys?").listed is None


def test_a_turn_ends_in_the_stream_as_the_template_writes_it():
    template, qa = GenerationConfig(chat_format="template"), GenerationConfig(chat_format="qa")
    asked = "What are all the keys?"
    for generation, end in ((template, [3]), (qa, [])):  # qa: the next turn's blank line ends it
        listed = chat.chat_turn(EndingTokenizer(), generation, [], asked)
        ids = chat.closing_ids(EndingTokenizer(), generation, [], asked, listed, " 5 6", None)
        assert ids == listed.prompt_ids[: listed.listed] + [5, 6] + end  # the draft is gone: question and items
    plain = chat.chat_turn(EndingTokenizer(), template, [], "4 5")
    assert chat.closing_ids(EndingTokenizer(), template, [], "4 5", plain, " 7", last_read=7) == [3]  # cut short
    assert chat.closing_ids(EndingTokenizer(), template, [], "4 5", plain, " 7", last_read=3) == []  # stopped
    assert chat.closing_ids(EndingTokenizer(), template, [], "4 5", plain, "", last_read=2) == [3]  # nothing said
    assert chat.turn_end(IntTokenizer(), template, [], "4 5", " 7") == ""  # a template that writes no end


def test_no_list_is_drafted_where_the_reply_could_pass_the_trained_length():
    from engramkv.session import _list_room

    _, lm = tiny_pair("llama", CFG)
    room = lm.spec.trained_length - CFG.attention_span(0)
    assert _list_room(CFG, lm.spec, None) == CFG.window.chunk_size
    assert _list_room(CFG, lm.spec, room) == CFG.window.chunk_size
    assert _list_room(CFG, lm.spec, room + 1) == 0


CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(enabled=False),  # the turn reads no memory, so a plain read of its ids is its twin
    segmentation=SegmentationConfig(min_event=4, max_event=24),
)


class LineTokenizer(IntTokenizer):
    """An IntTokenizer whose ids divisible by 8 are new lines, so a random model's list has whole items."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("\n" if i % 8 == 0 else f" {i}" for i in ids)


def test_the_stream_keeps_the_sentence_and_forgets_the_draft():
    lm = EpisodicLM(tiny_model("llama"), LineTokenizer(), "tiny-llama", CFG)
    listed, twin = lm.session(), lm.session()
    text = " ".join(str(i % 50 + 1) for i in range(300))  # past the local window: events are sealed
    listed.ingest(text)
    twin.ingest(text)
    events = listed.events
    reply = listed.chat("What are all the pass keys?", max_new_tokens=90)  # more than the window: no sealing
    assert reply.startswith(" The pass keys are:") and reply.endswith(".")
    turn = chat.chat_turn(lm.tokenizer, CFG.generation, [], "What are all the pass keys?")
    twin.ingest_ids(turn.prompt_ids[: turn.listed] + lm.tokenizer.encode(reply))
    assert listed.tokens_ingested == twin.tokens_ingested
    assert listed.events == twin.events >= events
    assert listed.generate_ids([5, 6, 7], max_new_tokens=8) == twin.generate_ids([5, 6, 7], max_new_tokens=8)
    assert listed._reader.chat_history[-1] == {"role": "assistant", "content": reply}


def test_a_stored_session_commits_the_sentence(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    with lm.session(store=tmp_path / "s") as session:
        session.ingest("1 2 3 4 5 6 7 8")
        reply = session.chat("What are all the pass keys?", max_new_tokens=6)
        tokens = session.tokens_ingested
    with lm.session(store=tmp_path / "s", read_only=True) as reopened:
        assert reopened.tokens_ingested == tokens
        assert reopened._reader.chat_history[-1]["content"] == reply


def test_a_list_that_ends_before_the_reply_does_lets_the_session_go(monkeypatch):
    _, lm = tiny_pair("llama", CFG)
    session = lm.session()
    session.ingest("1 2 3 4 5 6 7 8")
    # every token writes a line that is not an item: the list ends at the first, while the model goes on
    monkeypatch.setattr(lm.tokenizer, "decode", lambda ids, skip_special_tokens=False: " 5" + "\nsome prose" * len(ids))
    assert session.chat("What are all the pass keys?", max_new_tokens=20) == " The pass keys are: 5."
    assert session.chat("7 8", max_new_tokens=2)  # the session is free again


def test_a_draft_with_recall_on_leaves_the_stream_as_it_was():
    import torch

    config = CFG.model_copy(update={"recall": RecallConfig(budget_tokens=48)})
    _, lm = tiny_pair("llama", config)
    session = lm.session()
    session.ingest(" ".join(str(i % 70 + 1) for i in range(400)))
    events, before = session.events, session.state.snapshot()
    with session._reader.reading(None, list(range(1, 91)), draft=True):  # three chunks and more: would seal
        assert session.tokens_ingested == 490
    after = session.state.snapshot()
    assert session.events == events and session.tokens_ingested == 400
    assert after.keys() == before.keys()
    for key in before:
        if key == "layers":
            for was, now in zip(before[key], after[key]):
                assert all(torch.equal(was[k], now[k]) if torch.is_tensor(was[k]) else was[k] == now[k] for k in was)
        elif torch.is_tensor(before[key]):
            assert torch.equal(before[key], after[key])
        else:
            assert before[key] == after[key], key


@pytest.mark.parametrize("model_ended, shown", [(True, " 5\n 6"), (False, " 5\n")])
def test_a_list_cut_by_the_token_limit_loses_its_half_written_last_item(model_ended, shown):
    def tokens():  # what `sampling.sample` yields: "5", a new line, "6", then how the reply ended
        yield from (5, 8, 6)
        return model_ended

    assert "".join(chat.reply_text(LineTokenizer(), tokens(), None, None, whole_lines=True)) == shown
    assert "".join(chat.reply_text(LineTokenizer(), tokens(), None, None)) == " 5\n 6"  # a plain reply: as cut
