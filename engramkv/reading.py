"""Reading: a session's queue of tokens cut into chunks for the engine, and its commits.

The session hands token ids to `Reader.feed`; whole chunks (`window.chunk_size`) are read by the
engine at once, the rest waits for more or for `flush`. Every `store.commit_tokens` tokens, and when
the session says so, the reader commits the stream to its memory: the engine's snapshot, the queue,
the chat so far and the stream settings, which a reopened stream keeps (`continuing`). A step that fails
half-way, or a commit interrupted half-way, leaves the reader `broken`: the resident state is no
longer whole, the last commit stands.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import ValidationError

from engramkv.config import EngineConfig
from engramkv.documents import IngestRun
from engramkv.engine.state import EpisodicState
from engramkv.errors import ConfigError
from engramkv.memory.events import DocumentProgress, PersistentMemory
from engramkv.results import IngestProgress
from engramkv.retrieval.question import RecallPlan

ProgressCallback = Callable[[IngestProgress], None]


# Stream settings added since commits recorded them, with the value every stream committed before then was read with.
_BEFORE_THE_KNOB = {"segmentation": {"min_surprise": 0.0, "predicted_event": None}}


def stored_settings(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The stream settings a commit recorded (`snapshot`: a `load_checkpoint`), knobs added since filled in."""
    stored = json.loads(snapshot["stream_config"])
    for section, knobs in _BEFORE_THE_KNOB.items():
        if isinstance(stored.get(section), dict):
            stored[section] = {**knobs, **stored[section]}
    return stored


def continuing(config: EngineConfig, stored: dict[str, Any]) -> EngineConfig:
    """`config` to continue a stream written with the stream settings `stored` (`EngineConfig.stream_settings`).

    A setting left at its default takes the stored value, so a store outlives a change of the defaults; a
    setting changed on purpose is kept, and `Reader` refuses the stream where it differs from the stored one.
    """
    defaults, mine = EngineConfig().stream_settings(), config.stream_settings()
    update = {}
    for section, fields in mine.items():
        theirs = stored.get(section) if isinstance(stored.get(section), dict) else {}
        merged = {k: theirs[k] if k in theirs and v == defaults[section][k] else v for k, v in fields.items()}
        if merged != fields:
            update[section] = merged
    if not update:
        return config
    try:
        return type(config).model_validate({**config.model_dump(), **update})
    except ValidationError as e:
        raise ConfigError(f"this stream's stored {', '.join(update)} settings are not valid here: {e}") from e


class Reader:
    """Feeds one stream's tokens to its engine chunk by chunk and commits the stream to its memory."""

    def __init__(self, state: EpisodicState, memory: PersistentMemory, cfg: EngineConfig,
                 snapshot: dict[str, Any] | None):
        """`snapshot`: the memory's last commit (`load_checkpoint`), restored here; None for a new stream."""
        self.state, self.memory, self.cfg = state, memory, cfg
        self.pending: list[int] = []  # tokens waiting to fill a chunk
        self.chat_history: list[dict[str, str]] = []  # the conversation so far (chat templates need it)
        self.broken: str | None = None  # why the resident state is no longer whole, once a step failed
        self._uncommitted = 0  # tokens read since the last commit
        self._draft = False  # reading a draft: nothing sealed or committed (`reading`)
        if snapshot is not None:
            self._restore(snapshot)

    @property
    def tokens(self) -> int:
        """Tokens of the stream, the queued ones included."""
        return self.state.n_tokens + len(self.pending)

    def feed(self, token_ids: list[int], plan: RecallPlan | None = None, run: IngestRun | None = None,
             progress: ProgressCallback | None = None) -> None:
        """Queue token ids; whole chunks are read now (until `run` asks to stop), the rest waits."""
        self.pending.extend(token_ids)
        chunk = self.cfg.window.chunk_size
        while len(self.pending) >= chunk and not (run is not None and run.stop_requested):
            ids = self.pending[:chunk]
            del self.pending[:chunk]
            self._read(ids, plan, run, progress)
            if self.memory.persistent and not self._draft and self._uncommitted >= self.cfg.store.commit_tokens:
                if run is not None:
                    run.document.token_end = self.tokens
                self.commit(run.document if run is not None else None)

    def flush(self, plan: RecallPlan | None = None, run: IngestRun | None = None,
              progress: ProgressCallback | None = None, token_ids: Sequence[int] = ()) -> None:
        """Queue `token_ids` and read everything queued: whole chunks first (a restored stream can hold
        many), then the rest."""
        self.feed(list(token_ids), plan, run, progress)
        if self.pending and not (run is not None and run.stop_requested):
            ids, self.pending = self.pending, []
            self._read(ids, plan, run, progress)

    def end_turn(self, plan: RecallPlan | None, message: str, reply: str, token_ids: Sequence[int]) -> None:
        """Close a chat turn: read `token_ids` (how it ends in the stream), add it to the chat, commit."""
        self.flush(plan, token_ids=token_ids)
        self.chat_history += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]
        self.commit()

    def read_file(self, run: IngestRun, tokenizer: Any, progress: ProgressCallback | None) -> None:
        """Read the rest of `run`'s file and commit it; Ctrl-C (under `run.interruptible`) commits first, then
        raises `KeyboardInterrupt`."""
        with run.interruptible():
            if progress is not None:  # once before the first chunk, which takes seconds on a real model
                progress(self.progress(run))
            for ids in run.token_pieces(tokenizer):
                self.feed(ids, run=run, progress=progress)
                if run.stop_requested:
                    break
            self.flush(run=run, progress=progress)
            run.finish(self.tokens)
            self.commit(run.document)
            if progress is not None:  # the last word: everything read is committed
                progress(self.progress(run))
            if run.stop_requested:
                raise KeyboardInterrupt

    @contextmanager
    def reading(self, plan: RecallPlan | None, token_ids: Sequence[int], draft: bool) -> Iterator[None]:
        """Read `token_ids` with `plan`, then what the caller reads inside. With `draft`, all of it is a draft,
        forgotten after, the stream left as it was: nothing is sealed or committed meanwhile, so the local window
        grows by the draft (keep it short)."""
        if not draft:
            self.flush(plan, token_ids=token_ids)
            yield
            return
        saved, pending, uncommitted = self.state.snapshot(host=False), list(self.pending), self._uncommitted
        self._draft = True
        try:
            self.flush(plan, token_ids=token_ids)
            yield
        finally:
            self._draft = False
            self.state.restore(saved)
            self.pending, self._uncommitted = pending, uncommitted

    def _read(self, ids: list[int], plan: RecallPlan | None, run: IngestRun | None,
              progress: ProgressCallback | None) -> None:
        self.guarded(lambda: self.state.step(torch.tensor(ids, dtype=torch.long), plan, seal=not self._draft))
        self._uncommitted += len(ids)
        if progress is not None:
            progress(self.progress(run))

    def decode(self, token_id: int, plan: RecallPlan) -> torch.Tensor:  # (1, V)
        """Read one generated token; returns the logits that predict the next."""
        return self.guarded(lambda: self.state.decode(token_id, plan, seal=not self._draft))

    def guarded(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        try:
            return step()
        except BaseException as err:
            # The layers may have appended part of this step: the resident state is no longer whole.
            self.broken = type(err).__name__ + (f": {err}" if str(err) else "")
            raise

    def progress(self, run: IngestRun | None) -> IngestProgress:
        if run is None:
            return IngestProgress(tokens=self.state.n_tokens, events=len(self.memory))
        return run.progress(self.state.n_tokens, len(self.memory), queued_tokens=len(self.pending))

    # ------------------------------------------------------------------ persistence
    def commit(self, document: DocumentProgress | None = None) -> None:
        """Commit the stream (with `document`'s read position) where commits persist; a no-op in RAM."""
        if not (self.memory.persistent and self.memory.writable):
            return
        try:
            self.memory.commit(self._snapshot(), document)
        except Exception:
            raise  # the resident state is whole: a later commit may succeed (a failed write breaks the store instead)
        except BaseException as err:  # interrupted half-way: what the memory holds of this commit is unknown
            self.broken = f"a commit was interrupted ({type(err).__name__})"
            raise
        self.state.forget_recalled()  # read on as a stream restored from this commit would
        self._uncommitted = 0

    def refresh(self) -> int:
        """Take in the memory's later commits (a read-only store reader) and restart from the last one's state."""
        added = self.memory.refresh()
        snapshot = self.memory.load_checkpoint()
        if snapshot is not None:
            self._restore(snapshot)
        self._uncommitted = 0
        return added

    def _snapshot(self) -> dict[str, Any]:
        return {"engine": self.state.snapshot(), "pending": list(self.pending),
                "chat_history": json.dumps(self.chat_history),
                "stream_config": json.dumps(self.cfg.stream_settings())}

    def _restore(self, snapshot: dict[str, Any]) -> None:
        stored, mine = stored_settings(snapshot), self.cfg.stream_settings()
        if stored != mine:
            changed = [k for k in mine if stored.get(k) != mine[k]]
            raise ConfigError(
                f"this stream was written with other {', '.join(changed)} settings; open it with the same "
                f"config, or leave them at their defaults (stored: {json.dumps({k: stored.get(k) for k in changed})})"
            )
        self.state.restore(snapshot["engine"])
        self.pending = list(snapshot["pending"])
        self.chat_history = json.loads(snapshot["chat_history"])

    def copy_from(self, other: Reader) -> None:
        """Continue `other`'s stream: its engine state, queue and chat (the event memory is the caller's)."""
        self.state.restore(other.state.snapshot())
        self.pending, self.chat_history = list(other.pending), copy.deepcopy(other.chat_history)
