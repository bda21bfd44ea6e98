"""The per-event columns of a namespace (span, surprise, blob location) in compact arrays."""

from __future__ import annotations

from array import array

from engramkv.memory.events import Event
from engramkv.storage.segments import BlobRef


class EventColumns:
    """Per-event columns in compact arrays: 10M tokens are ~200k events, too many for objects."""

    def __init__(self) -> None:
        self.start, self.end = array("q"), array("q")
        self.segment, self.offset, self.length, self.crc = array("q"), array("q"), array("q"), array("q")
        self.surprise = array("d")  # mean, max interleaved
        self.shortest = 0  # tokens in the shortest event (0 while there is none)

    def __len__(self) -> int:
        return len(self.start)

    def append(self, event: Event, ref: BlobRef) -> None:
        self.shortest = min(self.shortest, event.length) if self.start else event.length
        self.start.append(event.start)
        self.end.append(event.end)
        self.segment.append(ref.segment)
        self.offset.append(ref.offset)
        self.length.append(ref.length)
        self.crc.append(ref.checksum)
        self.surprise.extend((event.surprise_mean, event.surprise_max))

    def event(self, i: int) -> Event:
        return Event(id=i, start=self.start[i], end=self.end[i],
                     surprise_mean=self.surprise[2 * i], surprise_max=self.surprise[2 * i + 1])

    def ref(self, i: int) -> BlobRef:
        return BlobRef(self.segment[i], self.offset[i], self.length[i], self.crc[i])

    def n_tokens(self, i: int) -> int:
        return self.end[i] - self.start[i]

    def segment_ends(self) -> dict[int, int]:
        """Where each segment's last blob ends: what recovery keeps."""
        ends: dict[int, int] = {}
        for segment, offset, length in zip(self.segment, self.offset, self.length):
            ends[segment] = max(ends.get(segment, 0), offset + length)
        return ends
