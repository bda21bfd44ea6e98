"""Shared helpers of the benchmark scripts: result files with their provenance, peak RSS, a passkey sample.

Every result file is `results/<benchmark>/NAME.json` (+ `.md`, a `.png` where a script plots) and its
JSON records what a reader needs to reproduce it (`write_results`): the commit of the code that ran
(`commit`, and `dirty` when the tree had uncommitted changes outside `benchmarks/results/`), the full
configuration used (`config`: the `EngineConfig` dump, or one per system), the machine and the command.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def passkey_sample(tokenizer: Any, n_tokens: int, depth: float, seed: int) -> tuple[str, str, str]:
    """(context, prompt, key) of the passkey task (`engramkv.tasks.passkey`, the one generator) with the key at
    `depth`: for callers that ingest a context and then continue the prompt (the tests, examples/quickstart.py,
    passkey_file.py). `n_tokens` counts context + prompt."""
    from engramkv.tasks import passkey

    sample = passkey(tokenizer, n_tokens, seed, depth=depth)
    return sample.context[0], sample.prompt, sample.answers[0]


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


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_state() -> dict[str, Any]:
    """The commit checked out (None outside a git checkout) and whether the tree differs from it.

    The results folder is left out of `dirty`: a long run rewrites its own files as it goes.
    """
    # A copy of the tree sent elsewhere (the device machine's) is told its commit by whoever sent it: the .git
    # that travels with it can name an older one.
    if os.environ.get("ENGRAMKV_COMMIT"):
        return {"commit": os.environ["ENGRAMKV_COMMIT"], "dirty": None}
    status = _git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def command_line() -> str:
    """This process's command, the script named from the repository root (`python benchmarks/x.py ...`)."""
    script = Path(sys.argv[0]).resolve()
    name = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    return shlex.join(["python", name, *sys.argv[1:]])


# Taken when the script starts: the code that ran is the code of this moment, not of the last write.
CODE = code_state()
COMMAND = command_line()


def _plain(config: Any) -> Any:
    """A pydantic config (or a dict of them, one per system) as JSON values."""
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    if isinstance(config, dict):
        return {key: _plain(value) for key, value in config.items()}
    return config


def provenance(config: Any) -> dict[str, Any]:
    """What every result JSON records first: commit, dirty, command, machine, the full config."""
    return {**CODE, "command": COMMAND, "machine": machine(), "config": _plain(config)}


def write_results(directory: Path, name: str, payload: dict[str, Any], table: str,
                  config: Any) -> tuple[Path, Path]:
    """Write `directory/NAME.json` (provenance, then `payload`) and `directory/NAME.md` (`table` + a footer
    naming the commit and the command). `config`: the `EngineConfig` the run used, or {system: config}."""
    json_path, md_path = directory / f"{name}.json", directory / f"{name}.md"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    info = provenance(config)
    json_path.write_text(json.dumps({**info, **payload}, indent=2) + "\n")
    commit = info["commit"] or "unknown"
    footer = (f"\nCommit {commit}{' with uncommitted changes' if info['dirty'] else ''}; command `{info['command']}`; "
              f"the full config and the machine are in {json_path.name}.\n")
    md_path.write_text(table.rstrip("\n") + "\n" + footer)
    return json_path, md_path


class WordIds:
    """The tokenizer a random-weight model needs: a stable id per word (the engine encodes its demonstrations)."""

    eos_token_id = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [zlib.crc32(word.encode()) % self.vocab for word in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def natural_text(n_chars: int) -> str:
    """Deterministic varied English-ish text: the standard library's docstrings (`engramkv.lowrank_fit`), no download."""
    from engramkv.lowrank_fit import stdlib_docstrings

    pieces = [doc for doc in stdlib_docstrings() if len(doc) > 200]
    parts: list[str] = []
    size = 0
    while size < n_chars:
        parts.extend(pieces)
        size += sum(map(len, pieces))
        pieces = pieces[::-1]  # on a second pass the order differs
    return "\n\n".join(parts)[:n_chars]
