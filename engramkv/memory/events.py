"""The Event record and the event memory interface, with its in-process implementation.

An event is a contiguous span of the token stream, sealed when it leaves the local
window. Its KV (pre-RoPE keys, values) for every layer, one representative vector per
layer (for recall while reading) and one key summary (for matching questions, see
`memory.summary`) go into an `EventMemory`. A session also commits its stream to its memory:
`PersistentMemory` adds those calls. The tiered store (`storage.namespace`) implements them; the
in-RAM memory here, and `TransientMemory` around any other `EventMemory`, make each of them a
no-op, so a session holds one `memory` and never asks which kind it is.

Event ids are consecutive integers in stream order, so id ± d are temporal neighbours.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from engramkv.errors import SessionError
from engramkv.kernels.backend import Backend
from engramkv.kernels.representatives import search as search_representatives
from engramkv.memory.buffer import GrowingBuffer


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    start: int  # first token (global stream index)
    end: int  # one past the last token
    surprise_mean: float
    surprise_max: float

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class DocumentProgress:
    """How far a document has been ingested; committed with the stream state it belongs to."""

    name: str
    size_bytes: int
    content_key: str
    token_start: int
    bytes_done: int = 0
    token_end: int = 0
    complete: bool = False
    id: int | None = None


@dataclass(frozen=True)
class TierBytes:
    """Bytes of event KV in each tier: decoded on the compute device, encoded in host RAM, on disk."""

    hot: int
    warm: int
    disk: int


class EventMemory(Protocol):
    """Where sealed events live. Keys are pre-RoPE; shapes per layer are (Hkv, L, D)."""

    def add(
        self,
        events: Sequence[Event],  # E events, ids consecutive from len(self)
        keys: torch.Tensor,  # (layers, Hkv, T, D): the events' tokens joined in order
        values: torch.Tensor,  # (layers, Hkv, T, D)
        representatives: torch.Tensor,  # (E, layers, Hkv * D)
        key_summaries: torch.Tensor,  # (E, S)
        token_ids: torch.Tensor,  # (T,) int
    ) -> None:
        """Append events in order. Should one fail, those before it stay added: `len` says how many."""
        ...

    def __len__(self) -> int: ...

    def event(self, event_id: int) -> Event: ...

    @property
    def shortest_event(self) -> int:
        """Tokens in the shortest event (0 while there is none): a budget with less left takes no more events."""
        ...

    def tokens(self, event_id: int) -> list[int]:
        """The token ids the event covers."""
        ...

    def search(self, layer: int, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """Top-k event ids by inner product of `query` (Hkv * D,) with the layer's representatives."""
        ...

    def search_keys(self, summary: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """Top-k event ids by inner product of a question's key summary (S,) with the events' summaries."""
        ...

    def gather(self, layer: int, event_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `event_ids` (in the given order), concatenated: (Hkv, M, D) each."""
        ...

    @property
    def kv_bytes(self) -> int: ...


@dataclass(frozen=True)
class RecallTensors:
    """What reading's recall reads of a memory whose events are on the compute device, as tensors there: the
    engine's device path (`kernels.selection`) picks events and gathers their KV with no id crossing to the host."""

    representatives: torch.Tensor  # (layers, N, Hkv * D) float32
    keys: torch.Tensor  # (layers, Hkv, T, D): every event's tokens in event order
    values: torch.Tensor  # (layers, Hkv, T, D)
    starts: torch.Tensor  # (N,) long: each event's first row in keys / values
    lengths: torch.Tensor  # (N,) int32
    peaks: torch.Tensor  # (N,) float32: each event's surprise_max


@runtime_checkable
class OnDevice(Protocol):
    """A memory that can hand recall its `RecallTensors` (None: not now, say none on the compute device)."""

    def recall_tensors(self) -> RecallTensors | None: ...


@runtime_checkable
class PersistentMemory(EventMemory, Protocol):
    """An `EventMemory` a session can commit its stream to (in RAM every call is a no-op)."""

    @property
    def persistent(self) -> bool:
        """True when commits outlive the process (a store namespace)."""
        ...

    @property
    def writable(self) -> bool:
        """False for a store opened read-only: events added stay in RAM and commits are refused."""
        ...

    @property
    def location(self) -> str | None:
        """Where the events live: the store directory, or None in RAM."""
        ...

    @property
    def namespace(self) -> str | None:
        """The store namespace as "user/agent/session", or None in RAM."""
        ...

    @property
    def codec(self) -> str:
        """How event KV is encoded at rest (the store's cold-tier codec, or the in-RAM dtype)."""
        ...

    @property
    def committed_tokens(self) -> int:
        """Stream position of the last commit (0 in RAM)."""
        ...

    def commit(self, snapshot: dict[str, Any], document: DocumentProgress | None) -> None:
        """Make every event added so far durable together with the stream state `snapshot`, and `document`'s
        read position (the document being ingested, if any)."""
        ...

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The stream state of the last commit, or None."""
        ...

    def last_document(self) -> DocumentProgress | None:
        """The most recent document (the only one an interrupted ingest can resume)."""
        ...

    def refresh(self) -> int:
        """A read-only reader takes in the commits made since it opened; returns the events added."""
        ...

    def documents(self) -> list[DocumentProgress]: ...

    def event_details(self, event_ids: Sequence[int]) -> dict[int, tuple[str | None, dt.datetime | None]]:
        """(document name, time sealed) of each event, where known."""
        ...

    def tier_bytes(self) -> TierBytes: ...

    def close(self) -> None: ...


class _NoPersistence:
    """The `PersistentMemory` calls of a memory whose events live as long as the process: no-ops."""

    persistent = False
    writable = True
    location: str | None = None
    namespace: str | None = None
    committed_tokens = 0

    kv_bytes: int  # the memory's own (a property there)

    def commit(self, snapshot: dict[str, Any], document: DocumentProgress | None) -> None:
        pass

    def load_checkpoint(self) -> dict[str, Any] | None:
        return None

    def last_document(self) -> DocumentProgress | None:
        return None

    def refresh(self) -> int:
        raise SessionError("refresh reads a store's later commits; this stream lives in RAM")

    def documents(self) -> list[DocumentProgress]:
        return []

    def event_details(self, event_ids: Sequence[int]) -> dict[int, tuple[str | None, dt.datetime | None]]:
        return {}

    def tier_bytes(self) -> TierBytes:
        return TierBytes(hot=0, warm=self.kv_bytes, disk=0)

    def close(self) -> None:
        pass


class TransientMemory(_NoPersistence):
    """Any `EventMemory` as a `PersistentMemory` whose commits do nothing (what `EpisodicLM.session(memory=)`
    wraps a memory of the caller's in)."""

    def __init__(self, memory: EventMemory):
        self.inner = memory

    @property
    def codec(self) -> str:
        return type(self.inner).__name__

    def add(self, events: Sequence[Event], keys: torch.Tensor, values: torch.Tensor, representatives: torch.Tensor,
            key_summaries: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.inner.add(events, keys, values, representatives, key_summaries, token_ids)

    def __len__(self) -> int:
        return len(self.inner)

    def event(self, event_id: int) -> Event:
        return self.inner.event(event_id)

    @property
    def shortest_event(self) -> int:
        return self.inner.shortest_event

    def tokens(self, event_id: int) -> list[int]:
        return self.inner.tokens(event_id)

    def search(self, layer: int, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        return self.inner.search(layer, query, k)

    def search_keys(self, summary: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        return self.inner.search_keys(summary, k)

    def gather(self, layer: int, event_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.gather(layer, event_ids)

    def recall_tensors(self) -> RecallTensors | None:
        return self.inner.recall_tensors() if isinstance(self.inner, OnDevice) else None

    @property
    def kv_bytes(self) -> int:
        return self.inner.kv_bytes


class InMemoryEventMemory(_NoPersistence):
    """All events in the process, on `device` (the model's, so on a GPU nothing crosses to the host but the
    chosen event ids): one growing buffer each for every layer's keys, values and representatives.

    `kernels` is handed to the representative search's dispatcher (`kernels.representatives`)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16,
                 device: torch.device | str = "cpu", kernels: Backend = "auto"):
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels: Backend = kernels
        self.events: list[Event] = []
        self.shortest_event = 0
        self._offsets: list[int] = []  # start of each event in the KV buffers
        # every layer in one buffer, so sealing an event is three copies, not three per layer
        self._keys = GrowingBuffer((num_layers, num_kv_heads), (head_dim,), dtype, self.device)  # (layers, Hkv, T, D)
        self._values = GrowingBuffer((num_layers, num_kv_heads), (head_dim,), dtype, self.device)
        # (layers, N, Hkv * D)
        self._reps = GrowingBuffer((num_layers,), (num_kv_heads * head_dim,), torch.float32, self.device)
        self._tokens = GrowingBuffer((), (), torch.int32)  # read back as lists: host RAM
        # (3, N) float64: each event's first row, length and surprise_max, for recall on the device (where Triton
        # runs: CUDA, or the CPU interpreted; another device may have no float64)
        self._on_kernels_device = self.device.type in ("cuda", "cpu")
        self._columns = GrowingBuffer((3,), (), torch.float64, self.device if self._on_kernels_device else None)
        self._recall_tensors: RecallTensors | None = None  # of the events so far (each layer reads them)
        self._summaries: GrowingBuffer | None = None  # (N, S) once the first event sets S

    def add(
        self, events: Sequence[Event], keys: torch.Tensor, values: torch.Tensor, representatives: torch.Tensor,
        key_summaries: torch.Tensor, token_ids: torch.Tensor,
    ) -> None:
        """All the events in one copy per buffer (one per event and buffer was a few hundred launches a chunk)."""
        if not events:
            return
        if [e.id for e in events] != list(range(len(self.events), len(self.events) + len(events))):
            raise SessionError(f"event ids must be consecutive from {len(self.events)}: got {[e.id for e in events]}")
        # every shape checked before anything is appended: the buffers stay aligned with the events
        n, e = sum(ev.length for ev in events), len(events)
        kv = (*self._keys.before, n, *self._keys.after)
        width = self._summaries.after[0] if self._summaries is not None else key_summaries.shape[-1]
        expected = {"keys": (keys, kv), "values": (values, kv), "token_ids": (token_ids, (n,)),
                    "representatives": (representatives, (e, self.num_layers, *self._reps.after)),
                    "key_summaries": (key_summaries, (e, width))}
        wrong = [f"{name} {tuple(part.shape)}, not {want}" for name, (part, want) in expected.items()
                 if tuple(part.shape) != want]
        if wrong:
            raise SessionError(f"{e} events of {n} tokens, given " + ", ".join(wrong))
        offset = self._keys.size
        for event in events:
            self._offsets.append(offset)
            offset += event.length
        columns = torch.tensor([self._offsets[-len(events):], [e.length for e in events],
                                [e.surprise_max for e in events]], dtype=torch.float64)  # (3, E)
        if self.device.type == "cuda":  # pinned, so the copy does not wait for the device's queue
            columns = columns.pin_memory().to(self.device, non_blocking=True)
        self._columns.append(columns)
        self._recall_tensors = None
        self._keys.append(keys)  # copy_ converts the dtype and the device
        self._values.append(values)
        self._reps.append(representatives.transpose(0, 1))  # (layers, E, Hkv * D)
        if self._summaries is None:
            self._summaries = GrowingBuffer((), (key_summaries.shape[1],), torch.float32, self.device)
        self._summaries.append(key_summaries)
        self._tokens.append(token_ids)
        shortest = min(e.length for e in events)
        self.shortest_event = min(self.shortest_event, shortest) if self.events else shortest
        self.events.extend(events)

    def __len__(self) -> int:
        return len(self.events)

    def event(self, event_id: int) -> Event:
        return self.events[event_id]

    def tokens(self, event_id: int) -> list[int]:
        start = self._offsets[event_id]
        return self._tokens.view()[start : start + self.events[event_id].length].tolist()

    def search(self, layer: int, query: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        if not self.events or k <= 0:
            return [], []
        reps, query = self._reps.view()[layer], query.float().to(self.device)  # (N, Hkv * D), (Hkv * D,)
        values, ids = search_representatives(reps[None], query[None], k, self.kernels)  # (1, k) each
        both = torch.cat([ids.double(), values.double()]).cpu()  # (2, k): one host round trip, not two
        return both[0].long().tolist(), both[1].tolist()

    def search_keys(self, summary: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        if self._summaries is None or k <= 0:
            return [], []
        scores = self._summaries.view() @ summary.float().to(self.device)  # (N,)
        top = torch.topk(scores, min(k, scores.shape[0]))
        return top.indices.tolist(), top.values.tolist()

    def gather(self, layer: int, event_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # the rows of every event at once: offset of its event + position inside it, built in NumPy on the host
        # (as torch operations it was a dozen per layer and chunk; one arange per event, a few thousand)
        starts = np.array([self._offsets[i] for i in event_ids], dtype=np.int64)  # (E,)
        lengths = np.array([self.events[i].length for i in event_ids], dtype=np.int64)  # (E,)
        firsts = np.cumsum(lengths) - lengths  # (E,) where each event begins in the result
        index = np.arange(int(lengths.sum())) + np.repeat(starts - firsts, lengths)  # (M,)
        index = torch.from_numpy(index).to(self.device)
        keys = self._keys.view()[layer].index_select(1, index)  # (Hkv, M, D)
        values = self._values.view()[layer].index_select(1, index)  # (Hkv, M, D)
        return keys, values

    def recall_tensors(self) -> RecallTensors | None:
        if self._recall_tensors is None and self.events and self._on_kernels_device:
            columns = self._columns.view()  # (3, N)
            self._recall_tensors = RecallTensors(self._reps.view(), self._keys.view(), self._values.view(),
                                                 columns[0].long(), columns[1].int(), columns[2].float())
        return self._recall_tensors

    @property
    def kv_bytes(self) -> int:
        return sum(b.view().numel() * b.view().element_size() for b in (self._keys, self._values))

    @property
    def codec(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def tier_bytes(self) -> TierBytes:
        on_device = self.device.type != "cpu"
        return TierBytes(hot=self.kv_bytes if on_device else 0, warm=0 if on_device else self.kv_bytes, disk=0)
