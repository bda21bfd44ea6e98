"""The `lowrank` cold-tier codec (after Palu, "KV-Cache Compression with Low-Rank Projection"): per layer,
keys (pre-RoPE) and values are centred and projected onto their principal directions, fitted on calibration
text, one basis per group of KV heads; each direction of the latent gets its own number of bits. Read back:
latent @ basis^T + mean.

    Projection       one layer's K or V: mean, basis, and (format 2) deviations, bits, step widening,
                     (format 3) each dimension's weight
    LowRankBases     every layer's projections for keys and values: a safetensors file with its digest

The codec that writes and reads a store's blobs with them is `storage.lowrank_codec`.

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

Format 3 (`engramkv-lowrank-3`, written since 2026-12-03) is format 2's layout with one-byte scales
(`scale_bytes`: `K scales (T, G) u1 | V scales (T, G) u1`) over a weighted projection: each input dimension
is multiplied by a weight w before it is projected and divided by it after it is read back, so the fit
spends its bits where attention is most sensitive, not where K or V is largest. For values w^2 is the
squared norm of the output projection's column that reads the dimension; for keys (optional, measured to
gain nothing) the queries' mean energy on the dimension's rotary pair (a score is q.k, and RoPE turns each
pair of q and of k by the same angle, so only the pair's energy is position-free); both summed over the
query heads sharing the KV head; an unweighted part stores w = 1. Where a store's error bites is measured
in benchmarks/README.md ("Cold-tier codecs").

The format also fixes the representatives a store writes (`blob.py`): float16 in format 1, int8 in 2 and 3.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from engramkv.errors import ConfigError, StoreCorruptError
from engramkv.storage.codec import F16_MAX

FORMATS = {"engramkv-lowrank-1": "f16", "engramkv-lowrank-2": "i8", "engramkv-lowrank-3": "i8"}  # -> representatives
FORMAT = "engramkv-lowrank-3"  # what `fit_bases` writes
MAX_BITS = 8
SCALE_STEPS = 32  # format 3: a byte scale's codes per octave
# Max's optimal uniform quantiser of a unit Gaussian with b bits (b = 1..8): its step (its squared error is
# `lowrank_fit.DISTORTION`). b = 0 codes nothing; its 1 only keeps the arithmetic finite.
_STEP = (1.0, 1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)


def quantise_latent(z: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor, steps: torch.Tensor,
                    byte_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Formats 2 and 3: latent z (..., G, r), the directions' sigma, bits and steps (broadcast to it) -> (scales
    (..., G) float16, or uint8 log codes with `byte_scales`, and codes (..., G, r) uint8, 0 where a direction
    has no bits)."""
    coded = bits > 0
    u = z.float() / sigma
    rms = ((u * u * coded).sum(-1) / coded.sum(-1).clamp(min=1)).sqrt()  # (..., G)
    scale = scale_bytes(rms) if byte_scales else rms.clamp(max=F16_MAX).half()
    stored = scale_values(scale)
    c = u / torch.where(stored == 0, torch.ones_like(stored), stored)[..., None]  # against the stored scale
    levels = (1 << bits).float()
    codes = torch.minimum((c / steps + levels / 2).floor_().clamp_(min=0), levels - 1)
    return scale, codes.to(torch.uint8)


def scale_bytes(rms: torch.Tensor) -> torch.Tensor:
    """Format 3's scales: one byte, 2^((code - 128) / 32) for code 1..255 (1/32 of an octave: at most 1.1% off;
    the whitened latent's RMS is within 2^-2.1 and 2^1.6 on the embedded model), 0 for 0."""
    code = (torch.log2(rms.clamp(min=1e-30)) * SCALE_STEPS + 128).round_().clamp_(1, 255)
    return torch.where(rms == 0, torch.zeros_like(code), code).to(torch.uint8)


_SCALES = torch.exp2((torch.arange(256) - 128) / SCALE_STEPS).float().index_fill_(0, torch.tensor([0]), 0.0)


def scale_values(scale: torch.Tensor) -> torch.Tensor:  # stored scales (float16 or format 3's bytes) -> float32
    return _SCALES[scale.long()] if scale.dtype == torch.uint8 else scale.float()


def dequantise_latent(scale: torch.Tensor, codes: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor,
                      steps: torch.Tensor) -> torch.Tensor:  # -> z (..., G, r) float32
    c = (codes.float() - (1 << bits).float() / 2 + 0.5) * steps * (bits > 0)
    return c * scale_values(scale)[..., None] * sigma


@dataclass(frozen=True)
class Projection:
    """One layer's K or V projection: G groups of `heads_per_group` KV heads, each (mean, basis); in format 2
    also each direction's deviation and bits, and the layer's step widening; in format 3 each input dimension's
    weight (the basis is orthonormal in the weighted space)."""

    mean: torch.Tensor  # (G, g D) float32
    basis: torch.Tensor  # (G, g D, r) float32, orthonormal columns
    sigma: torch.Tensor | None = None  # (G, r) float32: the latent's deviation per direction (format 2)
    bits: torch.Tensor | None = None  # (G, r) int64 in 0..8 (format 2)
    step: float = 1.0
    weight: torch.Tensor | None = None  # (G, g D) float32 (format 3); None: every dimension 1
    byte_scales: bool = False  # format 3: a token's scale in one byte (`scale_bytes`), not float16

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

    @cached_property
    def into(self) -> torch.Tensor:  # (G, g D, r): centred x -> latent, the weight folded in
        return self.basis if self.weight is None else self.basis * self.weight[..., None]

    @cached_property
    def out_of(self) -> torch.Tensor:  # (G, r, g D): latent -> centred x
        back = self.basis.transpose(1, 2)
        return back if self.weight is None else back / self.weight[:, None, :]

    def project(self, x: torch.Tensor) -> torch.Tensor:  # (H, T, D) -> (T, G r)
        groups, width, _ = self.basis.shape
        h, t, d = x.shape
        grouped = x.float().reshape(groups, h // groups, t, d).permute(0, 2, 1, 3).reshape(groups, t, width)
        z = torch.einsum("gtf,gfr->tgr", grouped - self.mean[:, None], self.into)  # (T, G, r)
        return z.reshape(t, -1)

    def reconstruct(self, z: torch.Tensor, heads: int) -> torch.Tensor:  # (T, G r) -> (H, T, D) float32
        groups, width, rank = self.basis.shape
        t = z.shape[0]
        grouped = torch.einsum("tgr,grf->gtf", z.float().reshape(t, groups, rank), self.out_of) + self.mean[:, None]
        return grouped.reshape(groups, t, heads // groups, width * groups // heads).permute(0, 2, 1, 3).reshape(
            heads, t, -1)

    def encode(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (T, G r) -> (T, G), (T, G r)
        assert self.sigma is not None and self.bits is not None
        scale, codes = quantise_latent(z.view(z.shape[0], *self.bits.shape), self.sigma, self.bits, self.steps,
                                       self.byte_scales)
        return scale, codes.view(z.shape[0], -1)

    def decode(self, scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:  # -> latent (T, G r) float32
        assert self.sigma is not None and self.bits is not None
        t = codes.shape[0]
        return dequantise_latent(scale, codes.view(t, *self.bits.shape), self.sigma, self.bits, self.steps).view(t, -1)


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
                if p.weight is not None:
                    tensors[f"{name}_weight.{layer}"] = p.weight.float().contiguous()
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
                third = meta["format"] == "engramkv-lowrank-3"
                return Projection(mean, basis, tensors[f"{name}_sigma.{i}"], tensors[f"{name}_bits.{i}"].long(),
                                  float(tensors[f"{name}_step.{i}"][0]), tensors[f"{name}_weight.{i}"] if third else None,
                                  third)

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
