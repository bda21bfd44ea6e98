"""ModelSpec: what the engine and a store know of a model (no transformers import).

`hf.model_spec` reads one off a loaded transformers model; a store records it as its
fingerprint and refuses to serve a model whose spec differs.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ModelSpec(BaseModel):
    """The shape of a model's attention and where its positions stop: what a stored stream depends on."""

    model_id: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: dict[str, Any]
    trained_length: int
    dtype: str
