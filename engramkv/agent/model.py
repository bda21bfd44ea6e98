"""EpisodicLM: a causal LM with an episodic memory in its attention."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from engramkv import hf
from engramkv.agent.session import Session
from engramkv.config import EngineConfig
from engramkv.errors import ConfigError
from engramkv.memory.events import EventMemory


class EpisodicLM:
    """A loaded model, patched for episodic attention. Cheap to share between sessions."""

    def __init__(self, model: PreTrainedModel, tokenizer: Any, model_id: str, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.spec = hf.model_spec(model, model_id)
        self.rope = hf.install_episodic_attention(model)
        self._check(self.config)

    @classmethod
    def from_pretrained(cls, name_or_path: str | None = None, config: EngineConfig | None = None) -> EpisodicLM:
        """Load a model: None = the embedded default (SmolLM2-135M-Instruct, offline), else a hub id or path."""
        config = config or EngineConfig()
        if name_or_path is not None:
            model_cfg = config.model.model_copy(update={"name_or_path": name_or_path})
            config = config.model_copy(update={"model": model_cfg})
        model, tokenizer, model_id = hf.load_pretrained(config.model)
        return cls(model, tokenizer, model_id, config)

    def session(self, config: EngineConfig | None = None, memory: EventMemory | None = None) -> Session:
        """A new, empty stream. Its events go to `memory` (any `EventMemory`), by default a fresh one in RAM."""
        config = config or self.config
        self._check(config)
        return Session(self, config, memory)

    def _check(self, config: EngineConfig) -> None:
        span = config.attention_span(config.generation.max_new_tokens)
        if span > self.spec.trained_length:
            raise ConfigError(
                f"the attention window can reach {span} tokens (sinks + recall budget + local window + one event "
                f"+ chunk + max_new_tokens) but {self.spec.model_id} was trained on {self.spec.trained_length}; "
                "shrink window.n_local or recall.budget_tokens"
            )
