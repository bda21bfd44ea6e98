"""EpisodicLM: a loaded model patched for episodic attention, and the sessions and stores opened over it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from engramkv import hf
from engramkv.config import EngineConfig, StoreConfig
from engramkv.errors import ConfigError
from engramkv.memory.events import EventMemory, InMemoryEventMemory, PersistentMemory, TransientMemory
from engramkv.memory.summary import summary_layer_ids
from engramkv.session import Session, check_span
from engramkv.storage.store import DEFAULT_NAME, EventStore


class EpisodicLM:
    """A loaded model, patched for episodic attention. Cheap to share between sessions."""

    def __init__(self, model: PreTrainedModel, tokenizer: Any, model_id: str, config: EngineConfig | None = None,
                 loader: Callable[[], EpisodicLM] | None = None):
        self.config = config or EngineConfig()
        # How another process loads this same model: a sharded ingest's workers call it (pickled by Ray).
        # from_pretrained sets it; a model built by hand has none unless given.
        self.loader = loader
        self.model = model
        self.tokenizer = tokenizer
        self.spec = hf.model_spec(model, model_id)
        self.rope = hf.install_episodic_attention(model)
        check_span(self.config, self.spec)
        self._stores: dict[tuple[Path, bool], tuple[EventStore, StoreConfig]] = {}

    @classmethod
    def from_pretrained(cls, name_or_path: str | None = None, config: EngineConfig | None = None) -> EpisodicLM:
        """Load a model: None = the embedded default (SmolLM2-135M-Instruct, offline), else a hub id or path."""
        config = config or EngineConfig()
        if name_or_path is not None:
            model_cfg = config.model.model_copy(update={"name_or_path": name_or_path})
            config = config.model_copy(update={"model": model_cfg})
        model, tokenizer, model_id = hf.load_pretrained(config.model)
        return cls(model, tokenizer, model_id, config, loader=functools.partial(cls.from_pretrained, None, config))

    def session(
        self,
        config: EngineConfig | None = None,
        memory: EventMemory | None = None,
        store: str | Path | None = None,
        user_id: str = DEFAULT_NAME,
        agent_id: str = DEFAULT_NAME,
        session_id: str = DEFAULT_NAME,
        read_only: bool = False,
    ) -> Session:
        """A stream and its episodic memory.

        Without `store`: a new, empty stream whose events go to `memory` (any `EventMemory`), by
        default a fresh one in RAM. With `store` (a directory, created if needed): the stream of
        namespace (user_id, agent_id, session_id) in that persistent store, continued where it
        stopped. `read_only` opens an existing store without taking the writer lock; what such a
        session adds stays in RAM.
        """
        config = config or self.config
        check_span(config, self.spec)
        spec = self.spec
        summary_layers = summary_layer_ids(spec.num_layers, config.recall.summary_layers)
        if store is not None:
            if memory is not None:
                raise ConfigError("give a session either memory= or store=, not both")
            memory = self.open_store(store, config, read_only).namespace(
                user_id, agent_id, session_id, summary_layers=summary_layers, device=self.model.device,
                dtype=self.model.dtype)
        elif memory is None:  # not `memory or ...`: an empty memory has len 0 and is falsy
            dtype = getattr(torch, config.recall.memory_dtype)
            memory = InMemoryEventMemory(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype,
                                         device=self.model.device, kernels=config.model.kernels)
        if not isinstance(memory, PersistentMemory):  # a memory of the caller's: its events live in the process
            memory = TransientMemory(memory)
        try:
            return Session(self, config, memory, summary_layers)
        except BaseException:
            memory.close()  # a stored stream that cannot be restored must not stay open in this process
            raise

    def open_store(self, path: str | Path, config: EngineConfig | None = None, read_only: bool = False) -> EventStore:
        """The persistent store at `path`, opened once per process and mode (it checks the model's fingerprint).

        A store stays open with the `StoreConfig` it was first opened with; opening it again with another
        one raises `ConfigError` (close this model's stores first to change them).
        """
        key = (Path(path).expanduser().resolve(), read_only)
        wanted = (config or self.config).store
        if key not in self._stores:
            self._stores[key] = (EventStore(key[0], self.spec, wanted, read_only=read_only), wanted)
        store, opened_with = self._stores[key]
        if opened_with != wanted:
            changed = sorted(k for k, v in wanted.model_dump().items() if opened_with.model_dump()[k] != v)
            raise ConfigError(f"the store {key[0]} is already open with other store settings ({', '.join(changed)}); "
                              "use the same StoreConfig, or close it first (EpisodicLM.close)")
        return store

    def close(self) -> None:
        """Close every store this model opened (sessions on them should be closed first)."""
        for store, _ in self._stores.values():
            store.close()
        self._stores.clear()
