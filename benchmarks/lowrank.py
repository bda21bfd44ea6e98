"""Cold-tier codecs on the embedded model's own KV: bytes per token, reconstruction error, speed.

The model reads two texts into in-RAM sessions: the `engramkv fit-bases` default (docstrings of the
standard library) to fit lowrank bases on, and a stretch of the evaluation's haystack (Python's language
reference, which the bases never saw) to measure on. Each codec encodes the second text's events as a
store would (event by event, every layer) and decodes them again. Reported per codec: KV bytes per token
(all layers, keys and values; fp16 is 23,040 on this model), the relative error of keys and of values
against their centred originals (||x - x_hat|| / ||x - mean||: attention is blind to a key's mean, so
the spread is what an error competes with), averaged over layers and the worst layer, and encode /
decode time as a ratio to int8 in the same run (these machines are shared).

    python benchmarks/lowrank.py [--fit-tokens 16384] [--eval-tokens 4096] [--name codecs]

Writes benchmarks/results/lowrank/NAME.json and .md.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
from _common import RESULTS, write_results

# (label, key_error, value_error): lowrank settings (format 2: bits per direction) measured beside the
# quantised codecs
LOWRANK = [("lowrank-0.15/0.25", 0.15, 0.25), ("lowrank-0.20/0.30", 0.20, 0.30), ("lowrank-0.25/0.35", 0.25, 0.35),
           ("lowrank-0.30/0.45", 0.30, 0.45)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit-tokens", type=int, default=16_384, help="calibration tokens the bases are fitted on")
    parser.add_argument("--eval-tokens", type=int, default=4_096, help="haystack tokens the codecs are measured on")
    parser.add_argument("--name", default="codecs")
    args = parser.parse_args()

    from engramkv import EngineConfig, EpisodicLM
    from engramkv.config import LowRankConfig
    from engramkv.lowrank_fit import fit_bases, stdlib_docstrings
    from engramkv.storage.codec import QuantCodec
    from engramkv.storage.lowrank_codec import LowRankCodec
    from engramkv.tasks import haystack

    lm = EpisodicLM.from_pretrained()
    cfg = EngineConfig().with_allocation_mode("fixed")
    spec = lm.spec

    def read(pieces: Any, limit: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """KV per layer (H, N, D) of the events sealed from `limit` tokens of `pieces`, and each event's length."""
        session = lm.session(cfg)
        ids: list[int] = []
        for text in pieces:
            ids += lm.tokenizer.encode("\n\n" + text, add_special_tokens=False)
            if len(ids) >= limit:
                break
        session.ingest_ids(ids[:limit])
        memory, events = session.memory, list(range(len(session.memory)))
        kv = [memory.gather(layer, events) for layer in range(spec.num_layers)]
        lengths = [memory.event(e).length for e in events]
        session.close()
        return [k.float() for k, _ in kv], [v.float() for _, v in kv], lengths

    fit_k, fit_v, _ = read(stdlib_docstrings(), args.fit_tokens)
    eval_k, eval_v, lengths = read(haystack(lm.tokenizer, args.eval_tokens + 2_000, random.Random(0)), args.eval_tokens)
    n_tokens = sum(lengths)
    keys = torch.stack(eval_k)  # (L, H, N, D)
    values = torch.stack(eval_v)

    codecs: dict[str, Any] = {name: QuantCodec(name, spec.num_kv_heads, spec.head_dim)
                              for name in ("fp16", "int8", "int4", "int2")}
    fitted: dict[str, Any] = {}
    for label, key_error, value_error in LOWRANK:
        lowrank_cfg = LowRankConfig(key_error=key_error, value_error=value_error)
        bases = fit_bases(fit_k, fit_v, lowrank_cfg, spec.model_dump())
        codecs[label] = LowRankCodec(bases, "lowrank:bench", spec.num_kv_heads, spec.head_dim)
        fitted[label] = {"config": lowrank_cfg.model_dump(), "code_bits_keys": [p.code_bits for p in bases.keys],
                         "code_bits_values": [p.code_bits for p in bases.values],
                         "directions_keys": [p.latent for p in bases.keys],
                         "directions_values": [p.latent for p in bases.values], "fit_errors": bases.errors}

    rows: dict[str, dict[str, Any]] = {}
    for name, codec in codecs.items():
        nbytes, k_parts, v_parts, encode_s, decode_s = 0, [], [], 0.0, 0.0
        at = 0
        for length in lengths:  # event by event, as a store seals them
            k, v = keys[:, :, at : at + length], values[:, :, at : at + length]
            at += length
            started = time.perf_counter()
            encoded = codec.encode_layers(k, v)
            encode_s += time.perf_counter() - started
            nbytes += sum(map(len, encoded))
            started = time.perf_counter()
            decoded = [codec.decode_layer(layer, buf, length) for layer, buf in enumerate(encoded)]
            decode_s += time.perf_counter() - started
            k_parts.append(torch.stack([d[0] for d in decoded]).float())
            v_parts.append(torch.stack([d[1] for d in decoded]).float())
        k_hat, v_hat = torch.cat(k_parts, dim=2), torch.cat(v_parts, dim=2)
        rows[name] = {"bytes_per_token": nbytes / n_tokens, "key_error": _errors(keys, k_hat),
                      "value_error": _errors(values, v_hat), "encode_s": encode_s, "decode_s": decode_s}

    fp16 = rows["fp16"]["bytes_per_token"]
    lines = [f"# Cold-tier codecs on {spec.model_id}'s KV", "",
             f"{n_tokens:,} tokens ({len(lengths)} events) of the evaluation haystack; lowrank bases fitted on "
             f"{fit_k[0].shape[1]:,} tokens of standard-library docstrings. Error: ||x - x_hat|| / ||x - mean|| "
             "per layer, mean (worst) over layers. Speed: seconds over int8's, same run.", "",
             "| codec | KV bytes / token | of fp16 | key error | value error | encode / int8 | decode / int8 |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        k, v = row["key_error"], row["value_error"]
        lines.append(f"| {name} | {row['bytes_per_token']:,.0f} | {row['bytes_per_token'] / fp16:.3f} | "
                     f"{k['mean']:.3f} ({k['max']:.3f}) | {v['mean']:.3f} ({v['max']:.3f}) | "
                     f"{row['encode_s'] / rows['int8']['encode_s']:.2f} | {row['decode_s'] / rows['int8']['decode_s']:.2f} |")
    lines += ["", "Lowrank per layer (keys; values): code bits per token (fp16: "
              f"{spec.num_kv_heads * spec.head_dim * 16}) and directions coded (of {spec.num_kv_heads * spec.head_dim}):", ""]
    for label, info in fitted.items():
        lines.append(f"- {label}: bits {min(info['code_bits_keys'])}-{max(info['code_bits_keys'])}; "
                     f"{min(info['code_bits_values'])}-{max(info['code_bits_values'])}, directions "
                     f"{min(info['directions_keys'])}-{max(info['directions_keys'])}; "
                     f"{min(info['directions_values'])}-{max(info['directions_values'])}")
    table = "\n".join(lines)
    write_results(RESULTS / "lowrank", args.name, {"args": vars(args), "tokens": n_tokens, "events": len(lengths),
                                                   "codecs": rows, "lowrank": fitted}, table, cfg)
    print(table)


def _errors(x: torch.Tensor, x_hat: torch.Tensor) -> dict[str, Any]:  # x: (L, H, N, D)
    """Per layer ||x - x_hat|| / ||x - mean over tokens||, with its mean and max."""
    per_layer = [float((x[i] - x_hat[i]).norm() / (x[i] - x[i].mean(dim=1, keepdim=True)).norm())
                 for i in range(x.shape[0])]
    return {"mean": sum(per_layer) / len(per_layer), "max": max(per_layer), "per_layer": per_layer}


if __name__ == "__main__":
    main()
