"""The `engramkv` command: a thin layer over the library API (every command is a few library calls).

    engramkv ingest PATH... --store DIR     stream files into a store (resumable; Ctrl-C safe)
    engramkv ask QUESTION --store DIR       one chat turn over the stored stream (read-only)
    engramkv recall QUERY --store DIR       the events that best match QUERY
    engramkv stats --store DIR              tokens, events, tiers and disk use of a namespace
    engramkv sessions list|delete --store DIR
    engramkv chat [--store DIR]             the terminal chat app
    engramkv calibrate --out FILE           fit the recall budget model (allocation coefficients)
    engramkv fit-bases --out FILE           fit the lowrank codec's bases on the model's own KV

Exit status: 0 success, 1 error (the message says why), 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engramkv import ConfigError, EngramError, IngestProgress, InputError
from engramkv.cli.options import config_file, output_file, read_text, with_options
from engramkv.cli.parser import parser_for

def load_model(name_or_path: str | None, quiet: bool = False) -> Any:
    """The model behind every command (the test seam: tests swap in a tiny one)."""
    from engramkv import EpisodicLM

    if not quiet:
        print(f"loading {name_or_path or 'the embedded SmolLM2-135M-Instruct'} ...", file=sys.stderr, flush=True)
    return EpisodicLM.from_pretrained(name_or_path)


_loaded: list[Any] = []  # models this invocation loaded; main() closes their stores (releasing the lock)


def _model(args: argparse.Namespace) -> Any:
    lm = load_model(args.model, args.json)
    _loaded.append(lm)
    return lm


class _IngestBar:
    """The progress bar of one file's ingest, drawn at its first report (a file already stored draws none).

    Bytes and tokens/s count from the first report, so a resumed ingest does not count what was stored before.
    """

    def __init__(self, path: str, hidden: bool) -> None:
        self.path, self.hidden = path, hidden
        self.bar: Any = None
        self.started, self.first_tokens = 0.0, 0

    def report(self, progress: IngestProgress) -> None:
        from tqdm import tqdm  # type: ignore[import-untyped]

        if self.bar is None:
            self.bar = tqdm(total=progress.size_bytes or 0, initial=progress.bytes_read or 0, unit="B",
                            unit_scale=True, desc=Path(self.path).name, disable=self.hidden, dynamic_ncols=True)
            self.started, self.first_tokens = time.perf_counter(), progress.tokens
        elif progress.bytes_read is not None:
            self.bar.update(progress.bytes_read - self.bar.n)
        rate = (progress.tokens - self.first_tokens) / max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{progress.tokens:,} tokens, {rate:,.0f} tok/s, {progress.events:,} events",
                                 refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------- commands
def cmd_ingest(args: argparse.Namespace) -> int:
    lm = _model(args)
    config = config_file(args.config, lm.config) if args.config else lm.config
    if args.codec is not None:
        config = with_options(config, ("store",), args, ("codec",))
    if args.workers is not None or args.ray_address is not None:
        config = with_options(config, ("shards",), args, ("workers", "ray_address"))
    session = lm.session(config, store=args.store, user_id=args.user, agent_id=args.agent,
                         session_id=args.session)
    stored = session.memory.codec.split(":")[0]  # "lowrank:<bases digest>"
    if args.codec is not None and stored != args.codec:
        session.close()
        raise ConfigError(f"{args.store} was created with codec '{stored}'; a store's codec is fixed when it is "
                          f"created: ingest into a new --store for '{args.codec}'")
    results: list[dict[str, Any]] = []
    try:
        for path in args.paths:
            last = session.memory.last_document()
            resolved = str(Path(path).expanduser().resolve())
            if last is not None and last.name == resolved and not last.complete and not args.json:
                print(f"resuming {path} at byte {last.bytes_done:,} of {last.size_bytes:,} "
                      f"({last.token_end - last.token_start:,} tokens already stored)", file=sys.stderr)
            bar = _IngestBar(path, hidden=args.json)
            try:
                report = session.ingest_file(path, progress=bar.report)
            finally:
                bar.close()
            results.append({"path": path, **report.model_dump()})
            if not args.json:
                if report.already_ingested:
                    print(f"{path}: already in the store ({report.document_tokens:,} tokens); nothing to do")
                else:
                    resumed = f", resumed at byte {report.resumed_from_byte:,}" if report.resumed_from_byte else ""
                    print(f"{path}: {report.tokens:,} tokens in {report.seconds:.0f} s "
                          f"({report.tokens_per_second:,.0f} tok/s), {report.events_sealed:,} events{resumed}")
    except EngramError:
        if args.json and results:  # the files read before the one refused: their reports are not lost
            print(json.dumps(results))
        raise
    except KeyboardInterrupt:
        # tokens_ingested counts the tokens still queued for the model: the commit saved them too.
        print(f"\ninterrupted: {session.tokens_ingested:,} tokens are committed in {args.store}; "
              "run the same command again to resume", file=sys.stderr)
        session.close()
        return 130
    session.close()
    if args.json:
        print(json.dumps(results))
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    lm = _model(args)
    config = lm.config
    if args.allocation is not None or args.coefficients is not None:
        given = argparse.Namespace(mode=args.allocation, coefficients=args.coefficients)
        config = with_options(config, ("allocation",), given, ("mode", "coefficients"),
                               {"mode": "--allocation", "coefficients": "--coefficients"})
    session = lm.session(config, store=args.store, user_id=args.user, agent_id=args.agent,
                         session_id=args.session, read_only=True)
    answer = session.chat(args.question, max_new_tokens=args.max_new_tokens, budget_tokens=args.budget_tokens)
    recalled = session.last_recalled[: args.k]  # the events the answer attended to, best match first
    plan = session.last_plan
    read = None if plan is None else {
        "budget_tokens": plan.budget, "events": None if plan.events is None else list(plan.events),
        "theta": None if plan.theta is None else dataclasses.asdict(plan.theta),
        "features": plan.features, "context_tokens": plan.context_tokens,
        "window_from": plan.window_from, "window_gap": None if plan.window_gap is None else list(plan.window_gap)}
    if args.json:
        print(json.dumps({"answer": answer, "recalled": [r.model_dump(mode="json") for r in recalled], "plan": read}))
    else:
        print(answer.strip())
        if args.show_recall and plan is not None:
            pinned = "each layer's own recall" if plan.events is None else f"{len(plan.events)} events"
            print(f"  read: {pinned}, at most {plan.budget} memory tokens per layer, "
                  f"{plan.context_tokens} context tokens in all")
            if plan.theta is not None:
                t = plan.theta
                print(f"  theta: k={t.k} events, s={t.s} tokens each, n={t.n} rounds, m={t.m} demonstrations, "
                      f"w={t.w} window tokens")
                print("  features: " + ", ".join(f"{name} {'not measured' if value is None else f'{value:.3g}'}"
                                                 for name, value in plan.features.items()))
            if plan.window_from is not None:  # part of the local window only
                upto = "the question" if plan.window_gap is None else f"{plan.window_gap[0]}, then the question"
                print(f"  window: stream tokens from {plan.window_from} to {upto}")
        for r in recalled if args.show_recall else []:
            print(f"  [{r.score:+.2f}] event {r.event_id} (tokens {r.token_start}-{r.token_end}): "
                  f"{_one_line(r.text)}")
    session.close()
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engramkv import EngineConfig, calibrate

    base = config_file(args.config) if args.config else EngineConfig()
    cfg = with_options(base, ("calibration",), args, ("tasks", "lengths", "samples", "design_size"))
    out = output_file(args.out)
    if args.fit_only and args.refeature:
        raise InputError("--refeature measures features with the model; it cannot be combined with --fit-only")
    if args.model:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": args.model})})
    lm = None if args.fit_only else _model(args)  # a fit alone needs the model's tokenizer, not its weights
    report = calibrate(lm, cfg, out, Path(args.work_dir), fit_only=args.fit_only,
                       model_id=args.model_id, progress=None if args.json else _progress_line,
                       refeature_only=args.refeature)
    if args.json:
        print(report.model_dump_json())
        return 0
    print(f"fitted on {report.observations} answers, held out {report.held_out}; wrote {args.out}")
    for name, fit in report.fits.items():
        print(f"  {name:15s} R^2 {fit.r2:+.3f}  MSE {fit.mse:.4f} per answer; R^2 {fit.r2_cells:+.3f}  "
              f"MSE {fit.mse_cells:.4f} per task, length and theta (held-out samples); ridge {fit.ridge:g}")
    for name, score in report.held_out_scores.items():
        print(f"  held-out mean score, {name:20s} {score:.3f} at {report.held_out_context[name]:.0f} context tokens")
    print(f"  best fixed theta {report.best_fixed_theta}; default {report.default_theta}")
    return 0


def cmd_fit_bases(args: argparse.Namespace) -> int:
    from engramkv import EngineConfig, fit_lowrank_bases

    out = output_file(args.out)
    if out.exists() and not args.force:
        raise InputError(f"{out} exists; pass --force to replace it")
    texts = [read_text(path) for path in args.text] if args.text else None
    names = ("tokens", "key_error", "early_key_error", "early_layers", "value_error", "heads_per_group",
             "weight_keys", "weight_values")
    with_options(config_file(args.config) if args.config else EngineConfig(), ("store", "lowrank"), args, names)
    lm = _model(args)  # the options are checked above: a wrong one is refused before the load, not after it
    base = config_file(args.config, lm.config) if args.config else lm.config
    cfg = with_options(base, ("store", "lowrank"), args, names)
    bases = fit_lowrank_bases(lm, cfg, texts, progress=None if args.json else _progress_line)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        bases.save(out)
    except OSError as err:
        raise InputError(f"cannot write the bases to {out}: {err.strerror or err}") from err
    sizes = {"keys": [p.code_bits for p in bases.keys], "values": [p.code_bits for p in bases.values]}
    if args.json:
        print(json.dumps({"out": str(out), "code_bits": sizes, "errors": bases.errors}))
        return 0
    fp16 = lm.spec.num_kv_heads * lm.spec.head_dim * 16
    for name in ("keys", "values"):
        bits = sizes[name]
        print(f"  {name:6s} code bits per token per layer {min(bits)}-{max(bits)} (mean {sum(bits) / len(bits):.0f}; "
              f"fp16: {fp16}); held-out relative error {max(bases.errors[name]):.3f} at most")
    print(f"wrote {out}; use it with store.codec 'lowrank' and store.lowrank.bases")
    return 0


def _progress_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_recall(args: argparse.Namespace) -> int:
    lm = _model(args)
    session = _session(lm, args, read_only=True)
    results = session.recall(args.query, k=args.k)
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in results]))
    else:
        for r in results:
            where = f" from {Path(r.document).name}" if r.document else ""
            print(f"[{r.score:+.2f}] event {r.event_id}, tokens {r.token_start}-{r.token_end}{where}:")
            print(f"    {_one_line(r.text, 300)}")
        if not results:
            print("no events stored in this namespace")
    session.close()
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    lm = _model(args)
    session = _session(lm, args, read_only=True)
    stats = session.stats()
    session.close()
    if args.json:
        print(stats.model_dump_json())
    else:
        for key, value in stats.model_dump().items():
            shown = f"{value:,}" if isinstance(value, int) else (", ".join(value) or "-") if isinstance(value, list) \
                else value
            print(f"{key:>17}: {shown}")
    return 0


def cmd_sessions(args: argparse.Namespace) -> int:
    lm = _model(args)
    lm.open_store(args.store, read_only=True)  # a store that does not exist is an error, not made empty to delete in
    store = lm.open_store(args.store, read_only=args.action == "list")
    if args.action == "list":
        rows = store.namespaces()
        if args.json:
            print(json.dumps([row.__dict__ for row in rows]))
        else:
            for row in rows:
                print(f"{row.user_id}/{row.agent_id}/{row.session_id}: {row.tokens:,} tokens, {row.events:,} events, "
                      f"{row.documents} documents, {row.disk_bytes / 2**20:,.1f} MiB")
            if not rows:
                print("no sessions in this store")
    else:
        if not args.yes and sys.stdin.isatty():
            answer = input(f"delete {args.user}/{args.agent}/{args.session} and all its events? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing deleted")
                return 1
        store.delete_namespace(args.user, args.agent, args.session)
        print(f"deleted {args.user}/{args.agent}/{args.session}")
    lm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from engramkv.tui.app import ChatApp

    app = ChatApp(lambda: load_model(args.model, quiet=True), args.store, args.user, args.agent, args.session)
    app.run()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from engramkv.server.app import create_app
    except ImportError as err:
        raise ConfigError(f"engramkv serve needs FastAPI and uvicorn ({err}): pip install 'engramkv[serve]'") from err

    token = args.token or os.environ.get("ENGRAMKV_API_TOKEN") or None
    loopback = ["127.0.0.1", "localhost", "::1"]
    if args.host not in loopback and token is None:
        raise ConfigError(f"serving on {args.host} reaches other machines: give --token (or set ENGRAMKV_API_TOKEN)")
    if args.max_open < 1:
        raise ConfigError(f"--max-open must be at least 1, not {args.max_open}")
    lm = _model(args)
    app = create_app(lm, args.store, token, files_root=args.files_root,
                     allowed_hosts=loopback if args.host in loopback else None, max_open=args.max_open)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


# ---------------------------------------------------------------------- plumbing
def _session(lm: Any, args: argparse.Namespace, read_only: bool = False) -> Any:
    return lm.session(store=args.store, user_id=args.user, agent_id=args.agent, session_id=args.session,
                      read_only=read_only)


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


COMMANDS = {"ingest": cmd_ingest, "ask": cmd_ask, "recall": cmd_recall, "calibrate": cmd_calibrate,
            "fit-bases": cmd_fit_bases, "stats": cmd_stats, "sessions": cmd_sessions, "chat": cmd_chat,
            "serve": cmd_serve}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (`cli.parser`), each wired to its `cmd_*` function."""
    return parser_for(COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except EngramError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        while _loaded:
            _loaded.pop().close()


if __name__ == "__main__":
    sys.exit(main())
