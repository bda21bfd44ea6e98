"""`generation.repeat_stop`: a reply ends where a sentence comes back a third time, as the scorer cuts it."""

import re

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from engramkv import EngineConfig, GenerationConfig
from engramkv import chat
from engramkv.chat import cut_repeats, until_repeat

SENTENCES = ["The pass key is", " the pass key.", " 12345.", "\n", "* Miso", "* Pepper\n", " Remember it!", " ", "1.5"]


def whole_reply_cut(reply: str, times: int) -> str:
    """The rule written plainly, over a finished reply: the oracle for the streamed cut."""
    seen: dict[str, int] = {}
    at = 0
    for piece in re.finditer(r"[^.!?\n]*[.!?\n]+|[^.!?\n]+$", reply):
        sentence = piece.group().strip()
        if sentence:
            seen[sentence] = seen.get(sentence, 0) + 1
            if seen[sentence] == times:
                return reply[:at].rstrip()
        at = piece.end()
    return reply


def streamed(pieces: list[str], before: str = "", times: int = 3) -> str:
    return before + "".join(until_repeat(iter(pieces), times, before))


def test_the_issues_degenerate_reply_ends_at_its_second_sentence():
    reply = " The pass key is the pass key." * 8
    tokens = [reply[i : i + 3] for i in range(0, len(reply), 3)]
    assert streamed(tokens) == " The pass key is the pass key. The pass key is the pass key."
    assert streamed(tokens, times=2) == " The pass key is the pass key."


def test_a_reply_without_a_repeat_streams_whole_and_unchanged():
    pieces = [" 12345.", " Remember", " it.", " 12345", "."]
    assert list(until_repeat(iter(pieces), 3)) == pieces  # nothing held back at the end of a piece


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(SENTENCES), max_size=24), st.lists(st.integers(1, 400), max_size=12),
       st.sampled_from(["", " The names of your cats are", "* Miso\n* Miso\n"]), st.integers(2, 3))
def test_the_stream_is_cut_where_the_whole_reply_is_cut(parts, splits, before, times):
    reply = "".join(parts)
    cuts = sorted({min(c, len(reply)) for c in splits} | {0, len(reply)})
    pieces = [reply[a:b] for a, b in zip(cuts, cuts[1:])]
    expected = whole_reply_cut(before + reply, times)
    assert cut_repeats(before + reply, times) == expected
    got = streamed(pieces, before, times)
    if len(expected) >= len(before.rstrip()):
        assert got.rstrip() == expected.rstrip()  # at most whitespace shown before the repeat was known
        assert got.startswith(expected)
    else:  # the repeat is in the given start: nothing more is said
        assert got == before


def test_a_session_reply_stops_at_the_repeat(default_lm):
    prompt = "\n\nWrite the word cat five times, each on its own line:\n\ncat\ncat\n"
    replies = {}
    for stop in (None, 3):
        session = default_lm.session(EngineConfig(generation=GenerationConfig(repeat_stop=stop, max_new_tokens=40)))
        session.ingest("My name is Ada. I have two cats.")
        replies[stop] = session.generate(prompt)
    assert replies[None].count("cat") > 3  # the embedded model does loop here, so the cut is exercised
    assert replies[3].rstrip() == cut_repeats(replies[None]).rstrip() == "cat\ncat"


def test_a_chat_reply_counts_its_given_start():
    # the start is yielded by the session before the model's pieces: the cut must count its sentences too
    assert streamed([" Miso.", " Miso.", " Pepper."], before="Miso.") == "Miso. Miso."
    assert chat.cut_repeats("Miso. Miso. Miso. Pepper.") == "Miso. Miso."


def test_a_repeat_stop_below_two_is_refused():
    with pytest.raises(ValidationError):
        GenerationConfig(repeat_stop=1)  # every first sentence would be "the first return": no reply at all
