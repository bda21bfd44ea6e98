"""Reading's recall on the device (`kernels.selection`, `retrieval.recall.recall_on_device`): the same events as the
host's rule, their KV in a fixed-size memory section, and no host read per layer. Triton runs interpreted on the CPU
(conftest); on a GPU the same tests run the compiled kernels."""

import copy
import sys
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

from engramkv import EngineConfig, EpisodicLM
from engramkv.config import ModelConfig, RecallConfig, SegmentationConfig, WindowConfig
from engramkv.engine.state import EpisodicState
from engramkv.engine.window import window_positions
from engramkv.kernels.selection import SelectionRule, select_rows
from engramkv.kernels.window_attention import window_attention
from engramkv.memory.events import Event, InMemoryEventMemory
from engramkv.retrieval.recall import recall_on_device, select_events

from conftest import VOCAB, IntTokenizer

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _memory(lengths, peaks, gen, layers=2, heads=2, dim=4):
    memory = InMemoryEventMemory(layers, heads, dim, torch.float32, device=DEVICE)
    start = 0
    for i, (n, peak) in enumerate(zip(lengths, peaks)):
        kv = torch.randn(layers, heads, n, dim, generator=gen)
        memory.add([Event(i, start, start + n, 0.5, peak)], kv, kv + 1, torch.randn(1, layers, heads * dim,
                   generator=gen), torch.zeros(1, 4), torch.zeros(n, dtype=torch.int32))
        start += n
    return memory


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=40), seed=st.integers(0, 2**16),
       budget=st.integers(1, 160), fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]), distance=st.integers(0, 9),
       floor=st.sampled_from([0.0, 1.0]), earlier=st.lists(st.integers(0, 50), max_size=4),
       kind=st.sampled_from(["triton", "torch"]))
def test_the_device_recalls_what_the_host_rule_chooses(lengths, seed, budget, fraction, distance, floor, earlier,
                                                       kind):
    """The kernel's (and its twin's) events, rows, KV and contiguity buffer are the host rule's (`select_events`,
    `gather`)."""
    gen = torch.Generator().manual_seed(seed)
    peaks = (torch.rand(len(lengths), generator=gen) * 2).tolist()  # about half under a floor of 1
    memory = _memory(lengths, peaks, gen)
    cfg = RecallConfig(budget_tokens=budget, contiguity_fraction=fraction, max_neighbour_distance=distance,
                       contiguity_buffer=4)
    query = torch.randn(8, generator=gen).to(DEVICE)
    host_buffer = deque(earlier, maxlen=4)
    chosen = select_events(memory, 1, query, cfg, 8, host_buffer, surprise_floor=floor)
    buffer = torch.tensor([-1] * (4 - len(earlier)) + earlier, dtype=torch.long, device=DEVICE)
    tensors = memory.recall_tensors()
    keys, values, used, after = recall_on_device(tensors, 1, query, cfg, 8, memory.shortest_event, buffer, floor,
                                                 kind)
    expected_k, expected_v = memory.gather(1, chosen)
    n = int(used)
    assert n == expected_k.shape[1] and keys.shape[1] == budget
    assert torch.equal(keys[:, :n], expected_k) and torch.equal(values[:, :n], expected_v)
    assert [e for e in after.tolist() if e >= 0] == list(host_buffer)


@pytest.mark.parametrize("budget, shortest", [(64, 8), (7, 3), (300, 1)])
def test_the_kernel_and_its_twin_return_the_same_tensors(budget, shortest):
    gen = torch.Generator().manual_seed(budget)
    n = 50
    lengths = torch.randint(shortest, 20, (n,), generator=gen, dtype=torch.int32)
    starts = torch.cumsum(lengths, 0) - lengths
    peaks = torch.rand(n, generator=gen) * 2
    candidates = torch.randperm(n, generator=gen)[:12]
    buffer = torch.tensor([-1, 4, 9], dtype=torch.long)
    rule = SelectionRule(budget, budget * 2 // 3, 5, 1.0)
    args = [t.to(DEVICE) for t in (candidates, starts.long(), lengths, peaks, buffer)]
    twin = select_rows(*args, shortest, rule, backend="torch")
    kernel = select_rows(*args, shortest, rule, backend="triton")
    for name in ("rows", "count", "chosen", "buffer"):
        assert torch.equal(getattr(kernel, name), getattr(twin, name)), name
    assert int(twin.count) <= budget and twin.rows[int(twin.count):].eq(0).all()


@pytest.mark.parametrize("kind", ["torch", "triton"])
def test_empty_columns_of_the_window_change_nothing(kind):
    """A memory section padded past its `used` slots attends as the window without the padding."""
    gen = torch.Generator().manual_seed(3)
    h, hkv, d, c_len, n_sink, used, capacity, n_local = 4, 2, 32, 5, 3, 6, 20, 9
    n = n_sink + capacity + n_local + c_len
    q = torch.randn(h, c_len, d, generator=gen).to(DEVICE)
    keys, values = (torch.randn(hkv, n, d, generator=gen).to(DEVICE) for _ in range(2))
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = (torch.cat([angles, angles], -1).cos().to(DEVICE), torch.cat([angles, angles], -1).sin().to(DEVICE))
    kept = torch.cat([torch.arange(n_sink + used), torch.arange(n_sink + capacity, n)]).to(DEVICE)
    expected, expected_mass = window_attention(q, keys[:, kept], values[:, kept], cos[kept], sin[kept], 0.2, 3,
                                               backend="torch")
    padding = (n_sink, capacity, torch.tensor([used], dtype=torch.int32, device=DEVICE))
    out, mass = window_attention(q, keys, values, cos, sin, 0.2, 3, backend=kind, padding=padding)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass[:, kept], expected_mass, atol=2e-5, rtol=1e-4)
    assert mass[:, n_sink + used : n_sink + capacity].eq(0).all()


@pytest.mark.parametrize("scheme", ["contiguous", "fixed"])
@pytest.mark.parametrize("used", [0, 2, 5])
def test_padded_positions_are_those_of_the_filled_window(scheme, used):
    """With 5 memory slots of which `used` hold events, every key that is not padding gets the RoPE row of its
    position in the window without the padding (`window_positions`)."""
    cfg = EngineConfig(window=WindowConfig(chunk_size=16, n_sink=8, n_local=512), recall=RecallConfig(positions=scheme))
    state = EpisodicLM(_tiny_model(), IntTokenizer(), "tiny-llama-d32", cfg).session().state
    like = torch.zeros(1, dtype=state.dtype, device=DEVICE)
    cos, sin = state._cos_sin(3, 5, 7, 2, like, torch.tensor([used], dtype=torch.int32, device=DEVICE))  # (17, D)
    kept = [*range(3 + used), *range(8, 17)]  # the padding is columns 3 + used .. 8
    positions = window_positions(3, used, 7, 2, scheme).to(DEVICE)  # (12,)
    table_cos, table_sin = state.rope.table(20, like)
    assert torch.equal(cos[kept], table_cos[positions]) and torch.equal(sin[kept], table_sin[positions])


def _tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=VOCAB, max_position_embeddings=2048)).eval().to(DEVICE)


def test_reading_on_the_device_reads_as_on_the_host():
    """The same stream through the same kernels, recalling on the device and (`select_on_device=False`) on the host:
    the same events, the same contiguity buffers, logits (and surprise) within float rounding (the padding moves
    where the kernel's tiles end)."""
    model = _tiny_model()
    ids = torch.randint(0, VOCAB, (320,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    for on_device in (True, False):
        cfg = EngineConfig(model=ModelConfig(kernels="triton"),
                           window=WindowConfig(chunk_size=32, n_sink=8, n_local=96),
                           segmentation=SegmentationConfig(min_event=8, max_event=32),
                           recall=RecallConfig(budget_tokens=64, select_on_device=on_device))
        lm = EpisodicLM(copy.deepcopy(model), IntTokenizer(), "tiny-llama-d32", cfg)
        memory = InMemoryEventMemory(2, 2, 32, torch.float16, device=DEVICE, kernels="triton")
        session = lm.session(memory=memory)
        session.ingest_ids(ids)
        assert (session.state.layers[0].device_buffer is not None) == on_device  # which path read
        snapshot = session.state.snapshot()
        spans = [(memory.event(i).start, memory.event(i).end) for i in range(len(memory))]
        results.append((session.state.last_logits, spans, [layer["buffer"] for layer in snapshot["layers"]]))
    (logits, events, buffers), (host_logits, host_events, host_buffers) = results
    assert len(events) > 5 and events == host_events
    assert buffers == host_buffers and any(buffers)
    torch.testing.assert_close(logits, host_logits, atol=1e-4, rtol=1e-4)


class _HostReads(TorchFunctionMode):
    """Counts what reads a tensor's data on the host (on a GPU each is a synchronisation), outside Triton's own
    interpreter (which runs the kernels on the host on the CPU)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero,
             torch.nonzero, torch.Tensor.masked_select, torch.masked_select, torch.unique, torch.Tensor.unique}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            frame = sys._getframe(1)
            while frame is not None and "triton" not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is None:
                self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_no_host_read_per_layer_while_reading_on_the_device(monkeypatch, kernels):
    """Issue 19: reading recalls, gathers and attends per layer without reading anything back to the host; the host
    path does (the ids of the search), which shows the count sees what it should."""
    counter = _HostReads()
    attend = EpisodicState.attend

    def counted(self, *args, **kwargs):
        with counter:
            return attend(self, *args, **kwargs)

    monkeypatch.setattr(EpisodicState, "attend", counted)
    cfg = EngineConfig(model=ModelConfig(kernels=kernels), window=WindowConfig(chunk_size=32, n_sink=8, n_local=96),
                       segmentation=SegmentationConfig(min_event=8, max_event=32),
                       recall=RecallConfig(budget_tokens=64))
    session = EpisodicLM(_tiny_model(), IntTokenizer(), "tiny-llama-d32", cfg).session()
    session.ingest_ids(torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(2)).tolist())
    assert len(session.memory) > 3
    if kernels == "triton":
        assert counter.reads == []
    else:
        assert "tolist" in counter.reads
