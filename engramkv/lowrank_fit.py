"""Fitting the `lowrank` codec's bases on a model's own KV (`engramkv fit-bases`; the format is
`storage.lowrank`'s).

    allocate           bits per latent direction for a budget (reverse water-filling, one bit at a time)
    fit_projection     one layer's K or V samples -> its `Projection` within an error budget
    fit_bases          every layer's, from calibration KV
    fit_lowrank_bases  the model reads calibration text, then `fit_bases`

The model reads calibration text into an in-RAM session; the keys (pre-RoPE) and values its events hold
are what the bases are fitted on, layer by layer (`fit_bases`: the last fifth of the
tokens, text the fit never saw, chooses each layer's bits).

The default text is the docstrings of a fixed list of standard-library modules and their public members:
on every machine with Python, offline, and not the text the evaluation's haystacks are cut from (Python's
language reference, the Debian handbook).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from engramkv import hf
from engramkv.config import EngineConfig, LowRankConfig
from engramkv.errors import ConfigError, InputError
from engramkv.lm import EpisodicLM
from engramkv.storage.lowrank import MAX_BITS, LowRankBases, Projection

# The squared error of Max's uniform quantiser of a unit Gaussian with b bits (b = 0..8; its steps:
# `storage.lowrank._STEP`).
DISTORTION = (1.0, 0.3634, 0.1188, 0.03744, 0.01154, 0.00349, 0.00104, 0.000303, 0.0000870)
STEP_FACTORS = (1.0, 1.25, 1.5, 2.0)  # the widenings of those steps a fit tries per layer
BUDGET_STEP = 16  # bits: the fit's budgets are multiples of this

CALIBRATION_MODULES = (
    "argparse", "ast", "asyncio", "bisect", "calendar", "codecs", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq",
    "http.client", "inspect", "io", "itertools", "json", "logging", "operator", "pathlib", "pickle", "pprint",
    "random", "re", "selectors", "shutil", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "traceback", "typing", "unittest", "urllib.request", "warnings",
    "weakref", "xml.etree.ElementTree", "zipfile",
)


def stdlib_docstrings() -> Iterable[str]:
    """The docstrings of `CALIBRATION_MODULES` and their public members, one piece each, in a fixed order."""
    for name in CALIBRATION_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without one (sqlite3, say): the rest suffice
            continue
        doc = inspect.getdoc(module)
        if doc:
            yield doc
        for member_name, member in sorted(vars(module).items()):
            if (member_name.startswith("_") or inspect.ismodule(member)
                    or getattr(member, "__module__", None) != module.__name__):
                continue
            with warnings.catch_warnings():  # typing.io and typing.re warn when read
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(member)
            if doc and len(doc) > 80:
                yield doc


def allocate(variance: torch.Tensor, budget: int) -> torch.Tensor:
    """Bits per direction (G, r) for `budget` bits in all, each next bit to the direction whose expected
    squared error (variance x Max's error at its bits) falls most; `variance` (G, r)."""
    gains = variance[..., None] * -torch.diff(torch.tensor(DISTORTION))  # (G, r, 8): the b-th bit's gain
    best = gains.flatten().argsort(descending=True)[:budget]  # gains fall with b, so bits go in order per direction
    return torch.bincount(best // MAX_BITS, minlength=variance.numel()).view(variance.shape)


def fit_projection(train: torch.Tensor, held_out: torch.Tensor, heads_per_group: int, max_error: float,
                   weight: torch.Tensor | None = None) -> tuple[Projection, float]:
    """One layer's projection for K or V samples (H, N, D) each, every dimension multiplied by its `weight`
    (H, D) (default 1): per head group the mean and the principal directions of the weighted train samples;
    bits per direction (`allocate`) for the least budget, a multiple of `BUDGET_STEP` bits, and the step
    widening, whose relative error on the held-out samples (||w (x - x_hat)|| / ||w (x - mean)||) is within
    `max_error`, else 8 bits a direction. Returns it and that error."""
    h, _, d = train.shape
    if h % heads_per_group:
        raise ConfigError(f"lowrank.heads_per_group {heads_per_group} does not divide {h} KV heads")
    groups, width = h // heads_per_group, heads_per_group * d

    def grouped(x: torch.Tensor) -> torch.Tensor:  # (H, N, D) -> (G, N, g D)
        return x.float().reshape(groups, heads_per_group, x.shape[1], d).permute(0, 2, 1, 3).reshape(groups, -1, width)

    w = grouped(torch.ones(h, 1, d) if weight is None else weight[:, None].float())[:, 0]  # (G, g D)
    x = grouped(train)
    mean = x.mean(dim=1)  # (G, g D)
    # The principal directions as eigenvectors of the covariance: a full basis even with fewer samples than
    # dimensions, and no (N, N) factor.
    centred = ((x - mean[:, None]) * w[:, None]).double()
    eigenvalues, eigenvectors = torch.linalg.eigh(centred.transpose(1, 2) @ centred)  # ascending
    basis = eigenvectors.flip(-1).float().contiguous()  # (G, g D, g D), largest variance first
    variance = (eigenvalues.flip(-1) / x.shape[1]).float()  # (G, g D)
    # Directions the train samples hardly span still get a deviation: whitening by ~0 would let one held-out
    # component swamp a token's scale.
    variance = variance.clamp(min=float(variance.max()) * 1e-4 + 1e-12)
    full = Projection(mean, basis, variance.sqrt(), torch.zeros_like(variance, dtype=torch.int64), weight=w,
                      byte_scales=True)
    y = held_out.float()
    z = full.project(y)  # (T, G gD): the basis is complete, so the error is the latent's
    norm = float(((grouped(y) - mean[:, None]) * w[:, None]).norm()) or 1.0

    def error(projection: Projection) -> float:
        return float((projection.decode(*projection.encode(z)) - z).norm()) / norm

    best: tuple[int, float, Projection] | None = None
    most = variance.numel() * MAX_BITS
    for factor in STEP_FACTORS:
        for budget in [*range(BUDGET_STEP, most, BUDGET_STEP), most]:
            if best is not None and budget >= best[0]:
                break
            candidate = Projection(mean, basis, full.sigma, allocate(variance, budget), factor, w, True)
            if (e := error(candidate)) <= max_error or budget == most:
                best = (budget, e, candidate)  # fewer bits than any earlier widening's: the loop stops short of those
                break
    assert best is not None
    _, e, chosen = best
    keep = int((chosen.bits > 0).sum(0).nonzero().max()) + 1 if chosen.code_bits else 1  # directions any group codes
    return Projection(mean, basis[:, :, :keep].contiguous(), chosen.sigma[:, :keep].contiguous(),
                      chosen.bits[:, :keep].contiguous(), chosen.step, w, True), e


def attention_weights(query_energy: torch.Tensor, column_energy: torch.Tensor, kv_heads: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's key and value weights (Hkv, D) each from its queries' E[q^2] and its output projection's
    squared column norms (Hq, D) each: the square root of the energy that reads the dimension, summed over
    the query heads sharing the KV head, for keys over the dimension's rotary pair (d, d + D/2: `hf.Rope`),
    scaled to a mean square of 1 and held at 1/20 of that or more (a dimension nothing reads still gets
    some bits, and read back, its error divided by the weight stays finite)."""
    hq, d = query_energy.shape

    def weight(energy: torch.Tensor) -> torch.Tensor:
        per_kv = energy.double().view(kv_heads, hq // kv_heads, d).sum(1)
        w = (per_kv / per_kv.mean().clamp(min=1e-30)).sqrt()
        return w.clamp(min=0.05).float()

    half = d // 2
    pair = (query_energy[:, :half] + query_energy[:, half:]) / 2
    return weight(torch.cat([pair, pair], dim=1)), weight(column_energy)


def fit_bases(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], cfg: LowRankConfig,
              fingerprint: dict[str, Any], held_out: float = 0.2,
              weights: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> LowRankBases:
    """Bases for every layer from calibration KV (H, N, D) per layer (N tokens in reading order): the last
    `held_out` share of the tokens chooses the bits, the rest fits the bases; the keys of the first
    `cfg.early_layers` share of the layers take `cfg.early_key_error` where it is set. `weights`: per layer (key,
    value) weights (H, D) (`attention_weights`), used where `cfg.weight_keys` / `cfg.weight_values` say."""
    k_out, v_out, errors = [], [], {"keys": [], "values": []}
    early = round(cfg.early_layers * len(keys)) if cfg.early_key_error is not None else 0
    for layer, (k, v) in enumerate(zip(keys, values)):
        key_error = cfg.early_key_error if layer < early else cfg.key_error
        cut = int(k.shape[1] * (1 - held_out))
        if cut < 1 or cut >= k.shape[1]:
            raise ConfigError(f"{k.shape[1]} calibration tokens are too few to fit and hold out")
        k_weight, v_weight = weights[layer] if weights is not None else (None, None)
        for x, budget, w, out, name in ((k, key_error, k_weight if cfg.weight_keys else None, k_out, "keys"),
                                        (v, cfg.value_error, v_weight if cfg.weight_values else None, v_out, "values")):
            projection, error = fit_projection(x[:, :cut], x[:, cut:], cfg.heads_per_group or x.shape[0], budget, w)
            out.append(projection)
            errors[name].append(round(error, 5))
    return LowRankBases(tuple(k_out), tuple(v_out), fingerprint, errors)


def fit_lowrank_bases(lm: EpisodicLM, cfg: EngineConfig, texts: Iterable[str] | None = None,
                  progress: Callable[[str], None] | None = None) -> LowRankBases:
    """The `lowrank` codec's bases for `lm`, fitted on `texts` (default `stdlib_docstrings`).

    `cfg.store.lowrank` sets the error budgets and how many tokens are read; `.save(path)` writes the file a
    store takes as `store.lowrank.bases`.
    """
    lowrank = cfg.store.lowrank
    say = progress or (lambda line: None)
    session = lm.session(cfg.with_allocation_mode("fixed"))
    queries = hf.QueryEnergy(lm.model)
    try:
        read = 0
        for text in texts if texts is not None else stdlib_docstrings():
            ids = lm.tokenizer.encode("\n\n" + text, add_special_tokens=False)[: lowrank.tokens - read]
            if not ids:
                continue
            # the queries' energy weighs only keys: not recorded (a hook per layer per forward) unless asked
            with queries.recording() if lowrank.weight_keys else contextlib.nullcontext():
                session.ingest_ids(ids)
            read += len(ids)
            say(f"read {read:,} / {lowrank.tokens:,} calibration tokens")
            if read >= lowrank.tokens:
                break
        memory = session.memory
        if len(memory) < 2:
            raise InputError(f"{read} calibration tokens sealed {len(memory)} events; give more text")
        events = list(range(len(memory)))
        keys, values = [], []
        for layer in range(lm.spec.num_layers):
            k, v = memory.gather(layer, events)  # (Hkv, M, D) each
            keys.append(k.float())
            values.append(v.float())
        say(f"fitting {lm.spec.num_layers} layers on {keys[0].shape[1]:,} tokens of {len(memory)} events")
        weights = [attention_weights(q, o, lm.spec.num_kv_heads)
                   for q, o in zip(queries.means(), hf.output_column_energy(lm.model))]
        return fit_bases(keys, values, lowrank, lm.spec.model_dump(), weights=weights)
    finally:
        session.close()
