"""engramkv: episodic memory inside a language model's attention.

    lm = EpisodicLM.from_pretrained()     # embedded SmolLM2-135M-Instruct, offline
    s = lm.session()
    s.ingest(open("book.txt").read())
    s.chat("Who wrote the letter?")

Everything a caller needs is exported here; the modules behind it are private to the package.
"""

from engramkv.calibration import CalibrationReport, FitReport, calibrate
from engramkv.config import (
    AllocationConfig,
    CalibrationConfig,
    EngineConfig,
    GenerationConfig,
    IndexConfig,
    LowRankConfig,
    ModelConfig,
    RecallConfig,
    RefinementConfig,
    RepresentativeConfig,
    SegmentationConfig,
    ShardConfig,
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
    WorkerError,
)
from engramkv.lm import EpisodicLM
from engramkv.lowrank_fit import fit_lowrank_bases
from engramkv.memory.events import (
    DocumentProgress,
    Event,
    EventMemory,
    InMemoryEventMemory,
    PersistentMemory,
    TierBytes,
    TransientMemory,
)
from engramkv.results import Answer, IngestProgress, IngestReport, RecalledEvent, SessionStats
from engramkv.retrieval.allocation import Theta
from engramkv.retrieval.question import RecallPlan
from engramkv.session import Session
from engramkv.spec import ModelSpec
from engramkv.storage.namespace import NamespaceMemory
from engramkv.storage.store import EventStore, NamespaceInfo

__all__ = [
    "AllocationConfig",
    "Answer",
    "CalibrationConfig",
    "CalibrationReport",
    "ConfigError",
    "DocumentProgress",
    "EmptyInputError",
    "EngineConfig",
    "EngramError",
    "EpisodicLM",
    "Event",
    "EventMemory",
    "EventStore",
    "FitReport",
    "GenerationConfig",
    "InMemoryEventMemory",
    "IndexConfig",
    "IngestProgress",
    "IngestReport",
    "InputError",
    "LowRankConfig",
    "ModelConfig",
    "ModelLoadError",
    "ModelSpec",
    "NamespaceError",
    "NamespaceInfo",
    "NamespaceMemory",
    "PersistentMemory",
    "ReadOnlyError",
    "RecallConfig",
    "RecallPlan",
    "RecalledEvent",
    "RefinementConfig",
    "RepresentativeConfig",
    "SegmentationConfig",
    "Session",
    "SessionError",
    "SessionStats",
    "ShardConfig",
    "StoreConfig",
    "StoreCorruptError",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
    "StoreMismatchError",
    "Theta",
    "TierBytes",
    "TransientMemory",
    "WindowConfig",
    "WorkerError",
    "calibrate",
    "fit_lowrank_bases",
]
__version__ = "0.1.0"
