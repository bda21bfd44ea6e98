"""A stored stream keeps the settings it was written with: those a reopen leaves at their defaults follow the store
(so a store outlives a change of the defaults), those it sets must match."""

import json

import pytest
from conftest import tiny_pair

from engramkv import ConfigError, EngineConfig
from engramkv.config import SegmentationConfig, WindowConfig
from engramkv.reading import continuing, stored_settings

WINDOW = WindowConfig(chunk_size=32, n_sink=8, n_local=64)
CFG = EngineConfig(window=WINDOW)
WRITTEN = EngineConfig(window=WINDOW, segmentation=SegmentationConfig(gamma=2.0, min_surprise=0.5))
TEXT = " ".join(f"item {i} is {i * 7 % 13} and the colour is {'red' if i % 3 else 'blue'}." for i in range(40))


def test_settings_left_at_their_defaults_take_the_stored_values():
    stored = WRITTEN.stream_settings()
    adopted = continuing(CFG, stored)
    assert adopted.stream_settings() == stored
    assert adopted.recall == CFG.recall  # only the stream's own settings follow the store
    chosen = EngineConfig(window=WINDOW, segmentation=SegmentationConfig(gamma=3.0))
    kept = continuing(chosen, stored)
    assert (kept.segmentation.gamma, kept.segmentation.min_surprise) == (3.0, 0.5)  # set on purpose: kept
    assert continuing(CFG, CFG.stream_settings()) is CFG


def test_a_commit_older_than_a_knob_reads_on_as_it_was_read_before_the_knob():
    stored = WRITTEN.stream_settings()
    del stored["segmentation"]["min_surprise"], stored["segmentation"]["predicted_event"]
    settings = stored_settings({"stream_config": json.dumps(stored)})
    assert (settings["segmentation"]["min_surprise"], settings["segmentation"]["predicted_event"]) == (0.0, None)
    adopted = continuing(CFG, settings).segmentation
    assert (adopted.min_surprise, adopted.predicted_event, adopted.gamma) == (0.0, None, 2.0)


def test_stored_settings_this_version_refuses_are_an_error():
    stored = WRITTEN.stream_settings()
    stored = WRITTEN.stream_settings()
    stored["segmentation"]["max_event"] = 1  # under min_event: not a config this version accepts
    with pytest.raises(ConfigError, match="segmentation"):
        continuing(CFG, stored)


def test_a_store_reopened_with_the_default_config_continues_with_its_own_settings(tmp_path):
    _, lm = tiny_pair("llama", WRITTEN)
    with lm.session(store=tmp_path / "s") as written:
        written.ingest(TEXT)
        events = len(written.memory)
    with lm.session(CFG, store=tmp_path / "s") as reopened:
        assert reopened.cfg.stream_settings() == WRITTEN.stream_settings()
        assert len(reopened.memory) == events
        reopened.ingest(TEXT)  # reads on with the stored segmentation
        assert reopened.state.n_tokens > 0
    other = EngineConfig(window=WINDOW, segmentation=SegmentationConfig(gamma=3.0))
    with pytest.raises(ConfigError, match="segmentation"):
        lm.session(other, store=tmp_path / "s")
    lm.close()


def test_a_fork_takes_the_stream_settings_it_leaves_at_their_defaults():
    _, lm = tiny_pair("llama", WRITTEN)
    session = lm.session()
    session.ingest(TEXT)
    twin = session.fork(CFG)
    assert twin.cfg.stream_settings() == WRITTEN.stream_settings()
    with pytest.raises(ConfigError, match="fork"):
        session.fork(EngineConfig(window=WINDOW, segmentation=SegmentationConfig(gamma=3.0)))
