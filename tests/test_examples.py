"""The examples run: the agent example over a tiny model (fast) and over the embedded model (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engramkv import EngineConfig
from engramkv.config import RecallConfig, SegmentationConfig, WindowConfig

from conftest import VOCAB, IntTokenizer, tiny_pair

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import agent_tool  # noqa: E402

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
)


class WordTokenizer(IntTokenizer):
    """Integers as themselves, any other word as a stable id: the agent's prompts contain English."""

    def encode(self, text, add_special_tokens=False):
        return [int(w) if w.isdigit() else sum(map(ord, w)) % VOCAB for w in text.split()]


def test_agent_tools_return_json_and_the_loop_calls_them(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(str(i % 200) for i in range(700)))
    _, lm = tiny_pair("llama", CFG)
    lm.tokenizer = WordTokenizer()
    transcript = agent_tool.main(["--document", str(doc), "--question", "5 6 7"], lm=lm)
    assert [step["tool"] for step in transcript][:2] == ["recall", "chat"]
    assert len(transcript[0]["result"]["events"]) == 3
    json.dumps(transcript)  # every tool result is JSON


def test_grounding_check():
    events = [{"text": "The warehouse goes to Tampere in March."}]
    question = "Where does the warehouse go?"
    assert agent_tool.grounded("Tampere.", events, question)
    assert not agent_tool.grounded("It is a city.", events, question)
    assert not agent_tool.grounded("The warehouse is in Ashwood.", events, question)  # only echoes the question


# The opt-in surprise floor cuts the report's filler into 32-token runs; before a predicted run was cut at its
# start and kept out of what follows a hit, the answer read filler after the fact and continued it.
FLOOR = {"min_surprise": 1.0, "predicted_event": 32}


@pytest.mark.slow
@pytest.mark.parametrize("segmentation", [{}, FLOOR], ids=["default", "floor"])
def test_agent_answers_from_the_document_with_the_default_model(default_lm, segmentation):
    _, question, fact = agent_tool.demo_document()
    config = default_lm.config.model_copy(update={"segmentation": default_lm.config.segmentation.model_copy(
        update=segmentation)})
    transcript = agent_tool.main([], lm=default_lm, config=config)
    answers = [step["result"]["answer"] for step in transcript if step["tool"] == "chat"]
    assert transcript[0]["result"]["events"], "recall returned nothing"
    assert any(fact in answer for answer in answers), answers
