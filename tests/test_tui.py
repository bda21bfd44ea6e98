"""The chat app, headless (App.run_test + Pilot) over a tiny model: chat, /ingest, /session, panels."""

from __future__ import annotations

import asyncio

import pytest
import torch
from textual.widgets import Input, Static

from engramkv import EngineConfig
from engramkv.config import GenerationConfig, RecallConfig, SegmentationConfig, StoreConfig, WindowConfig
from engramkv.tui.app import ChatApp, surprise_plot

from conftest import VOCAB, tiny_pair

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
    store=StoreConfig(codec="int8", commit_tokens=96),
    generation=GenerationConfig(max_new_tokens=6),
)


def _app(tmp_path) -> ChatApp:
    return ChatApp(lambda: tiny_pair("llama", CFG)[1], str(tmp_path / "store"))


async def _until_idle(pilot, app: ChatApp, timeout: float = 60.0) -> None:
    waited = 0.0
    while app.busy is not None and waited < timeout:
        await pilot.pause(0.05)
        waited += 0.05
    assert app.busy is None, f"still busy: {app.busy}"


def _texts(app: ChatApp, selector: str) -> list[str]:
    return [str(w.render()) for w in app.query(selector)]


async def _submit(pilot, app: ChatApp, text: str) -> None:
    prompt = app.query_one("#prompt", Input)
    prompt.value = text
    await pilot.press("enter")
    await pilot.pause(0.05)
    await _until_idle(pilot, app)


def test_ingest_chat_and_switch_sessions(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(map(str, torch.randint(0, VOCAB, (600,), generator=torch.Generator().manual_seed(0)).tolist())))

    async def scenario() -> None:
        app = _app(tmp_path)
        async with app.run_test(size=(140, 40)) as pilot:
            await _until_idle(pilot, app)
            assert any("ready" in t for t in _texts(app, ".system"))

            await _submit(pilot, app, f"/ingest {doc}")
            assert any("ingested" in t and "600 tokens" in t for t in _texts(app, ".system"))
            memory = str(app.query_one("#memory", Static).render())
            assert "600" in memory and "events" in memory

            await _submit(pilot, app, "1 2 3")
            answers = _texts(app, ".assistant")
            assert len(answers) == 1 and len(answers[0].split()) == 6  # six streamed tokens of the tiny model
            assert "#" in str(app.query_one("#recalled", Static).render())  # recalled events listed
            assert "k=" in str(app.query_one("#recalled", Static).render())  # with the theta the answer took
            assert "^" in str(app.query_one("#surprise", Static).render())

            await _submit(pilot, app, "/session other")
            assert app.session_id == "other" and app.session.tokens_ingested == 0

            await _submit(pilot, app, "/bogus")
            assert any("unknown command" in t for t in _texts(app, ".system"))

            await _submit(pilot, app, f"/ingest {tmp_path / 'missing.txt'}")
            assert any("no such file" in t for t in _texts(app, ".system"))

    asyncio.run(scenario())


def test_the_conversation_is_kept_in_the_store(tmp_path):
    async def chat_once() -> int:
        app = _app(tmp_path)
        async with app.run_test() as pilot:
            await _until_idle(pilot, app)
            await _submit(pilot, app, "4 5 6 7")
            return app.session.tokens_ingested

    tokens = asyncio.run(chat_once())
    assert tokens > 4

    async def reopen() -> int:
        app = _app(tmp_path)
        async with app.run_test() as pilot:
            await _until_idle(pilot, app)
            return app.session.tokens_ingested

    assert asyncio.run(reopen()) == tokens


@pytest.mark.parametrize("values, boundaries, marks", [([1.0] * 100, [0, 50], 1), ([1.0] * 100, [30, 50, 90], 3), ([0.5, 3.0, 1.0], [1], 1)])
def test_surprise_plot_marks_event_starts(values, boundaries, marks):
    bars, marker_row = surprise_plot(values, boundaries, width=20).split("\n")[:2]
    assert len(bars) <= 20 and marker_row.count("^") == marks


def test_surprise_plot_of_nothing():
    assert "no input" in surprise_plot([], [])


def test_surprise_plot_draws_only_the_most_recent_tokens():
    plot = surprise_plot([0.0] * 1000 + [9.0], [0, 500, 990], width=10, tokens_per_column=4)
    bars, marks, caption = plot.split("\n")
    assert len(bars) == 10 and marks.count("^") == 1  # only the start at 990 is among the last 40 tokens
    assert caption.startswith("40 tokens")
