"""Kill an ingesting process at random points; check the store after each kill; resume; compare.

    python tests/crash_harness.py --kills 100          # the full run (results under benchmarks/results/crash/)
    python tests/crash_harness.py --worker STORE TEXT  # one ingest (what the harness starts and kills)
    python tests/crash_harness.py --sharded-worker STORE TEXT  # one ingest in 2 shards (tests/test_sharding.py's)

The worker ingests a text file into a store with a tiny random Llama (same seed, so every process
computes the same thing) and commits every few chunks. The harness starts it, picks a random
point of what is left of the ingest, waits until the worker reports reaching it and sends SIGKILL
0-0.1 s later (anywhere in the next chunks, commits included), then opens the store itself: it must open, every
committed blob must verify, the segment files must hold exactly the committed blobs (after the
recovery that opening does), and the checkpoint must load. Then the next worker resumes. When a
worker finishes, the events (spans and blob checksums) must equal those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "benchmarks" / "results" / "crash"
sys.path.insert(0, str(HERE))

WORKER_CONFIG: dict[str, Any] = {
    "window": {"chunk_size": 32, "n_sink": 8, "n_local": 64},
    "recall": {"budget_tokens": 64},
    "segmentation": {"min_event": 4, "max_event": 24},
    "store": {"codec": "int8", "commit_tokens": 96, "index_save_events": 40, "segment_bytes": 65536},
}


def worker(store: str, text_path: str) -> None:
    from conftest import tiny_pair

    from engramkv import EngineConfig

    _, lm = tiny_pair("llama", EngineConfig.model_validate(WORKER_CONFIG))
    session = lm.session(store=store)
    print("ingesting", flush=True)
    report = session.ingest_file(text_path, progress=lambda record: print("tokens", record.tokens, flush=True))
    session.close()
    print("done", report.model_dump_json(), flush=True)


# A sharded ingest (`engramkv.sharding`) in two shards, the worker side of tests/test_sharding.py's driver kills.
SHARDED_CONFIG: dict[str, Any] = {
    "window": {"chunk_size": 32, "n_sink": 8, "n_local": 64},
    "recall": {"budget_tokens": 64},
    "segmentation": {"min_event": 4, "max_event": 24},
    "store": {"codec": "int8", "commit_tokens": 4096, "segment_bytes": 65536},
    "shards": {"min_shard_bytes": 1024, "threads_per_worker": 1},
}


def sharded_worker(store: str, text_path: str) -> None:
    """Ingest `text_path` in two shards; prints "merging" once both are read (the merge follows at once)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    from conftest import tiny_lm

    from engramkv import EngineConfig

    root = Path(store) / "shards"
    said = []

    def report(_record: Any) -> None:
        if not said and len(list(root.glob("*/*/RESULT"))) == 2:
            said.append(True)
            print("merging", flush=True)

    session = tiny_lm("llama", EngineConfig.model_validate(SHARDED_CONFIG)).session(store=store)
    report_ = session.ingest_file(text_path, workers=2, progress=report)
    session.close()
    print("done", report_.model_dump_json(), flush=True)


def make_paragraphs(path: Path, paragraphs: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    path.write_text("\n\n".join(" ".join(str(rng.randrange(256)) for _ in range(rng.randrange(20, 60)))
                                for _ in range(paragraphs)) + "\n")


def run_sharded(store: Path, text: Path, kill: str | None, rng: random.Random) -> str:
    """One sharded ingest (`--sharded-worker`). kill: None, "worker" (SIGKILL a Ray worker mid-shard: the
    driver goes on), "reading" (SIGKILL the driver while the shards are read) or "merging" (the driver, during
    the merge). Returns what happened: "finished", "killed", or "finished after a worker kill"."""
    proc = subprocess.Popen([sys.executable, __file__, "--sharded-worker", str(store), str(text)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if kill in ("worker", "reading"):
        progress = _first_progress(store, proc)
        if progress is not None and kill == "worker":
            os.kill(progress["pid"], signal.SIGKILL)
        elif progress is not None:
            time.sleep(rng.uniform(0.0, 2.0))
            proc.kill()
            proc.wait()
            return "killed"
    elif kill == "merging":
        for line in proc.stdout:
            if line.startswith("merging"):
                time.sleep(rng.uniform(0.0, 0.3))
                proc.kill()
                proc.wait()
                return "killed"
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"sharded ingest failed: {err[-2000:]}")
    return "finished after a worker kill" if kill == "worker" else "finished"


def _first_progress(store: Path, proc: subprocess.Popen[str]) -> dict[str, Any] | None:
    """The first shard progress record with tokens read (the worker's pid in it), or None if the ingest ended."""
    while proc.poll() is None:
        for path in store.glob("shards/*/*.progress"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record["tokens"] > 0:
                return dict(record)
        time.sleep(0.02)
    return None


def sharded_events(store: Path) -> list[tuple[int, int, int]]:
    if not (store / "catalog.sqlite").exists():
        return []
    return events_of(store)


def sharded_harness(workdir: Path, kills: int, paragraphs: int, seed: int = 0, log: Any = print) -> dict[str, Any]:
    """Kills of a worker mid-shard and of the driver while reading and while merging, in turn; after each, the
    store opens and verifies holding nothing or the whole document, and the same ingest run again ends with
    exactly the uninterrupted run's events."""
    rng = random.Random(seed)
    text = workdir / "doc.txt"
    make_paragraphs(text, paragraphs)
    run_sharded(workdir / "reference", text, None, rng)
    reference = sharded_events(workdir / "reference")
    outcomes: dict[str, dict[str, int]] = {}
    for i in range(kills):
        kind = ("worker", "reading", "merging")[i % 3]
        store = workdir / f"sharded-{i}"
        what = run_sharded(store, text, kind, rng)
        after = sharded_events(store)
        if (store / "catalog.sqlite").exists():
            check_store(store)
        assert after in ([], reference), f"kill {i} ({kind}): {len(after)} events, not 0 or {len(reference)}"
        state = "whole" if after else "empty"
        if what == "killed":
            run_sharded(store, text, None, rng)  # the same ingest again
        assert sharded_events(store) == reference, f"kill {i} ({kind}): the rerun differs from the reference"
        assert not (store / "shards").exists(), "the shards' stores outlived the merge"
        outcome = outcomes.setdefault(kind, {})
        outcome[f"{what}, {state}"] = outcome.get(f"{what}, {state}", 0) + 1
        log(f"kill {i + 1} ({kind}): {what}; the store held {state}; after the rerun {len(reference)} events equal "
            "the uninterrupted run's")
    return {"kills": kills, "outcomes": outcomes, "reference_events": len(reference), "paragraphs": paragraphs}


def make_text(path: Path, n_tokens: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    path.write_text(" ".join(str(rng.randrange(256)) for _ in range(n_tokens)) + "\n")


def run_worker(store: Path, text: Path, kill_at: tuple[int, float] | None) -> bool:
    """Run one worker; with kill_at = (tokens, seconds), SIGKILL it `seconds` after it reports `tokens`.

    Returns True if it finished on its own, False if it was killed.
    """
    proc = subprocess.Popen([sys.executable, __file__, "--worker", str(store), str(text)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ingesting"):
        proc.wait()
        raise RuntimeError(f"worker failed to start: {line}{proc.stderr.read() if proc.stderr else ''}")
    if kill_at is not None:
        target, jitter = kill_at
        for line in proc.stdout:  # progress lines come after every chunk
            if line.startswith("tokens") and int(line.split()[1]) >= target:
                # The jitter moves the kill off the progress report, anywhere into the next chunk or commit.
                try:
                    proc.wait(timeout=jitter)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return False
                break
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed: {err}")
    return True


def check_store(store: Path) -> dict[str, int]:
    """Open (which recovers), verify checksums, segments == catalog, checkpoint loads."""
    from conftest import tiny_pair

    from engramkv import EngineConfig
    from engramkv.storage.segments import scan

    _, lm = tiny_pair("llama", EngineConfig.model_validate(WORKER_CONFIG))
    event_store = lm.open_store(store)
    ns = event_store.namespace(summary_layers=[0])
    verified = ns.verify()
    committed = [ns.blob_ref(i) for i in range(len(ns))]
    on_disk = [ref for seg in sorted({r.segment for r in committed}) for ref in scan(ns.segments.directory, seg)]
    files = sorted(p.name for p in (ns.dir / "segments").glob("*.seg"))
    assert on_disk == committed, "segment files and catalog disagree"
    assert len(files) == len({r.segment for r in committed}), files  # none past the last commit: recovery cut them
    if ns.checkpoint_name is not None:
        ns.load_checkpoint()
    committed_tokens = ns.committed_tokens
    ns.close()
    lm.close()
    return {"events": verified, "tokens": committed_tokens}


def events_of(store: Path) -> list[tuple[int, int, int]]:
    from conftest import tiny_pair

    from engramkv import EngineConfig

    _, lm = tiny_pair("llama", EngineConfig.model_validate(WORKER_CONFIG))
    ns = lm.open_store(store, read_only=True).namespace(summary_layers=[0])
    events = [(ns.event(i).start, ns.event(i).end, ns.blob_ref(i).checksum) for i in range(len(ns))]
    ns.close()
    lm.close()
    return events


def harness(workdir: Path, kills: int, n_tokens: int, seed: int = 0, log: Any = print) -> dict[str, Any]:
    rng = random.Random(seed)
    text = workdir / "doc.txt"
    make_text(text, n_tokens)
    run_worker(workdir / "reference", text, kill_at=None)
    reference = events_of(workdir / "reference")
    tried, runs, complete_runs, missed = 0, 0, 0, 0
    while tried < kills:
        store = workdir / f"crash-{runs}"
        runs += 1
        stored_tokens = 0
        while True:
            # Aim at a random point of what is left of the ingest (a resumed worker starts further on).
            kill_at = (rng.randint(stored_tokens, n_tokens), rng.uniform(0.0, 0.1)) if tried < kills else None
            finished = run_worker(store, text, kill_at=kill_at)
            if finished:
                missed += kill_at is not None
                break
            tried += 1
            check = check_store(store)
            stored_tokens = check["tokens"]
            log(f"kill {tried}: {kill_at[1]:.2f} s after {kill_at[0]} tokens; the store holds {check['events']} "
                f"verified events, {stored_tokens} committed tokens")
        complete_runs += 1
        got = events_of(store)
        assert got == reference, f"resumed ingest differs: {len(got)} events vs {len(reference)}"
        log(f"run {runs}: resumed to completion, {len(got)} events equal the uninterrupted run")
    return {"kills": tried, "kills_that_came_too_late": missed, "runs_completed_and_compared": complete_runs,
            "reference_events": len(reference), "tokens": n_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("STORE", "TEXT"))
    parser.add_argument("--sharded-worker", nargs=2, metavar=("STORE", "TEXT"))
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=12_000)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--sharded", action="store_true", help="kill sharded ingests (a worker, the driver while "
                        "reading, the driver while merging, in turn) instead; --kills of them")
    parser.add_argument("--paragraphs", type=int, default=80, help="with --sharded: the document's paragraphs")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.sharded_worker:
        sharded_worker(*args.sharded_worker)
        return
    import tempfile

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="engramkv-crash-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.sharded:
        return write_sharded(sharded_harness(workdir, args.kills, args.paragraphs), started, args)
    result = _recorded(harness(workdir, args.kills, args.tokens), started, WORKER_CONFIG,
                       f"python tests/crash_harness.py --kills {args.kills} --tokens {args.tokens}")
    (RESULTS / "crash.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "crash.md").write_text(
        f"# Crash safety (SIGKILL during ingest)\n\n{result['kills']} kill points at random times; after each the "
        f"store opened, every checksum verified, segments matched the catalog and the checkpoint loaded. "
        f"{result['runs_completed_and_compared']} resumed runs finished and matched the uninterrupted run's "
        f"{result['reference_events']} events exactly ({result['tokens']} tokens, tiny Llama). "
        f"{result['kills_that_came_too_late']} more kill points fell after the worker had finished (not counted). "
        f"Run time {result['seconds']} s.\n\nCommand: `python tests/crash_harness.py --kills {result['kills']} "
        f"--tokens {result['tokens']}` at commit {result['commit']}\n"
    )
    print(json.dumps(result))



def _recorded(result: dict[str, Any], started: float, config: dict[str, Any], command: str) -> dict[str, Any]:
    """`result` with what a result file records: its run time, the commit, the config and the command."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    return {**result, "seconds": round(time.perf_counter() - started, 1), "commit": commit or None, "config": config,
            "command": command}


def write_sharded(result: dict[str, Any], started: float, args: argparse.Namespace) -> None:
    result = _recorded(result, started, SHARDED_CONFIG,
                       f"python tests/crash_harness.py --sharded --kills {args.kills} --paragraphs {args.paragraphs}")
    (RESULTS / "sharded.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| {kind} | {what} | {n} |" for kind, seen in result["outcomes"].items() for what, n in seen.items())
    (RESULTS / "sharded.md").write_text(
        f"# Crash safety of a sharded ingest (SIGKILL of a Ray worker or of the driver)\n\n{result['kills']} kills of "
        f"a 2-shard ingest ({result['paragraphs']} paragraphs, {result['reference_events']} events, the tiny random "
        "Llama), in turn: a worker mid-shard, the driver while the shards were read, the driver during the merge. "
        "After each, the store opened and verified holding nothing or the whole document, and the same ingest run "
        "again ended with exactly the uninterrupted run's events (spans and blob checksums), the shards' stores "
        f"removed.\n\n| kill | what happened, what the store held | times |\n|---|---|---|\n{rows}\n\n"
        f"{result['seconds']:.0f} s; commit {result['commit']}; command `{result['command']}`.\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
