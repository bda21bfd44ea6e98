"""Quick start: the embedded model reads a document longer than its trained window and answers from memory.

A 12k-token document (SmolLM2-135M was trained on 8k) with a pass key hidden in it is ingested
chunk by chunk; the model is then asked for the key and shows the events it recalled.

    python examples/quickstart.py [--tokens 12000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from tqdm import tqdm

from engramkv import EpisodicLM, IngestProgress

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from _common import passkey_sample  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=12_000, help="document length in tokens")
    parser.add_argument("--depth", type=float, default=None, help="where the key sits (0..1); random by default")
    args = parser.parse_args()

    print("loading the embedded SmolLM2-135M-Instruct ...", flush=True)
    started = time.perf_counter()
    lm = EpisodicLM.from_pretrained()
    print(f"loaded in {time.perf_counter() - started:.0f} s")

    depth = args.depth if args.depth is not None else random.uniform(0.1, 0.9)
    context, question, key = passkey_sample(lm.tokenizer, args.tokens, depth, seed=random.randrange(10**6))
    session = lm.session()
    total = len(lm.tokenizer.encode(context, add_special_tokens=False))
    with tqdm(total=total, unit="tok", desc="ingest") as bar:
        def progress(record: IngestProgress) -> None:
            bar.update(record.tokens - bar.n)
            bar.set_postfix(events=record.events)

        report = session.ingest(context, progress=progress)
    print(f"ingested {report.tokens} tokens into {session.events} events at {report.tokens_per_second:.0f} tokens/s")

    answer = session.generate(question, max_new_tokens=8)
    print(f"\nhidden key: {key} (at {depth:.0%} depth)")
    print(f"question:  {question.strip()}")
    print(f"answer:   {answer}")
    print("correct" if key in answer else "wrong")
    print("\nevents recalled for 'What is the pass key?':")
    for event in session.recall("What is the pass key?", k=3):
        print(f"  #{event.event_id} tokens {event.token_start}-{event.token_end} score {event.score:.2f}: {event.text!r}")


if __name__ == "__main__":
    main()
