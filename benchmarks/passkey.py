"""Passkey retrieval past the trained window (InfiniteBench format): a preset of `evaluate.py`.

The same harness, task generator and systems as the evaluation grid (`evalkit/`), with passkey
defaults: the passkey task only, 5 samples per length (the key's depth drawn from each sample's seed,
10%..90% of the filler), lengths 4k-64k, engramkv as shipped against plain full attention (full
attention up to --full-max tokens). A sample scores 1 when the 5-digit key is in the reply. Every
option of evaluate.py applies (--systems, --lengths, --samples, --resume, --merge, --name, ...); the
systems that used to be this script's own are evaluate.py systems: `engram-fixed` (memory at one
fixed distance), `infllm` (uniform 128-token blocks, no surprise: was `engram-uniform`) and
`engram-store-fp16/-int8/-int4/-int2/-lowrank` (the events in a store on disk, cold tier in that codec).

Writes benchmarks/results/passkey/{name}.json, .md and .png (default name: passkey).

    python benchmarks/passkey.py                                   # `make bench`'s passkey part
    python benchmarks/passkey.py --lengths 65536 --systems engram-store-int8 engram --name passkey_store_int8_64k
"""

from __future__ import annotations

import evaluate
from _common import RESULTS, ROOT

DEFAULTS = {
    "tasks": ["passkey"],
    "systems": ["engram", "full"],
    "lengths": [4096, 16384, 32768, 65536],
    "samples": 5,
    "full_max": 16384,
    "name": "passkey",
    "out": RESULTS / "passkey",
}


def main(argv: list[str] | None = None) -> None:
    parser = evaluate.build_parser(__doc__)
    parser.set_defaults(**DEFAULTS)
    spelt = " ".join(f"--{key.replace('_', '-')} " + (" ".join(map(str, value)) if isinstance(value, list) else
                                                      str(value.relative_to(ROOT) if key == "out" else value))
                     for key, value in DEFAULTS.items())
    parser.epilog = f"The defaults listed above are evaluate.py's; this preset's are {spelt}."
    evaluate.main(argv, parser)


if __name__ == "__main__":
    main()
