"""A store without a model, for the storage tests: a hand-written ModelSpec and random events."""

from __future__ import annotations

from pathlib import Path

import torch

from engramkv.config import StoreConfig
from engramkv.memory.events import Event
from engramkv.spec import ModelSpec
from engramkv.storage.namespace import NamespaceMemory
from engramkv.storage.store import EventStore

SPEC = ModelSpec(model_id="tiny-spec", model_type="llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                 rope={"rope_theta": 10000.0}, trained_length=512, dtype="float32")
SUMMARY_LAYERS = [1]


def open_store(path: Path, catalog_url: str | None = None, read_only: bool = False, **cfg: object) -> EventStore:
    return EventStore(path, SPEC, StoreConfig.model_validate({"codec": "fp16", "catalog_url": catalog_url, **cfg}),
                      read_only=read_only)


def open_namespace(store: EventStore, user_id: str = "default") -> NamespaceMemory:
    return store.namespace(user_id, summary_layers=SUMMARY_LAYERS)


def add_events(memory: NamespaceMemory, n: int, length: int = 5, seed: int = 0) -> None:
    """Append `n` events of `length` tokens after the last one."""
    g = torch.Generator().manual_seed(seed)
    layers, heads, dim = SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim
    for _ in range(n):
        event_id = len(memory)
        start = memory.event(event_id - 1).end if event_id else 0
        memory.add(
            [Event(event_id, start, start + length, surprise_mean=1.0 + event_id, surprise_max=2.0 + event_id)],
            keys=torch.randn(layers, heads, length, dim, generator=g),  # (L, Hkv, T, D)
            values=torch.randn(layers, heads, length, dim, generator=g),  # (L, Hkv, T, D)
            representatives=torch.randn(1, layers, heads * dim, generator=g),  # (E, L, F)
            key_summaries=torch.randn(1, len(SUMMARY_LAYERS) * heads * dim, generator=g),  # (E, S)
            token_ids=torch.arange(start, start + length) % 256,  # (T,)
        )


def snapshot(memory: NamespaceMemory) -> dict[str, object]:
    """A stand-in for the engine's snapshot: only its stream position is read by the store."""
    return {"engine": {"n_tokens": memory.event(len(memory) - 1).end if len(memory) else 0}}
