import pytest
from pydantic import ValidationError

from engramkv import ConfigError, EngineConfig, EpisodicLM
from engramkv.config import RecallConfig, SegmentationConfig, WindowConfig

from conftest import IntTokenizer, tiny_model


def test_defaults_fit_the_default_models_window():
    assert EngineConfig().attention_span(64) <= 8192


def test_unknown_knob_is_rejected():
    with pytest.raises(ValidationError):
        EngineConfig(window={"chunk": 3})


def test_min_event_above_max_event_is_rejected():
    with pytest.raises((ConfigError, ValidationError)):
        SegmentationConfig(min_event=64, max_event=32)


def test_window_larger_than_trained_length_is_refused():
    cfg = EngineConfig(window=WindowConfig(n_local=4000), recall=RecallConfig(budget_tokens=1024))
    with pytest.raises(ConfigError, match="trained on 2048"):
        EpisodicLM(tiny_model("llama"), IntTokenizer(), "tiny", cfg)


def test_config_round_trips_through_json():
    cfg = EngineConfig(recall=RecallConfig(positions="fixed"))
    assert EngineConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_with_allocation_mode_changes_the_mode_only():
    cfg = EngineConfig()
    fixed = cfg.with_allocation_mode("fixed")
    assert fixed.allocation.mode == "fixed" and cfg.allocation.mode == "auto"
    assert fixed.allocation.model_dump(exclude={"mode"}) == cfg.allocation.model_dump(exclude={"mode"})
    assert fixed.model_dump(exclude={"allocation"}) == cfg.model_dump(exclude={"allocation"})
