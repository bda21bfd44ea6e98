"""Recall's event selection on the device: which events a layer recalls, and their rows in the KV buffers.

Reading recalls per layer and chunk (`retrieval.recall.select_events`): the representative search's candidates
in score order are taken while they fit the similarity share of the budget, then the hits' temporal neighbours,
then the contiguity buffer's hits of earlier steps. In Python that needs the candidate ids on the host: one
host synchronisation per layer and chunk, which stalls a GPU's queue 30 times a chunk (issue 19). This module
runs the same rule where the candidates are.

- `select_rows_torch`, the twin: the ids to the host and the rule in Python, over the columns given.
- `_select_rows_triton`: one program walks the same rule (a few hundred scalar steps: the rule is sequential)
  and writes the chosen events' rows in chronological order, so the gather that follows needs nothing from
  the host either. The number of rows varies, the tensors do not: rows past `count` are 0 (padding the
  caller masks), and the budget bounds `count`.

Both return the same tensors: rows (budget,) long, count (1,) int32, chosen event ids (ascending, -1 padded),
and the contiguity buffer after this step ((B,) long, oldest first, -1 where empty).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engramkv.kernels.backend import Backend, triton_installed, use_triton

if triton_installed():
    import triton
    import triton.language as tl
else:  # the twin needs no Triton
    triton = tl = None


@dataclass(frozen=True)
class SelectionRule:
    """The numbers of `select_events`'s rule for one step (`RecallConfig` and the segmentation's)."""

    budget: int  # memory tokens to fill
    similarity_budget: int  # of which the similarity hits may take
    max_distance: int  # farthest temporal neighbour
    surprise_floor: float  # an event after a hit predicted whole ends the hit's context on that side (0: off)


@dataclass(frozen=True)
class Selected:
    rows: torch.Tensor  # (budget,) long: the chosen events' rows in the KV buffers, chronological; 0 past count
    count: torch.Tensor  # (1,) int32: rows in use
    chosen: torch.Tensor  # (E',) long: the chosen event ids ascending, -1 past them
    buffer: torch.Tensor  # (B,) long: the contiguity buffer after this step, oldest first, -1 where empty


def select_rows(
    candidates: torch.Tensor,  # (k,) long: event ids, best score first (the representative search's)
    starts: torch.Tensor,  # (N,) long: each event's first row in the KV buffers
    lengths: torch.Tensor,  # (N,) int32
    peaks: torch.Tensor,  # (N,) float32: each event's largest surprise
    buffer: torch.Tensor,  # (B,) long: hits of earlier steps, oldest first, -1 where empty
    shortest: int,  # the shortest event's length: nothing shorter is left to take
    rule: SelectionRule,
    backend: Backend = "auto",
) -> Selected:
    if use_triton(backend, candidates.device):
        return _select_rows_triton(candidates, starts, lengths, peaks, buffer, shortest, rule)
    return select_rows_torch(candidates, starts, lengths, peaks, buffer, shortest, rule)


def select_rows_torch(candidates: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, peaks: torch.Tensor,
                      buffer: torch.Tensor, shortest: int, rule: SelectionRule) -> Selected:
    """The rule on the host, written out over the columns (`retrieval.recall.select_events` is the same rule over
    an `EventMemory`; the tests hold the host rule, this twin and the kernel to the same choices)."""
    sizes, peak, first = lengths.tolist(), peaks.tolist(), starts.tolist()
    chosen: set[int] = set()
    used = 0

    def take(e: int, limit: int) -> bool:
        nonlocal used
        if not 0 <= e < len(sizes) or e in chosen or used + sizes[e] > limit:
            return False
        chosen.add(e)
        used += sizes[e]
        return True

    hits: list[int] = []
    for e in candidates.tolist():
        if rule.similarity_budget - used < shortest:
            break
        if take(e, rule.similarity_budget):
            hits.append(e)
    if not hits and take(int(candidates[0]), rule.budget):
        hits.append(int(candidates[0]))
    ended: set[int] = set()
    for distance in range(1, rule.max_distance + 1):
        if rule.budget - used < shortest:
            break
        for hit in hits:
            if rule.budget - used < shortest:
                break
            after = hit + distance
            if rule.surprise_floor > 0 and after < len(sizes) and peak[after] <= rule.surprise_floor:
                ended.add(hit)
            if hit not in ended:
                take(after, rule.budget)
            take(hit - distance, rule.budget)
    held = [e for e in buffer.tolist() if e >= 0]
    for e in reversed(held):
        take(e, rule.budget)
    after_step = ([-1] * buffer.shape[0] + held + hits)[-buffer.shape[0]:] if buffer.shape[0] else []
    ordered = sorted(chosen)
    rows = [first[e] + t for e in ordered for t in range(sizes[e])]
    padded = torch.zeros(rule.budget, dtype=torch.long)
    padded[: len(rows)] = torch.tensor(rows, dtype=torch.long)
    cap = _chosen_capacity(rule.budget, shortest, len(sizes))
    device = candidates.device
    return Selected(padded.to(device), torch.tensor([len(rows)], dtype=torch.int32, device=device),
                    torch.tensor(ordered + [-1] * (cap - len(ordered)), dtype=torch.long, device=device),
                    torch.tensor(after_step, dtype=torch.long, device=device))


def _chosen_capacity(budget: int, shortest: int, n_events: int) -> int:
    """Room for every event the budget can hold: each is at least `shortest` long."""
    most = min(n_events, budget // max(shortest, 1))
    return max(16, 1 << max(most, 1).bit_length())


def _select_rows_triton(candidates: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, peaks: torch.Tensor,
                        buffer: torch.Tensor, shortest: int, rule: SelectionRule) -> Selected:
    device = candidates.device
    n_events, n_candidates, n_buffer = lengths.shape[0], candidates.shape[0], buffer.shape[0]
    cap = _chosen_capacity(rule.budget, shortest, n_events)
    rows = torch.empty(max(rule.budget, 1), dtype=torch.long, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    chosen = torch.empty(cap, dtype=torch.long, device=device)
    after = torch.empty(n_buffer, dtype=torch.long, device=device)
    _select_kernel[(1,)](
        candidates, starts, lengths, peaks, buffer, rows, count, chosen, after,
        n_candidates, n_events, n_buffer, rule.budget, rule.similarity_budget, shortest, rule.max_distance,
        float(rule.surprise_floor),
        CAP=cap, HCAP=max(16, triton.next_power_of_2(n_candidates)), ROW_BLOCK=64, num_warps=1,
    )
    return Selected(rows[: rule.budget], count, chosen, after)


if triton is not None:

    @triton.jit
    def _pick(e, allowed, limit, chosen, n_chosen, used, slots, LENGTHS, n_events):
        """Take event `e` if allowed, it exists, is not taken yet and fits `limit`: `_Picked.take`."""
        inside = (e >= 0) & (e < n_events)
        length = tl.load(LENGTHS + e, mask=inside, other=0)
        new = tl.sum((chosen == e).to(tl.int32), 0) == 0
        ok = allowed & inside & new & (used + length <= limit)
        chosen = tl.where((slots == n_chosen) & ok, e, chosen)
        return chosen, n_chosen + ok.to(tl.int32), used + tl.where(ok, length, 0), ok

    @triton.jit
    def _element(vector, slots, i):
        """vector[i] of a register vector (a masked sum: Triton cannot index registers)."""
        return tl.sum(tl.where(slots == i, vector, 0), 0)

    @triton.jit
    def _select_kernel(CANDIDATES, STARTS, LENGTHS, PEAKS, BUFFER, ROWS, COUNT, CHOSEN, AFTER,
                       n_candidates, n_events, n_buffer, budget, similarity_budget, shortest, max_distance, floor,
                       CAP: tl.constexpr, HCAP: tl.constexpr, ROW_BLOCK: tl.constexpr):
        slots = tl.arange(0, CAP)
        chosen = tl.full((CAP,), -1, tl.int64)
        n_chosen = tl.zeros((), tl.int32)
        used = tl.zeros((), tl.int32)
        hit_slots = tl.arange(0, HCAP)
        hits = tl.full((HCAP,), -1, tl.int64)
        n_hits = tl.zeros((), tl.int32)
        yes = n_chosen == 0  # a true scalar

        # 1. similarity hits: candidates in score order while what is left of their share can hold an event
        i = 0
        while (i < n_candidates) & (similarity_budget - used >= shortest):
            e = tl.load(CANDIDATES + i)
            chosen, n_chosen, used, ok = _pick(e, yes, similarity_budget, chosen, n_chosen, used, slots, LENGTHS,
                                               n_events)
            hits = tl.where((hit_slots == n_hits) & ok, e, hits)
            n_hits += ok.to(tl.int32)
            i += 1
        first = tl.load(CANDIDATES)  # the best event alone, when it exceeds the similarity share
        chosen, n_chosen, used, ok = _pick(first, n_hits == 0, budget, chosen, n_chosen, used, slots, LENGTHS,
                                           n_events)
        hits = tl.where((hit_slots == 0) & ok, first, hits)
        n_hits += ok.to(tl.int32)

        # 2. temporal neighbours, nearest first, id + 1 before id - 1, best hit first; a predicted event after a
        # hit ends its context on that side
        ended = tl.zeros((HCAP,), tl.int32)
        going = budget - used >= shortest
        distance = 1
        while (distance <= max_distance) & going:
            h = 0
            while (h < n_hits) & going:
                going = budget - used >= shortest
                hit = _element(hits, hit_slots, h)
                after = hit + distance
                peak = tl.load(PEAKS + after, mask=after < n_events, other=float("inf"))
                ends = going & (floor > 0) & (after < n_events) & (peak <= floor)
                was_ended = _element(ended, hit_slots, h) != 0
                ended = tl.where((hit_slots == h) & ends, 1, ended)
                chosen, n_chosen, used, ok = _pick(after, going & ~(was_ended | ends), budget, chosen, n_chosen,
                                                   used, slots, LENGTHS, n_events)
                chosen, n_chosen, used, ok = _pick(hit - distance, going, budget, chosen, n_chosen, used, slots,
                                                   LENGTHS, n_events)
                h += 1
            distance += 1

        # 3. the contiguity buffer, newest first; then this step's hits join it
        j = n_buffer - 1
        while j >= 0:
            e = tl.load(BUFFER + j)
            chosen, n_chosen, used, ok = _pick(e, yes, budget, chosen, n_chosen, used, slots, LENGTHS, n_events)
            j -= 1
        n_old = tl.zeros((), tl.int32)
        j = 0
        while j < n_buffer:
            n_old += (tl.load(BUFFER + j) >= 0).to(tl.int32)
            j += 1
        s = 0
        while s < n_buffer:
            g = n_old + n_hits - n_buffer + s  # this slot's place in (old hits, new hits)
            from_old = (g >= 0) & (g < n_old)
            old = tl.load(BUFFER + (n_buffer - n_old + g), mask=from_old, other=-1)
            new = _element(hits, hit_slots, g - n_old)
            tl.store(AFTER + s, tl.where(g < 0, -1, tl.where(from_old, old, new)))
            s += 1

        # 4. the chosen events' rows, in chronological order, then zeros to the budget
        ordered = tl.sort(tl.where(slots < n_chosen, chosen, n_events))
        offset = tl.zeros((), tl.int32)
        i = 0
        while i < n_chosen:
            e = _element(ordered, slots, i)
            start = tl.load(STARTS + e)
            length = tl.load(LENGTHS + e)
            t = 0
            while t < length:
                at = t + tl.arange(0, ROW_BLOCK)
                tl.store(ROWS + offset + at, start + at, mask=at < length)
                t += ROW_BLOCK
            offset += length
            i += 1
        b = 0
        while b < budget:
            at = b + tl.arange(0, ROW_BLOCK)
            tl.store(ROWS + at, tl.zeros((ROW_BLOCK,), tl.int64), mask=(at >= offset) & (at < budget))
            b += ROW_BLOCK
        tl.store(COUNT, offset)
        tl.store(CHOSEN + slots, tl.where(slots < n_chosen, ordered, -1))
