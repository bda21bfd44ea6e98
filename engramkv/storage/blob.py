"""One event's bytes at rest: the blob layout, its encoder and its readers.

A blob is one segment record (`segments.py`) and holds everything a namespace needs to serve the
event again: its tokens, the representatives its layer indexes are rebuilt from, and its KV.
T = the event's tokens, L = layers, Hkv = KV heads, D = head dim, F = Hkv * D; little-endian, no padding:

    offset                          part                       bytes
    0                               token ids  int32 (T,)      4 T
    4 T                             representatives f32 (L, F)  4 L F
    4 T + 4 L F                     layer 0 KV                 n = layer_nbytes(codec, Hkv, T, D)
    4 T + 4 L F + l n               layer l KV                 n
    ...
    total                                                      4 T + 4 L F + L n

Each layer's KV is in the store's codec (`codec.py` draws that layout); every layer has the same
size, so one layer is read without decoding the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engramkv.storage.codec import Codec, decode_layer, encode_layers, layer_nbytes


@dataclass(frozen=True)
class BlobLayout:
    """The blob layout of one namespace: its codec and the model's attention shape."""

    codec: Codec
    num_layers: int
    kv_heads: int
    head_dim: int

    @property
    def dim(self) -> int:
        """F: the width of one layer's representative (KV heads concatenated)."""
        return self.kv_heads * self.head_dim

    def nbytes(self, n_tokens: int) -> int:
        """Exact size of the blob of an event of `n_tokens`."""
        return self._kv_start(n_tokens) + self.num_layers * layer_nbytes(self.codec, self.kv_heads, n_tokens,
                                                                         self.head_dim)

    def encode(
        self,
        token_ids: torch.Tensor,  # (T,) int
        representatives: np.ndarray,  # (L, F) float32
        keys: torch.Tensor,  # (L, Hkv, T, D)
        values: torch.Tensor,  # (L, Hkv, T, D)
    ) -> bytes:
        """The event's blob. ValueError when the parts do not share one event's shape (or KV is not finite)."""
        n = int(token_ids.numel())
        if tuple(keys.shape) != (self.num_layers, self.kv_heads, n, self.head_dim):
            raise ValueError(f"keys of shape {tuple(keys.shape)} do not match {n} tokens of a "
                             f"({self.num_layers}, {self.kv_heads}, T, {self.head_dim}) model")
        if representatives.shape != (self.num_layers, self.dim):
            raise ValueError(f"representatives of shape {representatives.shape}, expected ({self.num_layers}, "
                             f"{self.dim})")
        parts = [token_ids.to(torch.int32).cpu().numpy().astype("<i4").tobytes(),
                 representatives.astype("<f4").tobytes()]
        parts += encode_layers(self.codec, keys, values)  # one per layer, checks that values match keys
        return b"".join(parts)

    def tokens(self, blob: bytes | memoryview, n_tokens: int) -> list[int]:
        return np.frombuffer(blob, dtype="<i4", count=n_tokens).tolist()

    def representatives(self, blob: bytes | memoryview, n_tokens: int) -> np.ndarray:  # (L, F) float32
        """A copy: the index that receives it outlives the blob."""
        flat = np.frombuffer(blob, dtype="<f4", count=self.num_layers * self.dim, offset=4 * n_tokens)  # (L * F,)
        return flat.reshape(self.num_layers, self.dim).copy()

    def layer_kv(self, blob: bytes | memoryview, n_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each float16 (Hkv, T, D)."""
        size = layer_nbytes(self.codec, self.kv_heads, n_tokens, self.head_dim)
        at = self._kv_start(n_tokens) + layer * size
        return decode_layer(self.codec, memoryview(blob)[at : at + size], self.kv_heads, n_tokens, self.head_dim)

    def _kv_start(self, n_tokens: int) -> int:
        return 4 * n_tokens + 4 * self.num_layers * self.dim
