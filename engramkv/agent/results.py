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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
