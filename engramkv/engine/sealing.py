"""Sealing: surprise -> boundaries -> graph refinement -> events, as tokens leave the local window.

The stream's token side lives here: the sink tokens, the tokens not yet sealed (the local window,
`stream[local_start:]`), their surprise, and the boundaries the segmenter found among them. After each
forward pass the engine `record`s the new tokens with their surprise, then `seal`s every whole event
that starts before the local window's left edge:

    end = next boundary, moved by the graph refinement to the best split of [start, next-but-one)
    keys, values = the layers' first (end - start) local tokens              # (layers, Hkv, n, D)
    representatives = mean of the most-attended keys, per layer            # (layers, Hkv * D)
    key summary = mean unit key over the summary layers                    # (S * Hkv * D,)

and hands the event to the event memory (the representatives, summaries and surprise statistics of all the
events one sealing seals are computed together). Every count is derived from the tensors themselves
(`n_tokens = local_start + len(tail_tokens)`), so no counter can drift from what is held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engramkv.config import EngineConfig
from engramkv.memory.events import Event, EventMemory
from engramkv.memory.refinement import refine_boundary, similarity_graph
from engramkv.memory.segmentation import OnlineSegmenter, predicted
from engramkv.memory.summary import key_summaries, representatives_of_events


@dataclass
class LayerState:
    """One layer's resident part of the window, and what it recalled last."""

    sink_k: torch.Tensor  # (Hkv, S', D) pre-RoPE
    sink_v: torch.Tensor  # (Hkv, S', D)
    local_k: torch.Tensor  # (Hkv, L, D) pre-RoPE
    local_v: torch.Tensor  # (Hkv, L, D)
    local_attention: torch.Tensor  # (Hkv, L) float32, attention received while resident
    recalled_ids: list[int] = field(default_factory=list)
    recalled_tokens: tuple[tuple[int, int], ...] | None = None  # the part of each recalled event read (None: all)
    recalled_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    buffer: deque[int] = field(default_factory=deque)  # similarity hits of earlier steps (contiguity)
    device_buffer: torch.Tensor | None = None  # (B,) long: the buffer while reading recalls on the device


class Stream:
    """The token stream's unsealed part and its segmentation; seals events into an `EventMemory`."""

    def __init__(self, cfg: EngineConfig, summary_layers: Sequence[int]):
        self.cfg = cfg
        self.summary_layers = list(summary_layers)
        self.sink_tokens = torch.empty(0, dtype=torch.int32)
        self.tail_tokens = torch.empty(0, dtype=torch.int32)  # stream[local_start:], not yet sealed
        self.local_start = 0  # global index of the first local-window token
        self.local_surprise = torch.empty(0)  # (L,) surprise of the local tokens
        self.boundaries: list[int] = []  # starts of events inside the local window, after local_start
        self.segmenter = OnlineSegmenter(cfg.segmentation, cfg.surprise_window)

    @property
    def sink_len(self) -> int:
        return int(self.sink_tokens.numel())

    @property
    def n_tokens(self) -> int:
        return self.local_start + int(self.tail_tokens.numel())

    @property
    def last_token(self) -> int | None:
        """The id of the stream's last token (None while it is empty)."""
        tokens = self.tail_tokens if self.tail_tokens.numel() else self.sink_tokens
        return int(tokens[-1]) if tokens.numel() else None

    def recent_surprise(self) -> tuple[list[float], list[int]]:
        """Surprise of the local tokens, and where events start among them (indices into that list)."""
        values = self.local_surprise.tolist()
        starts = [b - self.local_start for b in self.boundaries]
        return values, [0, *starts] if values else []

    def record(self, token_ids: torch.Tensor, surprise: torch.Tensor) -> None:
        """Append the tokens of a forward pass (T,) with their surprise (T,); find the boundaries they open."""
        to_sink = min(token_ids.shape[0], self.cfg.window.n_sink - self.sink_len)
        self.sink_tokens = torch.cat([self.sink_tokens, token_ids[:to_sink].to(torch.int32)])
        self.tail_tokens = torch.cat([self.tail_tokens, token_ids[to_sink:].to(torch.int32)])
        # While the sinks fill, the local window starts right after them.
        self.local_start = max(self.local_start, self.sink_len)
        local_part = surprise[to_sink:]
        self.local_surprise = torch.cat([self.local_surprise, local_part])
        if local_part.numel():
            if self.segmenter.position < self.sink_len:  # the first local token opens the first event
                self.segmenter.position = self.segmenter.event_start = self.sink_len
            self.boundaries.extend(b for b in self.segmenter.push(local_part) if b > self.local_start)

    def seal(self, layers: Sequence[LayerState], memory: EventMemory) -> None:
        """Seal whole events that start before the local window's left edge."""
        cutoff = self.n_tokens - self.cfg.window.n_local
        window_keys = self._graph_keys(layers) if self.boundaries and self.local_start < cutoff else None
        ends: list[int] = []
        while (ends[-1] if ends else self.local_start) < cutoff and self.boundaries:
            ends.append(self._refined_end(window_keys, ends[-1] if ends else self.local_start))
        self._seal_events(layers, memory, ends)

    def seal_rest(self, layers: Sequence[LayerState], memory: EventMemory) -> None:
        """Seal the local window too, at the boundaries found so far and at the stream's end: what a shard of a
        sharded ingest does last, since the shard after it reads on without this window."""
        window_keys = self._graph_keys(layers) if self.boundaries else None
        ends: list[int] = []
        while (start := ends[-1] if ends else self.local_start) < self.n_tokens:
            ends.append(self._refined_end(window_keys, start) if self.boundaries else self.n_tokens)
        self._seal_events(layers, memory, ends)

    def _refined_end(self, window_keys: torch.Tensor | None, start: int) -> int:
        """The next boundary, moved to the best split of [start, the boundary after it) on the key graph.

        A boundary at a token the model predicted (surprise at or below the floor: a cut of predicted text every
        `predicted_event` tokens, or at `max_event`) stays: over repeated text the graph is periodic and its best
        split is the leftmost allowed, so refined cuts lag and then catch up in one max_event-long event."""
        seg, ref = self.cfg.segmentation, self.cfg.refinement
        end = self.boundaries.pop(0)
        if window_keys is None or predicted(float(self.local_surprise[end - self.local_start]), seg.min_surprise):
            return end
        after = self.boundaries[0] if self.boundaries else self.n_tokens
        graph = similarity_graph(window_keys[start - self.local_start : after - self.local_start])
        # Never let the following event grow past max_event when the boundary moves left.
        min_split = max(seg.min_event, (after - start) - seg.max_event)
        return start + refine_boundary(graph, end - start, min_split, ref.metric)

    def _graph_keys(self, layers: Sequence[LayerState]) -> torch.Tensor | None:
        """The refinement graph's node features for every local token, made once per sealing: (L, layers_up * Hkv
        * D), the upper layers' keys side by side, on the host (the refinement's small graphs are host work: on a
        GPU one copy per sealing, not a launch and a round trip per event). None when boundaries are not refined."""
        ref = self.cfg.refinement
        if not ref.enabled or self.cfg.segmentation.mode == "uniform":
            return None
        n_up = max(1, round(len(layers) * ref.layer_fraction))
        per_layer = [st.local_k.permute(1, 0, 2).flatten(1) for st in layers[-n_up:]]  # (L, Hkv * D)
        return torch.cat(per_layer, dim=1).float().cpu()

    def _seal_events(self, layers: Sequence[LayerState], memory: EventMemory, ends: list[int]) -> None:
        """Seal the events [local_start, ends[0]), [ends[0], ends[1]), ...: every layer's window is sliced once,
        and representatives, key summaries and surprise statistics are computed for all of them at once (per
        event, sealing cost ~90 host operations on random text: on a GPU, launches the engine waits on), and handed
        to `memory` together. What memory took leaves the window even when a later event fails."""
        if not ends:
            return
        spans = list(zip([self.local_start, *ends], ends))  # [start, end) of each event
        counts = [b - a for a, b in spans]
        total = sum(counts)
        keys = torch.stack([st.local_k[:, :total] for st in layers])  # (layers, Hkv, total, D)
        values = torch.stack([st.local_v[:, :total] for st in layers])  # (layers, Hkv, total, D)
        received = torch.stack([st.local_attention[:, :total] for st in layers])  # (layers, Hkv, total)
        reps = representatives_of_events(keys, received, counts, self.cfg.representatives.keys_per_head)
        summaries = key_summaries(keys[self.summary_layers], counts)  # (E, S * Hkv * D) on the keys' device
        surprise, lengths = self.local_surprise[:total], torch.tensor(counts)  # (total,) on the host, (E,)
        means = torch.segment_reduce(surprise.double(), "mean", lengths=lengths).tolist()
        peaks = torch.segment_reduce(surprise, "max", lengths=lengths).tolist()
        first = len(memory)
        events = [Event(id=first + i, start=a, end=b, surprise_mean=means[i], surprise_max=peaks[i])
                  for i, (a, b) in enumerate(spans)]
        try:
            memory.add(events, keys, values, reps, summaries, self.tail_tokens[:total])
        finally:  # what memory took leaves the window, even when a later event failed
            self._drop(layers, sum(counts[: len(memory) - first]))

    def _drop(self, layers: Sequence[LayerState], n: int) -> None:
        """The first `n` unsealed tokens leave the window (they are in memory now)."""
        if n == 0:
            return
        self.tail_tokens = self.tail_tokens[n:]
        for st in layers:
            st.local_k, st.local_v = st.local_k[:, n:], st.local_v[:, n:]
            st.local_attention = st.local_attention[:, n:]
        self.local_surprise = self.local_surprise[n:]
        self.local_start += n

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        return {
            "n_tokens": self.n_tokens, "local_start": self.local_start, "local_surprise": self.local_surprise.clone(),
            "boundaries": list(self.boundaries), "sink_tokens": self.sink_tokens.clone(),
            "tail_tokens": self.tail_tokens.clone(), "segmenter": self.segmenter.snapshot(),
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.local_start, self.local_surprise = snapshot["local_start"], snapshot["local_surprise"]
        self.sink_tokens, self.tail_tokens = snapshot["sink_tokens"], snapshot["tail_tokens"]
        self.boundaries = list(snapshot["boundaries"])
        self.segmenter.restore(snapshot["segmenter"])
