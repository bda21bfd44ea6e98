"""Snapshot tests of the chat app's main screens (pytest-textual-snapshot, SVGs in __snapshots__/).

Each screen is rendered over a tiny random model and a store in a fixed relative path, so that
nothing in it depends on the machine or the run. After an intended change of the interface,
review the new screens and update them with `pytest tests/test_tui_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

import torch

from engramkv.tui.app import ChatApp

from conftest import VOCAB, tiny_pair
from test_tui import CFG, _submit, _until_idle

SIZE = (120, 34)


def _app() -> ChatApp:
    return ChatApp(lambda: tiny_pair("llama", CFG)[1], "store")


def _ingested_store() -> None:
    """A store in ./store holding 600 tokens of a document, written through the library."""
    lm = tiny_pair("llama", CFG)[1]
    text = " ".join(map(str, torch.randint(0, VOCAB, (600,), generator=torch.Generator().manual_seed(0)).tolist()))
    with lm.session(store="store") as session:
        session.ingest(text)
    lm.close()


def test_the_opening_screen(snap_compare, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert snap_compare(_app(), terminal_size=SIZE, run_before=lambda pilot: _until_idle(pilot, pilot.app))


def test_an_answer_with_its_recalled_events(snap_compare, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _ingested_store()

    async def ask(pilot) -> None:
        await _until_idle(pilot, pilot.app)
        await _submit(pilot, pilot.app, "1 2 3")

    assert snap_compare(_app(), terminal_size=SIZE, run_before=ask)


def test_the_help_screen(snap_compare, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    async def help_(pilot) -> None:
        await _until_idle(pilot, pilot.app)
        await _submit(pilot, pilot.app, "/help")

    assert snap_compare(_app(), terminal_size=SIZE, run_before=help_)
