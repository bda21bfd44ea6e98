"""Ingest throughput of the full engine as a ratio to the bare model's chunked forward, same text, same run.

Baseline: plain transformers, the same 512-token chunks, its own KV cache (DynamicCache), logits for
every token, over the same tokens. The default length is 8192, the longest context the bare model
reads in distribution; past it the bare model's cost keeps growing with length while ours stays flat,
so longer lengths only flatter the ratio. Runs alternate (bare, engine, bare, engine, ...) and the
median of each is compared, so the machine's noise hits both sides alike.

Writes benchmarks/results/throughput/{name}.json and .md.

    python benchmarks/throughput.py [--tokens 8192] [--repeats 2] [--name throughput]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache

from _common import RESULTS, natural_text, write_results
from engramkv import EngineConfig, EpisodicLM
from engramkv.hf import load_pretrained


def bare_forward(model: torch.nn.Module, ids: list[int], chunk: int) -> float:
    cache = DynamicCache(config=model.config)
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(ids), chunk):
            out = model(input_ids=torch.tensor([ids[i : i + chunk]]), past_key_values=cache, use_cache=True)
            out.logits.float().logsumexp(-1)  # the bare model also normalises its logits once
    return time.perf_counter() - started


def engine_forward(lm: EpisodicLM, ids: list[int]) -> tuple[float, int]:
    session = lm.session()
    started = time.perf_counter()
    session.ingest_ids(ids)
    return time.perf_counter() - started, session.events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="throughput")
    args = parser.parse_args()

    config = EngineConfig()
    model, tokenizer, model_id = load_pretrained(config.model)
    plain = copy.deepcopy(model)
    lm = EpisodicLM(model, tokenizer, model_id, config)
    ids = tokenizer.encode(natural_text(args.tokens * 6), add_special_tokens=False)[: args.tokens]
    assert len(ids) == args.tokens, "not enough text"

    bare_s, engine_s, events = [], [], 0
    for _ in range(args.repeats):
        bare_s.append(bare_forward(plain, ids, config.window.chunk_size))
        seconds, events = engine_forward(lm, ids)
        engine_s.append(seconds)
        print(f"bare {bare_s[-1]:.1f} s, engine {engine_s[-1]:.1f} s", flush=True)
    bare_tps, engine_tps = args.tokens / statistics.median(bare_s), args.tokens / statistics.median(engine_s)
    ratio = engine_tps / bare_tps
    table = "\n".join([
        f"# Ingest throughput ({model_id}, {args.tokens} tokens, chunks of {config.window.chunk_size})",
        "",
        "| run | tokens/s |",
        "|---|---|",
        f"| bare transformers chunked forward (DynamicCache) | {bare_tps:.0f} |",
        f"| engramkv ingest (segmentation, refinement, sealing, recall) | {engine_tps:.0f} |",
        f"| **ratio engine / bare** | **{ratio:.2f}** |",
        "",
        f"{events} events formed; medians of {args.repeats} alternating runs.",
        "",
    ])
    payload = {"model": model_id, "tokens": args.tokens, "bare_seconds": bare_s, "engine_seconds": engine_s,
               "bare_tokens_per_s": bare_tps, "engine_tokens_per_s": engine_tps, "ratio": ratio,
               "events": events}
    print(table)
    print("wrote", *write_results(RESULTS / "throughput", args.name, payload, table, config))


if __name__ == "__main__":
    main()
