"""Sharded ingest: one document cut at paragraphs, each shard read by a Ray worker, merged in document order.

    plan    the file's bytes cut into N ranges of about equal size at paragraph breaks ("\\n\\n", else a line
            break, else a space): `plan_shards`
    read    each shard on a worker (`read_shard`), into a store of its own, STORE/shards/<document>-<N>/<i>/. A
            shard after the first reads the document's own first `n_sink` tokens before its text, so every
            shard attends to the sinks the whole document has; its local window starts cold, so segmentation
            near a cut differs a little from one sequential read. A shard whose worker dies is read again
            from an empty directory (Ray's task retries); a finished shard leaves a RESULT file, and a rerun
            of the same ingest (after Ctrl-C or a kill of the driver) reads only the shards without one.
    merge   in the driver, shard by shard: the shard's segment files become the namespace's next segments
            as written (hard links, `SegmentLog.adopt`; keys are stored without RoPE, so KV does not depend on
            position), each event's id moved past the events and its span past the tokens of the shards before,
            its blob checksummed and its index entries taken from the shard's (`NamespaceMemory.adopt`); then
            ONE commit, with the last shard's resident window moved the same way
            (`engine.state.shifted_snapshot`) and the document complete. A kill before that commit leaves the
            namespace as it was (opening the store deletes the adopted files), after it the whole document.

Ray is optional (`pip install 'engramkv[ray]'`), imported only when a document is cut into more than one shard.
Workers load the model through the `EpisodicLM.loader` they are given, so they must see the same files.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engramkv.config import EngineConfig
from engramkv.documents import CheckedDocument, read_text, tokenize_pieces
from engramkv.engine.state import shifted_snapshot
from engramkv.errors import (EmptyInputError, EngramError, SessionError, StoreCorruptError, StoreError,
                             StoreMismatchError, WorkerError)
from engramkv.memory.events import DocumentProgress, Event, PersistentMemory
from engramkv.results import IngestProgress
from engramkv.storage.durable import replace_durably
from engramkv.storage.namespace import NamespaceMemory
from engramkv.storage.segments import SegmentError
from engramkv.storage.store import BASES_FILE, EventStore

MERGE_BATCH = 256  # events merged at once (their blobs checksummed, their index entries taken or decoded together)
_SCAN = 1 << 16  # bytes searched after a cut's target for a paragraph break


@dataclass(frozen=True)
class Shard:
    index: int
    start: int  # first byte (a character boundary)
    end: int  # one past the last byte


@dataclass(frozen=True)
class ShardResult:
    index: int
    tokens: int  # tokens of the shard's text (not the sinks read before it)
    sinks: int  # the document's first tokens read before the text (0 for the first shard)
    events: int


def plan_shards(path: Path, size: int, workers: int, min_bytes: int) -> list[Shard]:
    """At most `workers` byte ranges of about size / workers (so about `min_bytes` or more each: fewer ranges
    for a short file), each cut right after the first paragraph break at or past its target."""
    count = max(1, min(workers, size // min_bytes))
    if count == 1:  # (ingest_file asks every time: one shard needs no look at the file)
        return [Shard(0, 0, size)]
    cuts = [0]
    with open(path, "rb") as f:
        for i in range(1, count):
            cut = _break_after(f, i * size // count, size)
            if cuts[-1] < cut < size:
                cuts.append(cut)
    cuts.append(size)
    return [Shard(i, a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def _break_after(f: Any, target: int, size: int) -> int:
    f.seek(target)
    window = f.read(min(_SCAN, size - target))
    for mark in (b"\n\n", b"\n", b" "):
        at = window.find(mark)
        if at >= 0:
            return target + at + len(mark)
    while window and window[0] & 0xC0 == 0x80:  # no break at all: at least a character boundary
        window, target = window[1:], target + 1
    return target


def ingest_sharded(loader: Callable[[], Any] | None, tokenizer: Any, memory: PersistentMemory, config: EngineConfig,
                   document: CheckedDocument, shards: list[Shard],
                   progress: Callable[[IngestProgress], None] | None) -> DocumentProgress:
    """Read `document` in `shards` on Ray workers into the empty namespace `memory`, merged and committed once."""
    if not isinstance(memory, NamespaceMemory) or not memory.writable:
        raise SessionError("a sharded ingest (workers > 1) writes to a store: open the session with store= (not "
                           "read-only)")
    if len(memory) or memory.committed_tokens:
        raise SessionError("a sharded ingest starts a namespace, and this one holds a stream already: ingest into a "
                           "new namespace, or with workers=1")
    if loader is None:
        raise SessionError("a sharded ingest loads the model in each worker: open it with EpisodicLM.from_pretrained, "
                           "or give EpisodicLM(..., loader=) a function that loads it")
    store_path = Path(memory.store.path)
    root = store_path / "shards" / f"{document.content_key[:16]}-{len(shards)}"
    sinks = document_sinks(tokenizer, document, config.window.n_sink)
    plan = json.dumps({"shards": [asdict(s) for s in shards], "sinks": sinks, "codec": memory.codec,
                       "stream": config.stream_settings()}, sort_keys=True)
    if _read(root / "PLAN") != plan:  # results of another plan (or none): start over
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        replace_durably(root / "PLAN", plan.encode())
    results = run_shards(loader, worker_config(config, store_path), document, shards, root, sinks, progress)
    return merge_shards(memory, config, document, root, results, progress)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def worker_config(config: EngineConfig, store_path: Path) -> EngineConfig:
    """The config a worker reads with: the driver's, with a SQLite catalog of the shard's own and, for a lowrank
    store, the destination's own bases (so every blob is encoded alike)."""
    store = config.store.model_copy(update={"catalog_url": None})
    if config.store.codec == "lowrank":
        store = store.model_copy(update={"lowrank": store.lowrank.model_copy(
            update={"bases": str(store_path / BASES_FILE)})})
    return config.model_copy(update={"store": store})


def read_shard(loader: Callable[[], Any], config: EngineConfig, path: str, shard: Shard, directory: str,
               sink_ids: list[int], threads: int, last: bool) -> ShardResult:
    """Read one shard into a new store at `directory` (what was there is removed first); runs on a worker. All
    but the `last` shard seal their local window at the end (the merge keeps only the last shard's)."""
    torch.set_num_threads(threads)
    out = Path(directory)
    with _held(out.with_name(f"{shard.index}.lock")):
        return _read_shard(loader, config, path, shard, out, sink_ids, last)


@contextmanager
def _held(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`, waited for: a worker of a killed driver may still be writing the shard until
    Ray stops it, and the shard's next reader must not remove its files under it."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _read_shard(loader: Callable[[], Any], config: EngineConfig, path: str, shard: Shard, out: Path,
                sink_ids: list[int], last: bool) -> ShardResult:
    shutil.rmtree(out, ignore_errors=True)
    lm = loader()
    progress_file = out.with_name(f"{shard.index}.progress")
    fed = [0]

    def texts() -> Iterator[str]:
        for text, n_bytes in read_text(Path(path), shard.start, shard.end):
            fed[0] += n_bytes
            yield text

    def report(record: IngestProgress) -> None:  # after every chunk: renamed whole, not fsynced (a hint, not state)
        tmp = progress_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "tokens": record.tokens - len(sink_ids),
                                   "events": record.events, "bytes": fed[0]}))
        os.replace(tmp, progress_file)

    try:
        with lm.session(config=config, store=out) as session:
            if sink_ids:
                session.ingest_ids(sink_ids)
            try:
                session.ingest(texts(), progress=report)
            except EmptyInputError:  # whitespace alone: the shard adds no tokens
                pass
            if not last:  # the next shard reads on without this window: its tokens must be events
                session.state.seal_rest()
                session.commit()
            result = ShardResult(shard.index, session.tokens_ingested - len(sink_ids), len(sink_ids), session.events)
    finally:
        lm.close()
    replace_durably(out / "RESULT", json.dumps(asdict(result)).encode())
    return result


def run_shards(loader: Callable[[], Any], config: EngineConfig, document: CheckedDocument, shards: list[Shard],
               root: Path, sink_ids: list[int], progress: Callable[[IngestProgress], None] | None) -> list[ShardResult]:
    """Read every shard without a RESULT under `root` on Ray workers; the results of all, in order."""
    try:
        import ray
    except ImportError:
        raise SessionError("a sharded ingest (workers > 1) runs on Ray: pip install 'engramkv[ray]'") from None
    done = {s.index: _result(root / str(s.index)) for s in shards}
    todo = [s for s in shards if done[s.index] is None]
    cfg = config.shards
    threads = cfg.threads_per_worker or max(1, (os.cpu_count() or 1) // min(cfg.workers, len(shards)))
    started_here = not ray.is_initialized()
    if todo and started_here:
        ray.init(address=cfg.ray_address, num_cpus=None if cfg.ray_address else threads * len(todo),
                 include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(read_shard).options(num_cpus=threads, max_retries=cfg.max_retries, retry_exceptions=False,
                                              num_gpus=1 if config.model.device.startswith("cuda") else 0)
        pending = {task.remote(loader, config, str(document.path), s, str(root / str(s.index)),
                               sink_ids if s.index else [], threads, s.index == len(shards) - 1): s for s in todo}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                shard = pending.pop(ref)
                done[shard.index] = _task_result(ray, ref, shard, cfg.max_retries)
            if progress is not None:
                progress(_progress(root, shards, done, document.size_bytes))
    finally:
        if todo and started_here:
            ray.shutdown()
    return [r for r in done.values() if r is not None]


def _task_result(ray: Any, ref: Any, shard: Shard, retries: int) -> ShardResult:
    try:
        result: ShardResult = ray.get(ref)
        return result
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, EngramError):
            raise err.cause from None
        raise WorkerError(f"shard {shard.index} (bytes {shard.start}-{shard.end}) failed: {err.cause!r}") from None
    except ray.exceptions.RayError as err:
        raise WorkerError(f"shard {shard.index}'s worker died {retries + 1} times ({type(err).__name__}); the "
                          "namespace keeps its last commit; the same ingest again reads unfinished shards") from None


def _result(directory: Path) -> ShardResult | None:
    try:
        return ShardResult(**json.loads((directory / "RESULT").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _progress(root: Path, shards: list[Shard], done: dict[int, ShardResult | None], size: int) -> IngestProgress:
    tokens = events = read = 0
    for shard in shards:
        result = done[shard.index]
        if result is not None:
            tokens, events, read = tokens + result.tokens, events + result.events, read + shard.end - shard.start
            continue
        try:
            record = json.loads((root / f"{shard.index}.progress").read_text())
        except (OSError, ValueError):
            continue
        tokens, events, read = tokens + record["tokens"], events + record["events"], read + record["bytes"]
    return IngestProgress(tokens=tokens, events=events, bytes_read=min(read, size), size_bytes=size)


def document_sinks(tokenizer: Any, document: CheckedDocument, n_sink: int) -> list[int]:
    """The document's first `n_sink` tokens, as the first shard's reader tokenises them."""
    texts = (text for text, _ in read_text(document.path, 0, min(document.size_bytes, 4 * _SCAN)))
    first = next(tokenize_pieces(tokenizer, texts), ([], 0))[0]
    return first[:n_sink]


def merge_shards(memory: NamespaceMemory, config: EngineConfig, document: CheckedDocument, root: Path,
                 results: list[ShardResult], progress: Callable[[IngestProgress], None] | None) -> DocumentProgress:
    """Append every shard's events to `memory` in document order, then commit once with the last shard's window.
    A merge stopped half-way leaves the namespace broken until it is opened again (which deletes what it took in)."""
    try:
        snapshot, position = _adopt_shards(memory, config, document, root, results, progress)
        done = DocumentProgress(name=str(document.path.resolve()), size_bytes=document.size_bytes,
                                content_key=document.content_key, token_start=0, bytes_done=document.size_bytes,
                                token_end=position, complete=True)
        memory.commit(snapshot, done)
    except BaseException as err:
        # The namespace was empty: any segment file is one this merge took in, even before its events were added
        if memory.broken is None and (len(memory) > memory.committed_events or memory.segments.segment_files()):
            memory.broken = f"a sharded ingest's merge stopped half-way ({type(err).__name__})"
        raise
    shutil.rmtree(root, ignore_errors=True)
    try:
        root.parent.rmdir()  # STORE/shards, once no other document's shards wait there
    except OSError:
        pass
    return done


def _adopt_shards(memory: NamespaceMemory, config: EngineConfig, document: CheckedDocument, root: Path,
                  results: list[ShardResult], progress: Callable[[IngestProgress], None] | None
                  ) -> tuple[dict[str, Any], int]:
    """(the last shard's checkpoint moved to the end of the merged stream, the merged stream's tokens)."""
    shard_cfg = worker_config(config, memory.store.path).store
    snapshot = None
    position = 0  # where the next shard's text starts in the merged stream
    for result in results:
        store = EventStore(root / str(result.index), memory.store.spec, shard_cfg, read_only=True)
        try:
            if store.codec != memory.codec:
                raise StoreMismatchError(f"shard {result.index} was written with codec {store.codec}, the store "
                                         f"holds {memory.codec}; remove {root} and ingest again")
            shard = store.namespace(summary_layers=memory.summary_layers)
            shift, first_event = position - result.sinks, len(memory)
            files = shard.segments.segment_files()
            try:  # the shard's blobs stay where they are: its files become the namespace's next segments
                numbers = dict(zip(files, memory.segments.adopt(list(files.values()))))
            except (OSError, SegmentError) as err:
                raise StoreError(f"shard {result.index}'s segments could not be taken into {memory.dir}: "
                                 f"{err}") from err
            for lo in range(0, len(shard), MERGE_BATCH):
                ids = range(lo, min(lo + MERGE_BATCH, len(shard)))
                refs = [shard.blob_ref(i) for i in ids]
                try:
                    blobs = [shard.segments.read(ref, verify=True) for ref in refs]  # views into the shard's maps
                except SegmentError as err:
                    raise StoreCorruptError(f"shard {result.index} in {root} is damaged ({err}): remove the "
                                            "directory and ingest again") from err
                events = [_moved(shard.event(i), shift, first_event) for i in ids]
                # What the shard indexed (the exact key summaries, as a sequential read indexes them), else decoded
                indexed = shard.indexes.flat_entries(lo, len(ids))
                representatives, summaries = indexed or (
                    [memory.layout.representatives(b, e.length) for b, e in zip(blobs, events)],
                    memory.layout.key_summaries(blobs, [e.length for e in events], memory.summary_layers))
                memory.adopt(events, [replace(ref, segment=numbers[ref.segment]) for ref in refs], representatives,
                             summaries)
                del blobs  # the views pin the shard's maps, which close with it
            checkpoint = shard.load_checkpoint()
            snapshot = None if checkpoint is None else {
                **checkpoint, "engine": shifted_snapshot(checkpoint["engine"], shift, first_event)}
            shard.close()
        finally:
            store.close()
        position += result.tokens
        if progress is not None:
            progress(IngestProgress(tokens=position, events=len(memory), bytes_read=document.size_bytes,
                                    size_bytes=document.size_bytes))
    if snapshot is None:
        raise EmptyInputError(f"{document.path} holds no tokens")
    return snapshot, position


def _moved(event: Event, tokens: int, events: int) -> Event:
    return Event(event.id + events, event.start + tokens, event.end + tokens, event.surprise_mean, event.surprise_max)

