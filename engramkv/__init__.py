"""engramkv: episodic memory inside a language model's attention.

    lm = EpisodicLM.from_pretrained()     # embedded SmolLM2-135M-Instruct, offline
    s = lm.session()
    s.ingest(open("book.txt").read())
    s.chat("Who wrote the letter?")
"""

from engramkv.lm import EpisodicLM
from engramkv.results import IngestReport, RecalledEvent
from engramkv.session import Session
from engramkv.config import (
    EngineConfig,
    GenerationConfig,
    IndexConfig,
    ModelConfig,
    RecallConfig,
    RefinementConfig,
    RepresentativeConfig,
    SegmentationConfig,
    StoreConfig,
    WindowConfig,
)
from engramkv.errors import (
    ConfigError,
    EmptyInputError,
    EngramError,
    InputError,
    ModelLoadError,
    NamespaceError,
    ReadOnlyError,
    SessionError,
    StoreCorruptError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    StoreMismatchError,
)
from engramkv.memory.events import Event, EventMemory, InMemoryEventMemory
from engramkv.storage.store import EventStore, NamespaceInfo, NamespaceMemory

__all__ = [
    "ConfigError",
    "EmptyInputError",
    "EngineConfig",
    "EngramError",
    "EpisodicLM",
    "Event",
    "EventMemory",
    "EventStore",
    "GenerationConfig",
    "InMemoryEventMemory",
    "IndexConfig",
    "IngestReport",
    "InputError",
    "ModelConfig",
    "ModelLoadError",
    "NamespaceError",
    "NamespaceInfo",
    "NamespaceMemory",
    "ReadOnlyError",
    "RecallConfig",
    "RecalledEvent",
    "RefinementConfig",
    "RepresentativeConfig",
    "SegmentationConfig",
    "Session",
    "SessionError",
    "StoreConfig",
    "StoreCorruptError",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
    "StoreMismatchError",
    "WindowConfig",
]
__version__ = "0.1.0"
