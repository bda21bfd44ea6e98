"""The Triton kernels against their PyTorch twins, on the CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 where there is no GPU); on a GPU the same tests run the compiled kernels."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engramkv import EngineConfig, EpisodicLM
from engramkv.config import ModelConfig, RecallConfig, SegmentationConfig, WindowConfig
from engramkv.errors import ConfigError
from engramkv.kernels import backend
from engramkv.kernels.gather import gather
from engramkv.kernels.representatives import TILE, search
from engramkv.kernels.window_attention import window_attention
from engramkv.storage.codec import decode_layer, encode_layers, quant_parts

from conftest import VOCAB, IntTokenizer

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rope_tables(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:  # (N, D) each, positions 0..N-1
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(n).float()[:, None] * inv[None]
    both = torch.cat([angles, angles], dim=-1)
    return both.cos().to(DEVICE), both.sin().to(DEVICE)


def _naive(q, keys, values, cos, sin, scaling, n_probe):
    """Attention written out in float64: RoPE, full (C, N) weights with the lower-right causal mask."""
    def rot(x, c, s):
        half = x.shape[-1] // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s
    h, c_len, _ = q.shape
    hkv, n = keys.shape[0], keys.shape[1]
    qr = rot(q.double(), cos[-c_len:].double(), sin[-c_len:].double())
    kr = rot(keys.double(), cos.double(), sin.double()).repeat_interleave(h // hkv, dim=0)  # (H, N, D)
    logits = qr @ kr.transpose(1, 2) * scaling  # (H, C, N)
    visible = torch.ones(c_len, n, dtype=torch.bool, device=q.device).tril(n - c_len)
    weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    out = weights @ values.double().repeat_interleave(h // hkv, dim=0)
    mass = weights[:, c_len - n_probe :].sum(1).view(hkv, h // hkv, n).sum(1)  # (Hkv, N)
    return out, mass


# (H, Hkv, D, C, N): odd sizes, a one-token decode step, an empty memory (N == C), tiles of both kinds cut short
SHAPES = [(4, 2, 64, 5, 37), (6, 2, 32, 16, 16), (4, 4, 64, 1, 100), (9, 3, 64, 33, 130), (2, 1, 128, 70, 201)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["torch", "triton"])
def test_window_attention_matches_attention_written_out(shape, kind):
    h, hkv, d, c_len, n = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q, keys, values = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((h, c_len, d), (hkv, n, d), (hkv, n, d)))
    cos, sin = _rope_tables(n, d)
    n_probe = min(c_len, 3)
    out, mass = window_attention(q, keys, values, cos, sin, d**-0.5, n_probe, backend=kind)
    expected_out, expected_mass = _naive(q, keys, values, cos, sin, d**-0.5, n_probe)
    torch.testing.assert_close(out.double(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass.double(), expected_mass, atol=2e-5, rtol=1e-4)
    # each probing query spreads one unit of attention per query head over the keys it sees
    expected_sum = torch.full((hkv,), float(n_probe * h // hkv), dtype=torch.float64)
    torch.testing.assert_close(mass.sum(1).double().cpu(), expected_sum, atol=1e-5, rtol=1e-5)


def test_window_attention_in_half_precision_stays_within_its_rounding():
    h, hkv, d, c_len, n = 4, 2, 64, 20, 150
    gen = torch.Generator().manual_seed(3)
    q, keys, values = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((h, c_len, d), (hkv, n, d), (hkv, n, d)))
    cos, sin = _rope_tables(n, d)
    half = [t.half() for t in (q, keys, values, cos, sin)]
    out, mass = window_attention(*half, d**-0.5, 4, backend="triton")
    twin_out, twin_mass = window_attention(*[t.float() for t in half], d**-0.5, 4, backend="torch")
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), twin_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mass, twin_mass, atol=2e-2, rtol=2e-2)


def test_window_attention_without_probing_queries_returns_no_mass():
    q, keys = torch.randn(2, 3, 32, device=DEVICE), torch.randn(1, 9, 32, device=DEVICE)
    cos, sin = _rope_tables(9, 32)
    for kind in ("torch", "triton"):
        assert window_attention(q, keys, keys, cos, sin, 0.2, 0, backend=kind)[1] is None


@pytest.mark.parametrize("layers,events,dim,k", [(3, 300, 576, 10), (2, 5, 64, 5), (4, 129, 100, 7),
                                                 (1, 1000, 64, TILE), (2, 40, 64, 100), (1, 3, 8, 0)])
def test_representative_search_returns_what_torch_topk_returns(layers, events, dim, k):
    gen = torch.Generator().manual_seed(events + k)
    reps, queries = torch.randn(layers, events, dim, generator=gen), torch.randn(layers, dim, generator=gen)
    values, ids = search(reps.to(DEVICE), queries.to(DEVICE), k, backend="triton")
    expected = torch.topk(torch.einsum("led,ld->le", reps.double(), queries.double()), min(k, events), dim=1)
    assert ids.shape == expected.indices.shape
    for layer in range(layers):
        assert set(ids[layer].tolist()) == set(expected.indices[layer].tolist())
    torch.testing.assert_close(values.double().cpu(), expected.values, atol=1e-4, rtol=1e-5)
    assert torch.equal(ids.cpu(), expected.indices)  # in order too (random scores: no ties)


@pytest.mark.parametrize("codec,bits", [("int8", 8), ("int4", 4), ("int2", 2)])
@pytest.mark.parametrize("kind", ["torch", "triton"])
def test_gather_dequantises_as_the_codec_decodes(codec, bits, kind):
    heads, dim, lengths = 3, 64, [5, 17, 9, 1]
    gen = torch.Generator().manual_seed(bits)
    parts, decoded = [], []
    for length in lengths:
        keys, values = torch.randn(1, heads, length, dim, generator=gen) * 3, torch.randn(1, heads, length, dim, generator=gen)
        blob = encode_layers(codec, keys, values)[0]
        parts.append(quant_parts(codec, blob, heads, length, dim))
        decoded.append(decode_layer(codec, blob, heads, length, dim))
    arena = {name: torch.cat([p[name] for p in parts], dim=1).to(DEVICE)
             for name in ("k_codes", "v_codes", "v_scale", "v_zero")}
    k_scale, k_zero = (torch.stack([p[name] for p in parts]).to(DEVICE) for name in ("k_scale", "k_zero"))
    starts = torch.tensor([0, *lengths]).cumsum(0)
    picked = [3, 2, 0]  # events in recall order, not arena order
    rows = torch.cat([torch.arange(starts[e], starts[e] + lengths[e]) for e in picked]).to(DEVICE)
    events = torch.cat([torch.full((lengths[e],), e) for e in picked]).to(DEVICE)
    keys, values = gather(arena["k_codes"], arena["v_codes"], k_scale, k_zero, arena["v_scale"], arena["v_zero"],
                          rows, events, bits, torch.float32, backend=kind)
    assert torch.equal(keys.cpu(), torch.cat([decoded[e][0] for e in picked], dim=1).float())
    assert torch.equal(values.cpu(), torch.cat([decoded[e][1] for e in picked], dim=1).float())


def test_the_dispatcher_runs_the_twin_on_the_cpu_unless_asked(monkeypatch):
    cpu = torch.device("cpu")
    assert not backend.use_triton("auto", cpu)
    assert not backend.use_triton("torch", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.use_triton("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        backend.use_triton("triton", cpu)


def test_the_engine_reads_the_same_through_the_kernels():
    """A stream long enough to seal and recall events, read by a random Llama of head dim 32 through the twins
    and through the Triton kernels: the same events, logits within float32 rounding. On a GPU the whole engine
    runs there (its in-RAM memory on the device too)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=VOCAB, max_position_embeddings=2048)).eval().to(DEVICE)
    ids = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    for kind in ("torch", "triton"):
        cfg = EngineConfig(model=ModelConfig(kernels=kind), window=WindowConfig(chunk_size=32, n_sink=8, n_local=96),
                           segmentation=SegmentationConfig(min_event=8, max_event=32),
                           recall=RecallConfig(budget_tokens=64))
        session = EpisodicLM(copy.deepcopy(model), IntTokenizer(), "tiny-llama-d32", cfg).session()
        assert session.memory.device.type == DEVICE.type
        session.ingest_ids(ids)
        results.append((session.state.last_logits, [session.memory.event(i).start for i in range(len(session.memory))]))
    (logits_torch, starts_torch), (logits_triton, starts_triton) = results
    assert len(starts_torch) > 3  # events were sealed, and recalled by the later chunks
    assert starts_triton == starts_torch
    torch.testing.assert_close(logits_triton, logits_torch, atol=1e-4, rtol=1e-4)


def test_window_attention_accepts_strided_views():
    """The engine hands over views (the HF hook's transposed queries); a head dim that is not unit-stride too."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(7, 4, 64, generator=gen).to(DEVICE).transpose(0, 1)  # (H 4, C 7, D) view
    keys = torch.randn(2, 30, 128, generator=gen).to(DEVICE)[..., ::2]  # (Hkv, N, D) with stride 2 along D
    values = torch.randn(2, 30, 64, generator=gen).to(DEVICE)
    cos, sin = _rope_tables(30, 64)
    expected = window_attention(q.contiguous(), keys.contiguous(), values, cos, sin, 0.125, 2, backend="torch")
    got = window_attention(q, keys, values, cos, sin, 0.125, 2, backend="triton")
    torch.testing.assert_close(got[0], expected[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], expected[1], atol=2e-5, rtol=1e-4)
