"""The `lowrank` codec itself (`codec.LayerCodec`): one event's layers to bytes and back, over the bases and
in the formats `storage.lowrank` defines; format 1's group codes and formats 2 and 3's bit packing."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from engramkv.storage.codec import F16_MAX
from engramkv.storage.lowrank import FORMATS, LowRankBases, scale_bytes, scale_values


# ------------------------------------------------------------------------------- formats 2 and 3: packing bits
def read_matrix(bits: torch.Tensor, read_basis: torch.Tensor) -> torch.Tensor:
    """One group's stored bits (T, B) -> its centred output: (B, g D), row j = 2^k x the read basis row of the
    direction whose k-th bit is bit j (directions in order, least-significant bit first), so a token's codes
    never need assembling: sum_j bit_j 2^k_j row(dir_j) = sum_dir code_dir row(dir). bits (r,), read_basis (r, g D)."""
    widths = bits.tolist()
    direction = torch.repeat_interleave(torch.arange(len(widths)), bits)  # (B,)
    power = torch.cat([torch.arange(w) for w in widths]) if widths else torch.zeros(0)
    return torch.exp2(power.float())[:, None] * read_basis[direction]


# ------------------------------------------------------------------------------------- format 1: group codes
def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def quantise(z: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, R) float -> (codes (T, R) uint8 holding code + qmax, scales (T, ceil(R / group)) float16)."""
    t, r = z.shape
    n = math.ceil(r / group)
    padded = torch.nn.functional.pad(z.float(), (0, n * group - r)).view(t, n, group)
    qmax = _qmax(bits)
    scale = (padded.abs().amax(dim=2) / qmax).clamp(max=F16_MAX).half()  # (T, n)
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float()[..., None]  # codes against stored scale
    codes = (padded / step).round_().clamp_(-qmax, qmax).view(t, n * group)[:, :r] + qmax
    return codes.to(torch.uint8), scale


def dequantise(codes: torch.Tensor, scale: torch.Tensor, bits: int, group: int) -> torch.Tensor:  # (T, R) float32
    t, r = codes.shape
    n = scale.shape[1]
    signed = torch.nn.functional.pad(codes.float() - _qmax(bits), (0, n * group - r)).view(t, n, group)
    return (signed * scale.float()[..., None]).view(t, n * group)[:, :r]


def _pack4(codes: torch.Tensor) -> torch.Tensor:  # (T, R) uint8 < 16, R even -> (T, R / 2)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:  # (T, R / 2) -> (T, R)
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)



class LowRankCodec:
    """`codec.LayerCodec` over fitted bases; `name` is what the catalog records ("lowrank:" + digest).

    Formats 2 and 3 encode an event's layers at once: keys and values of every layer as 2L parts padded to the
    widest basis (padding has no bits, so it writes nothing), one einsum and one quantisation; an event is
    written while the model reads on, so a loop of 60 small calls per event would cost about a sixth of ingest.
    """

    def __init__(self, bases: LowRankBases, name: str, kv_heads: int, head_dim: int):
        self.bases, self.name, self.kv_heads, self.head_dim = bases, name, kv_heads, head_dim
        self.representatives = FORMATS[bases.format]
        self._v1 = bases.format == "engramkv-lowrank-1"
        self._byte_scales = bases.format == "engramkv-lowrank-3"
        self._parts = parts = [*bases.keys, *bases.values]  # part i: layer i's keys, i + L its values
        self._sizes = [(2 * math.ceil(p.latent / bases.group), p.latent * bases.bits // 8) if self._v1 else
                       ((1 if p.byte_scales else 2) * p.basis.shape[0], math.ceil(p.code_bits / 8))
                       for p in parts]  # per token: scale, code bytes
        if self._v1:
            return
        rank = max(p.basis.shape[2] for p in parts)

        def padded(x: torch.Tensor, value: float) -> torch.Tensor:  # (..., r) -> (..., rank)
            return torch.nn.functional.pad(x, (0, rank - x.shape[-1]), value=value)

        n, groups = len(parts), parts[0].basis.shape[0]
        self._mean = torch.stack([p.mean for p in parts]).view(n * groups, 1, -1)  # (2L G, 1, gD)
        self._basis = torch.stack([padded(p.into, 0.0) for p in parts]).flatten(0, 1)  # (2L G, gD, R)
        self._sigma = torch.stack([padded(p.sigma, 1.0) for p in parts]).view(n * groups, 1, rank)  # (2L G, 1, R)
        bits = torch.stack([padded(p.bits, 0) for p in parts]).view(n * groups, rank)  # (2L G, R)
        self._coded_mask = (bits > 0).float()[:, None]  # (2L G, 1, R)
        self._coded_count = self._coded_mask.sum(-1).clamp(min=1)  # (2L G, 1)
        # Quantising touches only the coded directions (7,440 of 11,340 on the embedded model): (Nc,) each
        self._coded = torch.nonzero(bits.flatten()).squeeze(1)  # positions in (2L G R)
        self._coded_group = self._coded // rank  # its (part, group)
        coded_bits = bits.flatten()[self._coded]
        self._coded_step = torch.stack([padded(p.steps, 1.0) for p in parts]).flatten()[self._coded]
        self._coded_half = (1 << coded_bits).float() / 2
        self._coded_top = (1 << coded_bits).float() - 1
        # Reading folds the dequantisation and the bits' place values into one matrix per group:
        # x = scale (bits @ M - centre @ R) + mean, R = (step sigma basis)^T, M = `read_matrix` of R.
        self._reads: list[list[tuple[int, int, torch.Tensor, torch.Tensor]]] = []  # per part, per group:
        for p in parts:                                                       # first bit, end, M, centre @ R
            read = p.out_of * (p.steps * (p.bits > 0) * p.sigma)[..., None]  # (G, r, gD)
            centre = ((1 << p.bits).float() / 2 - 0.5) * (p.bits > 0)  # (G, r)
            ends = torch.cumsum(p.bits.sum(1), 0).tolist()
            self._reads.append([(end - int(p.bits[g].sum()), end, read_matrix(p.bits[g], read[g]), centre[g] @ read[g])
                                for g, end in enumerate(ends)])
        # Every stored bit is one (direction, bit) of the codes: bit k of direction j is (code_j >> k) & 1. One
        # gather of them, each part padded to whole bytes with a zero column's bits, and one packbits write all
        # parts' codes. A direction's bits go least-significant first.
        widths = coded_bits.numpy()
        direction = np.repeat(np.arange(len(widths)), widths)
        bit = np.concatenate([np.arange(w) for w in widths]).astype(np.uint8)
        part_of_bit = np.repeat((self._coded // (groups * rank)).numpy(), widths)
        directions, bits_of, self._code_at = [], [], [0]
        for i in range(n):
            mine = part_of_bit == i
            pad = -int(mine.sum()) % 8
            directions += [direction[mine], np.full(pad, len(widths))]  # the zero column past the codes
            bits_of += [bit[mine], np.zeros(pad, np.uint8)]
            self._code_at.append(self._code_at[-1] + math.ceil(int(mine.sum()) / 8))
        self._bit_direction, self._bit_shift = np.concatenate(directions), np.concatenate(bits_of)

    def layer_nbytes(self, layer: int, n_tokens: int) -> int:
        return n_tokens * sum(sum(self._sizes[i]) for i in (layer, layer + len(self.bases.keys)))

    def encode_layers(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes]:
        """keys, values: (L, Hkv, T, D) -> one layer's bytes per layer."""
        n_layers = len(self.bases.keys)
        if keys.dim() != 4 or keys.shape != values.shape or keys.shape[0] != n_layers:
            raise ValueError(f"keys and values must share one ({n_layers}, Hkv, T, D) shape, got "
                             f"{tuple(keys.shape)} and {tuple(values.shape)}")
        x = torch.cat([keys, values]).detach().to("cpu", torch.float32)  # (2L, H, T, D)
        if not math.isfinite(float(x.sum())):  # NaN or inf anywhere reaches the sum
            raise ValueError("keys/values hold NaN or inf")
        if self._v1:
            return self._encode_v1(x)
        n, h, t, d = x.shape
        groups = self._mean.shape[0] // n
        grouped = x.reshape(n, groups, h // groups, t, d).permute(0, 1, 3, 2, 4).reshape(n * groups, t, -1)
        u = torch.bmm(grouped - self._mean, self._basis) / self._sigma  # (2L G, T, R): whitened latent
        # `lowrank.quantise_latent`, on the coded directions alone: a scale per token and group, the RMS of its
        # coded directions; each direction's code against the stored scale
        rms = ((u * u * self._coded_mask).sum(-1) / self._coded_count).sqrt()  # (2L G, T)
        scale = scale_bytes(rms) if self._byte_scales else rms.clamp(max=F16_MAX).half()
        stored = scale_values(scale)
        stored = torch.where(stored == 0, torch.ones_like(stored), stored)
        c = (u.permute(1, 0, 2).reshape(t, -1).index_select(1, self._coded)
             / stored.T.index_select(1, self._coded_group))  # (T, Nc)
        codes = torch.minimum((c / self._coded_step + self._coded_half).floor_().clamp_(min=0), self._coded_top)
        padded_codes = np.zeros((t, codes.shape[1] + 1), np.uint8)  # and a zero column
        padded_codes[:, :-1] = codes.to(torch.uint8).numpy()
        stored_bits = (padded_codes[:, self._bit_direction] >> self._bit_shift) & 1  # (T, all parts' bits)
        packed = np.packbits(stored_bits, axis=1, bitorder="little")  # (T, all parts' code bytes)
        scale = scale.view(n, groups, t).permute(0, 2, 1).numpy()  # (2L, T, G)
        scales, at = scale if self._byte_scales else scale.astype("<f2"), self._code_at
        return [b"".join([scales[k].tobytes(), scales[k + n_layers].tobytes(), packed[:, at[k] : at[k + 1]].tobytes(),
                          packed[:, at[k + n_layers] : at[k + n_layers + 1]].tobytes()]) for k in range(n_layers)]

    def _encode_v1(self, x: torch.Tensor) -> list[bytes]:
        n_layers, out = len(self.bases.keys), []
        for layer in range(n_layers):
            scales, codes = [], []
            for i in (layer, layer + n_layers):
                projection = self._parts[i]
                c, s = quantise(projection.project(x[i]), self.bases.bits, self.bases.group)
                codes.append((_pack4(c) if self.bases.bits == 4 else c).numpy().tobytes())
                scales.append(s.numpy().astype("<f2").tobytes())
            out.append(b"".join(scales + codes))
        return out

    def decode_layer(self, layer: int, buffer: bytes | memoryview, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values), each float16 (Hkv, T, D)."""
        k_scales, v_scales, k_codes, v_codes = self._sections(layer, buffer, n_tokens)
        k, v = layer, layer + len(self.bases.keys)
        return (self._decode_part(k, k_scales, k_codes, n_tokens), self._decode_part(v, v_scales, v_codes, n_tokens))

    def decode_joined(self, layer: int, buffers: Sequence[bytes | memoryview], n_tokens: Sequence[int],
                      values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(keys, values or None) of several events' layer bytes, joined along the tokens: float16 (Hkv, sum T, D).

        A layer's bytes are token-major sections (key scales, value scales, key codes, value codes), so the
        sections of many events join into one decode: a recall decodes tens to hundreds of small events per
        layer, and one call each cost more in overhead than in arithmetic.
        """
        if self._v1 or not buffers:
            empty = torch.empty(self.kv_heads, 0, self.head_dim, dtype=torch.float16)
            pairs = [self.decode_layer(layer, b, t) for b, t in zip(buffers, n_tokens)]
            return (torch.cat([k for k, _ in pairs] or [empty], dim=1),
                    torch.cat([v for _, v in pairs] or [empty], dim=1) if values else None)
        k, v = layer, layer + len(self.bases.keys)
        # key scales, value scales, key codes, value codes: each section of every event (values' only if asked)
        sections = list(zip(*(self._sections(layer, b, t) for b, t in zip(buffers, n_tokens))))
        total = sum(n_tokens)
        keys = self._decode_part(k, b"".join(sections[0]), b"".join(sections[2]), total)
        if not values:
            return keys, None
        return keys, self._decode_part(v, b"".join(sections[1]), b"".join(sections[3]), total)

    def _sections(self, layer: int, buffer: bytes | memoryview, t: int) -> list[memoryview]:
        """One layer's bytes of T tokens -> its key scales, value scales, key codes and value codes."""
        buf = memoryview(buffer).cast("B")
        n = self.layer_nbytes(layer, t)
        if buf.nbytes != n:
            raise ValueError(f"lowrank layer {layer} of {t} tokens needs {n} bytes, got {buf.nbytes}")
        (ks, kc), (vs, vc) = self._sizes[layer], self._sizes[layer + len(self.bases.keys)]
        at = [0, ks * t, (ks + vs) * t, (ks + vs + kc) * t, (ks + vs + kc + vc) * t]
        return [buf[at[i] : at[i + 1]] for i in range(4)]

    def _decode_part(self, i: int, scale_bytes: bytes | memoryview, code_bytes: bytes | memoryview,
                     t: int) -> torch.Tensor:  # part i (a layer's keys or values) of T tokens -> float16 (Hkv, T, D)
        projection = self._parts[i]
        if self._byte_scales:
            scale = scale_values(torch.from_numpy(np.frombuffer(scale_bytes, "u1").copy())).view(t, -1)
        else:
            scale = torch.from_numpy(np.frombuffer(scale_bytes, "<f2").astype("f4")).view(t, -1)
        raw = np.frombuffer(code_bytes, "u1").reshape(t, -1)
        if self._v1:
            codes = torch.from_numpy(raw.copy())
            z = dequantise(_unpack4(codes) if self.bases.bits == 4 else codes, scale, self.bases.bits, self.bases.group)
            return projection.reconstruct(z, self.kv_heads).clamp(-F16_MAX, F16_MAX).half()
        reads = self._reads[i]
        stream = torch.from_numpy(np.unpackbits(raw, axis=1, count=reads[-1][1], bitorder="little")).float()  # (T, B)
        grouped = torch.stack([(stream[:, first:end] @ m - offset) * scale[:, g, None] + projection.mean[g]
                               for g, (first, end, m, offset) in enumerate(reads)])  # (G, T, gD)
        groups, h = len(reads), self.kv_heads
        x = grouped.view(groups, t, h // groups, -1).permute(0, 2, 1, 3).reshape(h, t, -1)  # (Hkv, T, D)
        return x.clamp(-F16_MAX, F16_MAX).half()
