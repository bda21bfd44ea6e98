"""Sealing several events at once: each event gets exactly what sealing it alone would give it."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engramkv.config import EngineConfig, RefinementConfig, RepresentativeConfig, WindowConfig
from engramkv.engine.sealing import LayerState, Stream
from engramkv.memory.events import InMemoryEventMemory
from engramkv.memory.summary import key_summary, representatives_of_events

LAYERS, HEADS, DIM = 3, 2, 8


def _representatives(keys: torch.Tensor, received: torch.Tensor, keys_per_head: int) -> torch.Tensor:
    """One event's representatives as the design states them (the oracle): per layer and KV head, the mean of
    the `keys_per_head` most-attended pre-RoPE keys, heads concatenated. keys (layers, Hkv, n, D) -> (layers,
    Hkv * D)."""
    top = received.topk(min(keys.shape[2], keys_per_head), dim=2).indices  # (layers, Hkv, r)
    chosen = keys.float().gather(2, top[..., None].expand(-1, -1, -1, keys.shape[-1]))  # (layers, Hkv, r, D)
    return chosen.mean(dim=2).flatten(1)


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(1, 40), min_size=1, max_size=12), keys_per_head=st.integers(1, 8),
       seed=st.integers(0, 2**16))
def test_representatives_of_events_are_each_events_own(counts, keys_per_head, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, HEADS, sum(counts), DIM, generator=gen).half()  # (layers, Hkv, T, D)
    received = torch.rand(LAYERS, HEADS, sum(counts), generator=gen)  # (layers, Hkv, T)
    together = representatives_of_events(keys, received, counts, keys_per_head)  # (E, layers, Hkv * D)
    alone, start = [], 0
    for n in counts:
        alone.append(_representatives(keys[:, :, start : start + n], received[:, :, start : start + n], keys_per_head))
        start += n
    assert torch.equal(together, torch.stack(alone))  # bit for bit


def test_a_sealing_of_several_events_gives_each_its_own_statistics():
    cfg = EngineConfig(window=WindowConfig(n_sink=0, n_local=16, chunk_size=8),
                       refinement=RefinementConfig(enabled=False),
                       representatives=RepresentativeConfig(keys_per_head=3))
    stream = Stream(cfg, summary_layers=[0, 2])
    gen = torch.Generator().manual_seed(0)
    n = 60
    empty = torch.empty(HEADS, 0, DIM)
    layers = [LayerState(empty, empty, torch.randn(HEADS, n, DIM, generator=gen),
                         torch.randn(HEADS, n, DIM, generator=gen), torch.rand(HEADS, n, generator=gen))
              for _ in range(LAYERS)]
    stream.tail_tokens = torch.arange(n, dtype=torch.int32)
    stream.local_surprise = torch.rand(n, generator=gen) * 4
    stream.boundaries = [10, 12, 30, 41, 50, 55]  # a 16-token window: events starting before 44 leave it
    memory = InMemoryEventMemory(LAYERS, HEADS, DIM, torch.float32)
    keys = torch.stack([st.local_k for st in layers])  # (layers, Hkv, n, D)
    received = torch.stack([st.local_attention for st in layers])  # (layers, Hkv, n)
    surprise = stream.local_surprise.clone()
    stream.seal(layers, memory)
    assert [(e.start, e.end) for e in memory.events] == [(0, 10), (10, 12), (12, 30), (30, 41), (41, 50)]
    assert stream.local_start == 50 and stream.boundaries == [55]
    for e in memory.events:
        part = slice(e.start, e.end)
        assert e.surprise_max == float(surprise[part].max())
        assert abs(e.surprise_mean - float(surprise[part].double().mean())) < 1e-12
        assert memory.tokens(e.id) == list(range(e.start, e.end))
        gathered, _ = memory.gather(1, [e.id])
        assert torch.equal(gathered, keys[1, :, part])
        assert torch.equal(memory._reps.view()[:, e.id], _representatives(keys[:, :, part], received[:, :, part], 3))
        assert torch.equal(memory._summaries.view()[e.id], key_summary(keys[[0, 2], :, part]))
