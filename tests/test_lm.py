"""EpisodicLM: the sessions and stores it opens over one loaded model."""

import pytest

from engramkv import ConfigError, EngineConfig, InMemoryEventMemory, NamespaceMemory
from engramkv.config import StoreConfig, WindowConfig

from conftest import tiny_pair

CFG = EngineConfig(window=WindowConfig(chunk_size=32, n_sink=8, n_local=64))


def test_a_store_opened_again_with_other_store_settings_is_refused(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    store = lm.open_store(tmp_path / "s")
    assert lm.open_store(tmp_path / "s") is store  # the same settings: the same open store
    other = CFG.model_copy(update={"store": StoreConfig(commit_tokens=64)})
    with pytest.raises(ConfigError, match="commit_tokens"):
        lm.open_store(tmp_path / "s", other)
    with pytest.raises(ConfigError, match="commit_tokens"):
        lm.session(other, store=tmp_path / "s")
    lm.close()
    reopened = lm.open_store(tmp_path / "s", other)  # closed first: the new settings are honoured
    assert reopened.cfg.commit_tokens == 64
    lm.close()


def test_a_session_has_one_memory_in_ram_or_in_a_store(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    in_ram = lm.session()
    assert isinstance(in_ram.memory, InMemoryEventMemory) and not in_ram.memory.persistent
    stored = lm.session(store=tmp_path / "s")
    assert isinstance(stored.memory, NamespaceMemory) and stored.memory.persistent
    with pytest.raises(ConfigError, match="not both"):
        lm.session(memory=in_ram.memory, store=tmp_path / "s")
    stored.close()
    lm.close()
