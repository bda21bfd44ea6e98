"""EpisodicLM: the sessions and stores it opens over one loaded model."""

import pytest
from conftest import tiny_pair

from engramkv import ConfigError, EngineConfig, InMemoryEventMemory, NamespaceMemory
from engramkv.config import StoreConfig, WindowConfig

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


def test_a_memory_of_the_callers_is_wrapped_so_its_commits_do_nothing():
    from engramkv import TransientMemory

    class Bare:  # only the EventMemory calls, no persistence
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name in ("add", "event", "shortest_event", "tokens", "search", "search_keys", "gather", "kv_bytes"):
                return getattr(self.inner, name)
            raise AttributeError(name)

        def __len__(self):
            return len(self.inner)

    _, lm = tiny_pair("llama", CFG)
    spec = lm.spec
    bare = Bare(InMemoryEventMemory(spec.num_layers, spec.num_kv_heads, spec.head_dim))
    session = lm.session(memory=bare)
    assert isinstance(session.memory, TransientMemory) and session.memory.inner is bare
    session.ingest(" ".join(str(i % 200) for i in range(300)))
    assert len(bare) == session.events > 0
    session.commit()  # a no-op, not an AttributeError
    assert session.stats().store is None


def test_a_stream_that_cannot_be_restored_leaves_its_namespace_closed(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    with lm.session(store=tmp_path / "s") as s:
        s.ingest(" ".join(str(i % 200) for i in range(300)))
    other = CFG.model_copy(update={"window": CFG.window.model_copy(update={"n_local": 96})})
    for _ in range(2):  # the second attempt is refused for the same reason, not "already open"
        with pytest.raises(ConfigError, match="window"):
            lm.session(other, store=tmp_path / "s")
    lm.close()
