"""Question-time recall variants on passkey samples: ingest once, then ask under several recall settings.

Ingest is the expensive part (about 270 s for 64k tokens here), and the recall settings used while
reading the question and answering can be swapped afterwards on a copy of the ingested state. This
finds which settings rescue a sample that the default misses; a default still has to be confirmed
with `passkey.py`, since it also changes nothing about ingest.

    python benchmarks/recall_variants.py --length 65536 --depths 0.5 0.7 0.9
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

from _common import passkey_sample, write_results
from engramkv import EngineConfig, EpisodicLM

VARIANTS: dict[str, dict[str, Any]] = {
    "answer budget 1024 (reading budget)": {"answer_budget_tokens": None},
    "answer budget 768": {"answer_budget_tokens": 768},
    "answer budget 512": {"answer_budget_tokens": 512},
    "answer budget 1024, contiguity 0.7": {"answer_budget_tokens": None, "contiguity_fraction": 0.7},
    "answer budget 1024, fixed positions": {"answer_budget_tokens": None, "positions": "fixed"},
    "answer budget 512, fixed positions": {"answer_budget_tokens": 512, "positions": "fixed"},
}
DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]  # passkey.py's default depths: sample i uses seed 1000 * i + length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    parser.add_argument("--name", default="recall_variants")
    args = parser.parse_args()

    base = EngineConfig()
    lm = EpisodicLM.from_pretrained()
    rows: list[dict[str, Any]] = []
    for depth in args.depths:
        seed = 1000 * DEPTHS.index(depth) + args.length if depth in DEPTHS else int(depth * 1000) + args.length
        context, question, key = passkey_sample(lm.tokenizer, args.length, depth, seed=seed)
        session = lm.session(base)
        started = time.perf_counter()
        session.ingest(context)
        print(f"depth {depth}: ingested in {time.perf_counter() - started:.0f} s, {session.events} events", flush=True)
        keep = {id(lm.model): lm.model, id(lm.rope): lm.rope}
        ingested = copy.deepcopy(session.state, memo=keep)
        for name, update in VARIANTS.items():
            cfg = base.model_copy(update={"recall": base.recall.model_copy(update=update)})
            state = copy.deepcopy(ingested, memo=dict(keep))
            state.cfg = cfg
            session.state, session.memory, session.cfg = state, state.memory, cfg
            answer = session.generate(question, max_new_tokens=8)
            rows.append({"depth": depth, "variant": name, "answer": answer, "correct": key in answer})
            print(f"  {name}: {answer!r} {'correct' if key in answer else 'wrong'}", flush=True)
        report(rows, args)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    depths = sorted({r["depth"] for r in rows})
    lines = [f"# Question-time recall variants, passkey at {args.length} tokens (ingest with the defaults)", "",
             "| variant | " + " | ".join(f"depth {d}" for d in depths) + " |", "|---|" + "---|" * len(depths)]
    for name in VARIANTS:
        cells = []
        for d in depths:
            hit = [r for r in rows if r["variant"] == name and r["depth"] == d]
            cells.append(("yes" if hit[0]["correct"] else f"no ({hit[0]['answer'].strip()!r})") if hit else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    write_results(args.name, {"args": vars(args), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
