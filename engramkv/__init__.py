"""engramkv: episodic memory inside a language model's attention.

    lm = EpisodicLM.from_pretrained()     # embedded SmolLM2-135M-Instruct, offline
    s = lm.session()
    s.ingest(open("book.txt").read())
    s.chat("Who wrote the letter?")
"""

from engramkv.agent.model import EpisodicLM
from engramkv.agent.results import IngestReport, RecalledEvent
from engramkv.agent.session import Session
from engramkv.config import (
    EngineConfig,
    GenerationConfig,
    ModelConfig,
    RecallConfig,
    RefinementConfig,
    RepresentativeConfig,
    SegmentationConfig,
    WindowConfig,
)
from engramkv.errors import ConfigError, EmptyInputError, EngramError, InputError, ModelLoadError, SessionError
from engramkv.memory.events import Event, EventMemory, InMemoryEventMemory

__all__ = [
    "ConfigError",
    "EmptyInputError",
    "EngineConfig",
    "EngramError",
    "EpisodicLM",
    "Event",
    "EventMemory",
    "GenerationConfig",
    "InMemoryEventMemory",
    "IngestReport",
    "InputError",
    "ModelConfig",
    "ModelLoadError",
    "RecallConfig",
    "RecalledEvent",
    "RefinementConfig",
    "RepresentativeConfig",
    "SegmentationConfig",
    "Session",
    "SessionError",
    "WindowConfig",
]
__version__ = "0.1.0"
