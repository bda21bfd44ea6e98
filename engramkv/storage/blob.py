"""One event's bytes at rest: the blob layout, its encoder and its readers.

A blob is one segment record (`segments.py`) and holds everything a namespace needs to serve the
event again: its tokens, the representatives its layer indexes are rebuilt from, and its KV.
T = the event's tokens, L = layers, Hkv = KV heads, D = head dim, F = Hkv * D; little-endian, no padding:

    offset                          part                           bytes
    0                               token ids  int32 (T,)          4 T
    4 T                             representatives (L, F)          L P
    4 T + L P                       layer 0 KV                     n_0 = codec.layer_nbytes(0, T)
    4 T + L P + n_0 + ... n_l-1     layer l KV                     n_l
    ...
    total                                                          4 T + L P + sum n_l

P, one representative's bytes, is set by the codec's `representatives` format:

    f32   F float32                                               P = 4 F   (fp16 / int8 / int4 / int2)
    f16   F float16                                               P = 2 F   (lowrank bases of format 1)
    i8    Hkv float16 scales | F int8 codes                       P = F + 2 Hkv (lowrank bases of format 2)

i8 is symmetric per KV head: code = round(x / scale), scale = max |x| over the head's D dims / 127. At 30
layers of F = 192 it is 5.9 KB per event instead of 23 KB (f32). It costs ranking: on the embedded model's
own searches a flat search over i8 keeps 0.95 of the exact top 10 (f16 0.999), a low-rank two-stage search
0.915 (f32 0.945) (`benchmarks/index_projection.py`). Four bits per code, the same way, kept 0.44 (measured at
624a5b8 and dropped): the keys' few large channels take the scale, the rest round to zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from engramkv.memory.summary import key_summaries
from engramkv.storage.codec import F16_MAX, LayerCodec

REPRESENTATIVE_FORMATS = ("f32", "f16", "i8")
_I8_MAX = 127


def representative_nbytes(fmt: str, kv_heads: int, head_dim: int) -> int:
    """P: the bytes of one representative of F = kv_heads * head_dim in format `fmt`."""
    dim = kv_heads * head_dim
    return {"f32": 4 * dim, "f16": 2 * dim, "i8": dim + 2 * kv_heads}[fmt]


def encode_representatives(fmt: str, x: np.ndarray, kv_heads: int) -> bytes:  # x (N, F) float -> N P bytes
    if fmt == "f32":
        return x.astype("<f4").tobytes()
    if fmt == "f16":
        return np.clip(x, -F16_MAX, F16_MAX).astype("<f2").tobytes()  # past the range it would read back inf
    n, dim = x.shape
    heads = x.astype(np.float32).reshape(n, kv_heads, dim // kv_heads)  # (N, Hkv, D)
    scale = np.minimum(np.abs(heads).max(axis=2) / _I8_MAX, F16_MAX).astype("<f2")  # (N, Hkv)
    step = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]  # codes against the stored scale
    codes = np.clip(np.rint(heads / step), -_I8_MAX, _I8_MAX).astype("i1").reshape(n, dim)
    return np.concatenate([scale.view("u1").reshape(n, -1), codes.view("u1")], axis=1).tobytes()


def decode_representatives(fmt: str, data: bytes | memoryview, count: int, kv_heads: int, head_dim: int,
                           offset: int = 0) -> np.ndarray:  # (count, F) float32, a copy
    dim = kv_heads * head_dim
    if fmt in ("f32", "f16"):
        flat = np.frombuffer(data, dtype="<f4" if fmt == "f32" else "<f2", count=count * dim, offset=offset)
        return flat.reshape(count, dim).astype(np.float32)
    rows = np.frombuffer(data, dtype="u1", count=count * (dim + 2 * kv_heads), offset=offset).reshape(count, -1)
    scale = rows[:, : 2 * kv_heads].copy().view("<f2").astype(np.float32)  # (count, Hkv)
    codes = rows[:, 2 * kv_heads :].view("i1").astype(np.float32).reshape(count, kv_heads, head_dim)
    return (codes * scale[..., None]).reshape(count, dim)


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
                 encode_representatives(self.codec.representatives, representatives, self.kv_heads)]
        parts += self.codec.encode_layers(keys, values)  # one per layer, checks that values match keys
        return b"".join(parts)

    def tokens(self, blob: bytes | memoryview, n_tokens: int) -> list[int]:
        return np.frombuffer(blob, dtype="<i4", count=n_tokens).tolist()

    def representatives(self, blob: bytes | memoryview, n_tokens: int) -> np.ndarray:  # (L, F) float32
        """A copy: the index that receives it outlives the blob."""
        return decode_representatives(self.codec.representatives, blob, self.num_layers, self.kv_heads,
                                      self.head_dim, offset=4 * n_tokens)

    def representative_span(self, n_tokens: int, layer: int) -> tuple[int, int]:
        """(offset, bytes) of one layer's representative in the blob of an event of `n_tokens`."""
        size = self.representative_bytes
        return 4 * n_tokens + layer * size, size

    @cached_property
    def representative_bytes(self) -> int:  # P; asked once per re-scored candidate: not worked out each time
        return representative_nbytes(self.codec.representatives, self.kv_heads, self.head_dim)

    def decode_representatives(self, data: bytes, count: int) -> np.ndarray:  # (count, F) float32
        """`count` representatives of one layer, back to back."""
        return decode_representatives(self.codec.representatives, data, count, self.kv_heads, self.head_dim)

    def layer_kv(self, blob: bytes | memoryview, n_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each float16 (Hkv, T, D)."""
        at = self._layer_start(n_tokens, layer)
        size = self.codec.layer_nbytes(layer, n_tokens)
        return self.codec.decode_layer(layer, memoryview(blob)[at : at + size], n_tokens)

    def layer_keys(self, blobs: Sequence[bytes | memoryview], counts: Sequence[int], layer: int) -> torch.Tensor:
        """Keys of one layer of several events' blobs, joined along the tokens: float16 (Hkv, sum T, D)."""
        return self.codec.decode_joined(layer, self._layer_parts(blobs, counts, layer), counts, values=False)[0]

    def layer_kv_each(self, blobs: Sequence[bytes | memoryview], counts: Sequence[int], layer: int
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) of one layer of each blob, float16 (Hkv, T, D), decoded in one call (`decode_joined`)."""
        if not blobs:
            return []
        keys, values = self.codec.decode_joined(layer, self._layer_parts(blobs, counts, layer), counts)
        assert values is not None
        # clones: each pair gets storage of its own, so a cache can drop them one by one
        return [(k.clone(), v.clone()) for k, v in zip(keys.split(list(counts), dim=1), values.split(list(counts), dim=1))]

    def key_summaries(self, blobs: Sequence[bytes | memoryview], counts: Sequence[int], layers: Sequence[int]
                      ) -> np.ndarray:  # (N, S) float32
        """`memory.summary.key_summary` of each blob's keys in `layers`, each layer's keys decoded in one call."""
        keys = torch.stack([self.layer_keys(blobs, counts, layer) for layer in layers])  # (S, Hkv, sum T, D)
        return key_summaries(keys, list(counts)).numpy()

    def _layer_parts(self, blobs: Sequence[bytes | memoryview], counts: Sequence[int], layer: int) -> list[memoryview]:
        parts = []
        for blob, n_tokens in zip(blobs, counts):
            at = self._layer_start(n_tokens, layer)
            parts.append(memoryview(blob)[at : at + self.codec.layer_nbytes(layer, n_tokens)])
        return parts

    def _layer_start(self, n_tokens: int, layer: int) -> int:
        """Offset of `layer`'s KV (of `num_layers`: the blob's end)."""
        offsets = self._offsets.get(n_tokens)
        if offsets is None:
            at = 4 * n_tokens + self.representative_bytes * self.num_layers
            starts = [at]
            for i in range(self.num_layers):
                starts.append(starts[-1] + self.codec.layer_nbytes(i, n_tokens))
            offsets = self._offsets[n_tokens] = tuple(starts)
        return offsets[layer]

