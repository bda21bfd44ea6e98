"""The catalog: stores written before the `tier` column was retired open, read and take new events."""

from __future__ import annotations

import pytest
from sqlalchemy import Column, MetaData, String, create_engine, inspect, insert, select

from engramkv.storage import catalog

from tiny_store import add_events, open_namespace, open_store, snapshot


def _url(path, catalog_url: str | None) -> str:
    return catalog_url or f"sqlite:///{path / 'catalog.sqlite'}"


def _columns(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns("events")}
    finally:
        engine.dispose()


def _give_back_the_tier_column(url: str) -> None:
    """Rebuild the events table as the previous commit created it: with `tier VARCHAR(8) NOT NULL`, no
    server default (the ORM filled it in), every row "disk". Row ids are left to the new table's sequence."""
    old = MetaData()
    for table in catalog.Base.metadata.sorted_tables:
        table.to_metadata(old)
    old.tables["events"].append_column(Column("tier", String(8), nullable=False))
    engine = create_engine(url)
    with engine.begin() as conn:
        rows = [{k: v for k, v in row.items() if k != "id"}
                for row in conn.execute(select(catalog.EventRow.__table__)).mappings()]
        catalog.EventRow.__table__.drop(conn)
        old.tables["events"].create(conn)
        conn.execute(insert(old.tables["events"]), [{**row, "tier": "disk"} for row in rows])
    engine.dispose()


def _old_store(path, catalog_url: str | None) -> list[list[int]]:
    """A store with 4 committed events whose catalog has the old schema; returns their tokens."""
    with open_store(path, catalog_url) as store:
        memory = open_namespace(store)
        add_events(memory, 4)
        memory.commit(snapshot(memory), None)
        tokens = [memory.tokens(i) for i in range(4)]
        memory.close()
    _give_back_the_tier_column(_url(path, catalog_url))
    assert "tier" in _columns(_url(path, catalog_url))
    return tokens


def test_a_store_with_the_old_tier_column_opens_and_accepts_new_events(tmp_path, catalog_url):
    tokens = _old_store(tmp_path, catalog_url)
    with open_store(tmp_path, catalog_url, read_only=True) as store:  # a reader changes no schema
        memory = open_namespace(store)
        assert [memory.tokens(i) for i in range(4)] == tokens and memory.verify() == 4
        memory.close()
    assert "tier" in _columns(_url(tmp_path, catalog_url))
    with open_store(tmp_path, catalog_url) as store:  # a writer drops it
        memory = open_namespace(store)
        add_events(memory, 3, seed=1)
        memory.commit(snapshot(memory), None)
        memory.close()
    assert "tier" not in _columns(_url(tmp_path, catalog_url))
    with open_store(tmp_path, catalog_url, read_only=True) as store:
        memory = open_namespace(store)
        assert len(memory) == 7 and memory.verify() == 7 and [memory.tokens(i) for i in range(4)] == tokens
        memory.close()


def test_where_the_column_cannot_be_dropped_inserts_fill_it_in(tmp_path, monkeypatch):
    tokens = _old_store(tmp_path, None)
    monkeypatch.setattr(catalog, "_drops_columns", lambda engine: False)  # as on SQLite before 3.35
    with open_store(tmp_path) as store:
        memory = open_namespace(store)
        add_events(memory, 3, seed=1)
        memory.commit(snapshot(memory), None)
        details = memory.event_details([6])
        memory.close()
    assert details[6][1] is not None  # the time the ORM default gave other rows, given by hand here
    assert "tier" in _columns(_url(tmp_path, None))
    monkeypatch.undo()
    with open_store(tmp_path) as store:
        memory = open_namespace(store)
        assert len(memory) == 7 and memory.verify() == 7 and [memory.tokens(i) for i in range(4)] == tokens
        memory.close()


def test_the_fingerprint_is_the_json_of_the_model_spec(tmp_path, catalog_url):
    from tiny_store import SPEC

    with open_store(tmp_path, catalog_url) as store:
        info = catalog.store_info(store.db)
    assert info is not None and info.fingerprint == SPEC.model_dump() and info.codec == "fp16"
    assert info.format_version == catalog.FORMAT_VERSION


@pytest.mark.parametrize("create", [True, False])
def test_a_namespace_is_created_only_when_asked(tmp_path, create):
    with open_store(tmp_path) as store:
        first = catalog.get_or_create_namespace(store.db, ("a", "b", "c"), create=create)
        assert (first is not None) == create
        assert catalog.get_or_create_namespace(store.db, ("a", "b", "c"), create=False) == first
        assert [state.names for state, _ in catalog.list_namespaces(store.db)] == ([("a", "b", "c")] if create else [])
