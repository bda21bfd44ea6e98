"""Ingest speed of this checkout against an earlier commit's, same machine, same run.

Both engines ingest the same token ids (the text of `throughput.py`) in child processes that take turns
(baseline, this, this, baseline, ...), each child also timing the bare transformers chunked forward over
the same ids in the same process. The figure is the ratio of the two engines' medians, and beside it the
ratio of their engine/bare ratios (which the bare forward normalises for the machine's load at the time).
Issue 19 uses it on the CPU: the engine attends through `engramkv.kernels` (the PyTorch twins there)
against the commit before the kernels existed.

The baseline is checked out in a temporary git worktree, removed afterwards; each child imports engramkv
from its tree (PYTHONPATH), which the JSON records per run.

    python benchmarks/ingest_vs_commit.py [--baseline ba6353d~1] [--tokens 8192] [--rounds 3] [--name kernels_cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import RESULTS, natural_text, write_results

ROOT = Path(__file__).resolve().parent.parent


def child(ids_path: Path) -> None:
    """Run in a child process: time one bare forward and one engine ingest (`throughput.py`'s); print one JSON line."""
    import engramkv
    from engramkv import EngineConfig, EpisodicLM
    from engramkv.hf import load_pretrained
    from throughput import bare_forward, engine_forward

    ids = json.loads(ids_path.read_text())
    config = EngineConfig()
    model, tokenizer, model_id = load_pretrained(config.model)
    bare_s = bare_forward(model, ids, config.window.chunk_size)
    engine_s, events = engine_forward(EpisodicLM(model, tokenizer, model_id, config), ids)
    print(json.dumps({"engramkv": engramkv.__file__, "bare_s": bare_s, "engine_s": engine_s, "events": events}))


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def run_child(tree: Path, ids_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, __file__, "--child", str(ids_path)], cwd=tree, env=env,
                          check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["engramkv"].startswith(str(tree)):
        raise SystemExit(f"the child imported {result['engramkv']}, not the tree {tree}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="ba6353d~1", help="the commit to compare against (git revision)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens ingested per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, taking turns")
    parser.add_argument("--name", default="kernels_cpu", help="results/throughput/NAME.{json,md}")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)

    from engramkv import EngineConfig
    from engramkv.hf import load_pretrained

    config = EngineConfig()
    _, tokenizer, _ = load_pretrained(config.model)  # the children load their own model
    ids = tokenizer.encode(natural_text(args.tokens * 6), add_special_tokens=False)[: args.tokens]
    assert len(ids) == args.tokens, "not enough text"
    baseline = git("rev-parse", args.baseline)
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory() as scratch:
        old_tree, ids_path = Path(scratch) / "baseline", Path(scratch) / "ids.json"
        ids_path.write_text(json.dumps(ids))
        git("worktree", "add", "--detach", str(old_tree), baseline)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still removes the worktree (finally)
        try:
            for round_ in range(args.rounds):
                order = ["baseline", "this"] if round_ % 2 == 0 else ["this", "baseline"]
                for side in order:
                    result = run_child(old_tree if side == "baseline" else ROOT, ids_path)
                    runs[side].append(result)
                    print(f"round {round_ + 1} {side}: bare {result['bare_s']:.1f} s, "
                          f"engine {result['engine_s']:.1f} s, {result['events']} events", flush=True)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second kill must not stop the removal
            git("worktree", "remove", "--force", str(old_tree))

    def median(side: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[side])

    speed = median("baseline", "engine_s") / median("this", "engine_s")
    normalised = ((median("baseline", "engine_s") / median("baseline", "bare_s"))
                  / (median("this", "engine_s") / median("this", "bare_s")))
    table = "\n".join([
        f"# Ingest speed against {baseline[:7]} ({args.tokens} tokens, {args.rounds} runs each, taking turns)",
        "",
        "| side | engine s (median) | bare s (median) | engine / bare tokens/s | events |",
        "|---|---|---|---|---|",
        *(f"| {label} | {median(side, 'engine_s'):.1f} | {median(side, 'bare_s'):.1f} | "
          f"{median(side, 'bare_s') / median(side, 'engine_s'):.2f} | {runs[side][0]['events']} |"
          for side, label in (("baseline", f"baseline {baseline[:7]}"), ("this", "this checkout"))),
        "",
        f"**Engine speed, this / baseline: {speed:.2f}** (medians); normalised by each run's bare forward: "
        f"{normalised:.2f}.",
        "",
    ])
    payload = {"baseline": baseline, "tokens": args.tokens, "rounds": args.rounds, "runs": runs,
               "speed_ratio": speed, "normalised_ratio": normalised,
               "threads": os.environ.get("OMP_NUM_THREADS")}
    print(table)
    print("wrote", *write_results(RESULTS / "throughput", args.name, payload, table, config))


if __name__ == "__main__":
    main()
