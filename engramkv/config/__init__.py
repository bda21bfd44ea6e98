"""Every knob of engramkv, as one tree of pydantic models.

`EngineConfig` is the root; each sub-model groups the knobs of one algorithm, sized for the embedded SmolLM2-135M
(trained length 8192); a field's description says what was measured where a default rests on a measurement.
The sub-models live by what they shape: `reading` (model, window, segmentation, refinement, representatives,
recall), `answering` (allocation, calibration, generation) and `storage` (store, codecs, index, shards).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from engramkv.config._base import _Strict
from engramkv.config.answering import AllocationConfig, CalibrationConfig, GenerationConfig
from engramkv.config.reading import (
    ModelConfig,
    RecallConfig,
    RefinementConfig,
    RepresentativeConfig,
    SegmentationConfig,
    WindowConfig,
)
from engramkv.config.storage import IndexConfig, LowRankConfig, ShardConfig, StoreConfig

__all__ = [
    "AllocationConfig", "CalibrationConfig", "EngineConfig", "GenerationConfig", "IndexConfig", "LowRankConfig",
    "ModelConfig", "RecallConfig", "RefinementConfig", "RepresentativeConfig", "SegmentationConfig", "ShardConfig",
    "StoreConfig", "WindowConfig",
]


class EngineConfig(_Strict):
    """The root of the configuration tree."""

    model: ModelConfig = ModelConfig()
    window: WindowConfig = WindowConfig()
    segmentation: SegmentationConfig = SegmentationConfig()
    refinement: RefinementConfig = RefinementConfig()
    representatives: RepresentativeConfig = RepresentativeConfig()
    recall: RecallConfig = RecallConfig()
    generation: GenerationConfig = GenerationConfig()
    allocation: AllocationConfig = AllocationConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    store: StoreConfig = StoreConfig()
    shards: ShardConfig = ShardConfig()

    # The knobs that shape the stream itself: a stored stream can only continue under the same ones.
    STREAM_SETTINGS: ClassVar[tuple[str, ...]] = ("window", "segmentation", "refinement", "representatives")

    def stream_settings(self) -> dict[str, Any]:
        """The stream-shaping sub-configs as plain data (what a checkpoint records and a reopen must match)."""
        return {name: getattr(self, name).model_dump() for name in self.STREAM_SETTINGS}

    def with_allocation_mode(self, mode: Literal["fixed", "model", "auto"]) -> EngineConfig:
        """This config with `allocation.mode` set (the baselines and the calibration pin "fixed")."""
        return self.model_copy(update={"allocation": self.allocation.model_copy(update={"mode": mode})})

    def attention_span(self, max_new_tokens: int = 0) -> int:
        """Largest number of keys any query can see: sinks + memory + local (+ one event of slack) + chunk."""
        w, r = self.window, self.recall
        memory = r.budget_tokens if r.enabled else 0
        return w.n_sink + memory + w.n_local + self.segmentation.max_event + w.chunk_size + max_new_tokens

    @property
    def surprise_window(self) -> int:
        explicit = self.segmentation.surprise_window
        return explicit if explicit is not None else max(2, self.window.n_local - self.window.chunk_size)
