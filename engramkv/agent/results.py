"""Result models returned by the library API; pydantic, so they serialise to JSON."""

from __future__ import annotations

from pydantic import BaseModel


class RecalledEvent(BaseModel):
    """One event returned by `Session.recall`."""

    event_id: int
    text: str
    token_start: int
    token_end: int
    score: float


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
