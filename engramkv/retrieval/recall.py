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
from engramkv.memory.events import EventMemory
from engramkv.memory.segmentation import predicted


def select_events(
    memory: EventMemory,
    layer: int,
    query: torch.Tensor,  # (Hkv * D,)
    cfg: RecallConfig,
    min_event: int,
    buffer: deque[int] | None = None,
    budget: int | None = None,  # memory tokens to fill (default cfg.budget_tokens)
    predicted_below: float = 0.0,  # the segmentation's surprise floor (see add_neighbours)
) -> list[int]:
    budget = cfg.budget_tokens if budget is None else budget
    if len(memory) == 0 or budget == 0:
        return []
    similarity_budget = int(budget * (1 - cfg.contiguity_fraction))
    candidates, _ = memory.search(layer, query, k=max(1, budget // min_event))
    chosen: set[int] = set()
    hits: list[int] = []
    used = 0
    for event_id in candidates:
        length = memory.event(event_id).length
        if used + length <= similarity_budget:
            chosen.add(event_id)
            hits.append(event_id)
            used += length
    if not hits and candidates:  # the best event alone is larger than the similarity share
        first = candidates[0]
        if memory.event(first).length <= budget:
            chosen.add(first)
            hits.append(first)
            used += memory.event(first).length

    used = add_neighbours(memory, chosen, hits, used, budget, cfg.max_neighbour_distance, predicted_below)
    if buffer is not None:
        for event_id in reversed(buffer):
            used = _take(memory, chosen, event_id, used, budget)
        buffer.extend(hits)
    return sorted(chosen)


def add_neighbours(
    memory: EventMemory, chosen: set[int], hits: list[int], used: int, budget: int, max_distance: int,
    predicted_below: float = 0.0,
) -> int:
    """Add temporal neighbours of `hits` (up to `max_distance` away) to `chosen`, nearest first, while `used`
    stays within `budget`.

    Returns the tokens used after. id+1 comes before id-1: what follows a match usually completes it. With
    `predicted_below` > 0 (the segmentation's surprise floor), an event after a hit that the model predicted
    whole (its largest surprise at or below the floor: a run of filler) ends the hit's context on that side:
    read just before the question, such filler is what the small model continues instead of answering
    (measured: the agent example's report). Filler before a hit is context like any other.
    """
    ended: set[int] = set()  # hits whose following context stopped at predicted text
    for distance in range(1, max_distance + 1):
        for hit in hits:
            after = hit + distance
            # Without a floor nothing is predicted: skip the event lookup (this runs per layer and chunk).
            if predicted_below > 0 and after < len(memory) and predicted(memory.event(after).surprise_max,
                                                                          predicted_below):
                ended.add(hit)
            if hit not in ended:
                used = _take(memory, chosen, after, used, budget)
            used = _take(memory, chosen, hit - distance, used, budget)
    return used


def _take(memory: EventMemory, chosen: set[int], event_id: int, used: int, budget: int) -> int:
    if 0 <= event_id < len(memory) and event_id not in chosen:
        length = memory.event(event_id).length
        if used + length <= budget:
            chosen.add(event_id)
            used += length
    return used
