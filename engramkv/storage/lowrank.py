"""The `lowrank` cold-tier codec (after Palu, "KV-Cache Compression with Low-Rank Projection"): per layer,
keys (pre-RoPE) and values are centred and projected onto their principal directions, fitted on calibration
text, one basis per group of KV heads; each direction of the latent gets its own number of bits. Read back:
latent @ basis^T + mean.

    Projection       one layer's K or V: mean, basis, and (format 2) deviations, bits, step widening
    LowRankBases     every layer's projections for keys and values: a safetensors file with its digest
    LowRankCodec     one layer of one event to bytes and back (`codec.LayerCodec`)

The fit (`engramkv.lowrank_fit`). Why bits per direction: the latent's variance falls steeply along the directions (measured on the
embedded model, 95% of a layer's centred key energy lies in 14-45 of its 192 dimensions; values need
55-128), and the error of a budget of bits is least when a direction of variance s^2 gets about
log2(s / theta) of them (reverse water-filling). The fit hands out bits one at a time, each to the direction
whose expected squared error falls most (Max's uniform quantiser of a unit Gaussian), and keeps the least
budget, in steps of 16 bits, whose error on held-out tokens is within the layer's budget. Measured on the
embedded model (`benchmarks/lowrank.py`): at the same errors, 32-38% fewer bytes than one rank cut with
4-bit codes (format 1).

Format 2 (`engramkv-lowrank-2`), layout of one layer (T tokens; G head groups; for K, then V: b_i bits of
direction i, B = sum b_i over the group's directions):

    K scales (T, G) f16 | V scales (T, G) f16 | K codes (T, ceil(G B_k / 8)) u1 | V codes (T, ceil(G B_v / 8)) u1

A token's latent z is whitened by the directions' fitted deviations (u = z / sigma) and scaled by one number
per token and group, its RMS over the coded directions (c = u / rms, rms stored); direction i is then a
b_i-bit uniform mid-rise code: code = clip(floor(c / step_i + 2^b_i / 2), 0, 2^b_i - 1), read back as
(code - 2^b_i / 2 + 1/2) step_i, step_i = Max's step for b_i bits times the layer's `step` (1, 1.25, 1.5 or 2:
heavy-tailed layers want a wider range; the fit picks it on held-out tokens). The codes are packed
least-significant bit first, direction after direction, group after group.

Format 1 (`engramkv-lowrank-1`, stores written before 2026-12-03) stays readable: one rank per layer, every
latent dimension `bits` (4 or 8) bits, symmetric per token group of `group` dimensions with a float16 scale:

    K scales (T, ceil(R_k / group)) f16 | V scales (T, ceil(R_v / group)) f16
    | K codes (T, R_k * bits / 8) u1 | V codes (T, R_v * bits / 8) u1

The format also fixes the representatives a store writes (`blob.py`): float16 in format 1, int8 in 2.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from engramkv.errors import ConfigError, StoreCorruptError
from engramkv.storage.codec import F16_MAX

FORMATS = {"engramkv-lowrank-1": "f16", "engramkv-lowrank-2": "i8"}  # format -> its representatives (`blob.py`)
FORMAT = "engramkv-lowrank-2"  # what `fit_bases` writes
MAX_BITS = 8
# Max's optimal uniform quantiser of a unit Gaussian with b bits (b = 1..8): its step (its squared error is
# `lowrank_fit.DISTORTION`). b = 0 codes nothing; its 1 only keeps the arithmetic finite.
_STEP = (1.0, 1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)


def quantise_latent(z: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor, steps: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Format 2: latent z (..., G, r), the directions' sigma, bits and steps (broadcast to it) -> (scales
    (..., G) float16, codes (..., G, r) uint8, 0 where a direction has no bits)."""
    coded = bits > 0
    u = z.float() / sigma
    rms = ((u * u * coded).sum(-1) / coded.sum(-1).clamp(min=1)).sqrt()  # (..., G)
    scale = rms.clamp(max=F16_MAX).half()
    c = u / torch.where(scale == 0, torch.ones_like(scale), scale).float()[..., None]  # against the stored scale
    levels = (1 << bits).float()
    codes = torch.minimum((c / steps + levels / 2).floor_().clamp_(min=0), levels - 1)
    return scale, codes.to(torch.uint8)


def dequantise_latent(scale: torch.Tensor, codes: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor,
                      steps: torch.Tensor) -> torch.Tensor:  # -> z (..., G, r) float32
    c = (codes.float() - (1 << bits).float() / 2 + 0.5) * steps * (bits > 0)
    return c * scale.float()[..., None] * sigma


@dataclass(frozen=True)
class Projection:
    """One layer's K or V projection: G groups of `heads_per_group` KV heads, each (mean, basis); in format 2
    also each direction's deviation and bits, and the layer's step widening."""

    mean: torch.Tensor  # (G, g D) float32
    basis: torch.Tensor  # (G, g D, r) float32, orthonormal columns
    sigma: torch.Tensor | None = None  # (G, r) float32: the latent's deviation per direction (format 2)
    bits: torch.Tensor | None = None  # (G, r) int64 in 0..8 (format 2)
    step: float = 1.0

    @property
    def latent(self) -> int:
        """R: latent dims per token (all groups)."""
        return self.basis.shape[0] * self.basis.shape[2]

    @property
    def code_bits(self) -> int:
        """Bits of codes per token (format 2)."""
        return int(self.bits.sum()) if self.bits is not None else 0

    @cached_property
    def steps(self) -> torch.Tensor:  # (G, r): each direction's quantiser step (format 2)
        assert self.bits is not None
        return torch.tensor(_STEP)[self.bits] * self.step

    def project(self, x: torch.Tensor) -> torch.Tensor:  # (H, T, D) -> (T, G r)
        groups, width, _ = self.basis.shape
        h, t, d = x.shape
        grouped = x.float().reshape(groups, h // groups, t, d).permute(0, 2, 1, 3).reshape(groups, t, width)
        z = torch.einsum("gtf,gfr->tgr", grouped - self.mean[:, None], self.basis)  # (T, G, r)
        return z.reshape(t, -1)

    def reconstruct(self, z: torch.Tensor, heads: int) -> torch.Tensor:  # (T, G r) -> (H, T, D) float32
        groups, width, rank = self.basis.shape
        t = z.shape[0]
        grouped = torch.einsum("tgr,gfr->gtf", z.float().reshape(t, groups, rank), self.basis) + self.mean[:, None]
        return grouped.reshape(groups, t, heads // groups, width * groups // heads).permute(0, 2, 1, 3).reshape(
            heads, t, -1)

    def encode(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (T, G r) -> (T, G), (T, G r)
        assert self.sigma is not None and self.bits is not None
        scale, codes = quantise_latent(z.view(z.shape[0], *self.bits.shape), self.sigma, self.bits, self.steps)
        return scale, codes.view(z.shape[0], -1)

    def decode(self, scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:  # -> latent (T, G r) float32
        assert self.sigma is not None and self.bits is not None
        t = codes.shape[0]
        return dequantise_latent(scale, codes.view(t, *self.bits.shape), self.sigma, self.bits, self.steps).view(t, -1)


# ------------------------------------------------------------------------------------- format 2: packing bits
def pack_bits(codes: torch.Tensor, bits: torch.Tensor) -> np.ndarray:
    """codes (T, R) int < 2^bits, bits (R,) -> (T, ceil(sum bits / 8)) uint8, least-significant bit first."""
    planes = np.unpackbits(codes.to(torch.uint8).numpy()[..., None], axis=2, bitorder="little")  # (T, R, 8)
    return np.packbits(planes[:, _plane_mask(bits)], axis=1, bitorder="little")  # (T, sum bits) packed


def unpack_bits(packed: np.ndarray, bits: torch.Tensor, plan: UnpackPlan | None = None) -> torch.Tensor:
    """(T, ceil(sum bits / 8)) uint8 -> codes (T, R) float32 (whole numbers; 0 where a direction has no bits)."""
    coded, starts, weights, width = plan if plan is not None else unpack_plan(bits)
    stream = np.unpackbits(packed, axis=1, count=len(weights), bitorder="little")  # (T, sum bits)
    codes = np.zeros((packed.shape[0], width), np.float32)
    if len(coded):
        codes[:, coded] = np.add.reduceat(stream * weights, starts, axis=1)  # each direction's bits, weighted
    return torch.from_numpy(codes)


UnpackPlan = tuple[np.ndarray, np.ndarray, np.ndarray, int]  # coded directions, their first bits, bit weights, R


def unpack_plan(bits: torch.Tensor) -> UnpackPlan:
    """What `unpack_bits` needs of `bits` (R,), worked out once per part by a codec."""
    widths = bits.numpy().astype(np.int64)
    coded = np.nonzero(widths)[0]
    starts = np.concatenate([[0], np.cumsum(widths[coded])[:-1]]).astype(np.int64)
    weights = np.exp2(np.arange(int(widths.sum())) - np.repeat(starts, widths[coded])).astype(np.float32)
    return coded, starts, weights, len(widths)


def _plane_mask(bits: torch.Tensor) -> np.ndarray:  # (R, 8) bool: which bit planes of each direction are stored
    return np.arange(MAX_BITS) < bits.numpy()[:, None]


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


@dataclass(frozen=True)
class LowRankBases:
    """Every layer's key and value projections and the model (`ModelSpec.model_dump()`) whose KV they project;
    format 1 also its one bit width and group."""

    keys: tuple[Projection, ...]
    values: tuple[Projection, ...]
    fingerprint: dict[str, Any]
    errors: dict[str, list[float]]  # held-out relative error per layer: {"keys": [...], "values": [...]}
    format: str = FORMAT  # a key of FORMATS
    bits: int = 0  # format 1: bits of every latent code
    group: int = 0  # format 1: latent dims sharing a scale

    def to_bytes(self) -> bytes:
        tensors = {}
        for name, projections in (("k", self.keys), ("v", self.values)):
            for layer, p in enumerate(projections):
                tensors[f"{name}_mean.{layer}"] = p.mean.float().contiguous()
                tensors[f"{name}_basis.{layer}"] = p.basis.float().contiguous()
                if p.sigma is not None and p.bits is not None:
                    tensors[f"{name}_sigma.{layer}"] = p.sigma.float().contiguous()
                    tensors[f"{name}_bits.{layer}"] = p.bits.to(torch.uint8).contiguous()
                    tensors[f"{name}_step.{layer}"] = torch.tensor([p.step], dtype=torch.float32)
        meta = {"format": self.format, "bits": str(self.bits), "group": str(self.group),
                "sha256": _content_hash(tensors), "fingerprint": json.dumps(self.fingerprint, sort_keys=True, default=str),
                "errors": json.dumps(self.errors)}
        return save_tensors(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> LowRankBases:
        """Parse a bases file; `source` names it in the error of a damaged or foreign file."""
        try:
            tensors = load_tensors(data)
            meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
            if meta.get("format") not in FORMATS:
                raise ValueError(f"format {meta.get('format')!r}, expected one of {sorted(FORMATS)}")
            if meta.get("sha256") != _content_hash(tensors):
                raise ValueError("its tensors do not match the checksum it was written with")
            n_layers = sum(1 for name in tensors if name.startswith("k_mean."))

            def projection(name: str, i: int) -> Projection:
                mean, basis = tensors[f"{name}_mean.{i}"], tensors[f"{name}_basis.{i}"]
                if meta["format"] == "engramkv-lowrank-1":
                    return Projection(mean, basis)
                return Projection(mean, basis, tensors[f"{name}_sigma.{i}"], tensors[f"{name}_bits.{i}"].long(),
                                  float(tensors[f"{name}_step.{i}"][0]))

            return cls(tuple(projection("k", i) for i in range(n_layers)),
                       tuple(projection("v", i) for i in range(n_layers)),
                       json.loads(meta["fingerprint"]), json.loads(meta["errors"]), meta["format"],
                       int(meta.get("bits", 0)), int(meta.get("group", 0)))
        except Exception as err:  # safetensors raises its own errors for a damaged header
            raise StoreCorruptError(f"{source} is not a readable lowrank bases file: {err}") from err

    def save(self, path: Path) -> None:
        path.write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: Path) -> LowRankBases:
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ConfigError(f"cannot read lowrank bases {path}: {err}") from err
        return cls.from_bytes(data, str(path))

    def check_model(self, fingerprint: dict[str, Any], source: str) -> None:
        mine = json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
        if self.fingerprint != mine:
            raise ConfigError(f"{source} was fitted for model {self.fingerprint.get('model_id')!r}, not "
                              f"{mine.get('model_id')!r}; fit bases for it with `engramkv fit-bases`")


def _content_hash(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def digest(data: bytes) -> str:
    """The 8 hex digits a store's codec name carries of its bases file ("lowrank:" + these: 16 characters,
    the catalog's codec column)."""
    return hashlib.sha256(data).hexdigest()[:8]


# ---------------------------------------------------------------------------------------------- the codec
class LowRankCodec:
    """`codec.LayerCodec` over fitted bases; `name` is what the catalog records ("lowrank:" + digest).

    Format 2 encodes an event's layers at once: keys and values of every layer as 2L parts padded to the
    widest basis (padding has no bits, so it writes nothing), one einsum and one quantisation; an event is
    written while the model reads on, so a loop of 60 small calls per event would cost about a sixth of ingest.
    """

    def __init__(self, bases: LowRankBases, name: str, kv_heads: int, head_dim: int):
        self.bases, self.name, self.kv_heads, self.head_dim = bases, name, kv_heads, head_dim
        self.representatives = FORMATS[bases.format]
        self._v1 = bases.format == "engramkv-lowrank-1"
        self._parts = parts = [*bases.keys, *bases.values]  # part i: layer i's keys, i + L its values
        self._sizes = [(2 * math.ceil(p.latent / bases.group), p.latent * bases.bits // 8) if self._v1 else
                       (2 * p.basis.shape[0], math.ceil(p.code_bits / 8)) for p in parts]  # per token: scale, code bytes
        if self._v1:
            return
        rank = max(p.basis.shape[2] for p in parts)

        def padded(x: torch.Tensor, value: float) -> torch.Tensor:  # (..., r) -> (..., rank)
            return torch.nn.functional.pad(x, (0, rank - x.shape[-1]), value=value)

        self._mean = torch.stack([p.mean for p in parts])  # (2L, G, gD)
        self._basis = torch.stack([padded(p.basis, 0.0) for p in parts])  # (2L, G, gD, R)
        self._sigma = torch.stack([padded(p.sigma, 1.0) for p in parts])[:, None]  # (2L, 1, G, R)
        self._bits = torch.stack([padded(p.bits, 0) for p in parts])[:, None]
        self._steps = torch.stack([padded(p.steps, 1.0) for p in parts])[:, None]
        self._plans = [unpack_plan(p.bits.flatten()) for p in parts]
        # Reading folds the dequantisation into the basis: x = scale (codes - centre) (step sigma basis)^T + mean.
        self._centres = [(1 << p.bits).float() / 2 - 0.5 for p in parts]  # (G, r)
        self._read_bases = [(p.basis * (p.steps * (p.bits > 0) * p.sigma)[:, None, :]).transpose(1, 2).contiguous()
                            for p in parts]  # (G, r, gD)
        # One gather takes every part's stored bit planes out of (2L, G R, 8) planes (and a zero plane past
        # them), each part padded with zero planes to whole bytes, so one packbits writes all parts' codes.
        where, self._code_at = [], [0]
        for i, bits in enumerate(self._bits[:, 0]):
            mask = _plane_mask(bits.flatten())  # (G R, 8)
            (first,) = np.nonzero(mask.ravel())
            where += [first + i * mask.size, np.full(-len(first) % 8, len(parts) * mask.size)]
            self._code_at.append(self._code_at[-1] + math.ceil(len(first) / 8))
        self._gather = np.concatenate(where)

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
        groups = self._mean.shape[1]
        grouped = x.reshape(n, groups, h // groups, t, d).permute(0, 1, 3, 2, 4).reshape(n, groups, t, -1)
        z = torch.einsum("ngtf,ngfr->ntgr", grouped - self._mean[:, :, None], self._basis)  # (2L, T, G, R)
        scale, codes = quantise_latent(z, self._sigma, self._bits, self._steps)
        planes = np.unpackbits(codes.numpy().reshape(n, t, -1)[..., None], axis=3, bitorder="little")  # (2L, T, GR, 8)
        planes = np.concatenate([planes.transpose(1, 0, 2, 3).reshape(t, -1), np.zeros((t, 1), np.uint8)], axis=1)
        packed = np.packbits(planes[:, self._gather], axis=1, bitorder="little")  # (T, all parts' code bytes)
        scales, at = scale.numpy().astype("<f2"), self._code_at
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
        buf = memoryview(buffer).cast("B")
        n = self.layer_nbytes(layer, n_tokens)
        if buf.nbytes != n:
            raise ValueError(f"lowrank layer {layer} of {n_tokens} tokens needs {n} bytes, got {buf.nbytes}")
        t, parts = n_tokens, (layer, layer + len(self.bases.keys))
        at, scales = 0, []
        for i in parts:
            count = t * self._sizes[i][0] // 2
            scales.append(torch.from_numpy(np.frombuffer(buf, "<f2", count, at).astype("f4")).view(t, -1))
            at += 2 * count
        out = []
        for i, scale in zip(parts, scales):
            projection = self._parts[i]
            raw = np.frombuffer(buf, "u1", t * self._sizes[i][1], at).reshape(t, -1)
            at += raw.size
            if self._v1:
                codes = torch.from_numpy(raw.copy())
                z = dequantise(_unpack4(codes) if self.bases.bits == 4 else codes, scale, self.bases.bits,
                               self.bases.group)
                out.append(projection.reconstruct(z, self.kv_heads).clamp(-F16_MAX, F16_MAX).half())
                continue
            groups, rank, _ = self._read_bases[i].shape
            codes = unpack_bits(raw, projection.bits.flatten(), self._plans[i]).view(t, groups, rank)
            latent = (codes - self._centres[i]).transpose(0, 1) * scale.T[..., None]  # (G, T, r)
            grouped = torch.matmul(latent, self._read_bases[i]) + projection.mean[:, None]  # (G, T, gD)
            h = self.kv_heads
            x = grouped.view(groups, t, h // groups, -1).permute(0, 2, 1, 3).reshape(h, t, -1)  # (Hkv, T, D)
            out.append(x.clamp(-F16_MAX, F16_MAX).half())
        return out[0], out[1]
