"""End to end on the embedded SmolLM2-135M-Instruct: recall past the local window, chat, streaming."""

import sys
from pathlib import Path

import pytest

from engramkv import EngineConfig
from engramkv.config import RecallConfig, WindowConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from _common import passkey_sample  # noqa: E402

pytestmark = pytest.mark.slow

# Small windows so that a 2.5k-token context already lies mostly in event memory.
SMALL = EngineConfig(window=WindowConfig(chunk_size=256, n_sink=64, n_local=256), recall=RecallConfig(budget_tokens=512))


def test_passkey_comes_back_from_event_memory(default_lm):
    context, question, key = passkey_sample(default_lm.tokenizer, 2500, depth=0.3, seed=5)
    session = default_lm.session(SMALL)
    session.ingest(context)
    needle = [
        e for e in (session.memory.event(i) for i in range(len(session.memory)))
        if key[:3] in default_lm.tokenizer.decode(session.memory.tokens(e.id))
    ]
    assert needle, "the passkey must have left the local window"
    assert key in session.generate(question, max_new_tokens=8)
    top = session.recall("What is the pass key?", k=5)
    assert any(key[:3] in r.text for r in top), [r.text for r in top]


def test_chat_streams_and_remembers_the_turn(default_lm):
    session = default_lm.session()
    pieces = list(session.chat("Say hello in one short sentence.", stream=True, max_new_tokens=16))
    assert pieces and "".join(pieces).strip()
    tokens_after_first = session.tokens_ingested
    reply = session.chat("And now say goodbye.", max_new_tokens=16)
    assert reply.strip()
    assert session.tokens_ingested > tokens_after_first  # conversation turns join the stream
