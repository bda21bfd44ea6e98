"""The lowrank cold-tier codec: the fit's rank search, the layer layout, the bases file, and stores that
take, keep and check their bases."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engramkv import EngineConfig
from engramkv.config import LowRankConfig, RecallConfig, SegmentationConfig, StoreConfig, WindowConfig
from engramkv.errors import ConfigError, StoreCorruptError
from engramkv import fit_lowrank_bases
from engramkv.lowrank_fit import allocate, attention_weights, fit_bases, fit_projection, stdlib_docstrings
from engramkv.storage import lowrank, lowrank_codec
from engramkv.storage.blob import BlobLayout
from engramkv.storage.store import BASES_FILE

from conftest import VOCAB, tiny_pair

H, D = 2, 16  # the tiny models' KV heads and head dim


def low_rank_kv(n: int, rank: int, seed: int, noise: float = 1e-3) -> torch.Tensor:  # (H, n, D)
    """KV whose centred rows span `rank` of the H * D dimensions, plus a little noise and a large mean."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(H * D, rank, generator=g))[0]  # (F, r)
    rows = torch.randn(n, rank, generator=g) * torch.linspace(3, 1, rank) @ basis.T  # (n, F)
    rows = rows + 5.0 + noise * torch.randn(n, H * D, generator=g)
    return rows.view(n, H, D).transpose(0, 1).contiguous()


def test_the_fit_codes_only_the_directions_of_the_signal():
    x = low_rank_kv(600, 16, seed=0)
    projection, error = fit_projection(x[:, :500], x[:, 500:], H, max_error=0.02)
    assert projection.basis.shape[2] <= 16 and error <= 0.02
    assert projection.bits is not None and projection.bits.shape == (1, projection.basis.shape[2])
    assert torch.allclose(projection.basis[0].T @ projection.basis[0], torch.eye(projection.basis.shape[2]), atol=1e-4)
    # A budget below what 8 bits a direction reach takes every direction at 8 bits.
    full, _ = fit_projection(x[:, :500], x[:, 500:], H, max_error=1e-6)
    assert full.latent == H * D and int(full.bits.min()) == 8


@pytest.mark.parametrize("heads_per_group", [1, 2])
def test_project_and_reconstruct_are_inverse_at_full_rank(heads_per_group):
    x = torch.randn(H, 240, D, generator=torch.Generator().manual_seed(1))
    projection, error = fit_projection(x[:, :200], x[:, 200:], heads_per_group, max_error=1e-9)
    assert projection.latent == H * D and projection.basis.shape[0] == H // heads_per_group
    assert torch.allclose(projection.reconstruct(projection.project(x), H), x, atol=1e-4)
    assert error < 0.03  # what 8-bit codes cost


def test_a_weighted_fit_spends_its_bits_where_the_weight_is():
    x = torch.randn(H, 600, D, generator=torch.Generator().manual_seed(4))  # every dimension alike
    weight = torch.ones(H, D)
    weight[:, :4] = 8.0  # what reads these four dims is 8x as sensitive to their error
    plain, _ = fit_projection(x[:, :500], x[:, 500:], H, max_error=0.2)
    weighted, error = fit_projection(x[:, :500], x[:, 500:], H, max_error=0.2, weight=weight)
    assert error <= 0.2 and weighted.weight is not None

    def heavy_error(p: lowrank.Projection) -> float:  # relative error on the four weighted dims, read back
        back = p.reconstruct(p.decode(*p.encode(p.project(x[:, 500:]))), H)
        return float((back - x[:, 500:])[..., :4].norm() / x[:, 500:, :4].norm())

    assert heavy_error(weighted) < 0.5 * heavy_error(plain)
    full, _ = fit_projection(x[:, :500], x[:, 500:], H, max_error=1e-9, weight=weight)  # complete: exact inverse
    assert torch.allclose(full.reconstruct(full.project(x), H), x, atol=1e-4)


def test_attention_weights_pair_the_rotary_halves_and_sum_a_query_group():
    hq, kv, d = 4, 2, 8
    queries = torch.zeros(hq, d)
    queries[0, 1] = 4.0  # head 0 (KV head 0) reads dim 1 only: its rotary pair is dims 1 and 5
    columns = torch.ones(hq, d)
    columns[2:] = 3.0  # KV head 1's query heads write out through columns 3x as large
    k_weight, v_weight = attention_weights(queries, columns, kv)
    assert k_weight.shape == v_weight.shape == (kv, d)
    assert k_weight[0, 1] == k_weight[0, 5] and k_weight[0, 1] > 1
    assert float(k_weight.min()) == pytest.approx(0.05)  # nothing reads the rest: held at the floor
    assert float(v_weight[1, 0] / v_weight[0, 0]) == pytest.approx(3 ** 0.5)
    assert float(v_weight.pow(2).mean()) == pytest.approx(1.0)


def test_the_early_layers_keys_take_their_own_budget():
    x = low_rank_kv(500, 16, seed=5)
    cfg = LowRankConfig(key_error=0.05, early_key_error=0.3, early_layers=0.5, value_error=0.3)
    bases = fit_bases([x] * 4, [x] * 4, cfg, {"model_id": "synthetic"})  # four identical layers
    bits = [p.code_bits for p in bases.keys]
    assert bits[0] == bits[1] < bits[2] == bits[3]
    assert all(e <= 0.3 for e in bases.errors["keys"][:2]) and all(e <= 0.05 for e in bases.errors["keys"][2:])
    assert len({p.code_bits for p in bases.values}) == 1  # values keep one budget
    plain = fit_bases([x] * 4, [x] * 4, cfg.model_copy(update={"early_key_error": None}), {"model_id": "synthetic"})
    assert len({p.code_bits for p in plain.keys}) == 1


def test_a_byte_scale_is_within_a_sixty_fourth_of_an_octave():
    rms = torch.tensor([0.0, 1e-9, 0.07, 0.3, 1.0, 2.7, 15.0, 1e6])
    back = lowrank.scale_values(lowrank.scale_bytes(rms))
    assert back[0] == 0 and back[1] == pytest.approx(2 ** (-127 / 32))  # the least: code 1
    inside = slice(2, 7)
    assert torch.allclose(back[inside], rms[inside], rtol=2 ** (1 / 64) - 1 + 1e-6)
    assert back[-1] == pytest.approx(2 ** (127 / 32))  # the most: code 255


def test_bits_go_where_the_variance_is():
    variance = torch.tensor([[16.0, 4.0, 1.0, 0.25, 0.0]])
    bits = allocate(variance, 10)
    assert int(bits.sum()) == 10 and bits[0, -1] == 0
    assert bits[0].tolist() == sorted(bits[0].tolist(), reverse=True)
    assert int(bits[0, 0] - bits[0, 2]) in (2, 3)  # a deviation 4x as large: about log2(4) = 2 bits more


def test_codes_of_any_widths_pack_and_unpack():
    g = torch.Generator().manual_seed(3)
    bits = torch.tensor([8, 5, 3, 3, 1, 0, 2, 0])
    codes = (torch.rand(6, 8, generator=g) * (1 << bits)).long()
    # each direction's low `bits` bits, least-significant first, direction after direction
    stream = [(int(c) >> i) & 1 for row in codes for c, b in zip(row, bits) for i in range(int(b))]
    packed = np.packbits(np.array(stream, np.uint8).reshape(6, 22), axis=1, bitorder="little")
    read = np.unpackbits(packed, axis=1, count=22, bitorder="little")  # as the codec reads a part
    # with an identity read basis, the read matrix gives back each direction's code
    assert torch.equal((torch.from_numpy(read).float() @ lowrank_codec.read_matrix(bits, torch.eye(8))).long(), codes)


def test_the_codec_reads_back_exactly_what_the_projection_quantised():
    bases = _bases_of("engramkv-lowrank-3")
    codec = lowrank_codec.LowRankCodec(bases, "lowrank:00000000", H, D)
    keys = torch.stack([low_rank_kv(400, 16, seed=s)[:, 380:] for s in range(3)])  # (L, H, 20, D)
    encoded = codec.encode_layers(keys, keys * 0.5)
    for layer in range(3):
        for p, x, got in zip((bases.keys[layer], bases.values[layer]), (keys[layer], keys[layer] * 0.5),
                             codec.decode_layer(layer, encoded[layer], 20)):
            expected = p.reconstruct(p.decode(*p.encode(p.project(x))), H)
            torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-3)


def test_quantise_round_trips_within_half_a_step():
    z = torch.randn(9, 37, generator=torch.Generator().manual_seed(2)) * 4
    for bits in (4, 8):
        codes, scale = lowrank_codec.quantise(z, bits, group=16)
        assert codes.dtype == torch.uint8 and scale.shape == (9, math.ceil(37 / 16))
        assert int(codes.max()) <= 2 * (2 ** (bits - 1) - 1)
        back = lowrank_codec.dequantise(codes, scale, bits, group=16)
        step = scale.float().repeat_interleave(16, dim=1)[:, :37]
        assert bool(((back - z).abs() <= step / 2 + 1e-3).all())
    zero = torch.zeros(2, 8)
    assert torch.equal(lowrank_codec.dequantise(*lowrank_codec.quantise(zero, 4, 8), 4, 8), zero)


def _bases(rank: int = 16) -> lowrank.LowRankBases:
    layers = [low_rank_kv(400, rank, seed=s) for s in range(3)]
    cfg = LowRankConfig(key_error=0.1, value_error=0.1)
    return fit_bases(layers, [x * 0.5 for x in layers], cfg, {"model_id": "synthetic"})


def _bases_of(fmt: str) -> lowrank.LowRankBases:
    """Bases as a fit of format `fmt` wrote them (format 2: no weights, every dimension counts the same)."""
    if fmt == "engramkv-lowrank-1":
        return _bases_v1()
    bases = _bases()
    if fmt == "engramkv-lowrank-2":
        bases = dataclasses.replace(bases, format=fmt, **{name: tuple(dataclasses.replace(p, weight=None, byte_scales=False)
                                                                      for p in getattr(bases, name))
                                                          for name in ("keys", "values")})
    return bases


def _bases_v1(bits: int = 4, rank: int = 16) -> lowrank.LowRankBases:
    """Bases of the first format: `rank` directions of every layer, `bits` per latent dim, scales per 8 dims."""
    layers = [low_rank_kv(400, rank, seed=s) for s in range(3)]

    def first_format(x: torch.Tensor) -> lowrank.Projection:
        full, _ = fit_projection(x[:, :320], x[:, 320:], H, max_error=1e-9)  # every direction
        return lowrank.Projection(full.mean, full.basis[:, :, :rank].contiguous())

    return lowrank.LowRankBases(tuple(first_format(x) for x in layers), tuple(first_format(x * 0.5) for x in layers),
                                {"model_id": "synthetic"}, {"keys": [], "values": []}, "engramkv-lowrank-1", bits, 8)


@pytest.mark.parametrize("fmt", ["v1-4", "v1-8", "v2", "v3"])
def test_the_codec_writes_what_layer_nbytes_says_and_reads_it_back(fmt):
    bases = _bases_of(f"engramkv-lowrank-{fmt[1]}") if fmt in ("v2", "v3") else _bases_v1(int(fmt[-1]))
    codec = lowrank_codec.LowRankCodec(bases, "lowrank:00000000", H, D)
    keys = torch.stack([low_rank_kv(400, 16, seed=s)[:, 390:] for s in range(3)])  # (L, H, T=10, D)
    values = keys * 0.5
    encoded = codec.encode_layers(keys, values)
    for layer, buf in enumerate(encoded):
        k_part, v_part = bases.keys[layer], bases.values[layer]
        if fmt in ("v2", "v3"):
            scale = 2 if fmt == "v2" else 1  # format 3's scales are a byte
            expected = sum(10 * (scale + math.ceil(p.code_bits / 8)) for p in (k_part, v_part))
        else:
            expected = sum(10 * (2 * math.ceil(p.latent / 8) + p.latent * bases.bits // 8) for p in (k_part, v_part))
        assert len(buf) == codec.layer_nbytes(layer, 10) == expected
        k, v = codec.decode_layer(layer, memoryview(b"\x00" + buf)[1:], 10)
        assert k.dtype == v.dtype == torch.float16 and k.shape == (H, 10, D)
        centred = (keys[layer] - keys[layer].mean(dim=1, keepdim=True)).norm()
        limit = 0.05 if fmt == "v1-8" else 0.2
        assert float((k.float() - keys[layer]).norm() / centred) < limit
        assert float((v.float() - values[layer]).norm() / (centred * 0.5)) < limit
    # the signal is rank 16 of 32 dims: the codec stores less than 8 bits of every dim would
    assert len(encoded[0]) < 10 * 2 * H * D
    with pytest.raises(ValueError, match="needs"):
        codec.decode_layer(0, encoded[0][:-1], 10)
    with pytest.raises(ValueError, match="NaN"):
        codec.encode_layers(keys * float("nan"), values)


@pytest.mark.parametrize("fmt", ["v1-4", "v2", "v3"])
def test_the_keys_of_several_events_decode_at_once_as_they_do_one_by_one(fmt):
    bases = _bases_of(f"engramkv-lowrank-{fmt[1]}") if fmt in ("v2", "v3") else _bases_v1(4)
    codec = lowrank_codec.LowRankCodec(bases, "lowrank:00000000", H, D)
    events = [torch.stack([low_rank_kv(400, 16, seed=s)[:, a : a + n] for s in range(3)]) for a, n in
              ((0, 3), (10, 7), (50, 1))]  # (L, H, n, D) each: three events of 3, 7 and 1 tokens
    blobs = [codec.encode_layers(x, x * 0.5) for x in events]
    for layer in range(3):
        one_by_one = torch.cat([codec.decode_layer(layer, b[layer], x.shape[2])[0] for b, x in zip(blobs, events)], 1)
        joined = codec.decode_joined(layer, [memoryview(b[layer]) for b in blobs], [3, 7, 1], values=False)[0]
        assert joined.dtype == torch.float16 and torch.allclose(joined.float(), one_by_one.float(), atol=1e-3)
    assert codec.decode_joined(0, [], [], values=False)[0].shape == (H, 0, D)
    with pytest.raises(ValueError, match="needs"):
        codec.decode_joined(0, [blobs[0][0][:-1]], [3], values=False)[0]


@pytest.mark.parametrize("fmt", sorted(lowrank.FORMATS))
def test_a_blob_of_the_lowrank_codec_round_trips_with_its_formats_representatives(fmt):
    bases = _bases_of(fmt)
    codec = lowrank_codec.LowRankCodec(bases, "lowrank:00000000", H, D)
    layout = BlobLayout(codec, 3, H, D)
    keys = torch.stack([low_rank_kv(400, 16, seed=s)[:, :7] for s in range(3)])
    reps = torch.randn(3, H * D).numpy()
    blob = layout.encode(torch.arange(7), reps, keys, keys * 0.5)
    rep_bytes = {"f16": 2 * H * D, "i8": H * D + 2 * H}[lowrank.FORMATS[fmt]]
    assert len(blob) == layout.nbytes(7) == 4 * 7 + 3 * rep_bytes + sum(codec.layer_nbytes(i, 7) for i in range(3))
    assert layout.tokens(blob, 7) == list(range(7))
    assert abs(layout.representatives(blob, 7) - reps).max() < 0.01 * abs(reps).max()
    for layer in range(3):
        assert torch.equal(layout.layer_kv(blob, 7, layer)[0], codec.decode_layer(
            layer, codec.encode_layers(keys, keys * 0.5)[layer], 7)[0])
        at, size = layout.representative_span(7, layer)  # what a low-rank search re-scores from
        assert np.array_equal(layout.decode_representatives(blob[at : at + size], 1)[0],
                              layout.representatives(blob, 7)[layer])


@pytest.mark.parametrize("fmt", ["engramkv-lowrank-2", "engramkv-lowrank-3"])
def test_bases_of_the_second_and_third_format_round_trip_with_or_without_weights(fmt):
    bases = _bases_of(fmt)
    again = lowrank.LowRankBases.from_bytes(bases.to_bytes(), "here")
    assert again.format == fmt
    for a, b in zip(again.keys + again.values, bases.keys + bases.values):
        assert (a.weight is None) == (fmt == "engramkv-lowrank-2") and (b.weight is None) == (a.weight is None)
        assert a.weight is None or torch.equal(a.weight, b.weight)


def test_bases_of_the_first_format_still_read_and_keep_float16_representatives():
    old = _bases_v1(bits=8)
    again = lowrank.LowRankBases.from_bytes(old.to_bytes(), "old")
    assert again.format == "engramkv-lowrank-1" and again.bits == 8 and again.group == 8
    assert again.keys[0].bits is None and torch.equal(again.keys[0].basis, old.keys[0].basis)
    assert lowrank_codec.LowRankCodec(again, "lowrank:00000000", H, D).representatives == "f16"
    assert lowrank_codec.LowRankCodec(_bases(), "lowrank:00000000", H, D).representatives == "i8"  # what a fit writes


def test_the_bases_file_round_trips_and_a_damaged_one_is_refused(tmp_path):
    bases = _bases()
    data = bases.to_bytes()
    again = lowrank.LowRankBases.from_bytes(data, "here")
    assert again.errors == bases.errors and again.bits == bases.bits and again.fingerprint == bases.fingerprint
    assert all(torch.equal(a.basis, b.basis) and torch.equal(a.mean, b.mean) for a, b in zip(again.keys, bases.keys))
    flipped = bytearray(data)
    flipped[-3] ^= 0x40  # a byte of the last tensor
    for damaged in (data[:100], b"\xff" * 64, bytes(flipped)):
        with pytest.raises(StoreCorruptError, match="not a readable lowrank bases file"):
            lowrank.LowRankBases.from_bytes(damaged, "here")
    with pytest.raises(ConfigError, match="fitted for model 'synthetic'"):
        bases.check_model({"model_id": "another"}, "here")


CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
)


def _text(n: int, seed: int = 0) -> str:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def tiny_bases(tmp_path_factory) -> str:
    """Bases fitted by `fit_lowrank_bases` on the tiny llama's own KV of random text."""
    cfg = CFG.model_copy(update={"store": StoreConfig(lowrank=LowRankConfig(tokens=1200))})
    _, lm = tiny_pair("llama", cfg)
    bases = fit_lowrank_bases(lm, cfg, [_text(700, seed=1), _text(700, seed=2)])
    assert len(bases.keys) == 3 and bases.fingerprint["model_id"] == "tiny-llama"
    path = tmp_path_factory.mktemp("bases") / "tiny.safetensors"
    bases.save(path)
    return str(path)


def _lowrank_cfg(bases: str | None) -> EngineConfig:
    return CFG.model_copy(update={"store": StoreConfig(codec="lowrank", commit_tokens=100,
                                                       lowrank=LowRankConfig(bases=bases))})


def test_a_lowrank_store_keeps_its_bases_and_serves_the_stream_after_reopening(tmp_path, tiny_bases):
    cfg = _lowrank_cfg(tiny_bases)
    _, lm = tiny_pair("llama", cfg)
    with lm.session(store=tmp_path / "s") as s:
        s.ingest(_text(600, seed=3))
        assert s.memory is not None and s.memory.codec.startswith("lowrank:")
        events = s.events
    lm.close()
    assert (tmp_path / "s" / BASES_FILE).read_bytes() == open(tiny_bases, "rb").read()
    replies = []
    # Reopened with the config it was made with, then with another (another codec, no bases): the store
    # reads with what it was written with, the same KV both times. (The writing session answered from the
    # exact KV it still held; a lossy codec's store answers from what it kept.)
    for config in (cfg, CFG):
        _, fresh = tiny_pair("llama", config)
        with fresh.session(store=tmp_path / "s", read_only=True) as s:
            assert s.events == events and s.memory is not None and s.memory.verify() == events
            replies.append(s.generate_ids([1, 2, 3], max_new_tokens=8))
        fresh.close()
    assert replies[0] == replies[1] and len(replies[0]) == 8


def test_a_store_written_with_first_format_bases_still_opens_and_reads(tmp_path, tiny_bases):
    old = tmp_path / "old.safetensors"  # the bases as fitted before int8 representatives
    fitted = lowrank.LowRankBases.load(Path(tiny_bases))
    lowrank.LowRankBases(tuple(lowrank.Projection(p.mean, p.basis) for p in fitted.keys),
                         tuple(lowrank.Projection(p.mean, p.basis) for p in fitted.values), fitted.fingerprint,
                         fitted.errors, "engramkv-lowrank-1", 8, 8).save(old)
    _, lm = tiny_pair("llama", _lowrank_cfg(str(old)))
    with lm.session(store=tmp_path / "s") as s:
        s.ingest(_text(400, seed=5))
        events = s.events
    lm.close()
    _, fresh = tiny_pair("llama", CFG)
    with fresh.session(store=tmp_path / "s", read_only=True) as s:
        assert s.events == events and s.memory is not None and s.memory.verify() == events
        assert len(s.generate_ids([1, 2, 3], max_new_tokens=4)) == 4
    fresh.close()


def test_a_store_whose_bases_were_swapped_or_lost_is_refused(tmp_path, tiny_bases):
    _, lm = tiny_pair("llama", _lowrank_cfg(tiny_bases))
    with lm.session(store=tmp_path / "s") as s:
        s.ingest(_text(300, seed=4))
    lm.close()
    path = tmp_path / "s" / BASES_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-4] + bytes(4))
    _, again = tiny_pair("llama", CFG)
    with pytest.raises(StoreCorruptError, match="not the bases this store was written with"):
        again.session(store=tmp_path / "s")
    again.close()
    path.unlink()
    _, again = tiny_pair("llama", CFG)
    with pytest.raises(StoreCorruptError, match="has lost its bases"):
        again.session(store=tmp_path / "s")
    again.close()


def test_a_new_lowrank_store_needs_bases_of_its_model(tmp_path, tiny_bases):
    _, qwen = tiny_pair("qwen2", _lowrank_cfg(tiny_bases))  # the bases are the llama's
    with pytest.raises(ConfigError, match="fitted for model 'tiny-llama'"):
        qwen.session(store=tmp_path / "a")
    qwen.close()
    _, lm = tiny_pair("llama", _lowrank_cfg(None))  # none ship for a tiny model
    with pytest.raises(ConfigError, match="fit-bases"):
        lm.session(store=tmp_path / "b")
    lm.close()


def test_the_default_calibration_text_is_there_offline():
    pieces = list(stdlib_docstrings())
    assert len(pieces) > 200 and sum(map(len, pieces)) > 200_000


@pytest.mark.parametrize("fmt", ["v1-4", "v3"])
def test_keys_and_values_of_several_events_decode_joined_as_one_by_one(fmt):
    bases = _bases_of("engramkv-lowrank-3") if fmt == "v3" else _bases_v1(4)
    codec = lowrank_codec.LowRankCodec(bases, "lowrank:00000000", H, D)
    events = [torch.stack([low_rank_kv(400, 16, seed=s)[:, a : a + n] for s in range(3)]) for a, n in ((0, 2), (9, 5))]
    blobs = [codec.encode_layers(x, x * 0.5) for x in events]
    keys, values = codec.decode_joined(1, [b[1] for b in blobs], [2, 5])
    one = [codec.decode_layer(1, b[1], x.shape[2]) for b, x in zip(blobs, events)]
    assert torch.allclose(keys.float(), torch.cat([k for k, _ in one], 1).float(), atol=1e-3)
    assert values is not None and torch.allclose(values.float(), torch.cat([v for _, v in one], 1).float(), atol=1e-3)
    assert codec.decode_joined(1, [b[1] for b in blobs], [2, 5], values=False)[1] is None
