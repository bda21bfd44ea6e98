"""Loading: a local checkpoint directory works offline; a missing one fails with a clear error."""

import pytest

from engramkv import EngineConfig, EpisodicLM, ModelLoadError, WindowConfig
from engramkv.config import ModelConfig
from engramkv.hf import DEFAULT_MODEL_ID, default_model_dir, load_pretrained, load_tokenizer

from conftest import tiny_model


def test_local_checkpoint_directory_loads_offline(tmp_path):
    from transformers import AutoTokenizer

    from engramkv.hf import DEFAULT_GGUF_FILE

    tiny_model("qwen2").save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=DEFAULT_GGUF_FILE).save_pretrained(tmp_path)
    small = EngineConfig(window=WindowConfig(n_local=256, chunk_size=256))  # the tiny model was "trained" on 2048 tokens
    lm = EpisodicLM.from_pretrained(str(tmp_path), config=small)
    assert lm.spec.model_type == "qwen2"
    session = lm.session()
    assert lm.tokenizer.encode("hello there", add_special_tokens=False)  # the saved tokenizer came along
    session.ingest_ids(list(range(100)))  # ids inside the tiny model's 256-token vocabulary
    assert len(session.generate_ids([1, 2, 3], max_new_tokens=4)) <= 4


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load model"):
        EpisodicLM.from_pretrained(str(tmp_path / "nothing-here"))
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "nothing-here")))


def test_a_tokenizer_loads_alone_as_the_model_loads_it():
    # A calibration fit prices demonstrations in the model's tokens without loading its weights.
    tokenizer, model_id = load_tokenizer(ModelConfig())
    _, full, full_id = load_pretrained(ModelConfig())
    assert model_id == full_id == DEFAULT_MODEL_ID
    text = "Question: What is the pass key?\nAnswer:"
    assert tokenizer.encode(text, add_special_tokens=False) == full.encode(text, add_special_tokens=False)


def test_embedded_model_ships_in_the_wheel():
    assert (default_model_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size > 50_000_000


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_embedded_model_loads_without_progress_bars_unless_asked(capfd, progress):
    from engramkv.config import ModelConfig
    from engramkv.hf import load_pretrained

    load_pretrained(ModelConfig(load_progress=progress))
    err = capfd.readouterr().err
    assert ("Loading weights" in err and "GGUF" in err) is progress, err[-500:]


def test_progress_filter_passes_warnings_and_drops_bar_redraws():
    import io

    from engramkv.hf import _DropProgressBars

    target = io.StringIO()
    stream = _DropProgressBars(target)
    for text in ["\r  0%|   | 0/9", "\r100%|###| 9/9", "\n", "UserWarning: something real\n", "\n"]:
        stream.write(text)
    assert target.getvalue() == "UserWarning: something real\n\n"
