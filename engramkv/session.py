"""Session: one token stream with its episodic memory, and the calls people make on it.

A session owns the stream's order: it tokenises what is ingested (`documents`), feeds the engine
chunk by chunk (`engine.state`), commits to its memory (a store namespace, or RAM where commits are
no-ops), and answers: a question is probed against memory, turned into a `RecallPlan`
(`retrieval.question`), and read and answered with that plan (`chat` for the turn's format).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from engramkv import answering, chat, sampling, sharding
from engramkv.config import EngineConfig
from engramkv.documents import IngestRun, check_document, tokenize_pieces
from engramkv.engine.state import EpisodicState
from engramkv.errors import ConfigError, EmptyInputError, EngramError, InputError, ReadOnlyError, SessionError
from engramkv.memory.events import PersistentMemory
from engramkv.reading import ProgressCallback, Reader, continuing, stored_settings
from engramkv.results import Answer, IngestReport, RecalledEvent, SessionStats, recalled_events
from engramkv.retrieval import allocation, question
from engramkv.retrieval.allocation import Theta
from engramkv.retrieval.question import RecallPlan
from engramkv.spec import ModelSpec


def check_span(config: EngineConfig, spec: ModelSpec) -> None:
    """Refuse a config whose attention window could reach past the positions the model was trained on."""
    span = config.attention_span(config.generation.max_new_tokens)
    if span > spec.trained_length:
        raise ConfigError(
            f"the attention window can reach {span} tokens (sinks + recall budget + local window + one event "
            f"+ chunk + max_new_tokens) but {spec.model_id} was trained on {spec.trained_length}; "
            "shrink window.n_local or recall.budget_tokens"
        )


class Backbone(Protocol):
    """What a session uses of the model it runs on (an `EpisodicLM`): the patched model, RoPE, spec, tokenizer."""

    model: Any
    rope: Any
    spec: ModelSpec
    tokenizer: Any
    loader: Any  # () -> a backbone like this one, in another process (None: cannot)


class Session:
    """Reads a stream, remembers it as events, answers from it. Create with `EpisodicLM.session()`.

    One stream has one order, so a session does one thing at a time: a call made while another is
    running (from another thread, or while a streamed reply is still being consumed) raises
    `SessionError` instead of interleaving tokens. Use one session per thread of work.
    """

    def __init__(self, lm: Backbone, cfg: EngineConfig, memory: PersistentMemory, summary_layers: list[int]):
        snapshot = memory.load_checkpoint()
        if snapshot is not None:  # a stored stream: the settings it was written with, where cfg leaves them default
            cfg = continuing(cfg, stored_settings(snapshot))
            check_span(cfg, lm.spec)
        self.lm, self.cfg, self.memory = lm, cfg, memory
        self.state = EpisodicState(lm.model, lm.rope, lm.spec, cfg, memory, summary_layers)
        self.last_recalled: list[RecalledEvent] = []  # the events the last answer attended to, best match first
        self.last_plan: RecallPlan | None = None  # how the last answer read memory (its events and budget)
        self._busy = threading.Lock()
        self._closed = False
        self._answerer = answering.Answerer(self.state, memory, cfg, lm.tokenizer,
                                            allocation.load_model(cfg.allocation, lm.spec.model_id))
        self._reader = Reader(self.state, memory, cfg, snapshot)

    # ------------------------------------------------------------------ persistence
    def commit(self) -> None:
        """Make the stream durable in its store (done automatically during and after ingest and chat)."""
        with self._exclusive("commit"):
            if not self.memory.writable:
                raise ReadOnlyError("this session's store was opened read-only; what it adds stays in RAM")
            self._reader.commit()

    def close(self) -> None:
        """Commit (a persistent session) and release the memory; the session refuses every call after."""
        if self._closed:
            return
        if self._reader.broken is not None:  # nothing whole to commit: the last commit stands
            self._release()
            return
        with self._exclusive("close"):
            try:
                self._reader.commit()
            finally:
                self._release()

    def _release(self) -> None:
        self.memory.close()
        self._closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            self.close()
        except EngramError:
            if exc_type is None:
                raise
            # else the error in flight says more (a full disk, say); close released the memory regardless

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise SessionError(f"cannot {what}: the session is busy with another call (one stream, one reader)")
        try:
            if self._closed:
                raise SessionError(f"cannot {what}: the session is closed")
            if self._reader.broken is not None:
                raise SessionError(f"cannot {what}: an earlier call stopped half-way ({self._reader.broken}); "
                                   "open a new session (a stored stream resumes from its last commit)")
            yield
        finally:
            self._busy.release()

    def fork(self, config: EngineConfig | None = None) -> Session:
        """A new in-RAM session that continues this stream (its events, resident window, queue and chat so
        far, copied), read with `config`, whose stream settings must be this session's (or default, taken from
        it): what-ifs on the answer side (recall budgets, layouts, generation) without reading the stream twice."""
        config = continuing(config or self.cfg, self.cfg.stream_settings())
        check_span(config, self.lm.spec)
        _check_fork(self.cfg, config)
        with self._exclusive("fork"):
            if self.memory.persistent:
                raise SessionError("fork copies an in-RAM stream; open a stored one again (read_only=True) instead")
            twin = Session(self.lm, config, copy.deepcopy(self.memory), self.state.summary_layers)
            twin._reader.copy_from(self._reader)
        return twin

    # ------------------------------------------------------------------ ingest
    def ingest(self, text: str | Iterable[str], progress: ProgressCallback | None = None) -> IngestReport:
        """Read `text` (a string, or an iterable of string pieces) into the stream. A persistent session commits
        every `store.commit_tokens` tokens and at the end."""
        pieces: Iterable[str] = [text] if isinstance(text, str) else text
        with self._exclusive("ingest"):
            started, tokens_before, events_before = time.perf_counter(), self.state.n_tokens, len(self.memory)
            for ids, _ in tokenize_pieces(self.lm.tokenizer, pieces):
                self._reader.feed(ids, progress=progress)
            self._reader.flush(progress=progress)
            self._reader.commit()
        if self.state.n_tokens == tokens_before:
            raise EmptyInputError("nothing to ingest: the input holds no tokens")
        return IngestReport(tokens=self.state.n_tokens - tokens_before, events_sealed=len(self.memory) - events_before,
                            seconds=time.perf_counter() - started)

    def ingest_file(self, path: str | Path, progress: ProgressCallback | None = None,
                    workers: int | None = None) -> IngestReport:
        """Stream a UTF-8 text file into the stream (checked first: a bad file changes nothing).

        In a persistent session the document is recorded and commits carry its read position: the same ingest
        run again after an interruption (Ctrl-C, a kill, a full disk) resumes where the last commit stopped, a
        file already read whole is skipped, and an earlier document left unfinished is an `InputError` (only the
        latest resumes). Ctrl-C is honoured between chunks: the session commits, then `KeyboardInterrupt` propagates.

        `workers` (default `shards.workers`) > 1 reads that many shards at once on Ray workers into an empty
        store namespace (`engramkv.sharding`); a document too short to cut is read here as usual.
        """
        checked = check_document(path)
        shards = sharding.plan_shards(checked.path, checked.size_bytes, workers or self.cfg.shards.workers,
                                      self.cfg.shards.min_shard_bytes)
        with self._exclusive("ingest"):
            started, tokens_before, events_before = time.perf_counter(), self.state.n_tokens, len(self.memory)
            run = IngestRun.start(checked, self.memory.documents(), self.tokens_ingested)
            if run.document.complete:
                return IngestReport(tokens=0, events_sealed=0, seconds=0.0, already_ingested=True,
                                    document_tokens=run.document.token_end - run.document.token_start)
            if len(shards) > 1:
                sharding.ingest_sharded(self.lm.loader, self.lm.tokenizer, self.memory, self.cfg, checked, shards,
                                        progress)
                self._reader = Reader(self.state, self.memory, self.cfg, self.memory.load_checkpoint())
            else:
                self._reader.read_file(run, self.lm.tokenizer, progress)
        return IngestReport(
            tokens=self.state.n_tokens - tokens_before, events_sealed=len(self.memory) - events_before,
            seconds=time.perf_counter() - started, resumed_from_byte=run.resumed_from,
            document_tokens=self.tokens_ingested - run.document.token_start,
        )

    def ingest_ids(self, token_ids: list[int], progress: ProgressCallback | None = None) -> None:
        """Read token ids into the stream (all of them: a short last chunk is processed too)."""
        with self._exclusive("ingest"):
            self._reader.flush(progress=progress, token_ids=token_ids)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str, max_new_tokens: int | None = None, question: str | None = None,
                 stream: bool = False, budget_tokens: int | None = None, theta: Theta | None = None) -> Any:
        """Raw continuation of everything ingested, then `prompt`; the text, or an iterator of pieces if `stream`.

        `question`: the part of `prompt` that asks (its last occurrence), matched against memory the
        way `chat` matches a message (`recall.question_match`); e.g. `prompt="\n\nWhat is the pass
        key? The pass key is"`, `question="What is the pass key?"`. Without it, every layer recalls by
        its own queries. `budget_tokens`: the most context the answer reads (resident window + prompt +
        recalled tokens; default `recall.answer_context_tokens`) and `theta` (the inference parameters), as
        `chat` takes them. Like `chat`'s, the text ends before a sentence's third return (`generation.repeat_stop`).
        """
        ids, span = chat.encode_prompt(self.lm.tokenizer, prompt, question)
        pieces = _held(self._exclusive("generate"), self._reply(ids, max_new_tokens, question_span=span,
                                                                budget_tokens=budget_tokens, theta=theta))
        return pieces if stream else "".join(pieces)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> list[int]:
        """Greedy/temperature continuation on token ids; returns the new ids (stops at EOS)."""
        with self._exclusive("generate"):
            return list(self._generate(prompt_ids, max_new_tokens))

    def chat(self, message: str, stream: bool = False, max_new_tokens: int | None = None,
             budget_tokens: int | None = None, theta: Theta | None = None) -> Any:
        """One chat turn in `generation.chat_format`, answered from memory; the reply, or an iterator of pieces
        if `stream`. The turn joins the stream (and, in a store, is committed): conversation is memory too.

        `budget_tokens`: the most context the answer reads, its resident window, the turn and the recalled
        events together (default `recall.answer_context_tokens`; None: only `recall.answer_budget_tokens`
        bounds the recalled part). `theta`: the inference parameters (`Theta`: events, tokens per event,
        recall rounds, demonstrations, window tokens); default: the allocation model's choice within the budget
        (`allocation.mode` "auto" where coefficients ship for the model, or "model"), else the fixed default.
        `last_plan` tells what the answer read.
        """
        if not isinstance(message, str):
            raise InputError(f"chat takes a str message, got {type(message).__name__}")
        if not message.strip():
            raise EmptyInputError("empty chat message")
        pieces = _held(self._exclusive("chat"), self._chat_pieces(message, max_new_tokens, budget_tokens, theta))
        return pieces if stream else "".join(pieces)

    def _chat_pieces(self, message: str, max_new_tokens: int | None, budget_tokens: int | None,
                     theta: Theta | None, allocated: bool = False) -> Generator[str, None, None]:  # caller holds
        turn = chat.chat_turn(self.lm.tokenizer, self.cfg.generation, self._reader.chat_history, message,
                              list_room=_list_room(self.cfg, self.lm.spec, max_new_tokens))
        pieces = self._reply(turn.prompt_ids, max_new_tokens, turn.preamble_ids, turn.stop_text, turn.question_span,
                             budget_tokens, theta, allocated, turn.reply_start, draft=turn.listed is not None)
        shown: list[str] = []
        with contextlib.suppress(GeneratorExit):  # a caller that stops reading ends the turn where it stopped
            yield from chat.kept(chat.shown(turn, pieces), pieces, shown)
        reply, history = "".join(shown), self._reader.chat_history
        ids = chat.closing_ids(self.lm.tokenizer, self.cfg.generation, history, message, turn, reply,
                               self.state.stream.last_token)
        self._reader.end_turn(self.last_plan, message, reply, ids)

    def _reply(self, prompt_ids: list[int], max_new_tokens: int | None, preamble_ids: Sequence[int] = (),
               stop_text: str | None = None, question_span: tuple[int, int] | None = None,
               budget_tokens: int | None = None, theta: Theta | None = None, allocated: bool = False,
               reply_start: str = "", draft: bool = False) -> Generator[str, None, None]:
        tokens = self._generate(prompt_ids, max_new_tokens, preamble_ids, question_span, budget_tokens, theta,
                                allocated, draft)  # a draft is a list: its last item must be whole
        return chat.reply_text(self.lm.tokenizer, tokens, stop_text, self.cfg.generation.repeat_stop, reply_start,
                               whole_lines=draft)

    def _generate(self, prompt_ids: list[int], max_new_tokens: int | None, preamble_ids: Sequence[int] = (),
                  question_span: tuple[int, int] | None = None, budget_tokens: int | None = None,
                  theta: Theta | None = None, allocated: bool = False,
                  draft: bool = False) -> Generator[int, None, bool]:
        """With `question_span` (the question's tokens within `prompt_ids`) and question_match = "keys",
        every layer attends to the events that match the question while the answer is read and written,
        under inference parameters `theta` (default: the allocation's choice, `answering`). `draft`: the prompt and
        the reply are a draft (`Reader.reading`), gone from the stream after the reply. The caller holds the session."""
        if not prompt_ids and self._reader.tokens == 0:
            raise EmptyInputError("nothing to continue: empty prompt and empty session")
        chat.check_limits(budget_tokens, max_new_tokens)
        if theta is not None:
            self._answerer.check(theta)
        generation, recall = self.cfg.generation, self.cfg.recall
        max_new = max_new_tokens if max_new_tokens is not None else generation.max_new_tokens
        stop = sampling.stop_ids(self.lm.tokenizer)
        limit = budget_tokens if budget_tokens is not None else recall.answer_context_tokens
        matching = recall.enabled and recall.question_match == "keys" and len(self.memory) > 0
        plan = self.last_plan = self._answerer.read_turn(self._reader, prompt_ids, preamble_ids,
                                                         question_span if matching else None, limit, theta,
                                                         allocated)
        self.last_recalled = recalled_events(self.memory, self.lm.tokenizer.decode, list(plan.hits))
        with self._reader.reading(plan, prompt_ids, draft):
            if question_span is not None and plan.events is None:
                self.last_recalled = _attended_events(self.state, self.memory, self.lm.tokenizer)
            return (yield from sampling.sample(self.state.last_logits, lambda token: self._reader.decode(token, plan),
                                           max_new, stop, generation))

    def ask_many(self, questions: Sequence[str], total_tokens: int, max_new_tokens: int | None = None) -> list[Answer]:
        """Answer `questions` as chat turns, in order, their effective context (`RecallPlan.context_tokens`) together
        at most `total_tokens`: with the allocation model, each step of budget goes to the question with the best
        predicted gain per token; else the default theta. A total too small raises `InputError` before reading."""
        if isinstance(questions, str) or not questions or not all(isinstance(q, str) and q.strip() for q in questions):
            raise InputError("ask_many takes a non-empty list of non-blank questions")
        if total_tokens < 0:
            raise InputError(f"total_tokens must be 0 or more, got {total_tokens}")
        with self._exclusive("ask_many"):
            self._reader.flush()
            recall = self.cfg.recall
            matching = recall.enabled and recall.question_match == "keys" and len(self.memory) > 0
            chosen = answering.allocate_turns(self._answerer, self._reader, questions, total_tokens, matching)
            answers = []
            for message, (theta, limit) in zip(questions, chosen):
                text = "".join(self._chat_pieces(message, max_new_tokens, limit, theta, allocated=theta is not None))
                plan = self.last_plan
                answers.append(Answer(question=message, text=text, context_tokens=plan.context_tokens,
                                      theta=plan.theta and dataclasses.asdict(plan.theta), recalled=self.last_recalled))
        return answers

    def refresh(self) -> int:
        """A read-only session of a store takes in what its writer committed since: the new events (returned) and
        the last commit's resident window; what this session read or said since it opened is dropped."""
        with self._exclusive("refresh"):
            return self._reader.refresh()

    # ------------------------------------------------------------------ recall
    def recall(self, query: str, k: int = 5) -> list[RecalledEvent]:
        """The `k` events that best match `query`, best first.

        With question_match = "keys" (default) the score is the re-ranking's mean best key cosine
        (`retrieval.question`); with "attention", per-layer z-scored inner products of the query's
        mean recall query with the representatives, averaged over layers.
        """
        ids = chat.encode(self.lm.tokenizer, query)
        if not ids:
            raise EmptyInputError("empty recall query")
        if k < 1:
            raise InputError(f"k must be at least 1, got {k}")
        with self._exclusive("recall"):
            if len(self.memory) == 0:
                return []
            self._reader.flush()
            hits = self._answerer.recall(ids, k)
        return recalled_events(self.memory, self.lm.tokenizer.decode, hits)

    # ------------------------------------------------------------------ introspection
    @property
    def tokens_ingested(self) -> int:
        """Tokens read into the stream, those still queued for the model included."""
        return self._reader.tokens

    @property
    def events(self) -> int:
        return len(self.memory)

    def recent_surprise(self) -> tuple[list[float], list[int]]:
        """Surprise of the tokens still in the local window, and where events start among them (indices)."""
        return self.state.stream.recent_surprise()

    def stats(self) -> SessionStats:
        """Tokens, events, documents, memory tiers and disk use of this session's stream."""
        if self._closed:
            raise SessionError("cannot report stats: the session is closed")
        return _stats(self.lm.spec.model_id, self.memory, self.state, self._reader)


def _held(hold: AbstractContextManager[None], pieces: Generator[str, None, Any]) -> Generator[str, None, None]:
    """`pieces` within `hold` (a session's `_exclusive`), entered at the first and left when the stream ends or is
    closed: a streamed turn, its record in the stream and its commit included, is one call on the session."""
    with hold:
        yield from pieces


def _list_room(cfg: EngineConfig, spec: ModelSpec, max_new_tokens: int | None) -> int:
    """The most tokens a prompt may take to be answered from a drafted list: a draft seals nothing, so its window
    grows by the prompt (the span allows a chunk) and the reply (none where that reaches past the trained length)."""
    max_new = max_new_tokens if max_new_tokens is not None else cfg.generation.max_new_tokens
    return cfg.window.chunk_size if cfg.attention_span(max_new) <= spec.trained_length else 0


def _stats(model_id: str, memory: PersistentMemory, state: EpisodicState, reader: Reader) -> SessionStats:
    stream, tiers = state.stream, memory.tier_bytes()
    return SessionStats(
        model=model_id, tokens=stream.n_tokens, queued_tokens=len(reader.pending), events=len(memory),
        resident_tokens=stream.sink_len + int(stream.tail_tokens.numel()),
        documents=[d.name for d in memory.documents()], store=memory.location, namespace=memory.namespace,
        codec=memory.codec, hot_bytes=tiers.hot, warm_bytes=tiers.warm, disk_bytes=tiers.disk,
        committed_tokens=memory.committed_tokens,
    )


def _check_fork(mine: EngineConfig, theirs: EngineConfig) -> None:
    if mine.stream_settings() != theirs.stream_settings() or (
        mine.recall.summary_layers, mine.recall.memory_dtype) != (theirs.recall.summary_layers, theirs.recall.memory_dtype):
        raise ConfigError("a fork continues this stream: its window, segmentation, refinement and "
                          "representative settings, recall.summary_layers and recall.memory_dtype must be the same")


def _attended_events(state: EpisodicState, memory: PersistentMemory, tokenizer: Any) -> list[RecalledEvent]:
    """The events the layers recalled for the prompt, most layers first; score = share of layers."""
    ranked = question.votes([layer.recalled_ids for layer in state.layers])
    scored = [(event_id, count / len(state.layers)) for event_id, count in ranked]
    return recalled_events(memory, tokenizer.decode, scored)
