"""`generation.answer_start = "echo"`: a "What is/are X?" chat question has its answer begun as "X is/are"."""

import pytest

from engramkv import EngineConfig
from engramkv import chat
from engramkv.config import GenerationConfig, WindowConfig

from conftest import IntTokenizer, tiny_pair


@pytest.mark.parametrize("question, start", [
    ("What is the pass key?", "The pass key is"),
    ("what are all the special magic numbers for amber-fjord mentioned in the provided text?",
     "The special magic numbers for amber-fjord mentioned in the provided text are"),
    ("What is the name of my pet?", "The name of your pet is"),
    ("What's your name?", "My name is"),
    ('What is the value associated with the key "a-b"?', 'The value associated with the key "a-b" is'),
])
def test_a_what_question_is_echoed_in_the_answerers_person(question, start):
    assert chat.echo(question) == start


@pytest.mark.parametrize("question", [
    "What is my sister called?",  # "Your sister called is" is not English
    "What is the weather like?",
    "What is it?",
    "What are you?",  # "I are" would not agree
    "In which city does my sister live?",
    "What is the key? Tell me twice.",
    "What is the key",  # not asked as a question
    "Tell me the key.",
])
def test_other_messages_are_not_echoed(question):
    assert chat.echo(question) is None


@pytest.mark.parametrize("chat_format", ["qa", "template"])
def test_the_echo_follows_the_prompt_outside_the_questions_span(chat_format):
    tokenizer = IntTokenizer()
    plain = chat.chat_turn(tokenizer, GenerationConfig(chat_format=chat_format, answer_start="none"), [],
                            "What is the pass key?")
    echoed = chat.chat_turn(tokenizer, GenerationConfig(chat_format=chat_format, answer_start="echo"), [],
                            "What is the pass key?")
    assert plain.reply_start == ""
    assert echoed.reply_start.strip() == "The pass key is"
    assert echoed.prompt_ids == plain.prompt_ids + tokenizer.encode(echoed.reply_start)
    assert echoed.question_span == plain.question_span


def test_a_chat_reply_begins_with_the_echo_and_the_stream_reads_it_once():
    config = EngineConfig(window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
                          generation=GenerationConfig(answer_start="echo"))
    _, lm = tiny_pair("llama", config)
    session = lm.session()
    session.ingest("1 2 3 4 5 6 7 8")
    before = session.tokens_ingested
    reply = session.chat("What is the pass key?", max_new_tokens=3)
    assert reply.startswith(" The pass key is")
    assert len(reply.removeprefix(" The pass key is").split()) == 3  # the echo does not use up the reply's tokens
    turn = len(IntTokenizer().encode("Question: What is the pass key? Answer: The pass key is"))
    assert session.tokens_ingested == before + turn + 3


@pytest.mark.parametrize("chat_format, lead", [("qa", " "), ("template", "")])
def test_list_begins_a_plural_answer_as_a_bulleted_list_and_echoes_a_singular_one(chat_format, lead):
    cfg = GenerationConfig(chat_format=chat_format, answer_start="list")
    plural = chat.chat_turn(IntTokenizer(), cfg, [], "What are the pass keys of the two doors?")
    assert plural.reply_start == lead + "The pass keys of the two doors are:\n\n*"
    assert chat.chat_turn(IntTokenizer(), cfg, [], "What is the pass key?").reply_start == lead + "The pass key is"
    assert chat.chat_turn(IntTokenizer(), cfg, [], "Which doors are locked?").reply_start == ""


def test_a_listed_reply_ends_at_the_blank_line_after_its_items():
    # The list's own blank line is in the answer start, not in what the model writes; the stop text ends
    # the reply at the first blank line the model writes after some text.
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    written = map(ord, " 1\n* 2\n\nQuestion: 3")
    assert "".join(chat.stream_text(Chars(), written, "\n\n")) == " 1\n* 2"
