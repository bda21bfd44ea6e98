"""Two-stage recall: similarity top-k under a token budget, then temporal contiguity.

Stage 1 takes events in descending representative score until (1 - contiguity_fraction)
of the budget is spent. Stage 2 spends the rest on temporal neighbours of the hits,
nearest first (id+1 before id-1: what follows a match usually completes it), best hit
first, and then on the hits of earlier steps (the contiguity buffer). The result is
sorted chronologically, which is the order the attention window wants.
"""

from __future__ import annotations

from collections import deque

import torch

from engramkv.config import RecallConfig
from engramkv.kernels.backend import Backend
from engramkv.kernels.representatives import search as search_representatives
from engramkv.kernels.selection import SelectionRule, select_rows
from engramkv.memory.events import Event, EventMemory, RecallTensors
from engramkv.memory.segmentation import predicted


def select_events(
    memory: EventMemory,
    layer: int,
    query: torch.Tensor,  # (Hkv * D,)
    cfg: RecallConfig,
    min_event: int,
    buffer: deque[int] | None = None,
    budget: int | None = None,  # memory tokens to fill (default cfg.budget_tokens)
    surprise_floor: float = 0.0,  # the segmentation's floor, `min_surprise` (see add_neighbours)
) -> list[int]:
    budget = cfg.budget_tokens if budget is None else budget
    if len(memory) == 0 or budget == 0:
        return []
    similarity_budget = int(budget * (1 - cfg.contiguity_fraction))
    candidates, _ = memory.search(layer, query, k=max(1, budget // min_event))
    picked = _Picked(memory, budget)
    hits: list[int] = []
    for event_id in candidates:
        if similarity_budget - picked.used < picked.shortest:
            break
        if picked.take(event_id, similarity_budget):
            hits.append(event_id)
    if not hits and candidates and picked.take(candidates[0]):  # the best event alone exceeds the similarity share
        hits.append(candidates[0])
    picked.add_neighbours(hits, cfg.max_neighbour_distance, surprise_floor)
    if buffer is not None:
        for event_id in reversed(buffer):
            picked.take(event_id)
        buffer.extend(hits)
    return sorted(picked.chosen)


def recall_on_device(
    tensors: RecallTensors,
    layer: int,
    query: torch.Tensor,  # (Hkv * D,)
    cfg: RecallConfig,
    min_event: int,
    shortest: int,  # the memory's shortest event
    buffer: torch.Tensor,  # (B,) long: the contiguity buffer, oldest first, -1 where empty; replaced, not changed
    surprise_floor: float,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`select_events` with the reading budget, and the chosen events' KV, without leaving the device: keys and
    values (Hkv, budget, D) each, of which the first `used` (1,) int32 rows are the events' (the rest are
    padding), and the contiguity buffer after this step."""
    budget = cfg.budget_tokens
    _, candidates = search_representatives(tensors.representatives[layer][None], query.float()[None],
                                           max(1, budget // min_event), backend)  # (1, k)
    rule = SelectionRule(budget, int(budget * (1 - cfg.contiguity_fraction)), cfg.max_neighbour_distance,
                         surprise_floor)
    chosen = select_rows(candidates[0], tensors.starts, tensors.lengths, tensors.peaks, buffer, shortest, rule,
                         backend)
    keys = tensors.keys[layer].index_select(1, chosen.rows)  # (Hkv, budget, D)
    values = tensors.values[layer].index_select(1, chosen.rows)
    return keys, values, chosen.count, chosen.buffer


def add_neighbours(
    memory: EventMemory, chosen: set[int], hits: list[int], used: int, budget: int, max_distance: int,
    surprise_floor: float = 0.0,
) -> int:
    """Add temporal neighbours of `hits` (up to `max_distance` away) to `chosen`, nearest first, while `used`
    stays within `budget`.

    Returns the tokens used after. id+1 comes before id-1: what follows a match usually completes it. With
    `surprise_floor` > 0 (the segmentation's `min_surprise`), an event after a hit that the model predicted
    whole (its largest surprise at or below the floor: a run of filler) ends the hit's context on that side:
    read just before the question, such filler is what the small model continues instead of answering
    (measured: the agent example's report). Filler before a hit is context like any other.
    """
    picked = _Picked(memory, budget, chosen, used)
    picked.add_neighbours(hits, max_distance, surprise_floor)
    return picked.used


class _Picked:
    """Events chosen under a token budget, each event looked up in memory once, and no look-up once what is left
    of the budget is shorter than any event.

    Recall runs per layer and chunk: its Python is host time a GPU waits on (issue 19). The neighbour stage asks
    up to 2 * distance * hits times (about 740 per layer and chunk while reading random text, two thirds of them
    after the budget was spent), and a store's `memory.event` builds an object per call."""

    def __init__(self, memory: EventMemory, budget: int, chosen: set[int] | None = None, used: int = 0):
        self.memory, self.budget, self.n_events = memory, budget, len(memory)
        self.shortest = memory.shortest_event
        self.chosen = set() if chosen is None else chosen  # filled in place: add_neighbours' callers read it
        self.used = used
        self._events: dict[int, Event] = {}

    def event(self, event_id: int) -> Event:
        event = self._events.get(event_id)
        if event is None:
            event = self._events[event_id] = self.memory.event(event_id)
        return event

    def take(self, event_id: int, budget: int | None = None) -> bool:
        """Choose `event_id` if it exists, is not chosen yet and fits `budget` (default: the whole budget)."""
        if not 0 <= event_id < self.n_events or event_id in self.chosen:
            return False
        length = self.event(event_id).length
        if self.used + length > (self.budget if budget is None else budget):
            return False
        self.chosen.add(event_id)
        self.used += length
        return True

    def add_neighbours(self, hits: list[int], max_distance: int, surprise_floor: float) -> None:
        ended: set[int] = set()  # hits whose following context stopped at predicted text
        for distance in range(1, max_distance + 1):
            for hit in hits:
                if self.budget - self.used < self.shortest:
                    return
                after = hit + distance
                # Without a floor nothing is predicted: skip the event lookup.
                if surprise_floor > 0 and after < self.n_events and predicted(self.event(after).surprise_max,
                                                                               surprise_floor):
                    ended.add(hit)
                if hit not in ended:
                    self.take(after)
                self.take(hit - distance)
