"""With no event sealed (context inside the local window), engramkv is the plain model, token for token."""

import pytest
import torch

from engramkv import EngineConfig
from engramkv.config import RecallConfig, WindowConfig

from conftest import VOCAB, tiny_pair

PROMPT_LEN, NEW = 100, 24


def _greedy_reference(model, prompt):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("recall", [False, True])
def test_tiny_models_match_transformers(arch, recall):
    cfg = EngineConfig(
        window=WindowConfig(chunk_size=16, n_sink=8, n_local=512), recall=RecallConfig(enabled=recall)
    )
    reference, lm = tiny_pair(arch, cfg)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    session = lm.session()
    ours = session.generate_ids(prompt, max_new_tokens=NEW)
    assert len(session.memory) == 0  # nothing sealed: the premise of the test
    assert ours == _greedy_reference(reference, prompt)


@pytest.mark.slow
def test_default_model_matches_transformers(default_pair):
    reference, lm = default_pair
    text = (
        "The lighthouse keeper counted the ships every evening. On the first night there were three; "
        "on the second, five; and on the third night a storm came in from the west. "
    ) * 6
    prompt = lm.tokenizer.encode(text, add_special_tokens=False)
    cfg = lm.config.model_copy(update={"window": WindowConfig(chunk_size=64, n_sink=32, n_local=1024)})
    session = lm.session(cfg)
    ours = session.generate_ids(prompt, max_new_tokens=NEW)
    assert len(session.memory) == 0
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    eos = lm.tokenizer.eos_token_id
    expected = expected[: expected.index(eos)] if eos in expected else expected
    assert ours == expected
