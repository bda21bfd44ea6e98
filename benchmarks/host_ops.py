"""Host-side work per ingested chunk: operations dispatched and host time, this checkout against an earlier commit's.

On a GPU the engine waits on Python (issue 19: on the H200, 590 ms of host time against 71 ms of GPU time for
four chunks), and each operation on a CUDA tensor is at least one launch or one host step. How many operations a
chunk dispatches does not depend on the machine, so it can be counted here, on the CPU, deterministically: a
random-weight Llama with the embedded model's 30 layers and GQA grouping but narrow (so the count is not
drowned in compute time), the engine's default config, random token ids (about 38 events a chunk, as on the
H200), 16 chunks read first, then 8 counted. Every operation that reaches PyTorch's dispatcher is counted
(`TorchDispatchMode`), views included, by engine phase.

Python that dispatches nothing (recall's selection loops) costs host time all the same, so 8 more chunks are
timed by phase. Window attention is left out of the compared time: here it is the PyTorch twin's compute,
on a GPU one Triton launch. Both sides run `--repeats` times, alternating, each in a child process; the
medians are compared.

    python benchmarks/host_ops.py [--baseline c01d3c8] [--repeats 3] [--name host_ops]

The baseline runs from a temporary git worktree of that commit.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from _common import RESULTS, WordIds, write_results

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=30, num_attention_heads=3, num_key_value_heads=1,
             head_dim=32, vocab_size=512, max_position_embeddings=8192)
WARM_CHUNKS, COUNTED_CHUNKS, TIMED_CHUNKS = 16, 8, 8
WINDOW = "window attention"
# (module, owner, attribute, phase): what is labelled, where the checkout has it (older commits may not)
PHASES = [("engramkv.engine.sealing", "Stream", "seal", "sealing"),
          ("engramkv.engine.state", "EpisodicState", "_recalled", "recall (search, gather)"),  # before 2c9ae70
          ("engramkv.engine.memory_section", "MemorySection", "recall", "recall (search, gather)"),
          ("engramkv.engine.state", None, "window_attention", WINDOW),
          ("engramkv.engine.state", "EpisodicState", "attend", "attend: assembly, RoPE table, append")]


def count() -> dict[str, Any]:
    """Ingest WARM_CHUNKS chunks, count the operations of COUNTED_CHUNKS more, then time TIMED_CHUNKS more (in
    the engramkv imported), each by phase. Time is exclusive: a phase's time leaves out the phases it calls."""
    import importlib

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    import engramkv
    from engramkv import EngineConfig, EpisodicLM

    torch.set_num_threads(1)
    counts: collections.Counter[str] = collections.Counter()
    seconds: collections.Counter[str] = collections.Counter()
    current = ["other"]
    inner = [0.0]  # time spent in labelled phases called from the current one

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - PyTorch's signature
            counts[current[-1]] += 1
            return func(*args, **(kwargs or {}))

    def labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            current.append(name)
            inner.append(0.0)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                seconds[name] += spent - inner.pop()
                inner[-1] += spent
                current.pop()
        return wrapped

    labelled_phases = []
    for module_name, owner_name, attribute, phase in PHASES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:  # a module of later commits
            continue
        owner = getattr(module, owner_name) if owner_name else module
        if hasattr(owner, attribute):
            setattr(owner, attribute, labelled(phase, getattr(owner, attribute)))
            labelled_phases.append(phase)

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
    events = (session.events - events_before) / COUNTED_CHUNKS
    seconds.clear()
    inner[:] = [0.0]
    ids = torch.randint(0, SHAPE["vocab_size"], (TIMED_CHUNKS * chunk,), generator=gen).tolist()
    started = time.perf_counter()
    session.ingest_ids(ids)
    total = time.perf_counter() - started
    seconds["other"] = total - inner[0]
    return {"engramkv": engramkv.__file__, "ops_per_chunk": sum(counts.values()) / COUNTED_CHUNKS,
            "events_per_chunk": events, "phases": labelled_phases,
            "ops_by_phase": {k: v / COUNTED_CHUNKS for k, v in counts.most_common()},
            "ms_per_chunk": 1000 * total / TIMED_CHUNKS,
            "ms_by_phase": {k: 1000 * v / TIMED_CHUNKS for k, v in seconds.most_common()}}


def host_ms(run: dict[str, Any]) -> float:
    """Host time per chunk outside window attention (the twin's compute here, one launch on a GPU)."""
    return run["ms_per_chunk"] - run["ms_by_phase"].get(WINDOW, 0.0)


def child(tree: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--child"], cwd=tree, check=True, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    run = json.loads(done.stdout.strip().splitlines()[-1])
    if not run["engramkv"].startswith(str(tree)):
        raise SystemExit(f"the child imported {run['engramkv']}, not {tree}")
    return run


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="c01d3c8", help="the commit to compare against (git revision)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating (medians compared)")
    parser.add_argument("--name", default="host_ops", help="results/throughput/NAME.{json,md}")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(count()))
        return

    baseline = git("rev-parse", args.baseline)
    old_runs: list[dict[str, Any]] = []
    new_runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "baseline"
        git("worktree", "add", "--detach", str(tree), baseline)
        try:
            for _ in range(args.repeats):
                old_runs.append(child(tree))
                new_runs.append(child(ROOT))
        finally:
            git("worktree", "remove", "--force", str(tree))
    old, this = old_runs[0], new_runs[0]  # operation counts are the same in every run
    old_ms = statistics.median(host_ms(r) for r in old_runs)
    this_ms = statistics.median(host_ms(r) for r in new_runs)
    phases = list(this["ops_by_phase"])
    median_ms = {p: statistics.median(r["ms_by_phase"].get(p, 0.0) for r in new_runs) for p in phases}
    old_median_ms = {p: statistics.median(r["ms_by_phase"].get(p, 0.0) for r in old_runs) for p in phases}

    from engramkv import EngineConfig

    lines = [f"# Host work per ingested chunk, against {baseline[:7]}", "",
             f"A random Llama with 30 layers (GQA 3/1, head dim 32), default config, random ids; {COUNTED_CHUNKS} "
             f"chunks counted and {TIMED_CHUNKS} timed after {WARM_CHUNKS}; {args.repeats} runs of each side, "
             "alternating, one thread, medians.", "",
             "| side | ops per chunk | host ms per chunk outside window attention | events per chunk |",
             "|---|---|---|---|",
             f"| baseline {baseline[:7]} | {old['ops_per_chunk']:,.0f} | {old_ms:.1f} | "
             f"{old['events_per_chunk']:.1f} |",
             f"| this checkout | {this['ops_per_chunk']:,.0f} | {this_ms:.1f} | {this['events_per_chunk']:.1f} |", "",
             f"**This / baseline: {this['ops_per_chunk'] / old['ops_per_chunk']:.2f}** of the operations, "
             f"**{this_ms / old_ms:.2f}** of the host time outside window attention "
             f"(runs: {', '.join(f'{host_ms(r):.1f}' for r in old_runs)} ms against "
             f"{', '.join(f'{host_ms(r):.1f}' for r in new_runs)}).", "",
             "By phase (operations and host ms per chunk; time exclusive of the phases a phase calls; window "
             "attention's time is the twin's compute):", "",
             "| phase | baseline ops | ops | baseline ms | ms |", "|---|---|---|---|---|",
             *(f"| {p} | {old['ops_by_phase'].get(p, 0):,.0f} | {this['ops_by_phase'][p]:,.0f} | "
               f"{old_median_ms[p]:.1f} | {median_ms[p]:.1f} |" for p in phases), ""]
    table = "\n".join(lines)
    payload = {"baseline": baseline, "shape": SHAPE, "repeats": args.repeats, "baseline_runs": old_runs,
               "this_runs": new_runs, "ops_ratio": this["ops_per_chunk"] / old["ops_per_chunk"],
               "host_ms_ratio": this_ms / old_ms}
    print(table)
    print("wrote", *write_results(RESULTS / "throughput", args.name, payload, table, EngineConfig()))


if __name__ == "__main__":
    main()
