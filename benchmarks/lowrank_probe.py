"""Does a pass key survive the `lowrank` codec? Read back two ways, to tell where an error bites.

Each sample is a short passkey document (`--tokens`, the key at 40% depth) read with a small window (chunks
of 256, 64 sinks, 256 local tokens, 512 recalled), so the key must come back from event memory:

    ram          the engine in RAM, lossless: the reference
    int8         a real int8 store on disk, written, closed, reopened read-only and asked
    store        a real lowrank store the same way: the model *reads* the document through the lossy memory
                 (each chunk attends to recalled events decoded from the store), then answers through it
    answer-only  the engine in RAM reads exactly; only the answer attends to the recalled events' KV sent
                 through the codec (encode, decode): what the error costs when it does not compound

Bases: those shipped for the model (`shipped`) and, for each `--fit KEY/VALUE[/WEIGHTS]` pair of error budgets,
bases fitted in this run on the `engramkv fit-bases` default text (`--fit-tokens` of it, read for each fit);
WEIGHTS says which of keys and values the fit weighs by what attention reads of them (`kv`, the default;
`k`, `v`, or `none`: `store.lowrank.weight_keys` / `weight_values`).

    python benchmarks/lowrank_probe.py [--samples 16] [--fit 0.25/0.25 0.10/0.40/none] [--bases LABEL=PATH]
                                       [--store-only]

Writes benchmarks/results/lowrank/NAME.json and .md (hits / samples with a 95% Wilson interval).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, passkey_sample, write_results
from evalkit.stats import wilson


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16, help="passkey documents (seeds 11, 12, ...)")
    parser.add_argument("--tokens", type=int, default=2_500, help="tokens per document")
    parser.add_argument("--fit", nargs="*", default=["0.25/0.25"], metavar="KEY/VALUE",
                        help="error budgets of bases fitted in this run, beside the shipped ones")
    parser.add_argument("--bases", nargs="*", default=[], metavar="LABEL=PATH",
                        help="bases files fitted before (`engramkv fit-bases`), beside the shipped ones")
    parser.add_argument("--store-only", action="store_true", help="skip the answer-only reading")
    parser.add_argument("--fit-tokens", type=int, default=32_768, help="calibration tokens the fits read")
    parser.add_argument("--name", default="probe")
    args = parser.parse_args()

    from engramkv import EngineConfig, EpisodicLM
    from engramkv.config import LowRankConfig, RecallConfig, StoreConfig, WindowConfig
    from engramkv.lowrank_fit import fit_lowrank_bases
    from engramkv.storage.lowrank import LowRankBases
    from engramkv.storage.lowrank_codec import LowRankCodec
    from engramkv.storage.store import shipped_bases

    small = EngineConfig(window=WindowConfig(chunk_size=256, n_sink=64, n_local=256),
                         recall=RecallConfig(budget_tokens=512))
    lm = EpisodicLM.from_pretrained(config=small)
    spec = lm.spec
    work = Path(tempfile.mkdtemp(prefix="lowrank_probe-"))
    bases: dict[str, Path] = {"shipped": shipped_bases(spec.model_id)}
    for item in args.bases:
        label, _, path = item.partition("=")
        bases[label] = Path(path)
    for pair in args.fit:
        key_error, value_error, weights = (pair.split("/") + ["kv"])[:3]
        if weights not in ("kv", "k", "v", "none"):
            parser.error(f"--fit {pair}: WEIGHTS is kv, k, v or none")
        lowrank = LowRankConfig(key_error=float(key_error), value_error=float(value_error), tokens=args.fit_tokens,
                                weight_keys="k" in weights, weight_values="v" in weights)
        fitted = fit_lowrank_bases(lm, small.model_copy(update={"store": StoreConfig(codec="lowrank", lowrank=lowrank)}),
                                   progress=lambda line: print(line, end="\r", flush=True))
        bases[f"fit {pair}"] = work / f"fit-{key_error}-{value_error}-{weights}.safetensors"
        fitted.save(bases[f"fit {pair}"])
        print()

    def store_config(codec: str, path: Path | None) -> EngineConfig:
        return small.model_copy(update={"store": StoreConfig(codec=codec, lowrank=LowRankConfig(
            bases=str(path) if path else None))})

    def through_store(cfg: EngineConfig, context: str, question: str, where: Path) -> str:
        with lm.session(cfg, store=where) as session:
            session.ingest(context)
        with lm.session(cfg, store=where, read_only=True) as session:
            return session.generate(question, max_new_tokens=8)

    codecs: dict[str, tuple[LowRankCodec, int]] = {}  # label -> the codec, its code bits per token
    for label, path in bases.items():
        loaded = LowRankBases.load(path)
        codecs[label] = (LowRankCodec(loaded, "probe", spec.num_kv_heads, spec.head_dim),
                         sum(p.code_bits for p in (*loaded.keys, *loaded.values)))
    rows: dict[str, dict[str, Any]] = {}

    def record(system: str, answer: str, key: str, bits: int | None = None) -> None:
        row = rows.setdefault(system, {"hits": 0, "samples": 0, "answers": [], "code_bits_per_token": bits})
        row["hits"] += key in answer
        row["samples"] += 1
        row["answers"].append(answer)

    for i in range(args.samples):
        seed = 11 + i
        context, question, key = passkey_sample(lm.tokenizer, args.tokens, depth=0.4, seed=seed)
        session = lm.session(small)
        session.ingest(context)
        record("ram", session.generate(question, max_new_tokens=8), key)
        exact = session.memory.gather
        for label, path in bases.items():
            codec, bits = codecs[label]
            encoded: dict[int, list[bytes]] = {}  # event id -> its layers' bytes

            def lossy(layer: int, event_ids: list[int], codec: LowRankCodec = codec,
                      encoded: dict[int, list[bytes]] = encoded) -> tuple[torch.Tensor, ...]:
                blocks = []
                for event_id in event_ids:
                    if event_id not in encoded:  # the codec encodes an event's layers at once
                        kv = [exact(n, [event_id]) for n in range(spec.num_layers)]
                        encoded[event_id] = codec.encode_layers(torch.stack([k for k, _ in kv]),
                                                                torch.stack([v for _, v in kv]))
                    n_tokens = session.memory.event(event_id).length
                    blocks.append(codec.decode_layer(layer, encoded[event_id][layer], n_tokens))
                return tuple(torch.cat([b[j] for b in blocks], dim=1).to(lm.model.dtype) for j in (0, 1))

            if not args.store_only:  # a diagnostic, not an engine path: the answer alone reads through the codec
                session.memory.gather = lossy
                record(f"answer-only, {label}", session.generate(question, max_new_tokens=8), key, bits)
                session.memory.gather = exact
            answer = through_store(store_config("lowrank", path), context, question, work / f"{seed}-{label}")
            record(f"store, {label}", answer, key, bits)
        record("int8", through_store(store_config("int8", None), context, question, work / f"{seed}-int8"), key)
        session.close()
        print(f"seed {seed}: " + ", ".join(f"{s} {r['hits']}/{r['samples']}" for s, r in rows.items()), flush=True)

    lines = ["| system | code bits / token (all layers) | hits | 95% interval |", "|---|---:|---:|---|"]
    for system, row in rows.items():
        low, high = wilson(row["hits"] / row["samples"], row["samples"])
        bits = f"{row['code_bits_per_token']:,}" if row["code_bits_per_token"] else "-"
        lines.append(f"| {system} | {bits} | {row['hits']}/{row['samples']} | {low:.2f}-{high:.2f} |")
    table = "\n".join(lines) + "\n"
    write_results(RESULTS / "lowrank", args.name, {"args": vars(args), "rows": rows}, table, small)
    print(table)


if __name__ == "__main__":
    main()
