"""Write a passkey document (InfiniteBench format, the same text as passkey.py) to a file, for the CLI.

    python benchmarks/passkey_file.py /tmp/pk1m/passkey.txt --tokens 1048576 --depth 0.5
    engramkv ingest /tmp/pk1m/passkey.txt --store /tmp/pk1m/store      # resumable: Ctrl-C, run again
    engramkv ask 'What is the pass key?' --store /tmp/pk1m/store --show-recall
    python benchmarks/passkey_file.py --ask /tmp/pk1m/store              # passkey.py's own prompt

`engramkv ask` is a chat turn; `--ask STORE` continues the benchmark's prompt ("... What is the pass
key? The pass key is") as passkey.py does, from the store opened read-only. The key is printed (and
nowhere else but in the text), so the answer can be checked by eye or script.
`--tokens` counts tokens of the embedded model's tokenizer, like passkey.py's lengths.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import PASSKEY_QUESTION, passkey_sample
from engramkv import EpisodicLM
from engramkv.config import EngineConfig, ModelConfig
from engramkv.hf import load_pretrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, nargs="?", help="file to write")
    parser.add_argument("--ask", type=Path, metavar="STORE", help="instead: answer from a store that ingested the file")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="with --ask (passkey.py's default)")
    parser.add_argument("--tokens", type=int, default=1_048_576, help="length of text + question in tokens")
    parser.add_argument("--depth", type=float, default=0.5, help="where the key sits, 0 (start) to 1 (end)")
    parser.add_argument("--seed", type=int, default=0, help="chooses the key")
    args = parser.parse_args()
    if args.ask is not None:
        return ask(args.ask, args.max_new_tokens)
    if args.path is None:
        parser.error("give the file to write, or --ask STORE")
    _, tokenizer, _ = load_pretrained(ModelConfig())
    context, _question, key = passkey_sample(tokenizer, args.tokens, args.depth, args.seed)
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(context, encoding="utf-8")
    print(f"wrote {args.path} ({len(context):,} characters); the pass key is {key}")


def ask(store: Path, max_new_tokens: int) -> None:
    config = EngineConfig()
    model, tokenizer, model_id = load_pretrained(config.model)
    lm = EpisodicLM(model, tokenizer, model_id, config)
    # As passkey.py asks (every layer recalls by its own queries), then as evaluate.py asks (the question's
    # keys matched against the events, which also names the events attended to). A fresh read-only
    # session each time: the first answer would otherwise sit in the second one's window.
    question = PASSKEY_QUESTION.split("?")[0].strip() + "?"
    for matching in (None, question):
        with lm.session(store=store, read_only=True) as session:
            stored = session.tokens_ingested
            answer = session.generate(PASSKEY_QUESTION, max_new_tokens=max_new_tokens, question=matching)
            how = "per-layer recall" if matching is None else f"matching {matching!r}"
            print(f"{stored:,} tokens in {store}; answer ({how}): {answer!r}")
            for event in session.last_recalled[:5]:
                print(f"  [{event.score:+.2f}] event {event.event_id} (tokens {event.token_start}-{event.token_end}): "
                      f"{event.text[:80]!r}")
    lm.close()


if __name__ == "__main__":
    main()
