"""Online event boundaries from surprise.

Convention: a boundary is the index of the *first token of a new event* (the surprising
token opens the event it belongs to). Token t is a candidate when
    s_t > mean + gamma * std   over the surprise of the `window` tokens before t
and, with the floor (`min_surprise`, 1.0 nat by default; 0 turns it off), s_t > min_surprise.
The floor matters on text the model predicts: over repeated filler every surprise is near zero,
the trailing std is tiny and the relative test alone fires on noise, so the cuts would depend on
whatever the model happened to read before (a shard that starts cold cuts the same filler
otherwise than the sequential read does). Such text is cut instead once `predicted_event` tokens in a row
fell below the floor: at the run's start (whatever surprised the model ends there, so an answer that
recalls it does not read on into filler), then every `predicted_event` tokens: pieces small enough for an
answer's recall budget, at a cadence nothing before them moves.
Candidates closer than `min_event` to the current event start are dropped (the short
piece merges forward into the running event; a predicted run's start cuts however short the event
before it); an event reaching `max_event` tokens is
cut there. Uniform mode ignores surprise and cuts every `uniform_size` tokens.

The segmenter only sees surprise values in stream order, chunk by chunk, and emits
boundaries as global token indices. Boundaries are final as emitted; the graph
refinement may later move them before events are sealed.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from engramkv.config import SegmentationConfig


def predicted(surprise: float, floor: float) -> bool:
    """Whether the model predicted a token (or a whole event, given its largest surprise): at or under the
    surprise floor. Nothing is, without a floor (0)."""
    return floor > 0 and surprise <= floor


class OnlineSegmenter:
    """Emits event boundaries (global token indices) from the surprise of tokens pushed in stream order."""

    def __init__(self, cfg: SegmentationConfig, window: int, start: int = 0):
        self.cfg = cfg
        self.window = window
        self.history: deque[float] = deque(maxlen=window)  # trailing surprise
        self.event_start = start  # first token of the running event
        self.position = start  # global index of the next token to be seen
        self.predicted_run = 0  # tokens in a row, up to the next one, with surprise at or below the floor

    def push(self, surprise: torch.Tensor) -> list[int]:
        """Consume the surprise of the next tokens; return the boundaries they open."""
        values = surprise.double().tolist()
        if self.cfg.mode == "uniform":
            candidates = [False] * len(values)
        else:
            candidates = self._candidates(values)
        run_cut = None  # run of predicted tokens that cuts an event (never shorter than min_event)
        if self.cfg.mode == "surprise" and self.cfg.predicted_event is not None:
            run_cut = max(self.cfg.predicted_event, self.cfg.min_event)
        boundaries = []
        for offset, (is_candidate, value) in enumerate(zip(candidates, values)):
            t = self.position + offset
            run_start = t - self.predicted_run
            if run_cut is not None and self.predicted_run == run_cut and run_start > self.event_start:
                boundaries.append(run_start)  # the predicted run leaves the event it followed, however short
                self.event_start = run_start
            length = t - self.event_start
            predicted_cut = run_cut is not None and min(self.predicted_run, length) >= run_cut
            if (is_candidate and length >= self.cfg.min_event) or length >= self._max_length() or predicted_cut:
                boundaries.append(t)
                self.event_start = t
            self.predicted_run = self.predicted_run + 1 if predicted(value, self.cfg.min_surprise) else 0
        self.position += len(values)
        self.history.extend(values)
        return boundaries

    def snapshot(self) -> dict[str, Any]:
        return {"history": list(self.history), "event_start": self.event_start, "position": self.position,
                "predicted_run": self.predicted_run}

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(snapshot["history"])
        self.event_start, self.position = snapshot["event_start"], snapshot["position"]
        if "predicted_run" in snapshot:
            self.predicted_run = snapshot["predicted_run"]
        else:  # a checkpoint from before the floor: the run is the predicted tail of the history
            self.predicted_run = 0
            for value in reversed(self.history):
                if not predicted(value, self.cfg.min_surprise):
                    break
                self.predicted_run += 1

    def _max_length(self) -> int:
        return self.cfg.uniform_size if self.cfg.mode == "uniform" else self.cfg.max_event

    def _candidates(self, values: list[float]) -> list[bool]:
        # Trailing mean/std for every token of the chunk with one cumulative sum over history + chunk.
        seq = torch.tensor(list(self.history) + values, dtype=torch.float64)  # (Hist + T,)
        first = len(self.history)
        csum = torch.cat([seq.new_zeros(1), seq.cumsum(0)])
        csq = torch.cat([seq.new_zeros(1), (seq * seq).cumsum(0)])
        idx = torch.arange(first, len(seq))  # positions of this chunk's tokens in seq
        lo = (idx - self.window).clamp(min=0)
        n = (idx - lo).double()
        mean = (csum[idx] - csum[lo]) / n.clamp(min=1)
        var = ((csq[idx] - csq[lo]) / n.clamp(min=1) - mean * mean).clamp(min=0)
        threshold = mean + self.cfg.gamma * var.sqrt()
        if self.cfg.min_surprise > 0:
            threshold = threshold.clamp(min=self.cfg.min_surprise)
        # Too little history to judge (fewer than 2 tokens): no boundary.
        return ((seq[idx] > threshold) & (n >= 2)).tolist()
