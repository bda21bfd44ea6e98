"""Host-side work per ingested chunk: tensor operations dispatched, this checkout against an earlier commit's.

On a GPU the engine waits on Python (issue 19: on the H200, 590 ms of host time against 71 ms of GPU time for
four chunks), and each operation on a CUDA tensor is at least one launch or one host step. How many operations a
chunk dispatches does not depend on the machine, so it can be counted here, on the CPU, deterministically: a
random-weight Llama with the embedded model's 30 layers and GQA grouping but narrow (so the count is not
drowned in compute time), the engine's default config, random token ids (about 38 events a chunk, as on the
H200), 16 chunks read first, then 8 counted. Every operation that reaches PyTorch's dispatcher is counted
(`TorchDispatchMode`), views included; for this checkout also by engine phase.

    python benchmarks/host_ops.py [--baseline c01d3c8] [--name host_ops]

The baseline runs in a child process from a temporary git worktree of that commit.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from _common import RESULTS, WordIds, write_results

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=30, num_attention_heads=3, num_key_value_heads=1,
             head_dim=32, vocab_size=512, max_position_embeddings=8192)
WARM_CHUNKS, COUNTED_CHUNKS = 16, 8


def count(phases: bool) -> dict[str, Any]:
    """Ingest WARM_CHUNKS chunks, then count the operations of COUNTED_CHUNKS more (in the engramkv imported)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    import engramkv
    from engramkv import EngineConfig, EpisodicLM

    counts: collections.Counter[str] = collections.Counter()
    current = ["other"]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - PyTorch's signature
            counts[current[-1]] += 1
            return func(*args, **(kwargs or {}))

    def labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            current.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                current.pop()
        return wrapped

    if phases:  # this checkout's names; a baseline is counted as a whole
        from engramkv.engine import sealing, state

        sealing.Stream.seal = labelled("sealing", sealing.Stream.seal)
        state.EpisodicState._recalled = labelled("recall (search, gather)", state.EpisodicState._recalled)
        state.window_attention = labelled("window attention", state.window_attention)
        state.EpisodicState.attend = labelled("attend: assembly, RoPE table, append", state.EpisodicState.attend)

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    config = EngineConfig()
    session = EpisodicLM(model, WordIds(SHAPE["vocab_size"]), "random-30-layers", config).session()
    gen = torch.Generator().manual_seed(2)
    chunk = config.window.chunk_size
    session.ingest_ids(torch.randint(0, SHAPE["vocab_size"], (WARM_CHUNKS * chunk,), generator=gen).tolist())
    events_before = session.events
    ids = torch.randint(0, SHAPE["vocab_size"], (COUNTED_CHUNKS * chunk,), generator=gen).tolist()
    with Counting():
        session.ingest_ids(ids)
    return {"engramkv": engramkv.__file__, "ops_per_chunk": sum(counts.values()) / COUNTED_CHUNKS,
            "events_per_chunk": (session.events - events_before) / COUNTED_CHUNKS,
            "by_phase": {k: v / COUNTED_CHUNKS for k, v in counts.most_common()} if phases else None}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="c01d3c8", help="the commit to compare against (git revision)")
    parser.add_argument("--name", default="host_ops", help="results/throughput/NAME.{json,md}")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(count(phases=False)))
        return

    baseline = git("rev-parse", args.baseline)
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "baseline"
        git("worktree", "add", "--detach", str(tree), baseline)
        try:
            done = subprocess.run([sys.executable, __file__, "--child"], cwd=tree, check=True, capture_output=True,
                                  text=True, env={**os.environ, "PYTHONPATH": str(tree)})
        finally:
            git("worktree", "remove", "--force", str(tree))
    old = json.loads(done.stdout.strip().splitlines()[-1])
    if not old["engramkv"].startswith(str(tree)):
        raise SystemExit(f"the baseline child imported {old['engramkv']}, not {tree}")
    this = count(phases=True)

    from engramkv import EngineConfig

    lines = [f"# Operations dispatched per ingested chunk, against {baseline[:7]}", "",
             f"A random Llama with 30 layers (GQA 3/1, head dim 32), default config, random ids; {COUNTED_CHUNKS} "
             f"chunks counted after {WARM_CHUNKS}.", "",
             "| side | ops per chunk | events per chunk |", "|---|---|---|",
             f"| baseline {baseline[:7]} | {old['ops_per_chunk']:,.0f} | {old['events_per_chunk']:.1f} |",
             f"| this checkout | {this['ops_per_chunk']:,.0f} | {this['events_per_chunk']:.1f} |", "",
             f"**This / baseline: {this['ops_per_chunk'] / old['ops_per_chunk']:.2f}** of the operations.", "",
             "This checkout by phase (operations per chunk):", "", "| phase | ops |", "|---|---|",
             *(f"| {phase} | {n:,.0f} |" for phase, n in this["by_phase"].items()), ""]
    table = "\n".join(lines)
    payload = {"baseline": baseline, "shape": SHAPE, "baseline_run": old, "this_run": this,
               "ratio": this["ops_per_chunk"] / old["ops_per_chunk"]}
    print(table)
    print("wrote", *write_results(RESULTS / "throughput", args.name, payload, table, EngineConfig()))


if __name__ == "__main__":
    main()
