"""Fitting the `lowrank` codec's bases on a model's own KV (`engramkv fit-bases`).

The model reads calibration text into an in-RAM session; the keys (pre-RoPE) and values its events hold
are what the bases are fitted on, layer by layer (`storage.lowrank.fit_bases`: the last fifth of the
tokens, text the fit never saw, chooses each layer's rank).

The default text is the docstrings of a fixed list of standard-library modules and their public members:
on every machine with Python, offline, and not the text the evaluation's haystacks are cut from (Python's
language reference, the Debian handbook).
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable, Iterable

from engramkv.config import EngineConfig
from engramkv.errors import InputError
from engramkv.lm import EpisodicLM
from engramkv.storage.lowrank import LowRankBases, fit_bases

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


def fit_lowrank_bases(lm: EpisodicLM, cfg: EngineConfig, texts: Iterable[str] | None = None,
                  progress: Callable[[str], None] | None = None) -> LowRankBases:
    """The `lowrank` codec's bases for `lm`, fitted on `texts` (default `stdlib_docstrings`).

    `cfg.store.lowrank` sets the error budgets and how many tokens are read; `.save(path)` writes the file a
    store takes as `store.lowrank.bases`.
    """
    lowrank = cfg.store.lowrank
    say = progress or (lambda line: None)
    session = lm.session(cfg.with_allocation_mode("fixed"))
    try:
        read = 0
        for text in texts if texts is not None else stdlib_docstrings():
            ids = lm.tokenizer.encode("\n\n" + text, add_special_tokens=False)[: lowrank.tokens - read]
            if not ids:
                continue
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
        return fit_bases(keys, values, lowrank, lm.spec.model_dump())
    finally:
        session.close()
