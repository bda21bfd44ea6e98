"""One store, many processes, a PostgreSQL catalog (issue 20): writers of different namespaces side by side,
readers beside them, a second writer of a namespace refused with its holder named, a killed writer's lock
released by the server. Runs against the test PostgreSQL server (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import tiny_pair

from engramkv import EngineConfig
from engramkv.config import StoreConfig
from engramkv.storage import catalog
from engramkv.storage import store as store_module
from engramkv.storage.store import EventStore

HERE = Path(__file__).resolve().parent
CONFIG = ('{"window": {"chunk_size": 32, "n_sink": 8, "n_local": 64}, "recall": {"budget_tokens": 64}, '
          '"segmentation": {"min_event": 4, "max_event": 24}, "store": {"codec": "int8", "commit_tokens": 64, '
          '"catalog_url": CATALOG}}')
PRELUDE = f"""
import json, os, random, sys, time
sys.path.insert(0, {str(HERE)!r})
from conftest import tiny_pair
from engramkv import EngineConfig, StoreLockedError
"""

WRITER = PRELUDE + """
store, url, user, low, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
_, lm = tiny_pair("llama", EngineConfig.model_validate_json(CONFIG.replace("CATALOG", json.dumps(url))))
session = lm.session(store=store, user_id=user)
print("open", flush=True)
rng = random.Random(low)
for i in range(rounds):  # this namespace's text: numbers in [low, low + 80)
    session.ingest(" ".join(str(rng.randrange(low, low + 80)) for _ in range(96)))
    session.commit()
    print("committed", session.events, flush=True)
if rounds < 100:
    print("holding", session.events, flush=True)
    sys.stdin.readline()  # the namespace stays open (and locked) until the test says so
session.close()
print("done", flush=True)
"""

READER = PRELUDE + """
store, url, user, low, flag = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
_, lm = tiny_pair("llama", EngineConfig.model_validate_json(CONFIG.replace("CATALOG", json.dumps(url))))
until = time.monotonic() + 300
while True:  # opened once, then kept up to date by refresh
    try:
        session = lm.session(store=store, user_id=user, read_only=True)
        break
    except Exception:  # the namespace is not created yet
        time.sleep(0.2)
checks, first, last_round = 0, session.events, False
while not last_round and time.monotonic() < until:
    last_round = os.path.exists(flag)  # the writers are done: one more round sees all they committed
    session.refresh()
    events = session.events
    assert session.tokens_ingested == session.memory.committed_tokens, "the window is not the last commit's"
    for hit in session.recall(" ".join(str(low + j) for j in range(0, 80, 7)), k=5):
        words = [int(w) for w in hit.text.split()]
        assert all(low <= w < low + 80 for w in words), ("another namespace's text", user, hit.text)
        assert hit.event_id < events, ("an event past the reader's view", hit.event_id, events)
        checks += 1
    time.sleep(0.1)
print("reader", checks, session.events, first, flush=True)
session.close()
lm.close()
"""

SECOND_WRITER = PRELUDE + """
store, url, user = sys.argv[1], sys.argv[2], sys.argv[3]
_, lm = tiny_pair("llama", EngineConfig.model_validate_json(CONFIG.replace("CATALOG", json.dumps(url))))
try:
    lm.session(store=store, user_id=user)
    print("opened", flush=True)
except StoreLockedError as err:
    print("locked:", err, flush=True)
"""


def _spawn(script: str, *args: str) -> subprocess.Popen:
    code = f"CONFIG = {CONFIG!r}\n" + script
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, word: str, timeout: float = 120) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith(word):
            return line
        assert time.monotonic() < deadline, f"no {word!r} in time"
    raise AssertionError(f"process ended before {word!r}: {proc.stderr.read() if proc.stderr else ''}")


@pytest.fixture
def pg_url(postgres_server: str) -> str:
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(host=postgres_server, user="engramkv", dbname="postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"postgresql+psycopg://engramkv@/{name}?host={postgres_server}"


def test_writers_of_two_namespaces_and_six_readers_share_one_store(tmp_path, pg_url):
    store = str(tmp_path / "store")
    first = _spawn(WRITER, store, pg_url, "alice", "0", "6")
    _wait_for(first, "open")  # the store exists (created by one process, not raced by two)
    second = _spawn(WRITER, store, pg_url, "bob", "80", "6")
    _wait_for(second, "open")
    flag = tmp_path / "writers-done"
    readers = [_spawn(READER, store, pg_url, user, low, str(flag)) for user, low in (("alice", "0"), ("bob", "80")) * 3]

    # a second writer of a namespace is refused, and told who holds it
    rival = _spawn(SECOND_WRITER, store, pg_url, "alice")
    out, err = rival.communicate(timeout=120)
    assert out.startswith("locked:") and f"pid {first.pid}" in out, out + err

    final = {user: int(_wait_for(writer, "holding").split()[1]) for user, writer in (("alice", first), ("bob", second))}
    flag.touch()
    seen = []
    for reader in readers:
        out, err = reader.communicate(timeout=300)
        assert reader.returncode == 0, err
        checks, last, opened_with = map(int, out.split()[1:4])
        assert checks > 0 and last >= opened_with, out
        seen.append(last)
    for writer in (first, second):
        out, err = writer.communicate("\n", timeout=300)
        assert writer.returncode == 0 and "done" in out, err
    # each reader, opened once, saw every commit of its namespace by refreshing
    assert seen == [final["alice"], final["bob"]] * 3

    # a writer killed while it holds its namespace: the server drops its connection, and the lock with it
    doomed = _spawn(WRITER, store, pg_url, "carol", "160", "1000")
    _wait_for(doomed, "committed")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=60)
    after = _spawn(SECOND_WRITER, store, pg_url, "carol")
    out, err = after.communicate(timeout=120)
    assert out.startswith("opened"), out + err


def test_processes_starting_on_a_new_store_at_once_all_open_the_one_store_created(tmp_path, pg_url, monkeypatch):
    """Four openers of a new shared store, each held at a barrier until all four are about to open its catalog
    (or 3 s have passed: the barrier then lets everyone through). Without the store's opening lock all four
    create its tables and its record at the same moment and some of them fail; with it one creates the store
    and the others open it, and directory and catalog name the same store."""
    _, lm = tiny_pair("llama", EngineConfig.model_validate_json(CONFIG.replace("CATALOG", json.dumps(pg_url))))
    cfg = StoreConfig(codec="int8", catalog_url=pg_url)
    real, barrier = catalog.open_catalog, threading.Barrier(4)

    def open_in_step(url, writable=True):
        try:
            barrier.wait(timeout=3)
        except threading.BrokenBarrierError:  # the others are waiting for this one's lock
            pass
        return real(url, writable)

    monkeypatch.setattr(catalog, "open_catalog", open_in_step)
    stores, errors = [], []

    def open_store() -> None:
        try:
            stores.append(EventStore(tmp_path / "store", lm.spec, cfg))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(stores) == 4, errors
    assert (tmp_path / "store" / "STORE_ID").read_text() == catalog.store_info(stores[0].db).store_uuid
    for store in stores:
        store.close()
    EventStore(tmp_path / "store", lm.spec, cfg, read_only=True).close()  # and it opens again


def test_a_namespace_deleted_before_its_writer_locks_it_is_created_anew(tmp_path, pg_url, monkeypatch):
    """A writer looks its namespace up, another process deletes it, then the writer takes its lock: the writer
    must not write into the deleted one (its rows are gone) but into a namespace created again."""
    _, lm = tiny_pair("llama", EngineConfig.model_validate_json(CONFIG.replace("CATALOG", json.dumps(pg_url))))
    cfg = StoreConfig(codec="int8", catalog_url=pg_url)
    writer, other = EventStore(tmp_path / "store", lm.spec, cfg), EventStore(tmp_path / "store", lm.spec, cfg)
    writer.namespace("alice", summary_layers=[0]).close()
    real, deleted = store_module.NamespaceLock, []

    def deleted_first(db, ns_id, label):
        if not deleted:  # between the writer's lookup and its lock
            deleted.append(ns_id)
            other.delete_namespace("alice")
        return real(db, ns_id, label)

    monkeypatch.setattr(store_module, "NamespaceLock", deleted_first)
    memory = writer.namespace("alice", summary_layers=[0])
    assert memory.ns_id != deleted[0] and catalog.namespace_state(writer.db, memory.ns_id) is not None
    memory.close()
    writer.close()
    other.close()
