import torch

from engramkv.config import RecallConfig
from engramkv.memory.events import Event, InMemoryEventMemory
from engramkv.retrieval.recall import select_events
from engramkv.engine.window import assemble, resident_columns, window_positions
from engramkv.kernels.window_attention import causal_mask, lower_right_causal_mask


def _memory(lengths, hot=None):
    layers, heads, dim = 2, 2, 4
    memory = InMemoryEventMemory(layers, heads, dim, torch.float32)
    start = 0
    for i, n in enumerate(lengths):
        rep = torch.full((layers, heads * dim), 0.0)
        rep[:, 0] = 10.0 if i == hot else float(i % 3)
        kv = torch.full((layers, heads, n, dim), float(i))
        summary = torch.zeros(layers * heads * dim)
        memory.add(Event(i, start, start + n, 1.0, 2.0), kv, kv, rep, summary, torch.zeros(n, dtype=torch.int32))
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
