"""Shared helpers of the benchmark scripts: result files, peak RSS, the passkey text."""

from __future__ import annotations

import json
import platform
import random
import resource
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n\n"
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_sample(tokenizer: Any, n_tokens: int, depth: float, seed: int) -> tuple[str, str, str]:
    """InfiniteBench-format passkey: (context, question, key). `n_tokens` counts context + question."""
    key = str(random.Random(seed).randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    count = len(tokenizer.encode(PASSKEY_INTRO + needle + PASSKEY_QUESTION, add_special_tokens=False))
    per_filler = len(tokenizer.encode(PASSKEY_FILLER * 20, add_special_tokens=False)) / 20
    n_fillers = max(1, int((n_tokens - count) / per_filler))
    before = int(n_fillers * depth)
    context = PASSKEY_INTRO + PASSKEY_FILLER * before + needle + PASSKEY_FILLER * (n_fillers - before)
    return context, PASSKEY_QUESTION, key


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_split_mb() -> tuple[float, float]:
    """Current (anonymous, file-backed) resident MB, from /proc/self/status (Linux; (nan, nan) elsewhere).

    File-backed pages include the memory-mapped segment files that recall reads: page cache the
    kernel can drop, which peak RSS counts as if it were the process's own memory.
    """
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["RssAnon"].split()[0]) / 1024, int(fields["RssFile"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return float("nan"), float("nan")


def machine() -> dict[str, Any]:
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor(),
    }


def write_results(name: str, payload: dict[str, Any], table: str, directory: Path = RESULTS) -> tuple[Path, Path]:
    json_path, md_path = directory / f"{name}.json", directory / f"{name}.md"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(table)
    return json_path, md_path


def natural_text(n_chars: int) -> str:
    """Deterministic varied English-ish text from the standard library's own docstrings (no download)."""
    import importlib
    import inspect

    modules = ["argparse", "collections", "email", "json", "logging", "pathlib", "subprocess", "typing",
               "unittest", "urllib.parse", "zipfile", "asyncio", "http.client", "textwrap", "decimal"]
    parts: list[str] = []
    size = 0
    while size < n_chars:
        for name in modules:
            module = importlib.import_module(name)
            for _, obj in inspect.getmembers(module):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    parts.append(doc)
                    size += len(doc)
        modules = modules[::-1]  # on a second pass the order differs
    return "\n\n".join(parts)[:n_chars]
