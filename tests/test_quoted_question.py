"""`generation.question_span = "quoted"`: a chat question that quotes something is matched by what it quotes."""

import pytest
import torch

from engramkv import EngineConfig, chat
from engramkv.config import GenerationConfig, RecallConfig, SegmentationConfig, WindowConfig
from engramkv.retrieval import question as question_module

from conftest import VOCAB, IntTokenizer, tiny_pair


@pytest.mark.parametrize("message, quoted", [
    ('What is the value associated with the key "9fb04eb0-0195-41ac"?', ' "9fb04eb0-0195-41ac"'),
    ("What does `engramkv ingest` do?", " `engramkv ingest`"),
    ("Who wrote \u201cthe pass key\u201d here?", " \u201cthe pass key\u201d"),
    ('Is "a" bigger than "b" or not?', ' "a" bigger than "b"'),  # first quote to last
])
def test_the_question_is_cut_to_what_it_quotes_and_the_text_stays_whole(message, quoted):
    before, question, after = chat.quoted("Question:", " " + message, "\nAnswer:")
    assert question == quoted
    assert before + question + after == "Question: " + message + "\nAnswer:"


@pytest.mark.parametrize("message", [
    "What is the pass key?",
    "What's Ada's cat called?",  # apostrophes are not quotes
    '"What is the pass key?"',  # all of it quoted: nothing to cut
    'Which key is "" or " "?',  # quotes around nothing
])
def test_a_question_that_quotes_nothing_is_matched_whole(message):
    assert chat.quoted("Question:", " " + message, "") == ("Question:", " " + message, "")


@pytest.mark.parametrize("chat_format", ["qa", "template"])
def test_a_turns_question_span_is_the_quote_and_its_ids_read_the_same_text(chat_format):
    tokenizer = IntTokenizer()
    message = 'what is "7 77 177" here?'
    cut = chat.chat_turn(tokenizer, GenerationConfig(chat_format=chat_format), [], message)
    whole = chat.chat_turn(tokenizer, GenerationConfig(chat_format=chat_format, question_span="message"), [], message)
    a, b = cut.question_span
    assert tokenizer.decode(cut.prompt_ids[a:b]) == tokenizer.decode(tokenizer.encode('"7 77 177"'))
    assert cut.prompt_ids == whole.prompt_ids  # only the span moves (IntTokenizer splits on spaces)
    a, b = whole.question_span
    assert tokenizer.decode(whole.prompt_ids[a:b]) == tokenizer.decode(tokenizer.encode(message))


@pytest.mark.parametrize("question_span, matched", [("quoted", 8), ("message", 11)])
def test_a_chat_question_is_matched_against_memory_by_its_quote(monkeypatch, question_span, matched):
    config = EngineConfig(window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
                          segmentation=SegmentationConfig(min_event=4, max_event=24),
                          recall=RecallConfig(budget_tokens=64, answer_budget_tokens=48, answer_hits=2),
                          generation=GenerationConfig(question_span=question_span))
    _, lm = tiny_pair("llama", config)
    session = lm.session()
    planted = '"7 77 177 17 71 170 107 7"'  # IntTokenizer: the quoted words get ids of their own, ingested alike
    before, after = (torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                     for n in (300, 400))
    session.ingest(" ".join(map(str, before)) + f" {planted} " + " ".join(map(str, after)))
    widths = []
    real = question_module.assess

    def assess(memory, question_keys, *args, **kwargs):
        widths.append(question_keys.shape[2])  # (S, Hkv, C, D): C, the question's tokens matched
        return real(memory, question_keys, *args, **kwargs)

    monkeypatch.setattr(question_module, "assess", assess)
    session.chat(f"what is {planted} about?", max_new_tokens=2)
    assert widths and set(widths) == {matched}
    first = session.memory.event(session.last_recalled[0].event_id)
    assert first.start < 308 and first.end > 300  # the planted span is what the best hit holds
