"""Damage a store's files in seeded ways; every damaged store must be refused clearly or read correctly.

    python tests/corruption_fuzz.py --cases 200      # the full run (results under benchmarks/results/corruption/)
    python tests/corruption_fuzz.py --worker DIR     # reads cases as JSON lines on stdin (what the fuzz starts)

One pristine store is written by a tiny random Llama (several commits: several segments, index files, a
checkpoint). Each case copies it, damages one file of one kind (the catalog, a segment, an index file, the
index manifest, the checkpoint, STORE_ID) by truncating it, flipping bytes, zeroing a run of bytes or
deleting it, then opens the copy as a user would (a writable session) and reads everything back: every
committed blob verified, every event's KV in every layer, and a short greedy reply. Outcomes:

- refused: a `StoreError` (a damaged file is a `StoreCorruptError` naming it);
- intact: it opened and read exactly what the pristine store holds (the same events, the same KV, the same
  reply), e.g. a damaged index rebuilt from the blobs;
- recovered: it opened at an earlier commit, and what it holds is a prefix of the pristine events, bit-equal;
- damaged answer (a failure): it opened and served KV or a reply that the pristine store does not hold;
- crash (a failure): any other exception, a signal, or a case that hangs past its timeout.

Workers run the cases in batches, each case in-process, so a crash by signal loses only that case: the
parent records it and starts a new worker on the rest.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from crash_harness import WORKER_CONFIG  # noqa: E402 - the crash harness's store, its indexes saved more often

CONFIG: dict[str, Any] = {**WORKER_CONFIG, "store": {**WORKER_CONFIG["store"], "index_save_events": 10}}
KINDS = ("catalog", "segment", "index", "manifest", "checkpoint", "store_id")
DAMAGES = ("truncate", "flip", "zero", "delete")
PROMPT = [5, 17, 99, 3, 42]


def _lm() -> Any:
    from conftest import tiny_pair

    from engramkv import EngineConfig

    return tiny_pair("llama", EngineConfig.model_validate(CONFIG))[1]


def build(store: Path, n_tokens: int = 700) -> dict[str, Any]:
    """Write the pristine store; return what reading it gives (the reference every case is held to)."""
    lm = _lm()
    rng = random.Random(0)
    with lm.session(store=store) as session:
        session.ingest(" ".join(str(rng.randrange(256)) for _ in range(n_tokens)))
    lm.close()
    return read_back(store)


def read_back(store: Path) -> dict[str, Any]:
    """Open as a user would and read everything: blobs verified, every event's KV, a reply."""
    import hashlib

    lm = _lm()
    try:
        # A writable open first, as a user's would: it recovers what it can (trims past the last commit,
        # rebuilds damaged indexes). Then a read-only one reads, so the reply is not committed to the store.
        lm.session(store=store).close()
        session = lm.session(store=store, read_only=True)
        memory = session.memory
        memory.verify()
        digests = []
        for event in range(len(memory)):
            h = hashlib.sha256()
            for layer in range(lm.spec.num_layers):
                keys, values = memory.gather(layer, [event])
                h.update(keys.float().numpy().tobytes())
                h.update(values.float().numpy().tobytes())
            digests.append(h.hexdigest())
        reply = session.generate_ids(PROMPT, max_new_tokens=6)
        tokens = session.tokens_ingested
        session.close()
        return {"events": digests, "reply": reply, "tokens": tokens}
    finally:
        lm.close()


def files_of(store: Path, kind: str) -> list[Path]:
    pattern = {"catalog": "catalog.sqlite*", "segment": "*.seg", "index": "*.faiss", "manifest": "manifest.json",
               "checkpoint": "checkpoint-*", "store_id": "STORE_ID"}[kind]
    return sorted(p for p in store.rglob(pattern) if p.is_file())


def damage(path: Path, how: str, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if how == "delete":
        path.unlink()
        return "deleted"
    if not data:
        path.write_bytes(b"\x00")
        return "empty file given one byte"
    if how == "truncate":
        at = rng.randrange(len(data))
        path.write_bytes(bytes(data[:at]))
        return f"truncated to {at} of {len(data)} bytes"
    if how == "flip":
        spots = sorted(rng.randrange(len(data)) for _ in range(rng.choice((1, 1, 4, 32))))
        for at in spots:
            data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"{len(spots)} bits flipped at {spots[:4]}{'...' if len(spots) > 4 else ''} of {len(data)} bytes"
    at = rng.randrange(len(data))
    width = rng.choice((8, 512, 4096))
    data[at : at + width] = bytes(len(data[at : at + width]))
    path.write_bytes(bytes(data))
    return f"{width} bytes zeroed at {at} of {len(data)}"


def judge(case_store: Path, pristine: dict[str, Any]) -> tuple[str, str]:
    from engramkv.errors import StoreError

    try:
        got = read_back(case_store)
    except StoreError as err:
        return "refused", f"{type(err).__name__}: {err}"[:600]
    n = len(got["events"])
    if got["events"] != pristine["events"][:n]:
        bad = next(i for i, (a, b) in enumerate(zip(got["events"], pristine["events"])) if a != b) \
            if n <= len(pristine["events"]) else len(pristine["events"])
        return "damaged answer", f"event {bad}'s KV is not the pristine store's"
    if n == len(pristine["events"]) and got["tokens"] == pristine["tokens"]:
        if got["reply"] != pristine["reply"]:
            return "damaged answer", f"reply {got['reply']} != {pristine['reply']}"
        return "intact", ""
    return "recovered", f"{n} of {len(pristine['events'])} events, {got['tokens']} tokens"


def worker(workdir: Path) -> None:
    pristine_dir = workdir / "pristine"
    pristine = json.loads((workdir / "pristine.json").read_text())
    for line in sys.stdin:
        case = json.loads(line)
        rng = random.Random(case["seed"])
        target = workdir / f"case-{case['seed']}"
        shutil.copytree(pristine_dir, target)
        candidates = files_of(target, case["kind"])
        path = rng.choice(candidates)
        what = damage(path, case["damage"], rng)
        print(json.dumps({"seed": case["seed"], "started": True}), flush=True)
        try:
            outcome, detail = judge(target, pristine)
        except Exception as err:  # noqa: BLE001 - every other exception is what this fuzz looks for
            frames = traceback.extract_tb(err.__traceback__)[::-1][:6]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames)
            outcome, detail = "crash", f"{type(err).__name__}: {err}"[:600] + f" (at {where})"
        shutil.rmtree(target, ignore_errors=True)
        print(json.dumps({**case, "file": str(path.relative_to(target)), "damage_done": what, "outcome": outcome,
                          "detail": detail}), flush=True)


def plan(n_cases: int, seed: int = 0) -> list[dict[str, Any]]:
    """Every kind with every damage, round robin, seeded."""
    return [{"seed": seed * 100_000 + i, "kind": KINDS[i % len(KINDS)],
             "damage": DAMAGES[(i // len(KINDS)) % len(DAMAGES)]} for i in range(n_cases)]


def run(n_cases: int, workdir: Path, seed: int = 0, case_timeout: float = 120.0) -> list[dict[str, Any]]:
    pristine = build(workdir / "pristine")
    (workdir / "pristine.json").write_text(json.dumps(pristine))
    todo = plan(n_cases, seed)
    results: list[dict[str, Any]] = []
    while todo:
        errors = open(workdir / "worker.err", "w+")  # a file, not a pipe: warnings must not fill it and block
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(workdir)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=errors, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("".join(json.dumps(c) + "\n" for c in todo))
        proc.stdin.close()
        current = None
        deadline = time.monotonic() + case_timeout
        for line in proc.stdout:
            record = json.loads(line)
            if record.get("started"):
                current, deadline = record["seed"], time.monotonic() + case_timeout
                continue
            results.append(record)
            todo = [c for c in todo if c["seed"] != record["seed"]]
            current = None
            if time.monotonic() > deadline:
                break
        try:
            proc.wait(timeout=case_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        errors.seek(0)
        stderr = errors.read()[-300:]
        errors.close()
        if current is not None:  # the worker died (or hung) inside this case
            case = next(c for c in todo if c["seed"] == current)
            results.append({**case, "outcome": "crash", "detail": f"worker exited {proc.returncode}: {stderr}"})
            todo = [c for c in todo if c["seed"] != current]
        elif todo and proc.returncode != 0:
            raise RuntimeError(f"worker failed outside a case: {stderr}")
    return results


def summary(results: list[dict[str, Any]]) -> str:
    by_kind: dict[str, Counter[str]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], Counter())[r["outcome"]] += 1
    outcomes = ("refused", "intact", "recovered", "damaged answer", "crash")
    lines = ["| file | " + " | ".join(outcomes) + " |", "|---" * (len(outcomes) + 1) + "|"]
    for kind in KINDS:
        counts = by_kind.get(kind, Counter())
        lines.append(f"| {kind} | " + " | ".join(str(counts[o]) for o in outcomes) + " |")
    total = Counter(r["outcome"] for r in results)
    lines.append("| **all** | " + " | ".join(f"**{total[o]}**" for o in outcomes) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="another seed, other damages")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args.cases, Path(tmp), args.seed)
    table = summary(results)
    print(table)
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    from _common import RESULTS, write_results

    from engramkv import EngineConfig

    header = (f"# Corruption fuzz: {len(results)} seeded damages ({time.perf_counter() - started:.0f} s)\n\n"
              "Outcomes per damaged file kind (`tests/corruption_fuzz.py`): refused with a StoreError, intact "
              "(read exactly as the pristine store), recovered (an earlier commit, bit-equal), damaged answer "
              "and crash (failures).\n\n")
    print("wrote", *write_results(RESULTS / "corruption", "corruption", {"cases": results}, header + table + "\n",
                                  EngineConfig.model_validate(CONFIG)))


if __name__ == "__main__":
    main()
