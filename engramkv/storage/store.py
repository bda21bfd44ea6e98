"""The event store: one directory, its writer lock, the model it belongs to, and its namespaces.

    STORE/
      catalog.sqlite          the catalog (`catalog.py`; or any SQLAlchemy URL, e.g. PostgreSQL)
      STORE_ID                the store's uuid, also in the catalog: pairs directory and catalog
      LOCK                    flock'ed by the one writer; holds its pid (a PostgreSQL catalog locks each
                              namespace in the server instead: `locks.py`)
      LOWRANK_BASES           the lowrank codec's bases (`lowrank.py`), copied in when such a store is
                              created; its digest is in the catalog's codec name ("lowrank:<digest>")
      ns/000001/              one directory per namespace (`namespace.py`), named by catalog id (never
                              by user text, so no name can reach outside the store)

A store records the `ModelSpec` of the model that created it and refuses to serve any other: its
events' KV only mean something to that model. One process writes at a time (with a PostgreSQL catalog:
one per namespace); readers open it read-only beside the writers and see their last commits.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from engramkv.config import StoreConfig
from engramkv.errors import (
    ConfigError,
    NamespaceError,
    ReadOnlyError,
    StoreCorruptError,
    StoreError,
    StoreMismatchError,
)
from engramkv.spec import ModelSpec
from engramkv.storage import catalog as cat
from engramkv.storage import lowrank
from engramkv.storage.codec import LayerCodec, QuantCodec
from engramkv.storage.lowrank_codec import LowRankCodec
from engramkv.storage.durable import dir_bytes, replace_durably
from engramkv.storage.locks import DirectoryLock, NamespaceLock, opening_shared_store
from engramkv.storage.namespace import NamespaceMemory

BASES_FILE = "LOWRANK_BASES"
SHIPPED_BASES = Path(__file__).resolve().parent.parent / "bases"  # fitted by `engramkv fit-bases`, one per model


def shipped_bases(model_id: str) -> Path:
    """Where the lowrank bases shipped for `model_id` live (the file may not exist)."""
    return SHIPPED_BASES / (model_id.replace("/", "--") + ".safetensors")


_NAME = re.compile(r"^[A-Za-z0-9_@:+=-][A-Za-z0-9_.@:+=-]{0,127}$")
DEFAULT_NAME = "default"


def check_name(kind: str, name: str) -> str:
    """Namespace names are labels, never paths; still, refuse anything that looks like one."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise NamespaceError(
            f"invalid {kind} {name!r}: use 1-128 letters, digits or _ . @ : + = - (not starting with '.', no '..')"
        )
    return name


@dataclass(frozen=True)
class NamespaceInfo:
    """One namespace of a store, as `EventStore.namespaces()` lists it."""

    user_id: str
    agent_id: str
    session_id: str
    tokens: int
    events: int
    documents: int
    disk_bytes: int


class EventStore:
    """A store directory opened by one process: read-write (one writer at a time) or read-only."""

    def __init__(self, path: str | Path, spec: ModelSpec, cfg: StoreConfig, read_only: bool = False):
        self.path = Path(path).expanduser().resolve()
        self.spec, self.cfg, self.read_only = spec, cfg, read_only
        # A PostgreSQL catalog: writers of different namespaces share the store, each holding its namespace's
        # lock (`locks.NamespaceLock`); otherwise one writer per store directory.
        self.shared = (cfg.catalog_url or "").startswith("postgresql")
        self._lock: DirectoryLock | None = None
        self._namespace_locks: dict[int, NamespaceLock] = {}
        if read_only:
            if not (self.path / "catalog.sqlite").exists() and cfg.catalog_url is None:
                raise StoreError(f"no engramkv store at {self.path}")
        else:
            if self.path.exists() and not self.path.is_dir():
                raise StoreError(f"{self.path} exists and is not a directory")
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(f"cannot create the store directory {self.path}: {err.strerror or err}") from err
            if not self.shared:
                self._lock = DirectoryLock(self.path)
        self._open: dict[int, NamespaceMemory] = {}
        try:
            url = cfg.catalog_url or f"sqlite:///{self.path / 'catalog.sqlite'}"
            # Processes started at once on a new shared store must not all create it (a SQLite catalog's writer
            # holds the directory's lock already, and its readers need a store that exists).
            with opening_shared_store(cat.server_connection(url)) if self.shared else nullcontext():
                self.db = cat.open_catalog(url, writable=not read_only)
                self.codec = self._check_fingerprint()
            self.kv_codec = self._layer_codec(self.codec)
        except BaseException:  # a store that cannot be opened must not stay locked by this process
            if hasattr(self, "db"):
                self.db.dispose()
            self._unlock()
            raise

    def _check_fingerprint(self) -> str:
        """The store's codec, once its catalog, directory and model are known to belong together."""
        mine = self.spec.model_dump()
        id_file = self.path / "STORE_ID"
        dir_id = id_file.read_bytes().decode(errors="replace").strip() if id_file.exists() else None
        info = cat.store_info(self.db)
        if info is None:
            if self.read_only:
                raise StoreError(f"the store at {self.path} is empty")
            if dir_id is not None:
                raise StoreMismatchError(f"{self.path} belongs to a store whose catalog is elsewhere (STORE_ID "
                                         f"{dir_id}); give the same catalog_url it was created with")
            store_uuid = str(uuid.uuid4())
            codec = self._new_codec()
            replace_durably(id_file, store_uuid.encode())
            cat.create_store_info(self.db, store_uuid, mine, codec)
            return codec
        if dir_id is None or not _is_uuid(dir_id):
            state = "missing" if dir_id is None else f"damaged (it holds {dir_id[:40]!r}, not a store id)"
            raise StoreCorruptError(f"{id_file} is {state}; the catalog {cat.describe(self.db)} names the store "
                                    f"{info.store_uuid}: if this directory is that store, write that id into it")
        if dir_id != info.store_uuid:
            raise StoreMismatchError(f"{id_file} names the store {dir_id}, the catalog {cat.describe(self.db)} the "
                                     f"store {info.store_uuid}: they belong to different stores (one catalog per store)")
        if info.format_version != cat.FORMAT_VERSION:
            raise StoreMismatchError(f"store format {info.format_version}, this engramkv reads {cat.FORMAT_VERSION}")
        theirs, mine_json = info.fingerprint, json.loads(json.dumps(mine, default=str))
        if theirs != mine_json:
            diff = {k: (theirs.get(k), mine_json.get(k)) for k in sorted(set(theirs) | set(mine_json))
                    if theirs.get(k) != mine_json.get(k)}
            raise StoreMismatchError(
                f"the store at {self.path} was written by model {theirs.get('model_id')!r}; it cannot serve "
                f"{self.spec.model_id!r} (differs in: "
                + ", ".join(f"{k}: store {a!r} vs model {b!r}" for k, (a, b) in diff.items()) + ")"
            )
        return info.codec

    def _new_codec(self) -> str:
        """The codec name a new store records; for lowrank, its bases are copied in first."""
        if self.cfg.codec != "lowrank":
            return self.cfg.codec
        source = Path(self.cfg.lowrank.bases).expanduser() if self.cfg.lowrank.bases else shipped_bases(
            self.spec.model_id)
        if not source.is_file():
            raise ConfigError(f"store.codec 'lowrank' needs bases: no file {source}; fit them with "
                              "`engramkv fit-bases` and pass store.lowrank.bases")
        data = source.read_bytes()
        lowrank.LowRankBases.from_bytes(data, str(source)).check_model(self.spec.model_dump(), str(source))
        replace_durably(self.path / BASES_FILE, data)
        return "lowrank:" + lowrank.digest(data)

    def _layer_codec(self, name: str) -> LayerCodec:
        """The codec the store's blobs are read and written with: a quantisation, or lowrank over the
        store's own bases, whose digest must be the one its name records."""
        spec = self.spec
        if not name.startswith("lowrank:"):
            return QuantCodec(name, spec.num_kv_heads, spec.head_dim)  # type: ignore[arg-type]  # a catalog codec
        path = self.path / BASES_FILE
        try:
            data = path.read_bytes()
        except OSError as err:
            raise StoreCorruptError(f"the lowrank store {self.path} has lost its bases {path}: {err}") from err
        if "lowrank:" + lowrank.digest(data) != name:
            raise StoreCorruptError(f"{path} is not the bases this store was written with (digest "
                                    f"{lowrank.digest(data)}, the catalog records {name.split(':')[1]})")
        bases = lowrank.LowRankBases.from_bytes(data, str(path))
        return LowRankCodec(bases, name, spec.num_kv_heads, spec.head_dim)

    # ------------------------------------------------------------------ namespaces
    def namespace(
        self, user_id: str = DEFAULT_NAME, agent_id: str = DEFAULT_NAME, session_id: str = DEFAULT_NAME,
        *, summary_layers: Sequence[int], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    ) -> NamespaceMemory:
        """The event memory of one stream; created on first use (read-only stores only open existing ones).

        summary_layers: the layers of the events' key summaries (`memory.summary.summary_layer_ids`).
        """
        names = (check_name("user_id", user_id), check_name("agent_id", agent_id),
                 check_name("session_id", session_id))
        while True:  # again only if another process deleted the namespace between its lookup and its lock
            ns_id = cat.get_or_create_namespace(self.db, names, create=not self.read_only)
            if ns_id is None:
                raise NamespaceError(f"no namespace {'/'.join(names)} in {self.path}")
            if ns_id in self._open:
                raise StoreError(f"namespace {'/'.join(names)} is already open in this process (one stream, one "
                                 "session)")
            try:
                if self.shared and not self.read_only:
                    self._namespace_locks[ns_id] = NamespaceLock(self.db, ns_id, f"{'/'.join(names)} of {self.path}")
                    if cat.namespace_state(self.db, ns_id) is None:
                        self._release(ns_id)
                        continue
                memory = NamespaceMemory(self, ns_id, torch.device(device), dtype, list(summary_layers))
            except BaseException:
                self._release(ns_id)
                raise
            self._open[ns_id] = memory
            return memory

    def _release(self, ns_id: int) -> None:
        """Called by `NamespaceMemory.close`: the namespace may be opened (or deleted) again."""
        self._open.pop(ns_id, None)
        lock = self._namespace_locks.pop(ns_id, None)
        if lock is not None:
            lock.release()

    def namespaces(self) -> list[NamespaceInfo]:
        return [NamespaceInfo(*state.names, state.n_tokens, state.n_events, documents,
                              dir_bytes(self.namespace_dir(state.id)))
                for state, documents in cat.list_namespaces(self.db)]

    def delete_namespace(self, user_id: str, agent_id: str = DEFAULT_NAME, session_id: str = DEFAULT_NAME) -> None:
        """Remove a namespace: its catalog rows (events, documents), index files, blobs and checkpoint."""
        if self.read_only:
            raise ReadOnlyError("cannot delete from a store opened read-only")
        names = (check_name("user_id", user_id), check_name("agent_id", agent_id),
                 check_name("session_id", session_id))
        ns_id = cat.get_or_create_namespace(self.db, names, create=False)
        if ns_id is None:
            raise NamespaceError(f"no namespace {user_id}/{agent_id}/{session_id} in {self.path}")
        if ns_id in self._open:
            raise StoreError("close the session on this namespace before deleting it")
        lock = NamespaceLock(self.db, ns_id, "/".join(names)) if self.shared else None
        try:
            cat.delete_namespace_rows(self.db, ns_id)
            # Files go after the rows: a crash in between leaves an orphan directory, which open ignores.
            shutil.rmtree(self.namespace_dir(ns_id), ignore_errors=True)
        finally:
            if lock is not None:
                lock.release()

    def namespace_dir(self, ns_id: int) -> Path:
        return self.path / "ns" / f"{ns_id:06d}"

    def disk_bytes(self) -> int:
        return dir_bytes(self.path)

    def close(self) -> None:
        for memory in list(self._open.values()):
            memory.close()
        self.db.dispose()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text
    except ValueError:
        return False
