"""One event's bytes at rest: the blob layout, its encoder and its readers.

A blob is one segment record (`segments.py`) and holds everything a namespace needs to serve the
event again: its tokens, the representatives its layer indexes are rebuilt from, and its KV.
T = the event's tokens, L = layers, Hkv = KV heads, D = head dim, F = Hkv * D; little-endian, no padding:

    offset                          part                           bytes
    0                               token ids  int32 (T,)          4 T
    4 T                             representatives (L, F)          r L F  (f32, r = 4; lowrank: f16, r = 2)
    4 T + r L F                     layer 0 KV                     n_0 = codec.layer_nbytes(0, T)
    4 T + r L F + n_0 + ... n_l-1   layer l KV                     n_l
    ...
    total                                                          4 T + r L F + sum n_l

Each layer's KV is in the store's codec (`codec.py` draws the quantised layouts, `lowrank.py` its own);
a layer's offset is known from the sizes alone, so one layer is read without decoding the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from engramkv.storage.codec import LayerCodec


@dataclass(frozen=True)
class BlobLayout:
    """The blob layout of one namespace: its codec and the model's attention shape."""

    codec: LayerCodec
    num_layers: int
    kv_heads: int
    head_dim: int
    # n_tokens -> the L + 1 layer offsets: read per layer per recalled event, so summed once per event size
    _offsets: dict[int, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def dim(self) -> int:
        """F: the width of one layer's representative (KV heads concatenated)."""
        return self.kv_heads * self.head_dim

    def nbytes(self, n_tokens: int) -> int:
        """Exact size of the blob of an event of `n_tokens`."""
        return self._layer_start(n_tokens, self.num_layers)

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
                 _as_dtype(representatives, self.codec.representative_dtype).tobytes()]
        parts += self.codec.encode_layers(keys, values)  # one per layer, checks that values match keys
        return b"".join(parts)

    def tokens(self, blob: bytes | memoryview, n_tokens: int) -> list[int]:
        return np.frombuffer(blob, dtype="<i4", count=n_tokens).tolist()

    def representatives(self, blob: bytes | memoryview, n_tokens: int) -> np.ndarray:  # (L, F) float32
        """A copy: the index that receives it outlives the blob."""
        flat = np.frombuffer(blob, dtype=self.codec.representative_dtype, count=self.num_layers * self.dim,
                             offset=4 * n_tokens)  # (L * F,)
        return flat.reshape(self.num_layers, self.dim).astype(np.float32)

    def representative_span(self, n_tokens: int, layer: int) -> tuple[int, int]:
        """(offset, bytes) of one layer's representative in the blob of an event of `n_tokens`."""
        size = self._representative_bytes
        return 4 * n_tokens + layer * size, size

    @cached_property
    def _representative_bytes(self) -> int:  # asked once per re-scored candidate: not worked out each time
        return np.dtype(self.codec.representative_dtype).itemsize * self.dim

    def decode_representatives(self, data: bytes, count: int) -> np.ndarray:  # (count, F) float32
        """`count` representatives of one layer, back to back."""
        flat = np.frombuffer(data, dtype=self.codec.representative_dtype, count=count * self.dim)
        return flat.reshape(count, self.dim).astype(np.float32)

    def layer_kv(self, blob: bytes | memoryview, n_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each float16 (Hkv, T, D)."""
        at = self._layer_start(n_tokens, layer)
        size = self.codec.layer_nbytes(layer, n_tokens)
        return self.codec.decode_layer(layer, memoryview(blob)[at : at + size], n_tokens)

    def _layer_start(self, n_tokens: int, layer: int) -> int:
        """Offset of `layer`'s KV (of `num_layers`: the blob's end)."""
        offsets = self._offsets.get(n_tokens)
        if offsets is None:
            at = 4 * n_tokens + np.dtype(self.codec.representative_dtype).itemsize * self.num_layers * self.dim
            starts = [at]
            for i in range(self.num_layers):
                starts.append(starts[-1] + self.codec.layer_nbytes(i, n_tokens))
            offsets = self._offsets[n_tokens] = tuple(starts)
        return offsets[layer]


def _as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` in `dtype`; into float16 clipped to its range (a representative past it would read back as inf)."""
    if np.dtype(dtype).itemsize == 2:
        x = np.clip(x, -65504.0, 65504.0)
    return x.astype(dtype)
