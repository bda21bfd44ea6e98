"""Issue 19's GPU run, one prepared script: the kernels against their twins, ingest and decode on CUDA.

Sized to finish inside about 8 minutes on an H200. Writes benchmarks/results/gpu/{name}.json and .md, and
copies both into --out (the device tool's $OUT). It measures:
1. the kernel tests (`tests/test_kernels.py`, `tests/test_device_recall.py`), compiled for the GPU;
2. each kernel against its PyTorch twin, and the window attention also against bare
   `scaled_dot_product_attention` over the same window already rotated, at the embedded model's shape, bf16;
3. ingest of --tokens (default 1M) by a random-weight model of the embedded model's shape in bf16 (the
   embedded GGUF is more than the device machine can be sent) against the bare model's forward over the
   same window size (a chunk over a cached prefix as long as the engine's attention span), and the host
   synchronisations per chunk (CUDA's sync debug mode, counted); stopped at --ingest-seconds, in which case
   the rate is measured on the tokens read and the 10M-token time is extrapolated (the report says so);
4. a decode step with that memory against one full-attention step over 4k tokens;
5. reading's recall chosen on the device against on the host (`recall.select_on_device`): two fresh sessions read
   the same --ab-tokens, their rates and host synchronisations per chunk.

On a machine without CUDA, --smoke runs every step at toy sizes (the kernels through Triton's interpreter),
which checks the script before device minutes are spent on it (written under results/tmp/, ignored).

The device machine's image lacks pydantic, SQLAlchemy, FAISS and our transformers pin: fetch their wheels
here with `bash benchmarks/gpu_wheels.sh`, then run there, carrying `.whl`:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && ENGRAMKV_COMMIT=<the commit sent> PYTHONUNBUFFERED=1 \
        python3 benchmarks/gpu.py --out $OUT

(ENGRAMKV_COMMIT: the .git that travels with the tree may name an older commit.) A section that fails records its
traceback in the JSON and the run goes on, so one call brings back everything that worked.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import subprocess
import traceback
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

SMOKE = "--smoke" in sys.argv
if SMOKE and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are imported, below

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from _common import RESULTS, WordIds, write_results  # noqa: E402
from engramkv import EngineConfig, EpisodicLM  # noqa: E402
from engramkv.config import ModelConfig  # noqa: E402
from engramkv.kernels.backend import Backend  # noqa: E402
from engramkv.kernels.gather import gather  # noqa: E402
from engramkv.kernels.representatives import search  # noqa: E402
from engramkv.kernels.window_attention import apply_rotary, window_attention  # noqa: E402

# SmolLM2-135M-Instruct's shape (the embedded model), and a toy one for --smoke
EMBEDDED = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                rope_theta=100000.0, tie_word_embeddings=True)
TOY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=32, vocab_size=512, max_position_embeddings=8192)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def kernel_tests(device: torch.device) -> dict[str, Any]:
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
                          "tests/test_device_recall.py"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    last = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    print("kernel tests:", last, flush=True)
    return {"returncode": run.returncode, "summary": last, "seconds": time.perf_counter() - started,
            "output_tail": (run.stdout + run.stderr)[-3000:]}


def kernel_timings(shape: dict[str, Any], cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
                   repeats: int, events: int, smoke: bool) -> list[dict[str, Any]]:
    """Each kernel against its twin at the model's shape: one layer's window, every layer's search, a recall."""
    h, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    # (the interpreter takes half a minute for one full-size window)
    chunk, n_keys = (64, 300) if smoke else (cfg.window.chunk_size, cfg.attention_span())
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device, dtype)

    q, keys, values = rand(h, chunk, d), rand(hkv, n_keys, d), rand(hkv, n_keys, d)
    angles = torch.arange(n_keys).float()[:, None] / 10000 ** (torch.arange(0, d, 2).float() / d)[None]
    cos, sin = (f(torch.cat([angles, angles], -1)).to(device, dtype) for f in (torch.cos, torch.sin))
    probe = cfg.representatives.stat_queries
    q_rot, k_rot = apply_rotary(q, cos[-chunk:], sin[-chunk:]), apply_rotary(keys, cos, sin)

    def sdpa() -> None:
        F.scaled_dot_product_attention(q_rot[None], k_rot[None], values[None], is_causal=True, scale=d**-0.5,
                                       enable_gqa=True)

    rows: list[dict[str, Any]] = []

    def compare(name: str, triton_fn: Callable[[], Any], twin_fn: Callable[[], Any],
                extra: dict[str, Callable[[], Any]] | None = None) -> None:
        row = {"kernel": name, "triton_s": median_seconds(triton_fn, device, repeats),
               "twin_s": median_seconds(twin_fn, device, repeats)}
        for label, fn in (extra or {}).items():
            row[f"{label}_s"] = median_seconds(fn, device, repeats)
        print(row, flush=True)
        rows.append(row)

    scale = d**-0.5
    compare(f"window attention + received mass (C {chunk}, N {n_keys}, probe {probe})",
            lambda: window_attention(q, keys, values, cos, sin, scale, probe, "triton"),
            lambda: window_attention(q, keys, values, cos, sin, scale, probe, "torch"),
            {"sdpa_rotated_no_mass": sdpa})
    layers = shape["num_hidden_layers"]
    reps, queries = rand(layers, events, hkv * d).float(), rand(layers, hkv * d).float()
    compare(f"representative search, all {layers} layers ({events} events, top 32)",
            lambda: search(reps, queries, 32, "triton"), lambda: search(reps, queries, 32, "torch"))
    arena_tokens, recalled = 64 * events if events < 10_000 else 262_144, cfg.recall.budget_tokens
    codes = torch.randint(0, 256, (2, hkv, arena_tokens, d), generator=gen, dtype=torch.uint8).to(device)
    params = [rand(events, hkv, d).half(), rand(events, hkv, d).half(), rand(hkv, arena_tokens).half(),
              rand(hkv, arena_tokens).half()]
    rows_at = torch.randint(0, arena_tokens, (recalled,), generator=gen).to(device)
    owner = torch.randint(0, events, (recalled,), generator=gen).to(device)
    compare(f"gather + int8 dequantisation ({recalled} tokens)",
            lambda: gather(codes[0], codes[1], *params, rows_at, owner, 8, dtype, "triton"),
            lambda: gather(codes[0], codes[1], *params, rows_at, owner, 8, dtype, "torch"))
    return rows


def bare_window_chunk_s(model: torch.nn.Module, cfg: EngineConfig, vocab: int, device: torch.device,
                        repeats: int) -> float:
    """One chunk's forward over a cached prefix as long as the engine's attention span, then cropped back."""
    chunk, span = cfg.window.chunk_size, cfg.attention_span()
    gen = torch.Generator().manual_seed(1)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, span - chunk), generator=gen).to(device), past_key_values=cache)
        ids = torch.randint(0, vocab, (1, chunk), generator=gen).to(device)

        def step() -> None:
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            out.logits.float().logsumexp(-1)  # the engine normalises its logits once too (surprise)
            cache.crop(-chunk)

        return median_seconds(step, device, repeats)


def ingest(lm: EpisodicLM, cfg: EngineConfig, tokens: int, vocab: int, seconds: float, device: torch.device
           ) -> tuple[Any, dict[str, Any]]:
    session = lm.session(cfg)
    gen = torch.Generator().manual_seed(2)
    chunk = cfg.window.chunk_size
    block = 16 * chunk
    done, syncs, sync_chunks = 0, 0, 0
    started = time.perf_counter()
    while done < tokens and time.perf_counter() - started < seconds:
        ids = torch.randint(0, vocab, (min(block, tokens - done),), generator=gen).tolist()
        if device.type == "cuda" and done >= 4 * block and sync_chunks == 0:  # count once, past the warm-up
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                session.ingest_ids(ids)
            torch.cuda.set_sync_debug_mode("default")
            syncs, sync_chunks = len(caught), len(ids) // chunk
        else:
            session.ingest_ids(ids)
        done += len(ids)
        if done % (32 * block) == 0:
            print(f"ingested {done:,} tokens, {session.events:,} events, {time.perf_counter() - started:.0f} s",
                  flush=True)
    _sync(device)
    elapsed = time.perf_counter() - started
    return session, {"tokens": done, "seconds": elapsed, "tokens_per_s": done / elapsed, "events": session.events,
                     "complete": done == tokens, "host_syncs_per_chunk": syncs / sync_chunks if sync_chunks else None,
                     "sync_counted_chunks": sync_chunks}


def selection_ab(model: torch.nn.Module, cfg: EngineConfig, name: str, vocab: int, tokens: int,
                 device: torch.device) -> dict[str, Any]:
    """Reading's recall chosen on the device (`recall.select_on_device`) against on the host: two fresh sessions
    read the same ids, one after the other; each run's rate and host synchronisations per chunk."""
    runs: dict[str, Any] = {}
    for on_device in (True, False):
        run_cfg = cfg.model_copy(update={"recall": cfg.recall.model_copy(update={"select_on_device": on_device})})
        session, runs["device" if on_device else "host"] = ingest(EpisodicLM(model, WordIds(vocab), name, run_cfg),
                                                                  run_cfg, tokens, vocab, float("inf"), device)
        session.close()
        del session
        if device.type == "cuda":
            torch.cuda.empty_cache()
    runs["ratio"] = runs["device"]["tokens_per_s"] / runs["host"]["tokens_per_s"]
    print("selection on the device against the host:", runs, flush=True)
    return runs


def profile_ingest(session: Any, vocab: int, cfg: EngineConfig, device: torch.device) -> dict[str, str]:
    """Where four more chunks of ingest spend their time (torch.profiler): what to make faster next."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ids = torch.randint(0, vocab, (4 * cfg.window.chunk_size,), generator=torch.Generator().manual_seed(3)).tolist()
    with profile(activities=activities) as prof:
        session.ingest_ids(ids)
        _sync(device)
    averages = prof.key_averages()
    tables = {"by_cpu_time": averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)}
    if device.type == "cuda":
        tables["by_device_time"] = averages.table(sort_by="self_device_time_total", row_limit=20,
                                                  max_name_column_width=60)
    print(tables["by_cpu_time"], flush=True)
    return tables


def decode_step_s(session: Any, vocab: int, new: int, repeats: int) -> float:
    """One decode step: a turn of `new` tokens minus a turn of one (medians of `repeats`), on the session itself
    (a fork would copy its whole memory, 23 GB at 1M tokens of this shape; the turns' few tokens joining the
    stream change nothing). A first turn compiles the kernels for the decode shapes and is not timed."""
    prompt = [1 % vocab, 2 % vocab, 3 % vocab]
    session.generate_ids(prompt, max_new_tokens=new)
    ones, longs = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        session.generate_ids(prompt, max_new_tokens=1)
        ones.append(time.perf_counter() - started)
        started = time.perf_counter()
        session.generate_ids(prompt, max_new_tokens=new)
        longs.append(time.perf_counter() - started)
    return (statistics.median(longs) - statistics.median(ones)) / (new - 1)


def full_attention_step_s(model: torch.nn.Module, context: int, vocab: int, device: torch.device,
                          repeats: int) -> float:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, context)).to(device), past_key_values=cache)
        token = torch.randint(0, vocab, (1, 1)).to(device)

        def step() -> None:
            model(input_ids=token, past_key_values=cache, use_cache=True).logits.argmax(-1).item()
            cache.crop(-1)

        return median_seconds(step, device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 20, help="tokens to ingest (default 1M)")
    parser.add_argument("--ingest-seconds", type=float, default=240.0, help="stop the ingest here and extrapolate")
    parser.add_argument("--ab-tokens", type=int, default=65_536,
                        help="tokens each of two fresh sessions reads, recall chosen on the device and on the host "
                        "(0: skip)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, on any machine (kernels interpreted)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/test_kernels.py first")
    parser.add_argument("--name", default="gpu")
    parser.add_argument("--out", type=Path, default=None, help="also copy the JSON and markdown here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: this script measures the GPU path (use --smoke to check it on the CPU)")
    shape, dtype = (TOY, torch.float32) if args.smoke else (EMBEDDED, torch.bfloat16)
    tokens = min(args.tokens, 6144) if args.smoke else args.tokens
    repeats = 1 if args.smoke else 20
    cfg = EngineConfig(model=ModelConfig(dtype="float32" if args.smoke else "bfloat16", device=device.type))

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "smoke": args.smoke, "shape": shape}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if not args.skip_tests:
        _section(report, "kernel_tests", lambda: kernel_tests(device))
    _section(report, "kernels", lambda: kernel_timings(shape, cfg, device, dtype, repeats,
                                                        200 if args.smoke else 25_000, args.smoke))

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device, dtype).eval()
    bare = copy.deepcopy(model)
    bare_s = bare_window_chunk_s(bare, cfg, shape["vocab_size"], device, repeats)
    session = None
    # if the engine fails with the kernels, its twins on the same GPU still measure the rest of the path, for a
    # third of the time (the run must end inside the device call)
    # (a smoke run on the CPU asks for Triton, interpreted, so that reading's recall on the device runs too)
    first: Backend = "triton" if args.smoke and device.type == "cpu" else "auto"
    for kernels, seconds in ((first, args.ingest_seconds), ("torch", args.ingest_seconds / 3)):
        run_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"kernels": kernels})})
        name = "random-" + ("toy" if args.smoke else "smollm2-135m-shape")
        lm = EpisodicLM(model, WordIds(shape["vocab_size"]), name, run_cfg)
        outcome = _section(report, f"ingest_{kernels}", lambda: ingest(lm, run_cfg, tokens, shape["vocab_size"],
                                                                       seconds, device))
        if outcome is not None:
            session, run = outcome
            run.update(kernels=kernels, bare_tokens_per_s=cfg.window.chunk_size / bare_s)
            run["ratio_to_bare"] = run["tokens_per_s"] / run["bare_tokens_per_s"]
            run["ten_million_minutes"] = 10_000_000 / run["tokens_per_s"] / 60
            del report[f"ingest_{kernels}"]  # (session, run): the run is the section
            report["ingest"] = run
            print(run, flush=True)
            break
    if session is not None:
        def decode() -> dict[str, Any]:
            step = decode_step_s(session, shape["vocab_size"], new=8 if args.smoke else 33, repeats=3)
            full = full_attention_step_s(bare, 4096, shape["vocab_size"], device, repeats)
            return {"memory_tokens": report["ingest"]["tokens"], "step_s": step, "full_attention_4k_step_s": full,
                    "ratio": step / full}
        _section(report, "decode", decode)
        print(report.get("decode"), flush=True)
        _section(report, "ingest_profile", lambda: profile_ingest(session, shape["vocab_size"], cfg, device))
        ab_tokens = min(args.ab_tokens, 3072) if args.smoke else args.ab_tokens  # (events sealed and recalled)
        if ab_tokens:
            session.close()
            del session
            _section(report, "selection", lambda: selection_ab(model, run_cfg, name, shape["vocab_size"], ab_tokens,
                                                               device))

    table = _table(report, cfg)
    print(table)
    # a smoke run checks the script and measures nothing: it stays out of the results
    written = write_results(RESULTS / ("tmp/gpu" if args.smoke else "gpu"), args.name, report, table, cfg)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copy(path, args.out / path.name)
    print("wrote", *written)


def _section(report: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """report[key] = fn(); a failure is recorded there (the traceback) and the run goes on to the next section."""
    try:
        report[key] = fn()
        return report[key]
    except Exception:  # noqa: BLE001 - one device run must bring back every section it can
        report[key] = {"error": traceback.format_exc()[-4000:]}
        print(f"{key} FAILED:\n{report[key]['error']}", flush=True)
        return None


def _table(report: dict[str, Any], cfg: EngineConfig) -> str:
    errors = {key: value["error"].strip().splitlines()[-1] for key, value in report.items()
              if isinstance(value, dict) and "error" in value}
    run, decode = report.get("ingest"), report.get("decode")
    lines = [f"# GPU path ({report['device']}, torch {report['torch']}, triton {report['triton']}"
             f"{', SMOKE RUN: toy sizes, not a measurement' if report['smoke'] else ''})", ""]
    if "summary" in report.get("kernel_tests", {}):
        lines += [f"Kernel tests: {report['kernel_tests']['summary']}", ""]
    if isinstance(report.get("kernels"), list):
        lines += ["| kernel | Triton ms | twin ms | twin / Triton | other |", "|---|---|---|---|---|"]
        for row in report["kernels"]:
            other = "; ".join(f"{k[:-2]} {v * 1e3:.3f} ms" for k, v in row.items() if k.endswith("_s")
                              and k not in ("triton_s", "twin_s"))
            lines.append(f"| {row['kernel']} | {row['triton_s'] * 1e3:.3f} | {row['twin_s'] * 1e3:.3f} | "
                         f"{row['twin_s'] / row['triton_s']:.2f}x | {other} |")
    if run is not None:
        measured = "measured on all of them" if run["complete"] else "measured on these, stopped at the time limit"
        kernels = f"model.kernels='{run['kernels']}'"
        kernels += " (under 'auto' it failed)" if run["kernels"] == "torch" else ""
        lines += ["", f"Ingest of {run['tokens']:,} tokens with {kernels} ({measured}; chunks of "
                  f"{cfg.window.chunk_size}): {run['tokens_per_s']:,.0f} tokens/s, {run['events']:,} events; the bare "
                  f"forward over the same window ({cfg.attention_span()} keys): {run['bare_tokens_per_s']:,.0f} "
                  f"tokens/s; **ratio {run['ratio_to_bare']:.2f}**. 10M tokens at this rate (extrapolated): "
                  f"{run['ten_million_minutes']:.1f} min. Host synchronisations per chunk: "
                  f"{run['host_syncs_per_chunk']}."]
    selection = report.get("selection")
    if selection is not None and "error" not in selection:
        on, off = selection["device"], selection["host"]
        lines += ["", "Recall chosen on the device against on the host (`recall.select_on_device`; two fresh sessions, "
                  f"{on['tokens']:,} tokens each): {on['tokens_per_s']:,.0f} against {off['tokens_per_s']:,.0f} "
                  f"tokens/s, **{selection['ratio']:.2f}x**; host synchronisations per chunk "
                  f"{on['host_syncs_per_chunk']} against {off['host_syncs_per_chunk']}; events sealed {on['events']:,} "
                  f"and {off['events']:,} (the same rule: they should match)."]
    if decode is not None and "error" not in decode:
        lines += ["", f"Decode with {decode['memory_tokens']:,} tokens of memory: {decode['step_s'] * 1e3:.1f} ms "
                  f"per step; full attention over 4k tokens: {decode['full_attention_4k_step_s'] * 1e3:.1f} ms; "
                  f"**ratio {decode['ratio']:.2f}**."]
    if errors:
        lines += ["", "Failed (the tracebacks are in the JSON):"]
        lines += [f"- {key}: `{last}`" for key, last in errors.items()]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
