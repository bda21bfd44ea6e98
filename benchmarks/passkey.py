"""Passkey retrieval past the trained window (InfiniteBench format) on the default model.

For every length and depth, each system reads the context and is asked the question; a
sample is correct when the 5-digit key appears in the first generated tokens. Systems:

  engram          surprise events + refinement, contiguous positions (the default)
  engram-fixed    same, memory at one fixed distance (InfLLM/EM-LLM position scheme)
  engram-uniform  fixed 128-token blocks, no surprise (the InfLLM-style baseline)
  engram-store-int8 / -int4 / -int2 / -fp16
                  the default engine with its events in a persistent store on disk (a temporary
                  directory), cold tier in that codec: the effect of the store and its compression
  full            plain transformers full attention over the whole prompt (run only up to --full-max tokens)

Writes benchmarks/results/passkey.json and passkey.md (or --name).

    python benchmarks/passkey.py --lengths 4096 16384 32768 65536 --depths 0.1 0.3 0.5 0.7 0.9
"""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
import time
from typing import Any

import torch

from _common import machine, passkey_sample, peak_rss_mb, write_results
from engramkv import EngineConfig, EpisodicLM
from engramkv.config import SegmentationConfig, StoreConfig
from engramkv.hf import load_pretrained

SYSTEMS = ("engram", "engram-fixed", "engram-uniform", "engram-store-int8", "engram-store-int4", "engram-store-int2", "engram-store-fp16",
           "full")


def system_config(base: EngineConfig, system: str) -> EngineConfig:
    if system == "engram-fixed":
        return base.model_copy(update={"recall": base.recall.model_copy(update={"positions": "fixed"})})
    if system == "engram-uniform":
        seg = SegmentationConfig(mode="uniform", uniform_size=base.segmentation.max_event)
        return base.model_copy(update={"segmentation": seg})
    if system.startswith("engram-store-"):
        return base.model_copy(update={"store": StoreConfig(codec=system.removeprefix("engram-store-"))})
    return base


def run_full(model: Any, tokenizer: Any, context: str, question: str, max_new: int) -> tuple[str, float]:
    ids = tokenizer.encode(context + question, add_special_tokens=False)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--full-max", type=int, default=16384, help="longest context given to full attention")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="passkey", help="results file stem under benchmarks/results/")
    args = parser.parse_args()

    base = EngineConfig()
    model, tokenizer, model_id = load_pretrained(base.model)
    plain = copy.deepcopy(model) if "full" in args.systems else None
    lm = EpisodicLM(model, tokenizer, model_id, base)

    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for length in args.lengths:
        # Systems take turns on each sample, so a run cut short still compares them on the same samples.
        for i, depth in enumerate(args.depths):
            context, question, key = passkey_sample(tokenizer, length, depth, seed=args.seed + 1000 * i + length)
            for system in args.systems:
                if system == "full" and length > args.full_max:
                    continue
                if system == "full":
                    answer, seconds = run_full(plain, tokenizer, context, question, args.max_new_tokens)
                else:
                    store = tempfile.mkdtemp(prefix="engramkv-passkey-") if system.startswith("engram-store") else None
                    session = lm.session(system_config(base, system), store=store)
                    t0 = time.perf_counter()
                    session.ingest(context)
                    answer = session.generate(question, max_new_tokens=args.max_new_tokens)
                    seconds = time.perf_counter() - t0
                    session.close()
                    if store is not None:
                        lm.close()
                        shutil.rmtree(store)
                row = {
                    "system": system, "length": length, "depth": depth, "key": key, "answer": answer,
                    "correct": key in answer, "seconds": round(seconds, 1),
                }
                rows.append(row)
                print(row, flush=True)
                report(rows, args, model_id, base, started)  # rewritten after every sample: a long run can be cut


def report(rows: list[dict[str, Any]], args: argparse.Namespace, model_id: str, base: EngineConfig,
           started: float) -> None:
    outcomes: dict[str, dict[int, list[bool]]] = {}
    for row in rows:
        outcomes.setdefault(row["system"], {}).setdefault(row["length"], []).append(row["correct"])
    accuracy = {s: {n: sum(v) / len(v) for n, v in by_len.items()} for s, by_len in outcomes.items()}
    lines = [
        f"# Passkey retrieval ({model_id}, {len(args.depths)} depths per cell)",
        "",
        "| system | " + " | ".join(f"{n // 1024}k" for n in args.lengths) + " |",
        "|---|" + "---|" * len(args.lengths),
    ]
    for system, by_len in outcomes.items():
        cells = [f"{sum(by_len[n]) / len(by_len[n]):.0%} ({sum(by_len[n])}/{len(by_len[n])})" if n in by_len else "n/a"
                 for n in args.lengths]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    lines += ["", f"{len(rows)} samples; run time {time.perf_counter() - started:.0f} s; "
              f"peak RSS {peak_rss_mb():.0f} MB.", ""]
    payload = {
        "model": model_id, "config": base.model_dump(), "args": vars(args), "machine": machine(),
        "accuracy": accuracy, "rows": rows, "seconds": time.perf_counter() - started,
    }
    write_results(args.name, payload, "\n".join(lines))


if __name__ == "__main__":
    main()
