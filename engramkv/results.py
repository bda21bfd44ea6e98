"""Result models returned by the library API; pydantic, so they serialise to JSON."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel


class RecalledEvent(BaseModel):
    """One event returned by `Session.recall`."""

    event_id: int
    text: str
    token_start: int
    token_end: int
    score: float
    document: str | None = None  # the file it came from (stored sessions; None for text given directly)
    time: dt.datetime | None = None  # when it was sealed into the store (stored sessions)


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
