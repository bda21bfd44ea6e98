"""Kill an ingesting process at random points; check the store after each kill; resume; compare.

    python tests/crash_harness.py --kills 100          # the full run (results under benchmarks/results/)
    python tests/crash_harness.py --worker STORE TEXT  # one ingest (what the harness starts and kills)

The worker ingests a text file into a store with a tiny random Llama (same seed, so every process
computes the same thing) and commits every few chunks. The harness starts it, waits until it is
ingesting, sends SIGKILL after a random delay, then opens the store itself: it must open, every
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
    report = session.ingest_file(text_path)
    session.close()
    print("done", report.model_dump_json(), flush=True)


def make_text(path: Path, n_tokens: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    path.write_text(" ".join(str(rng.randrange(256)) for _ in range(n_tokens)) + "\n")


def run_worker(store: Path, text: Path, kill_after: float | None) -> float | None:
    """Run one worker; kill it `kill_after` seconds into its ingest.

    Returns the seconds its ingest took if it finished on its own, None if it was killed.
    """
    proc = subprocess.Popen([sys.executable, __file__, "--worker", str(store), str(text)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ingesting"):
        proc.wait()
        raise RuntimeError(f"worker failed to start: {line}{proc.stderr.read() if proc.stderr else ''}")
    started = time.perf_counter()
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed: {err}")
    return time.perf_counter() - started


def check_store(store: Path) -> dict[str, int]:
    """Open (which recovers), verify checksums, segments == catalog, checkpoint loads."""
    from conftest import tiny_pair

    from engramkv import EngineConfig
    from engramkv.storage.segments import BlobRef

    _, lm = tiny_pair("llama", EngineConfig.model_validate(WORKER_CONFIG))
    event_store = lm.open_store(store)
    ns = event_store.namespace()
    verified = ns.verify()
    committed = [BlobRef(ns._segment[i], ns._offset[i], ns._length[i], ns._crc[i]) for i in range(len(ns))]
    on_disk = [ref for seg in sorted({r.segment for r in committed}) for ref in ns.segments.scan(seg)]
    files = sorted(p.name for p in (ns.dir / "segments").glob("*.seg"))
    assert on_disk == committed, "segment files and catalog disagree"
    assert len(files) == len({r.segment for r in committed}) or not committed, files
    if ns.checkpoint_name is not None:
        ns.load_checkpoint()
    ns.close()
    lm.close()
    return {"events": verified}


def events_of(store: Path) -> list[tuple[int, int, int]]:
    from conftest import tiny_pair

    from engramkv import EngineConfig

    _, lm = tiny_pair("llama", EngineConfig.model_validate(WORKER_CONFIG))
    ns = lm.open_store(store, read_only=True).namespace()
    events = [(ns._start[i], ns._end[i], ns._crc[i]) for i in range(len(ns))]
    ns.close()
    lm.close()
    return events


def harness(workdir: Path, kills: int, n_tokens: int, seed: int = 0, log: Any = print) -> dict[str, Any]:
    rng = random.Random(seed)
    text = workdir / "doc.txt"
    make_text(text, n_tokens)
    duration = run_worker(workdir / "reference", text, kill_after=None)
    reference = events_of(workdir / "reference")
    tried, runs, complete_runs, missed = 0, 0, 0, 0
    while tried < kills:
        store = workdir / f"crash-{runs}"
        runs += 1
        stored = 0
        while True:
            # A kill lands anywhere in what is left of the ingest (a resumed worker has less to do).
            left = duration * max(0.05, 1 - stored / len(reference))
            delay = rng.uniform(0.0, left) if tried < kills else None  # kill budget spent: let it finish
            finished = run_worker(store, text, kill_after=delay) is not None
            if finished:
                missed += delay is not None
                break
            tried += 1
            stored = check_store(store)["events"]
            log(f"kill {tried}: after {delay:.2f} s, store holds {stored} verified events")
        complete_runs += 1
        got = events_of(store)
        assert got == reference, f"resumed ingest differs: {len(got)} events vs {len(reference)}"
        log(f"run {runs}: resumed to completion, {len(got)} events equal the uninterrupted run")
    return {"kills": tried, "kills_that_came_too_late": missed, "runs_completed_and_compared": complete_runs,
            "reference_events": len(reference), "tokens": n_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("STORE", "TEXT"))
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=12_000)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    import tempfile

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="engramkv-crash-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = harness(workdir, args.kills, args.tokens)
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = HERE.parent / "benchmarks" / "results"
    (out / "crash.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "crash.md").write_text(
        f"# Crash safety (SIGKILL during ingest)\n\n{result['kills']} kill points at random times; after each the "
        f"store opened, every checksum verified, segments matched the catalog and the checkpoint loaded. "
        f"{result['runs_completed_and_compared']} resumed runs finished and matched the uninterrupted run's "
        f"{result['reference_events']} events exactly ({result['tokens']} tokens, tiny Llama). "
        f"{result['kills_that_came_too_late']} more kill times fell after the worker had finished (not counted). "
        f"Run time {result['seconds']} s.\n\nCommand: `python tests/crash_harness.py --kills {result['kills']} "
        f"--tokens {result['tokens']}`\n"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
