"""Write a passkey document (InfiniteBench format, the passkey task's generator) to a file, for the CLI.

    python benchmarks/passkey_file.py /tmp/pk1m/passkey.txt --tokens 1048576 --depth 0.5
    engramkv ingest /tmp/pk1m/passkey.txt --store /tmp/pk1m/store      # resumable: Ctrl-C, run again
    engramkv ask 'What is the pass key?' --store /tmp/pk1m/store --show-recall
    python benchmarks/passkey_file.py --ask /tmp/pk1m/store              # passkey.py's own prompt

`engramkv ask` is a chat turn; `--ask STORE` continues the benchmark's prompt ("... What is the pass
key? The pass key is") as passkey.py does, from the store opened read-only. The key is printed (and
nowhere else but in the text), so the answer can be checked by eye or script. The text comes from
`engramkv.tasks.passkey`, the generator of passkey.py and evaluate.py, with the key at --depth.
`--tokens` counts tokens of the embedded model's tokenizer, like passkey.py's lengths.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engramkv import EpisodicLM
from engramkv.config import EngineConfig, ModelConfig
from engramkv.hf import load_pretrained
from engramkv.tasks import PASSKEY_PROMPT, PASSKEY_QUESTION, passkey


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, nargs="?", help="file to write")
    parser.add_argument("--ask", type=Path, metavar="STORE", help="instead: answer from a store that ingested the file")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="with --ask (the key comes first)")
    parser.add_argument("--tokens", type=int, default=1_048_576, help="length of text + question in tokens")
    parser.add_argument("--depth", type=float, default=0.5, help="where the key sits, 0 (start) to 1 (end)")
    parser.add_argument("--seed", type=int, default=0, help="chooses the key")
    args = parser.parse_args()
    if args.ask is not None:
        return ask(args.ask, args.max_new_tokens)
    if args.path is None:
        parser.error("give the file to write, or --ask STORE")
    _, tokenizer, _ = load_pretrained(ModelConfig())
    sample = passkey(tokenizer, args.tokens, args.seed, depth=args.depth)
    context, key = sample.context[0], sample.answers[0]
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(context, encoding="utf-8")
    print(f"wrote {args.path} ({len(context):,} characters); the pass key is {key}")


def ask(store: Path, max_new_tokens: int) -> None:
    config = EngineConfig()
    model, tokenizer, model_id = load_pretrained(config.model)
    lm = EpisodicLM(model, tokenizer, model_id, config)
    # With every layer recalling by its own queries (as passkey.py asked before it became a preset of
    # evaluate.py), then as evaluate.py and passkey.py ask (the question's keys matched against the
    # events, which also names the events attended to). A fresh read-only
    # session each time: the first answer would otherwise sit in the second one's window.
    for matching in (None, PASSKEY_QUESTION):
        with lm.session(store=store, read_only=True) as session:
            stored = session.tokens_ingested
            answer = session.generate(PASSKEY_PROMPT, max_new_tokens=max_new_tokens, question=matching)
            how = "per-layer recall" if matching is None else f"matching {matching!r}"
            print(f"{stored:,} tokens in {store}; answer ({how}): {answer!r}")
            for event in session.last_recalled[:5]:
                print(f"  [{event.score:+.2f}] event {event.event_id} (tokens {event.token_start}-{event.token_end}): "
                      f"{event.text[:80]!r}")
    lm.close()


if __name__ == "__main__":
    main()
