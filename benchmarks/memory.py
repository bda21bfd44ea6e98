"""Peak RSS of an ingest as the stream grows: a short and a long ingest, each in its own process.

The claim checked: peak RSS(long) <= 1.5 x peak RSS(short) + the event KV the long ingest keeps
(event memory is in RAM by design here; the tiered store moves it to disk). Both use the default
model and the default config.

Writes benchmarks/results/memory/{name}.json and .md.

    python benchmarks/memory.py [--short 4096] [--long 65536] [--name memory]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import RESULTS, natural_text, peak_rss_mb, write_results


def child(tokens: int) -> None:
    from engramkv import EpisodicLM

    lm = EpisodicLM.from_pretrained()
    ids = lm.tokenizer.encode(natural_text(tokens * 6), add_special_tokens=False)[:tokens]
    loaded_rss = peak_rss_mb()
    session = lm.session()
    started = time.perf_counter()
    session.ingest_ids(ids)
    print(json.dumps({
        "tokens": len(ids), "peak_rss_mb": peak_rss_mb(), "rss_after_load_mb": loaded_rss,
        "event_kv_mb": session.memory.kv_bytes / 2**20, "events": session.events,
        "seconds": time.perf_counter() - started,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=4096)
    parser.add_argument("--long", type=int, default=65536)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--name", default="memory")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    runs = {}
    for tokens in (args.short, args.long):
        out = subprocess.run([sys.executable, __file__, "--child", str(tokens)], capture_output=True, text=True,
                             check=True)
        runs[tokens] = json.loads(out.stdout.strip().splitlines()[-1])
        print(runs[tokens], flush=True)
    short, long = runs[args.short], runs[args.long]
    overhead = (long["peak_rss_mb"] - long["event_kv_mb"]) / short["peak_rss_mb"]
    table = "\n".join([
        "# Peak RSS of an ingest (default model, default config)",
        "",
        "| tokens | peak RSS MB | event KV MB | events | ingest s |",
        "|---|---|---|---|---|",
        *(f"| {r['tokens']} | {r['peak_rss_mb']:.0f} | {r['event_kv_mb']:.0f} | {r['events']} | {r['seconds']:.0f} |"
          for r in (short, long)),
        "",
        f"(peak RSS long - event KV long) / peak RSS short = **{overhead:.2f}** (target <= 1.5)",
        "",
    ])
    print(table)
    from engramkv import EngineConfig

    payload = {"runs": runs, "overhead_ratio": overhead}
    print("wrote", *write_results(RESULTS / "memory", args.name, payload, table, EngineConfig()))


if __name__ == "__main__":
    main()
