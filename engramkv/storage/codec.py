"""Byte codecs for one layer of an event's KV cache: fp16, int8, int4 and int2.

Keys (pre-RoPE) have a few outlier channels, so they are quantised per channel: one
scale and zero point for each (head, dim), taken over the event's tokens. Values have
no such channels and are quantised per token: one scale and zero point for each
(head, token), taken over the head dim. This is the KIVI grouping. Quantisation is
asymmetric: zero = min, scale = (max - min) / qmax, code = round((x - zero) / scale),
x̂ = code * scale + zero, so |x - x̂| <= scale / 2 up to float16 rounding of scale,
zero and the decoded value.

Layout of one layer (H = KV heads, T = tokens, D = head dim; all little-endian, no padding):

    fp16:  K (H, T, D) float16 | V (H, T, D) float16
    int8:  K scale (H, D) f16 | K zero (H, D) f16 | V scale (H, T) f16 | V zero (H, T) f16
           | K codes (H, T, D) uint8 | V codes (H, T, D) uint8
    int4:  as int8, but codes are (H, T, D/2) uint8: element 2i in the low nibble, 2i+1 in the high
    int2:  as int8, but codes are (H, T, D/4) uint8: element 4i+j in bits 2j..2j+1 (KIVI-2)

The float16 parameters come first so they stay 2-byte aligned relative to the buffer start
whatever the (possibly odd) length of the codes.

A blob reads its KV through `LayerCodec`, which these codecs (`QuantCodec`) and `lowrank_codec.LowRankCodec`
implement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import torch

from engramkv.kernels.gather import unpack_codes

Codec = Literal["fp16", "int8", "int4", "int2"]
CODECS: tuple[str, ...] = ("fp16", "int8", "int4", "int2")

_BITS = {"int8": 8, "int4": 4, "int2": 2}
F16_MAX = 65504.0  # the largest float16; KV past it would read back as inf


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def layer_nbytes(codec: Codec, n_kv_heads: int, n_tokens: int, head_dim: int) -> int:
    """Exact byte size of one layer's encoded K and V for an event of n_tokens."""
    _check_codec(codec)
    h, t, d = n_kv_heads, n_tokens, head_dim
    if min(h, t, d) < 1:
        raise ValueError(f"shape (Hkv={h}, T={t}, D={d}) must be positive")
    if codec == "fp16":
        return 2 * (2 * h * t * d)
    per_byte = 8 // _BITS[codec]
    if d % per_byte:
        raise ValueError(f"{codec} packs {per_byte} codes per byte along D, which must divide by {per_byte} (got D={d})")
    params = 2 * (2 * h * d + 2 * h * t)  # float16 scale and zero: per channel for K, per token for V
    return params + 2 * (h * t * d // per_byte)


def _quantise(x: torch.Tensor, dim: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 -> (uint8 codes like x, float16 scale, float16 zero), statistics reduced over `dim`."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = lo.half()
    scale = ((hi - zero.float()) / qmax).half()
    # Codes are computed against the stored float16 parameters, so decode reproduces exactly what
    # encode aimed for. A degenerate (or float16-underflowing) range stores scale 0: every code is 0
    # and decodes to zero; dividing by 1 instead keeps the arithmetic finite.
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = ((x - zero.float()) / step).round_().clamp_(0, qmax).to(torch.uint8)
    return codes, scale, zero


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:  # (..., D) uint8 < 2**bits -> (..., D * bits / 8)
    per_byte = 8 // bits
    packed = codes[..., 0::per_byte].clone()
    for j in range(1, per_byte):
        packed |= codes[..., j::per_byte] << (bits * j)
    return packed


def encode_layers(codec: Codec, keys: torch.Tensor, values: torch.Tensor) -> list[bytes]:
    """keys, values: (L, Hkv, T, D) any float dtype -> one layer's bytes (length `layer_nbytes`) per layer.

    Sealing an event encodes every layer at once: a few large tensor ops instead of dozens of tiny
    ones (which, on a busy CPU, cost more in thread hand-offs than in arithmetic).
    """
    _check_codec(codec)
    if keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(f"keys and values must share one (L, Hkv, T, D) shape, got {tuple(keys.shape)} "
                         f"and {tuple(values.shape)}")
    n_layers, h, t, d = keys.shape
    n = layer_nbytes(codec, h, t, d)  # validates the shape for this codec
    k = keys.detach().to("cpu", torch.float32)  # (L, H, T, D)
    v = values.detach().to("cpu", torch.float32)  # (L, H, T, D)
    # NaN compares False, so this also rejects NaN; anything past float16's range would become inf.
    if not (bool((k.abs() <= F16_MAX).all()) and bool((v.abs() <= F16_MAX).all())):
        raise ValueError("keys/values hold NaN, inf or values outside the float16 range")
    if codec == "fp16":
        k16, v16 = k.half().numpy(), v.half().numpy()
        out = [k16[i].astype("<f2").tobytes() + v16[i].astype("<f2").tobytes() for i in range(n_layers)]
    else:
        bits = _BITS[codec]
        qmax = (1 << bits) - 1
        k_codes, k_scale, k_zero = _quantise(k, dim=2, qmax=qmax)  # per channel: (L, H, 1, D) params
        v_codes, v_scale, v_zero = _quantise(v, dim=3, qmax=qmax)  # per token: (L, H, T, 1) params
        if bits < 8:
            k_codes, v_codes = _pack(k_codes, bits), _pack(v_codes, bits)
        parts = [t.numpy() for t in (k_scale, k_zero, v_scale, v_zero, k_codes, v_codes)]
        dtypes = ("<f2", "<f2", "<f2", "<f2", "u1", "u1")
        out = [b"".join(np.ascontiguousarray(p[i], dtype=dt).tobytes() for p, dt in zip(parts, dtypes))
               for i in range(n_layers)]
    assert all(len(layer) == n for layer in out)
    return out


def _read(buffer: memoryview, offset: int, dtype: str, shape: tuple[int, ...], as_dtype: str) -> torch.Tensor:
    """Read `shape` elements of `dtype` at `offset`, converted to `as_dtype` in memory torch owns."""
    view = np.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=offset)  # zero-copy, read-only
    # The conversion is the one copy: the result must outlive the (mmap) buffer, and torch warns on
    # read-only memory.
    return torch.from_numpy(view.astype(as_dtype)).view(shape)


def decode_layer(
    codec: Codec, buffer: bytes | memoryview, n_kv_heads: int, n_tokens: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of one layer of encode_layers: (keys, values), each float16 (Hkv, T, D).

    Accepts a memoryview slice of an mmap; the only copies are the ones dequantising makes.
    """
    keys, values = _decode(codec, buffer, n_kv_heads, n_tokens, head_dim, values=True)
    assert values is not None
    return keys, values


def _decode(codec: Codec, buffer: bytes | memoryview, n_kv_heads: int, n_tokens: int, head_dim: int,
            values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # `decode_layer`, the values optional
    buf = _layer_buffer(codec, buffer, n_kv_heads, n_tokens, head_dim)
    h, t, d = n_kv_heads, n_tokens, head_dim
    if codec == "fp16":
        half = h * t * d * 2
        return _read(buf, 0, "<f2", (h, t, d), "f2"), _read(buf, half, "<f2", (h, t, d), "f2") if values else None
    bits = _BITS[codec]
    width = d * bits // 8
    at = _offsets(h, t, d, width)

    def codes(offset: int) -> torch.Tensor:  # (H, T, D) float32
        if bits == 8:
            return _read(buf, offset, "u1", (h, t, d), "f4")
        return unpack_codes(_read(buf, offset, "u1", (h, t, width), "u1"), bits).float()

    k_scale = _read(buf, at["k_scale"], "<f2", (h, 1, d), "f4")
    k_zero = _read(buf, at["k_zero"], "<f2", (h, 1, d), "f4")
    keys = torch.addcmul(k_zero, codes(at["k_codes"]), k_scale).half()  # (H, T, D)
    if not values:
        return keys, None
    v_scale = _read(buf, at["v_scale"], "<f2", (h, t, 1), "f4")
    v_zero = _read(buf, at["v_zero"], "<f2", (h, t, 1), "f4")
    return keys, torch.addcmul(v_zero, codes(at["v_codes"]), v_scale).half()  # (H, T, D) each


def _layer_buffer(codec: Codec, buffer: bytes | memoryview, h: int, t: int, d: int) -> memoryview:
    """`buffer` as bytes, checked to be one layer of shape (H, T, D) in `codec`."""
    n = layer_nbytes(codec, h, t, d)
    buf = memoryview(buffer).cast("B")
    if buf.nbytes != n:
        raise ValueError(f"{codec} layer of shape ({h}, {t}, {d}) needs {n} bytes, got {buf.nbytes}")
    return buf


def _offsets(h: int, t: int, d: int, width: int) -> dict[str, int]:
    """Where each part of a quantised layer starts (the layout in this module's docstring)."""
    return {"k_scale": 0, "k_zero": 2 * h * d, "v_scale": 4 * h * d, "v_zero": 4 * h * d + 2 * h * t,
            "k_codes": 4 * h * d + 4 * h * t, "v_codes": 4 * h * d + 4 * h * t + h * t * width}


def quant_parts(codec: Codec, buffer: bytes | memoryview, n_kv_heads: int, n_tokens: int, head_dim: int
                ) -> dict[str, torch.Tensor]:
    """One int8/int4/int2 layer's parts as they lie, for `kernels.gather`'s arena: k_scale, k_zero (H, D) and
    v_scale, v_zero (H, T) float16; k_codes, v_codes (H, T, D * bits / 8) uint8."""
    if codec not in _BITS:
        raise ValueError(f"{codec} is not a quantised codec; expected one of {tuple(_BITS)}")
    h, t, d = n_kv_heads, n_tokens, head_dim
    buf = _layer_buffer(codec, buffer, h, t, d)
    width = d * _BITS[codec] // 8
    at = _offsets(h, t, d, width)
    shapes = {"k_scale": (h, d), "k_zero": (h, d), "v_scale": (h, t), "v_zero": (h, t)}
    parts = {name: _read(buf, at[name], "<f2", shape, "f2") for name, shape in shapes.items()}
    return parts | {name: _read(buf, at[name], "u1", (h, t, width), "u1") for name in ("k_codes", "v_codes")}


class LayerCodec(Protocol):
    """How a blob's KV is encoded, one layer at a time (a layer's size may depend on the layer)."""

    name: str  # what the catalog records as the store's codec
    representatives: str  # the blob's representative format (`blob.REPRESENTATIVE_FORMATS`)

    def layer_nbytes(self, layer: int, n_tokens: int) -> int: ...

    def encode_layers(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes]: ...

    def decode_layer(self, layer: int, buffer: bytes | memoryview, n_tokens: int
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode_joined(self, layer: int, buffers: Sequence[bytes | memoryview], n_tokens: Sequence[int],
                      values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    # several events' (keys, values or None) of one layer, joined along the tokens: (Hkv, sum T, D) each


class QuantCodec:
    """`LayerCodec` of fp16 / int8 / int4 / int2: every layer the same size, float32 representatives."""

    representatives = "f32"

    def __init__(self, codec: Codec, kv_heads: int, head_dim: int):
        _check_codec(codec)
        self.name, self.kv_heads, self.head_dim = codec, kv_heads, head_dim
        self.codec: Codec = codec

    def layer_nbytes(self, layer: int, n_tokens: int) -> int:
        return layer_nbytes(self.codec, self.kv_heads, n_tokens, self.head_dim)

    def encode_layers(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes]:
        return encode_layers(self.codec, keys, values)

    def decode_layer(self, layer: int, buffer: bytes | memoryview, n_tokens: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_layer(self.codec, buffer, self.kv_heads, n_tokens, self.head_dim)

    def decode_joined(self, layer: int, buffers: Sequence[bytes | memoryview], n_tokens: Sequence[int],
                      values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        pairs = [_decode(self.codec, b, self.kv_heads, t, self.head_dim, values) for b, t in zip(buffers, n_tokens)]
        empty = torch.empty(self.kv_heads, 0, self.head_dim, dtype=torch.float16)
        keys = torch.cat([k for k, _ in pairs] or [empty], dim=1)
        return keys, torch.cat([v for _, v in pairs if v is not None] or [empty], dim=1) if values else None
