"""The KV byte codecs: sizes, exact fp16 round trip, quantisation error bounds, mmap-style decoding."""

from __future__ import annotations

import pytest
import torch

from engramkv.storage.codec import CODECS, Codec, decode_layer, encode_layers, layer_nbytes

SHAPES = [(1, 1, 4), (2, 1, 64), (3, 7, 64), (3, 64, 64), (2, 33, 8), (4, 255, 16)]
QMAX = {"int8": 255, "int4": 15, "int2": 3}


def encode_layer(codec: Codec, keys: torch.Tensor, values: torch.Tensor) -> bytes:
    """One layer, (Hkv, T, D) each, through the batched encoder."""
    return encode_layers(codec, keys[None], values[None])[0]


def kv(h: int, t: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(h, t, d, generator=g)
    keys[:, :, : min(3, d)] *= 20  # outlier channels, as real pre-RoPE keys have
    return keys, torch.randn(h, t, d, generator=g)


def assert_within_step(x: torch.Tensor, x_hat: torch.Tensor, dim: int, qmax: int) -> None:
    """|x - x̂| <= step/2 per element, step = (max - min) / qmax of its group, plus float16 slack:
    scale, zero and the output are float16, each off by at most 2^-11 relative to the group's magnitude."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    magnitude = torch.maximum(lo.abs(), hi.abs())
    bound = (hi - lo) / qmax / 2 + magnitude * 2.0**-9 + 1e-7
    err = (x - x_hat.float()).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_size_matches_layer_nbytes(codec: str, shape: tuple[int, int, int]) -> None:
    keys, values = kv(*shape)
    buf = encode_layer(codec, keys, values)  # type: ignore[arg-type]
    assert len(buf) == layer_nbytes(codec, *shape)  # type: ignore[arg-type]
    k, v = decode_layer(codec, buf, *shape)  # type: ignore[arg-type]
    assert k.shape == v.shape == shape and k.dtype == v.dtype == torch.float16


@pytest.mark.parametrize("shape", SHAPES)
def test_fp16_round_trip_is_bit_exact(shape: tuple[int, int, int]) -> None:
    keys, values = kv(*shape)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k, v = decode_layer("fp16", encode_layer("fp16", keys.to(dtype), values.to(dtype)), *shape)
        assert torch.equal(k, keys.to(dtype).half()) and torch.equal(v, values.to(dtype).half())


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantised_error_within_half_a_step(codec: str, shape: tuple[int, int, int]) -> None:
    keys, values = kv(*shape, seed=1)
    k, v = decode_layer(codec, encode_layer(codec, keys, values), *shape)  # type: ignore[arg-type]
    assert_within_step(keys, k, dim=1, qmax=QMAX[codec])  # keys per channel: groups over T
    assert_within_step(values, v, dim=2, qmax=QMAX[codec])  # values per token: groups over D


def test_keys_are_grouped_per_channel() -> None:
    # With per-channel keys, the outlier channels must not inflate the error of the others.
    keys, values = kv(3, 64, 64, seed=2)
    k, _ = decode_layer("int8", encode_layer("int8", keys, values), 3, 64, 64)
    normal = (keys - k.float())[:, :, 3:].abs().max().item()
    assert normal <= (keys[:, :, 3:].amax(1) - keys[:, :, 3:].amin(1)).max().item() / 255


@pytest.mark.parametrize("codec", CODECS)
def test_decode_from_memoryview_slice_at_odd_offset(codec: str) -> None:
    shape = (3, 5, 8)
    keys, values = kv(*shape, seed=3)
    buf = encode_layer(codec, keys, values)  # type: ignore[arg-type]
    blob = b"\x7f" * 13 + buf + b"\x00" * 7  # as if the layer sat inside a larger mmapped file
    view = memoryview(blob)[13 : 13 + len(buf)]
    k, v = decode_layer(codec, view, *shape)  # type: ignore[arg-type]
    k0, v0 = decode_layer(codec, buf, *shape)  # type: ignore[arg-type]
    assert torch.equal(k, k0) and torch.equal(v, v0)
    del view  # the decoded tensors own their memory: they survive the buffer
    assert torch.isfinite(k.float() + v.float()).all()


@pytest.mark.parametrize("codec", CODECS)
def test_constant_tensors_round_trip_exactly(codec: str) -> None:
    shape = (2, 9, 4)
    for c in (0.0, 1.5, -3.25, 1e-3):
        keys, values = torch.full(shape, c), torch.full(shape, -c)
        k, v = decode_layer(codec, encode_layer(codec, keys, values), *shape)  # type: ignore[arg-type]
        assert torch.equal(k, keys.half()) and torch.equal(v, values.half())


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_buffer_size_raises(codec: str) -> None:
    buf = encode_layer(codec, *kv(2, 4, 8))  # type: ignore[arg-type]
    for bad in (buf[:-1], buf + b"\x00", b""):
        with pytest.raises(ValueError, match="bytes"):
            decode_layer(codec, bad, 2, 4, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        decode_layer(codec, buf, 2, 5, 8)  # type: ignore[arg-type]


def test_bad_inputs_raise() -> None:
    keys, values = kv(2, 4, 8)
    with pytest.raises(ValueError, match="unknown codec"):
        encode_layer("int3", keys, values)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown codec"):
        layer_nbytes("bf16", 2, 4, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encode_layer("int8", keys, values[:, :3])
    with pytest.raises(ValueError, match="divide by 2"):
        encode_layer("int4", keys[..., :7], values[..., :7])
    with pytest.raises(ValueError, match="divide by 4"):
        encode_layer("int2", keys[..., :6], values[..., :6])
    for bad in (float("nan"), float("inf"), 1e6):
        broken = keys.clone()
        broken[0, 0, 0] = bad
        with pytest.raises(ValueError, match="float16"):
            encode_layer("int8", broken, values)


def test_int4_and_int2_codes_take_a_half_and_a_quarter_of_int8() -> None:
    h, t, d = 3, 64, 64
    keys, values = kv(h, t, d)
    n_int8, n_int4, n_int2 = (len(encode_layer(c, keys, values)) for c in ("int8", "int4", "int2"))
    params = 2 * (2 * h * d + 2 * h * t)  # the float16 scales and zeros the quantised codecs store
    assert n_int8 - params == 2 * h * t * d  # one byte per K and V element
    assert 2 * (n_int4 - params) == n_int8 - params  # two 4-bit codes per byte
    assert 4 * (n_int2 - params) == n_int8 - params  # four 2-bit codes per byte
    assert n_int2 < n_int4 < n_int8 < layer_nbytes("fp16", h, t, d)


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_is_lossless_for_every_code(bits: int) -> None:
    from engramkv.kernels.gather import unpack_codes as _unpack
    from engramkv.storage.codec import _pack

    per_byte = 8 // bits
    codes = torch.arange(2**bits, dtype=torch.uint8).repeat(per_byte * 3)[None, : per_byte * 2**bits]  # (1, D)
    assert torch.equal(_unpack(_pack(codes, bits), bits), codes)


@pytest.mark.parametrize("codec", CODECS)
def test_encoding_all_layers_at_once_equals_layer_by_layer(codec):
    keys = torch.randn(5, 3, 7, 8)  # (L, H, T, D)
    values = torch.randn(5, 3, 7, 8)
    batched = encode_layers(codec, keys, values)
    assert batched == [encode_layer(codec, keys[i], values[i]) for i in range(5)]


@pytest.mark.parametrize("codec", CODECS)
def test_keys_of_several_events_join_in_order(codec: str) -> None:
    from engramkv.storage.codec import QuantCodec

    layer_codec = QuantCodec(codec, 2, 8)  # type: ignore[arg-type]
    events = [kv(2, n, 8, seed=n) for n in (3, 1, 5)]
    buffers = [encode_layer(codec, k, v) for k, v in events]  # type: ignore[arg-type]
    joined = layer_codec.decode_joined(0, buffers, [3, 1, 5], values=False)[0]
    assert torch.equal(joined, torch.cat([layer_codec.decode_layer(0, b, n)[0] for b, n in zip(buffers, (3, 1, 5))], 1))
    assert layer_codec.decode_joined(0, [], [], values=False)[0].shape == (2, 0, 8)
    assert layer_codec.decode_joined(0, buffers, [3, 1, 5], values=False)[1] is None
    keys, values = layer_codec.decode_joined(0, buffers, [3, 1, 5])
    assert torch.equal(keys, joined) and values is not None
    assert torch.equal(values, torch.cat([layer_codec.decode_layer(0, b, n)[1] for b, n in zip(buffers, (3, 1, 5))], 1))
