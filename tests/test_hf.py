"""Contract tests: what engramkv assumes about transformers (see engramkv/hf.py)."""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engramkv import EngineConfig
from engramkv.hf import (ATTENTION_NAME, QueryEnergy, Rope, _DeferredRotary, install_episodic_attention, model_spec,
                         output_column_energy)

from conftest import tiny_model


def test_install_swaps_rotary_and_attention():
    model = tiny_model("llama")
    original = model.model.rotary_emb
    rope = install_episodic_attention(model)
    assert isinstance(model.model.rotary_emb, _DeferredRotary)
    assert rope.rotary is original
    assert model.config._attn_implementation == ATTENTION_NAME
    assert install_episodic_attention(model) is rope  # idempotent


def test_our_rope_matches_transformers():
    model = tiny_model("llama")
    rope = Rope(model.model.rotary_emb)
    q, k = torch.randn(1, 4, 10, 16), torch.randn(1, 2, 10, 16)
    positions = torch.arange(5, 15)
    cos, sin = model.model.rotary_emb(q, positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = rope.cos_sin(positions, like=q)
    torch.testing.assert_close(rope.apply(q, c, s), expected_q)
    torch.testing.assert_close(rope.apply(k, c, s), expected_k)


def test_attention_hook_receives_pre_rope_keys():
    """The layer's k_proj output reaches our state un-rotated (the deferral works)."""
    model = tiny_model("llama")
    install_episodic_attention(model)
    seen = {}

    class Recorder:
        def attend(self, layer, query, key, value, scaling):
            seen.setdefault(layer, key.clone())
            return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])

    ids = torch.tensor([[3, 1, 4, 1, 5]])
    from engramkv.hf import forward

    forward(model, ids, Recorder())
    attn = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    expected = attn.k_proj(hidden).view(1, 5, -1, 16).transpose(1, 2)
    torch.testing.assert_close(seen[0], expected)


def test_model_spec_reads_the_config():
    spec = model_spec(tiny_model("qwen2"), "tiny")
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (3, 4, 2, 16)
    assert spec == model_spec(tiny_model("qwen2"), "tiny")
    assert EngineConfig().model.allow_download is False


def test_identity_rotation_is_skipped_but_plain_models_still_rotate():
    import transformers.models.llama.modeling_llama as modeling

    patched, plain = tiny_model("llama"), tiny_model("llama")
    install_episodic_attention(patched)
    assert getattr(modeling.apply_rotary_pos_emb, "_engramkv_wrapped", False)
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    cos, sin = plain.model.rotary_emb(q, torch.arange(6)[None])
    rotated_q, _ = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    assert not torch.allclose(rotated_q, q)  # an unpatched model's rotation is untouched
    d_cos, d_sin = patched.model.rotary_emb(q, torch.arange(6)[None])
    same_q, same_k = modeling.apply_rotary_pos_emb(q, k, d_cos, d_sin)
    assert same_q is q and same_k is k


def test_query_energy_sums_each_layers_queries_squared_while_recording():
    model = tiny_model("llama")
    spec = model_spec(model, "")
    energy = QueryEnergy(model)
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    seen = []
    handle = model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(out))
    with energy.recording():
        model(input_ids=ids)
    handle.remove()
    model(input_ids=ids)  # not recording: not counted
    assert energy.tokens == 12 and len(energy.means()) == spec.num_layers
    expected = seen[0][0].double().pow(2).mean(0).view(spec.num_heads, spec.head_dim).float()
    torch.testing.assert_close(energy.means()[1], expected)


def test_output_column_energy_is_the_squared_norms_of_o_proj_columns_per_head():
    model = tiny_model("llama")
    spec = model_spec(model, "")
    energy = output_column_energy(model)
    weight = model.model.layers[0].self_attn.o_proj.weight  # (hidden, Hq D)
    assert energy[0].shape == (spec.num_heads, spec.head_dim)
    torch.testing.assert_close(energy[0][1, 2], weight[:, spec.head_dim + 2].float().pow(2).sum())
