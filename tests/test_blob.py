"""One event's blob: the layout its docstring draws, round trips, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engramkv.storage.blob import (REPRESENTATIVE_FORMATS, BlobLayout, decode_representatives, encode_representatives,
                                 representative_nbytes)
from engramkv.storage.codec import CODECS, QuantCodec, decode_layer, encode_layers, layer_nbytes

L, H, T, D = 3, 2, 7, 8


def parts(seed: int = 0) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (T,), generator=g)  # (T,)
    reps = torch.randn(L, H * D, generator=g).numpy()  # (L, F)
    return tokens, reps, torch.randn(L, H, T, D, generator=g), torch.randn(L, H, T, D, generator=g)


@pytest.mark.parametrize("codec", CODECS)
def test_the_blob_is_laid_out_as_drawn(codec):
    layout = BlobLayout(QuantCodec(codec, H, D), L, H, D)  # type: ignore[arg-type]
    tokens, reps, keys, values = parts()
    blob = layout.encode(tokens, reps, keys, values)
    n = layer_nbytes(codec, H, T, D)  # type: ignore[arg-type]
    assert len(blob) == layout.nbytes(T) == 4 * T + 4 * L * H * D + L * n
    assert np.frombuffer(blob[: 4 * T], "<i4").tolist() == tokens.tolist()
    assert np.array_equal(np.frombuffer(blob[4 * T : 4 * T + 4 * L * H * D], "<f4").reshape(L, H * D), reps)
    kv_start = 4 * T + 4 * L * H * D
    layers = [blob[kv_start + layer * n : kv_start + (layer + 1) * n] for layer in range(L)]
    assert layers == encode_layers(codec, keys, values)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", CODECS)
def test_readers_give_back_each_part(codec):
    layout = BlobLayout(QuantCodec(codec, H, D), L, H, D)  # type: ignore[arg-type]
    tokens, reps, keys, values = parts(seed=1)
    blob = layout.encode(tokens, reps, keys, values)
    view = memoryview(b"\x00" * 5 + blob)[5:]  # as read out of a segment file
    assert layout.tokens(view, T) == tokens.tolist()
    assert np.array_equal(layout.representatives(view, T), reps)
    for layer in range(L):
        k, v = layout.layer_kv(view, T, layer)  # (Hkv, T, D) float16 each
        expected = decode_layer(codec, encode_layers(codec, keys, values)[layer], H, T, D)  # type: ignore[arg-type]
        assert torch.equal(k, expected[0]) and torch.equal(v, expected[1]) and k.shape == (H, T, D)


def test_parts_of_another_shape_are_refused():
    layout = BlobLayout(QuantCodec("fp16", H, D), L, H, D)
    tokens, reps, keys, values = parts()
    with pytest.raises(ValueError, match="do not match"):
        layout.encode(tokens[:-1], reps, keys, values)
    with pytest.raises(ValueError, match="representatives"):
        layout.encode(tokens, reps[:, :-1], keys, values)
    with pytest.raises(ValueError, match="share one"):
        layout.encode(tokens, reps, keys, values[:, :1])


@pytest.mark.parametrize("fmt", REPRESENTATIVE_FORMATS)
def test_each_representative_format_round_trips_within_its_step(fmt):
    reps = torch.randn(5, H * D, generator=torch.Generator().manual_seed(2)).numpy() * 3  # (N, F)
    data = encode_representatives(fmt, reps, H)
    assert len(data) == 5 * representative_nbytes(fmt, H, D)
    back = decode_representatives(fmt, data, 5, H, D)
    if fmt in ("f32", "f16"):
        assert np.allclose(back, reps, atol=0.01)
    else:  # within half a step of its KV head's scale (largest |x| over the head / the largest code)
        step = np.abs(reps).reshape(5, H, D).max(axis=2, keepdims=True) / 127
        assert (np.abs(back - reps).reshape(5, H, D) <= step / 2 + 1e-3).all()
    zero = np.zeros((2, H * D), np.float32)
    assert np.array_equal(decode_representatives(fmt, encode_representatives(fmt, zero, H), 2, H, D), zero)
