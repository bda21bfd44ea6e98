"""Test seams: tiny random Llama/Qwen2/Mistral models with an integer tokenizer, and the real default model."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton kernels run on the CPU through Triton's interpreter (tests/test_kernels.py); it is read when a kernel
# module is imported, so before engramkv is. Only calls that ask for the Triton backend use it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engramkv import EngineConfig, EpisodicLM

VOCAB = 256


class IntTokenizer:
    """Text is space-separated integers; enough tokenizer for random models.

    A word that is not an integer (as in the 'Question: ...' chat format) becomes a stable id of its
    own, so text prompts work; decoding gives the integers back.
    """

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(x) if x.isdigit() else sum(x.encode()) % VOCAB for x in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f" {i}" for i in ids)

    turn_end = ""  # what the template writes after an assistant's content

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        # A "template": each turn is its role id (1 user, 2 assistant) followed by its content.
        rendered = "".join(f" {1 if m['role'] == 'user' else 2} {m['content']}"
                           + (self.turn_end if m["role"] == "assistant" else "") for m in messages)
        return rendered + (" 2" if add_generation_prompt else "")


class EndingTokenizer(IntTokenizer):
    """An IntTokenizer whose template ends an assistant's turn with its stop token 3, as ChatML's <|im_end|> does."""

    eos_token_id = 3
    turn_end = " 3"


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2048,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False)).eval()
    if arch == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=None)).eval()
    raise ValueError(arch)


def tiny_lm(arch: str, config: EngineConfig) -> EpisodicLM:
    """An EpisodicLM over tiny_model(arch) that another process can load again (its `loader`): what a sharded
    ingest's Ray workers need (they import this module: tests/ must be on their PYTHONPATH)."""
    return EpisodicLM(tiny_model(arch), IntTokenizer(), f"tiny-{arch}", config,
                      loader=functools.partial(tiny_lm, arch, config))


def tiny_pair(arch: str, config: EngineConfig) -> tuple[torch.nn.Module, EpisodicLM]:
    """(untouched reference model, EpisodicLM over a copy of it)."""
    reference = tiny_model(arch)
    return reference, EpisodicLM(copy.deepcopy(reference), IntTokenizer(), f"tiny-{arch}", config)


@pytest.fixture(scope="session")
def default_pair() -> tuple[torch.nn.Module, EpisodicLM]:
    """(plain transformers copy, EpisodicLM) of the embedded SmolLM2-135M-Instruct, loaded once (20-40 s)."""
    from engramkv.hf import load_pretrained

    config = EngineConfig()
    model, tokenizer, model_id = load_pretrained(config.model)
    reference = copy.deepcopy(model)
    return reference, EpisodicLM(model, tokenizer, model_id, config)


@pytest.fixture(scope="session")
def default_lm(default_pair: tuple[torch.nn.Module, EpisodicLM]) -> EpisodicLM:
    return default_pair[1]


# ---------------------------------------------------------------------- PostgreSQL
def _postgres_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return versions[-1].parent if versions else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL server on a Unix socket (Debian's package); yields the socket directory.

    Skipped where PostgreSQL is not installed, unless ENGRAMKV_REQUIRE_POSTGRES=1 (as in .ci/run).
    """
    bin_dir = _postgres_bin()
    if bin_dir is None:
        if os.environ.get("ENGRAMKV_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL is required (ENGRAMKV_REQUIRE_POSTGRES=1) but initdb was not found")
        pytest.skip("PostgreSQL is not installed (apt install postgresql)")
    base = Path(tempfile.mkdtemp(prefix="engramkv-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root: run the server as the package's user
        shutil.chown(base, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data = base / "data"
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "engramkv"],
                   check=True, capture_output=True)
    options = f"-k {base} -c listen_addresses='' -c fsync=off"
    subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(base / "log"),
                    "-w", "start"], check=True, capture_output=True)
    try:
        yield str(base)
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest) -> str | None:
    """None (the store's own catalog.sqlite) or the URL of a fresh database on the test server."""
    if request.param == "sqlite":
        return None
    import psycopg

    socket_dir = request.getfixturevalue("postgres_server")
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(host=socket_dir, user="engramkv", dbname="postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"postgresql+psycopg://engramkv@/{name}?host={socket_dir}"
