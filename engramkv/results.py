"""Result models returned by the library API; pydantic, so they serialise to JSON."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from engramkv.memory.events import EventMemory


class RecalledEvent(BaseModel):
    """One event returned by `Session.recall`, or one an answer attended to (`Session.last_recalled`)."""

    event_id: int
    text: str
    token_start: int
    token_end: int
    score: float
    document: str | None = None  # the file it came from (stored sessions; None for text given directly)
    time: dt.datetime | None = None  # when it was sealed into the store (stored sessions)


class Answer(BaseModel):
    """One answer of `Session.ask_many`: the reply, the inference parameters it took and what it read."""

    question: str
    text: str
    theta: dict[str, int] | None  # k, s, n, m, w (`Theta`); None: not matched against memory
    context_tokens: int  # effective context besides the reply: sinks, attended window, turn, memory
    recalled: list[RecalledEvent]


class IngestReport(BaseModel):
    """What one `Session.ingest` call did."""

    tokens: int
    events_sealed: int
    seconds: float
    resumed_from_byte: int = 0  # ingest_file: where an interrupted ingest of the same file picked up
    already_ingested: bool = False  # ingest_file: the file was complete in the store; nothing was read
    document_tokens: int = 0  # ingest_file: tokens of the whole document (all runs together)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class SessionStats(BaseModel):
    """What `Session.stats` reports: the stream, its memory tiers and its disk use."""

    model: str
    tokens: int  # read by the model
    queued_tokens: int  # tokenised, waiting to fill a chunk
    events: int
    resident_tokens: int  # sinks + local window + not yet sealed
    documents: list[str]
    store: str | None
    namespace: str | None
    codec: str  # cold-tier codec of the store, or the in-RAM memory dtype
    hot_bytes: int  # decoded KV on the compute device
    warm_bytes: int  # encoded blobs in host RAM (in-RAM sessions: all event KV)
    disk_bytes: int
    committed_tokens: int


class IngestProgress(BaseModel):
    """What an ingest progress callback receives, once before the first chunk and after every chunk."""

    tokens: int  # read by the model in this session's stream so far
    events: int  # sealed in this session's stream so far
    bytes_read: int | None = None  # ingest_file: bytes of the file the model has read (estimated)
    size_bytes: int | None = None  # ingest_file: the file's size


def recalled_events(memory: EventMemory, decode: Callable[[list[int]], str],
                    scored: Sequence[tuple[int, float]]) -> list[RecalledEvent]:
    """`RecalledEvent`s for (event id, score) pairs, in the given order, with their text and provenance."""
    details = memory.event_details([event_id for event_id, _ in scored])
    results = []
    for event_id, score in scored:
        event = memory.event(event_id)
        document, created = details.get(event_id, (None, None))
        results.append(RecalledEvent(
            event_id=event_id, text=decode(memory.tokens(event_id)), token_start=event.start,
            token_end=event.end, score=score, document=document, time=created,
        ))
    return results
