from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engramkv.config import EngineConfig, RecallConfig, WindowConfig
from engramkv.memory.events import Event, InMemoryEventMemory
from engramkv.retrieval.recall import select_events
from engramkv.engine.window import assemble, resident_columns, window_positions
from engramkv.kernels.window_attention import causal_mask, lower_right_causal_mask

from conftest import tiny_lm


def _memory(lengths, hot=None):
    layers, heads, dim = 2, 2, 4
    memory = InMemoryEventMemory(layers, heads, dim, torch.float32)
    start = 0
    for i, n in enumerate(lengths):
        rep = torch.full((layers, heads * dim), 0.0)
        rep[:, 0] = 10.0 if i == hot else float(i % 3)
        kv = torch.full((layers, heads, n, dim), float(i))
        summary = torch.zeros(layers * heads * dim)
        memory.add([Event(i, start, start + n, 1.0, 2.0)], kv, kv, rep[None], summary[None],
                   torch.zeros(n, dtype=torch.int32))
        start += n
    return memory


def test_hit_and_neighbours_within_budget_in_time_order():
    memory = _memory([10] * 20, hot=7)
    query = torch.zeros(8)
    query[0] = 1.0
    cfg = RecallConfig(budget_tokens=50, contiguity_fraction=0.4)
    chosen = select_events(memory, 0, query, cfg, min_event=10)
    assert 7 in chosen and 8 in chosen and 6 in chosen
    assert chosen == sorted(chosen)
    assert sum(memory.event(i).length for i in chosen) <= 50


def test_gather_returns_events_in_the_given_order():
    memory = _memory([3, 5, 2])
    keys, values = memory.gather(1, [0, 2])
    assert keys.shape == (2, 5, 4)
    assert keys[0, :, 0].tolist() == [0, 0, 0, 2, 2]


def _whole_parts():
    return {"keys": torch.ones(2, 2, 6, 4), "values": torch.ones(2, 2, 6, 4), "representatives": torch.ones(2, 2, 8),
            "key_summaries": torch.zeros(2, 16), "token_ids": torch.zeros(6, dtype=torch.int32)}


@pytest.mark.parametrize("part, shape", [
    ("representatives", (1, 2, 8)), ("key_summaries", (1, 16)), ("token_ids", (5,)), ("values", (2, 2, 5, 4)),
    ("keys", (2, 2, 6, 3)),  # another head size
    ("keys", (2, 1, 6, 4)),  # one KV head: copy_ would broadcast it
    ("representatives", (2, 2, 7)), ("key_summaries", (2, 15)),  # another width than the memory's
])
def test_the_in_ram_memory_refuses_misaligned_parts_and_stays_as_it_was(part, shape):
    """Every part of an `add` must cover the same events, in the memory's shapes: a wrong one is refused before
    anything is appended, so the memory reads as before (its buffers would otherwise no longer line up)."""
    from engramkv.errors import SessionError

    memory = _memory([3, 5])
    events = [Event(2, 8, 12, 1.0, 2.0), Event(3, 12, 14, 1.0, 2.0)]
    parts = _whole_parts()
    parts[part] = torch.ones(shape, dtype=parts[part].dtype)
    with pytest.raises(SessionError, match=f"2 events of 6 tokens, given {part} "):
        memory.add(events, **parts)
    assert len(memory) == 2 and memory.shortest_event == 3
    keys, _ = memory.gather(1, [1])
    assert keys.shape == (2, 5, 4) and bool((keys == 1).all())
    memory.add(events, **_whole_parts())  # the same events, whole: the memory goes on from where it was
    assert len(memory) == 4 and memory.gather(0, [2, 3])[0].shape == (2, 6, 4)
    assert memory.search_keys(torch.zeros(16), 4)[0]  # the summaries stayed one row per event


def test_contiguity_buffer_keeps_earlier_hits():
    memory = _memory([10] * 20, hot=3)
    cfg = RecallConfig(budget_tokens=40, contiguity_fraction=0.5, contiguity_buffer=2)
    from collections import deque

    buffer: deque[int] = deque(maxlen=2)
    q = torch.zeros(8)
    q[0] = 1.0
    select_events(memory, 0, q, cfg, 10, buffer)
    assert 3 in buffer


def test_position_schemes():
    assert window_positions(2, 3, 2, 1, "contiguous").tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert window_positions(2, 3, 2, 1, "fixed").tolist() == [0, 1, 2, 2, 2, 3, 4, 5]
    assert window_positions(2, 0, 2, 1, "fixed").tolist() == [0, 1, 2, 3, 4]


def test_assemble_puts_memory_after_the_local_text_before_the_prompt():
    def part(label: int, n: int) -> torch.Tensor:
        return torch.full((1, n, 1), float(label))  # (Hkv, n, D)

    sink, local, memory, new = part(0, 2), torch.arange(10.0, 15.0).view(1, 5, 1), part(9, 3), part(5, 1)
    order = assemble(sink, local, memory, new, memory_at=0).flatten().tolist()
    assert order == [0, 0, 9, 9, 9, 10, 11, 12, 13, 14, 5]  # reading: memory before the local window
    order = assemble(sink, local, memory, new, memory_at=3).flatten().tolist()
    assert order == [0, 0, 10, 11, 12, 9, 9, 9, 13, 14, 5]  # answer: memory before the prompt's 2 tokens
    weights = torch.tensor(order)[None]  # (1, N): each column labelled by what it holds
    assert resident_columns(weights, 2, 3, 3).tolist() == [[10, 11, 12, 13, 14, 5]]


def test_lower_right_mask():
    mask = lower_right_causal_mask(2, 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    # the cached one is the right end of a wider mask: the same values
    assert torch.equal(causal_mask(2, 4, torch.device("cpu")), mask)
    assert torch.equal(causal_mask(3, 5000, torch.device("cpu")), lower_right_causal_mask(3, 5000))


# ------------------------------------------------------------------ the selection against its plain rule


def _plain_select(memory, layer, query, cfg, min_event, buffer, budget, surprise_floor):
    """The selection as first written (one memory lookup per question asked): the oracle for `select_events`."""

    def take(event_id, used):
        if 0 <= event_id < len(memory) and event_id not in chosen:
            length = memory.event(event_id).length
            if used + length <= budget:
                chosen.add(event_id)
                used += length
        return used

    similarity_budget = int(budget * (1 - cfg.contiguity_fraction))
    candidates, _ = memory.search(layer, query, k=max(1, budget // min_event))
    chosen, hits, used = set(), [], 0
    for event_id in candidates:
        length = memory.event(event_id).length
        if used + length <= similarity_budget:
            chosen.add(event_id)
            hits.append(event_id)
            used += length
    if not hits and candidates and memory.event(candidates[0]).length <= budget:
        chosen.add(candidates[0])
        hits.append(candidates[0])
        used += memory.event(candidates[0]).length
    ended = set()
    for distance in range(1, cfg.max_neighbour_distance + 1):
        for hit in hits:
            after = hit + distance
            if surprise_floor > 0 and after < len(memory) and memory.event(after).surprise_max <= surprise_floor:
                ended.add(hit)
            if hit not in ended:
                used = take(after, used)
            used = take(hit - distance, used)
    for event_id in reversed(buffer):
        used = take(event_id, used)
    buffer.extend(hits)
    return sorted(chosen)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=60), seed=st.integers(0, 2**16),
       budget=st.integers(1, 200), fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]), distance=st.integers(0, 9),
       floor=st.sampled_from([0.0, 1.0]), earlier=st.lists(st.integers(0, 70), max_size=4),
       shortest=st.integers(1, 12))
def test_selection_matches_its_plain_rule(lengths, seed, budget, fraction, distance, floor, earlier, shortest):
    """Exactly the plain rule's choice, where the selection stops early once no event fits what is left."""
    lengths = [max(n, shortest) for n in lengths]
    gen = torch.Generator().manual_seed(seed)
    layers, heads, dim = 1, 1, 4
    memory = InMemoryEventMemory(layers, heads, dim, torch.float32)
    start = 0
    for i, n in enumerate(lengths):
        kv = torch.zeros(layers, heads, n, dim)
        surprise_max = float(torch.rand((), generator=gen) * 2)  # about half of them under a floor of 1
        memory.add([Event(i, start, start + n, 0.5, surprise_max)], kv, kv, torch.randn(1, layers, dim, generator=gen),
                   torch.zeros(1, 4), torch.zeros(n, dtype=torch.int32))
        start += n
    query = torch.randn(dim, generator=gen)
    cfg = RecallConfig(budget_tokens=budget, contiguity_fraction=fraction, max_neighbour_distance=distance)
    buffer, plain_buffer = deque(earlier, maxlen=4), deque(earlier, maxlen=4)
    chosen = select_events(memory, 0, query, cfg, 8, buffer, surprise_floor=floor)
    assert chosen == _plain_select(memory, 0, query, cfg, 8, plain_buffer, budget, floor)
    assert list(buffer) == list(plain_buffer)


@pytest.mark.parametrize("scheme", ["contiguous", "fixed"])
@pytest.mark.parametrize("n_memory", [0, 5])
def test_rope_rows_are_those_of_the_window_positions(scheme, n_memory):
    cfg = EngineConfig(window=WindowConfig(chunk_size=16, n_sink=8, n_local=512), recall=RecallConfig(positions=scheme))
    state = tiny_lm("llama", cfg).session().state
    like = torch.zeros(1, dtype=state.dtype)
    cos, sin = state._cos_sin(3, n_memory, 7, 2, like)  # (N, D) each
    positions = window_positions(3, n_memory, 7, 2, scheme)  # (N,)
    table_cos, table_sin = state.rope.table(int(positions.max()) + 1, like)
    assert torch.equal(cos, table_cos[positions]) and torch.equal(sin, table_sin[positions])
