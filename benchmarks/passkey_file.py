"""Write a passkey document (InfiniteBench format, the same text as passkey.py) to a file, for the CLI.

    python benchmarks/passkey_file.py /tmp/pk1m/passkey.txt --tokens 1048576 --depth 0.5
    engramkv ingest /tmp/pk1m/passkey.txt --store /tmp/pk1m/store      # resumable: Ctrl-C, run again
    engramkv ask 'What is the pass key?' --store /tmp/pk1m/store --show-recall

The key is printed (and nowhere else but in the text), so the answer can be checked by eye or script.
`--tokens` counts tokens of the embedded model's tokenizer, like passkey.py's lengths.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import passkey_sample
from engramkv.config import ModelConfig
from engramkv.hf import load_pretrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="file to write")
    parser.add_argument("--tokens", type=int, default=1_048_576, help="length of text + question in tokens")
    parser.add_argument("--depth", type=float, default=0.5, help="where the key sits, 0 (start) to 1 (end)")
    parser.add_argument("--seed", type=int, default=0, help="chooses the key")
    args = parser.parse_args()
    _, tokenizer, _ = load_pretrained(ModelConfig())
    context, _question, key = passkey_sample(tokenizer, args.tokens, args.depth, args.seed)
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(context, encoding="utf-8")
    print(f"wrote {args.path} ({len(context):,} characters); the pass key is {key}")


if __name__ == "__main__":
    main()
