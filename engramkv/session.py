"""A session: one token stream with its episodic memory, and the calls people make on it."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engramkv.documents import check_document, read_text
from engramkv.engine.state import EpisodicState
from engramkv.results import IngestReport, RecalledEvent, SessionStats
from engramkv.config import EngineConfig
from engramkv.errors import ConfigError, EmptyInputError, InputError, ReadOnlyError, SessionError
from engramkv.memory.events import EventMemory, InMemoryEventMemory
from engramkv.retrieval.question import answer_events, match_question, match_span, token_match
from engramkv.storage.store import DocumentProgress, NamespaceMemory

if TYPE_CHECKING:
    from engramkv.lm import EpisodicLM

ProgressCallback = Callable[[int, int], None]  # (tokens ingested so far, events sealed so far)

# Text is tokenised in pieces of about this many characters, cut at whitespace, so a
# stream never has to be held whole.
_TOKENIZE_PIECE_CHARS = 16_384


class Session:
    """Reads a stream, remembers it as events, answers from it. Create with `EpisodicLM.session()`.

    One stream has one order, so a session does one thing at a time: a call made while another is
    running (from another thread, or while a streamed reply is still being consumed) raises
    `SessionError` instead of interleaving tokens. Use one session per thread of work.
    """

    def __init__(self, lm: EpisodicLM, cfg: EngineConfig, memory: EventMemory | None = None):
        self.lm = lm
        self.cfg = cfg
        spec = lm.spec
        memory_dtype = getattr(torch, cfg.recall.memory_dtype)
        if memory is None:  # not `memory or ...`: an empty memory has len 0 and is falsy
            memory = InMemoryEventMemory(spec.num_layers, spec.num_kv_heads, spec.head_dim, memory_dtype)
        self.memory = memory
        self.state = EpisodicState(lm.model, lm.rope, spec, cfg, self.memory)
        self._pending: list[int] = []  # tokens waiting to fill a chunk
        self._chat_history: list[dict[str, str]] = []
        # The events the last chat answer attended to, best match first.
        self.last_recalled: list[RecalledEvent] = []
        self._busy = threading.Lock()
        self._broken: str | None = None  # set when a step failed half-way: the resident state is unusable
        self._uncommitted = 0  # tokens run since the last commit (persistent sessions)
        self._stop_requested = False  # set by Ctrl-C during ingest_file; honoured between chunks
        self.current_document: DocumentProgress | None = None  # what ingest_file is reading (bytes_done moves)
        self._fed = [0, 0]  # bytes and tokens that ingest_file has tokenised in this run
        self.store_memory = self.memory if isinstance(self.memory, NamespaceMemory) else None
        if self.store_memory is not None:
            snapshot = self.store_memory.load_checkpoint()
            if snapshot is not None:
                self._restore(snapshot)

    # ------------------------------------------------------------------ persistence
    # Knobs that shape the stream itself: a stored stream can only continue under the same ones.
    _STREAM_KNOBS = ("window", "segmentation", "refinement", "representatives")

    def _snapshot(self) -> dict[str, Any]:
        return {
            "engine": self.state.snapshot(), "pending": list(self._pending),
            "chat_history": json.dumps(self._chat_history),
            "stream_config": json.dumps({k: getattr(self.cfg, k).model_dump() for k in self._STREAM_KNOBS}),
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        stored = json.loads(snapshot["stream_config"])
        mine = {k: getattr(self.cfg, k).model_dump() for k in self._STREAM_KNOBS}
        if stored != mine:
            changed = [k for k in self._STREAM_KNOBS if stored.get(k) != mine[k]]
            raise ConfigError(
                f"this stream was written with other {', '.join(changed)} settings; open it with the same "
                f"config (stored: {json.dumps({k: stored.get(k) for k in changed})})"
            )
        self.state.restore(snapshot["engine"])
        self._pending = list(snapshot["pending"])
        self._chat_history = json.loads(snapshot["chat_history"])

    def commit(self) -> None:
        """Make the stream durable in its store (done automatically during and after ingest and chat)."""
        if self.store_memory is not None and not self.store_memory.writable:
            raise ReadOnlyError("this session's store was opened read-only; what it adds stays in RAM")
        with self._exclusive("commit"):
            self._commit()

    def _commit(self, document: DocumentProgress | None = None) -> None:
        if self.store_memory is None or not self.store_memory.writable:
            return
        self.store_memory.document = document
        self.store_memory.commit(self._snapshot())
        self._uncommitted = 0

    def close(self) -> None:
        """Release the session's store namespace (a persistent session commits first)."""
        with self._exclusive("close"):
            if self.store_memory is not None:
                if self._broken is None and self.store_memory.writable and self.store_memory.broken is None:
                    self._commit()
                self.store_memory.close()
                self.store_memory = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise SessionError(f"cannot {what}: the session is busy with another call (one stream, one reader)")
        try:
            if self._broken is not None:
                raise SessionError(f"cannot {what}: an earlier call stopped half-way ({self._broken}); "
                                   "open a new session (a stored stream resumes from its last commit)")
            yield
        finally:
            self._busy.release()

    # ------------------------------------------------------------------ ingest
    def ingest(self, text: str | Iterable[str], progress: ProgressCallback | None = None) -> IngestReport:
        """Read `text` (a string, or an iterable of string pieces) into the stream.

        A persistent session commits every `store.commit_tokens` tokens and at the end.
        """
        started, tokens_before, events_before = time.perf_counter(), self.state.n_tokens, self.state.events_sealed
        pieces: Iterable[str] = [text] if isinstance(text, str) else text
        with self._exclusive("ingest"):
            for ids, _ in self._tokenize_stream(pieces):
                self._feed(ids, progress)
            self._flush(progress)
            self._commit()
        ingested = self.state.n_tokens - tokens_before
        if ingested == 0:
            raise EmptyInputError("nothing to ingest: the input holds no tokens")
        return IngestReport(
            tokens=ingested, events_sealed=self.state.events_sealed - events_before,
            seconds=time.perf_counter() - started,
        )

    def ingest_file(self, path: str | Path, progress: ProgressCallback | None = None) -> IngestReport:
        """Stream a UTF-8 text file into the stream (checked first: a bad file changes nothing).

        In a persistent session the document is recorded, commits carry its read position, and
        running the same ingest again after an interruption (Ctrl-C, a kill, a full disk) resumes
        where the last commit stopped; a file already ingested completely is skipped. Ctrl-C is
        honoured between chunks: the session commits, then `KeyboardInterrupt` propagates.
        """
        checked = check_document(path)
        started, tokens_before, events_before = time.perf_counter(), self.state.n_tokens, self.state.events_sealed
        with self._exclusive("ingest"):
            doc = DocumentProgress(name=str(checked.path.resolve()), size_bytes=checked.size_bytes,
                                   content_key=checked.content_key, token_start=self.tokens_ingested)
            resumed_from = 0
            self.current_document = doc
            if self.store_memory is not None:
                last = self.store_memory.last_document()
                if last is not None and last.content_key == checked.content_key:
                    if last.complete:
                        return IngestReport(tokens=0, events_sealed=0, seconds=0.0, already_ingested=True,
                                            document_tokens=last.token_end - last.token_start)
                    doc, resumed_from = last, last.bytes_done
                    self.current_document = doc
            with self._deferred_interrupt():
                doc.bytes_done = resumed_from
                self._fed = [0, 0]
                if progress is not None:  # once before the first chunk, which takes seconds on a real model
                    progress(self.state.n_tokens, self.state.events_sealed)
                for ids, n_bytes in self._tokenize_stream(text for text, _ in read_text(checked.path, resumed_from)):
                    doc.bytes_done += n_bytes
                    self._fed[0] += n_bytes
                    self._fed[1] += len(ids)
                    self._feed(ids, progress, doc)
                    if self._stop_requested:
                        break
                self._flush(progress, doc)
                if not self._stop_requested:
                    doc.complete = True
                doc.token_end = self.tokens_ingested
                self._commit(doc)
                if self._stop_requested:
                    raise KeyboardInterrupt
        return IngestReport(
            tokens=self.state.n_tokens - tokens_before, events_sealed=self.state.events_sealed - events_before,
            seconds=time.perf_counter() - started, resumed_from_byte=resumed_from,
            document_tokens=self.tokens_ingested - doc.token_start,
        )

    def ingest_progress(self) -> tuple[int, int] | None:
        """(bytes the model has read, file size) of the document `ingest_file` is reading, estimated.

        `current_document.bytes_done` is the tokeniser's position, up to a piece ahead of the model;
        this subtracts the tokens still queued at the running bytes-per-token.
        """
        doc = self.current_document
        if doc is None:
            return None
        bytes_per_token = self._fed[0] / self._fed[1] if self._fed[1] else 4.0
        read = doc.bytes_done - int(len(self._pending) * bytes_per_token)
        return max(0, min(read, doc.size_bytes)), doc.size_bytes

    @contextmanager
    def _deferred_interrupt(self) -> Iterator[None]:
        """Turn Ctrl-C into a request honoured between chunks (a chunk cut half-way would be lost)."""
        self._stop_requested = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(_signum: int, _frame: Any) -> None:
            if self._stop_requested:  # a second Ctrl-C: the user insists; the last commit stands
                raise KeyboardInterrupt
            self._stop_requested = True

        previous = signal.signal(signal.SIGINT, request_stop)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def ingest_ids(self, token_ids: list[int], progress: ProgressCallback | None = None) -> None:
        """Read token ids into the stream (all of them: a short last chunk is processed too)."""
        with self._exclusive("ingest"):
            self._feed(token_ids, progress)
            self._flush(progress)

    def _feed(
        self, token_ids: list[int], progress: ProgressCallback | None = None, document: DocumentProgress | None = None,
        mode: str = "ingest",
    ) -> None:
        """Queue token ids; full chunks are processed now, the rest waits for more or for `_flush`."""
        self._pending.extend(token_ids)
        chunk = self.cfg.window.chunk_size
        while len(self._pending) >= chunk and not self._stop_requested:
            ids = self._pending[:chunk]
            del self._pending[:chunk]
            self._run_chunk(ids, progress, mode)
            if self.store_memory is not None and self._uncommitted >= self.cfg.store.commit_tokens:
                if document is not None:
                    document.token_end = self.tokens_ingested
                self._commit(document)

    def _flush(
        self, progress: ProgressCallback | None = None, document: DocumentProgress | None = None, mode: str = "ingest"
    ) -> None:
        """Run everything pending: whole chunks first (a restored stream can hold many), then the rest."""
        self._feed([], progress, document, mode)
        if self._pending and not self._stop_requested:
            self._run_chunk(self._pending, progress, mode)
            self._pending = []

    def _run_chunk(self, ids: list[int], progress: ProgressCallback | None, mode: str = "ingest") -> None:
        self._step(torch.tensor(ids, dtype=torch.long), mode)
        self._uncommitted += len(ids)
        if progress is not None:
            progress(self.state.n_tokens, self.state.events_sealed)

    def _step(self, token_ids: torch.Tensor, mode: str) -> torch.Tensor:
        try:
            return self.state.step(token_ids, mode=mode)  # type: ignore[arg-type]
        except BaseException as err:
            # The layers may have appended part of this step: the resident state is no longer whole.
            self._broken = type(err).__name__ + (f": {err}" if str(err) else "")
            raise

    def _tokenize_stream(self, pieces: Iterable[str]) -> Iterator[tuple[list[int], int]]:
        """Token ids of the text, piece by piece, with each piece's size in UTF-8 bytes.

        Cuts fall at whitespace about every _TOKENIZE_PIECE_CHARS characters and depend only on the
        text from the previous cut, so a resumed ingest tokenises exactly as the first run did.
        """
        tokenizer = self.lm.tokenizer
        carry = ""
        for piece in pieces:
            if not isinstance(piece, str):
                raise InputError(f"ingest takes str or an iterable of str, got {type(piece).__name__}")
            carry += piece
            while len(carry) >= _TOKENIZE_PIECE_CHARS:
                cut = _last_whitespace(carry, _TOKENIZE_PIECE_CHARS)
                text, carry = carry[:cut], carry[cut:]
                yield tokenizer.encode(text, add_special_tokens=False), len(text.encode("utf-8"))
        if carry:
            yield tokenizer.encode(carry, add_special_tokens=False), len(carry.encode("utf-8"))

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompt: str, max_new_tokens: int | None = None, question: str | None = None, stream: bool = False
    ) -> Any:
        """Raw continuation of everything ingested, then `prompt`; the text, or an iterator of pieces if `stream`.

        `question`: the part of `prompt` that asks (its last occurrence), matched against memory the
        way `chat` matches a message (`recall.question_match`); e.g. `prompt="\n\nWhat is the pass
        key? The pass key is"`, `question="What is the pass key?"`. Without it, every layer recalls by
        its own queries.
        """
        if question is None:
            pieces = self._generate_text(self._encode(prompt), max_new_tokens, stop_ids=self._stop_ids())
        else:
            at = prompt.rfind(question) if question.strip() else -1
            if at < 0:
                raise InputError("question must be a non-blank part of prompt")
            ids, span = self._encode_around(prompt[:at], question, prompt[at + len(question) :])
            pieces = self._generate_text(ids, max_new_tokens, stop_ids=self._stop_ids(), question_span=span)
        return pieces if stream else "".join(pieces)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> list[int]:
        """Greedy/temperature continuation on token ids; returns the new ids (stops at EOS)."""
        return list(self._generate(prompt_ids, max_new_tokens, stop_ids=self._stop_ids()))

    def chat(self, message: str, stream: bool = False, max_new_tokens: int | None = None) -> Any:
        """One chat turn with the model's template; returns the reply, or an iterator of pieces if `stream`."""
        pieces = self._chat_pieces(message, max_new_tokens)
        return pieces if stream else "".join(pieces)

    def _chat_pieces(self, message: str, max_new_tokens: int | None) -> Iterator[str]:
        if not message.strip():
            raise EmptyInputError("empty chat message")
        turn = {"role": "user", "content": message}
        if self.cfg.generation.chat_format == "qa":
            preamble, before, after, stop_text = "", "\n\nQuestion:", "\nAnswer:", "\n\n"
            content = " " + message.strip()
        else:
            preamble, question = self._template_turn(turn)
            split = len(message) if question.startswith(message) else 0  # 0: no known message span to match
            before, content, after, stop_text = "", question[:split], question[split:], None
        ids, span = self._encode_around(before, content, after)
        reply: list[str] = []
        pieces = self._generate_text(
            ids, max_new_tokens, stop_ids=self._stop_ids(),
            preamble_ids=self._encode(preamble), stop_text=stop_text, question_span=span,
        )
        for piece in pieces:
            reply.append(piece)
            yield piece
        self._chat_history += [turn, {"role": "assistant", "content": "".join(reply)}]
        if self.store_memory is not None:
            with self._exclusive("commit"):
                self._commit()  # the conversation itself is episodic memory: keep each turn

    def _template_turn(self, turn: dict[str, str]) -> tuple[str, str]:
        """The new text the chat template adds for `turn`, split into (preamble, question).

        The preamble (system prompt, role markers) is read as a step of its own: recall queries are
        the mean over a step's tokens, and the question must not be averaged with them.
        """
        tokenizer = self.lm.tokenizer
        rendered_before = (
            tokenizer.apply_chat_template(self._chat_history, tokenize=False) if self._chat_history else ""
        )
        rendered = tokenizer.apply_chat_template(self._chat_history + [turn], add_generation_prompt=True, tokenize=False)
        delta = rendered[len(rendered_before) :] if rendered.startswith(rendered_before) else rendered
        at = delta.rfind(turn["content"])
        return (delta[:at], delta[at:]) if at > 0 else ("", delta)

    def _generate_text(
        self, prompt_ids: list[int], max_new_tokens: int | None, stop_ids: set[int], preamble_ids: Sequence[int] = (),
        stop_text: str | None = None, question_span: tuple[int, int] | None = None,
    ) -> Iterator[str]:
        """Decoded pieces of the continuation; with `stop_text`, it ends where that text first follows
        some non-blank output that does not end in a colon (the stop text itself is not yielded)."""
        tokenizer = self.lm.tokenizer
        generated: list[int] = []
        emitted = ""
        tokens = self._generate(prompt_ids, max_new_tokens, stop_ids, preamble_ids, question_span)
        try:
            for token in tokens:
                generated.append(token)
                text = tokenizer.decode(generated, skip_special_tokens=True)
                if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                    continue
                if stop_text is not None:
                    begun = len(text) - len(text.lstrip())
                    cut = text.find(stop_text, begun) if begun < len(text) else -1
                    while cut >= 0 and text[:cut].rstrip().endswith(":"):  # "...are:" + blank line: a list follows
                        cut = text.find(stop_text, cut + len(stop_text))
                    if cut >= 0:
                        if cut > len(emitted):
                            yield text[len(emitted) : cut]
                        return
                    # hold back a tail that could be the start of the stop text
                    text = text[: len(text) - _partial_suffix(text, stop_text)] if begun < len(text) else ""
                if len(text) > len(emitted):
                    yield text[len(emitted) :]
                    emitted = text
        finally:
            tokens.close()  # releases the session even when the caller stops early

    def _generate(
        self, prompt_ids: list[int], max_new_tokens: int | None, stop_ids: set[int], preamble_ids: Sequence[int] = (),
        question_span: tuple[int, int] | None = None,
    ) -> Generator[int, None, None]:
        """With `question_span` (the question's tokens within `prompt_ids`) and question_match = "keys",
        every layer attends to the events that match the question while the answer is read and written."""
        if not prompt_ids and self.state.n_tokens == 0 and not self._pending:
            raise EmptyInputError("nothing to continue: empty prompt and empty session")
        limit = max_new_tokens if max_new_tokens is not None else self.cfg.generation.max_new_tokens
        with self._exclusive("generate"):
            if preamble_ids:
                self._pending.extend(preamble_ids)
                self._flush(mode="prompt")
            self.last_recalled = []
            recall = self.cfg.recall
            if question_span is not None and recall.enabled and recall.question_match == "keys" and len(self.memory):
                self._pin_answer_events(prompt_ids, question_span)
            try:
                self._pending.extend(prompt_ids)
                self._flush(mode="prompt")
                if question_span is not None and self.state.pinned_events is None:
                    self.last_recalled = self._attended_events()
                generator = torch.Generator().manual_seed(self.cfg.generation.seed)
                logits = self.state.last_logits
                for _ in range(limit):
                    assert logits is not None
                    token = self._pick(logits, generator)
                    logits = self._step(torch.tensor([token]), "decode")[-1]
                    if token in stop_ids:
                        return
                    yield token
            finally:
                self.state.pinned_events = None

    def _attended_events(self) -> list[RecalledEvent]:
        """The events the layers recalled for the prompt, most layers first; score = share of layers."""
        n_layers = len(self.state.layers)
        ranked = _by_votes([layer.recalled_ids for layer in self.state.layers])
        return self._recalled_events([(event_id, count / n_layers) for event_id, count in ranked])

    def _pin_answer_events(self, prompt_ids: list[int], span: tuple[int, int]) -> None:
        recall = self.cfg.recall
        self._flush()  # the probe reads the prompt after everything queued
        matches, window = self._match(prompt_ids, span, recall.answer_hits, against_window=True)
        if not matches:
            return  # nothing to match on: the per-layer recall stays in charge
        if window > matches[0][1] + recall.window_margin:
            # The text still in the window matches the question better than any event: memory would
            # only crowd it (measured: a passkey in the window, answered with 512 recalled filler
            # tokens, was lost; answered with none, found).
            self.state.pinned_events = []
            return
        budget = recall.budget_tokens
        if recall.answer_budget_tokens is not None:
            budget = min(budget, recall.answer_budget_tokens)
        self.state.pinned_events = answer_events(self.memory, [event_id for event_id, _ in matches], budget)
        self.state.pinned_from = self.state.n_tokens  # the queue is flushed: the prompt starts here
        self.last_recalled = self._recalled_events(matches)

    def _pick(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        temperature = self.cfg.generation.temperature
        if temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _stop_ids(self) -> set[int]:
        eos = self.lm.tokenizer.eos_token_id
        return {eos} if eos is not None else set()

    def _encode_around(self, before: str, question: str, after: str) -> tuple[list[int], tuple[int, int]]:
        """The ids of before + question + after, each encoded on its own so that the question's tokens
        (what recall matches) are known, and their span."""
        before_ids, question_ids = self._encode(before), self._encode(question)
        return before_ids + question_ids + self._encode(after), (len(before_ids), len(before_ids) + len(question_ids))

    def _encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InputError(f"expected str, got {type(text).__name__}")
        return list(self.lm.tokenizer.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------------ recall
    def recall(self, query: str, k: int = 5) -> list[RecalledEvent]:
        """The `k` events that best match `query`, best first.

        With question_match = "keys" (default) the score is the re-ranking's mean best key cosine
        (`retrieval.key_match`); with "attention", per-layer z-scored inner products of the query's
        mean recall query with the representatives, averaged over layers.
        """
        ids = self._encode(query)
        if not ids:
            raise EmptyInputError("empty recall query")
        if len(self.memory) == 0:
            return []
        with self._exclusive("recall"):
            self._flush()
            if self.cfg.recall.question_match == "keys":
                return self._recalled_events(self._match(ids, (0, len(ids)), k)[0])
            queries = self.state.probe(torch.tensor(ids, dtype=torch.long)).queries
        n_events = len(self.memory)
        total = torch.zeros(n_events)
        for layer, layer_query in enumerate(queries):
            event_ids, scores = self.memory.search(layer, layer_query, k=n_events)
            s = torch.tensor(scores)
            z = (s - s.mean()) / s.std().clamp(min=1e-6) if s.numel() > 1 else s * 0
            total[torch.tensor(event_ids)] += z
        total /= len(queries)
        best = torch.topk(total, min(k, n_events))
        return self._recalled_events(list(zip(best.indices.tolist(), best.values.tolist())))

    def _match(
        self, ids: list[int], span: tuple[int, int], k: int, against_window: bool = False
    ) -> tuple[list[tuple[int, float]], float]:
        """Probe `ids` after the stream and match the keys of ids[span[0]:span[1]] against the events.

        Returns the best `k` (event id, score) and, with `against_window`, the best score of a span of
        the resident window (sinks and local tokens) cut into pieces as long as the hits (else -inf):
        what the window offers, measured the way the events were.
        """
        probe = self.state.probe(torch.tensor(ids, dtype=torch.long))
        layers = self.state.summary_layers
        question_keys = torch.stack([probe.keys[layer][:, span[0] : span[1]] for layer in layers])  # (S, Hkv, C, D)
        candidates = self.cfg.recall.rerank_candidates
        # Also re-rank what the layers' query recall chose: a summary search alone can be crowded out.
        voted = [event_id for event_id, _ in _by_votes(probe.recalled)[:candidates]]
        neighbours = self.cfg.recall.match_neighbours
        matches = match_question(self.memory, question_keys, layers, k, candidates, also=voted, neighbours=neighbours)
        window = float("-inf")
        if against_window and question_keys.shape[2] > 0:
            resident = [torch.cat([self.state.layers[layer].sink_k, self.state.layers[layer].local_k], dim=1)
                        for layer in layers]  # (Hkv, R, D) each
            if resident[0].shape[1] > 0 and matches:
                span_tokens = max(1, round(sum(self.memory.event(m).length for e, _ in matches
                                                   for m in match_span(self.memory, e, neighbours)) / len(matches)))
                owner = torch.arange(resident[0].shape[1]) // span_tokens  # (R,)
                window = float(token_match(resident, owner, int(owner[-1]) + 1, question_keys).max())
        return matches, window

    def _recalled_events(self, scored: list[tuple[int, float]]) -> list[RecalledEvent]:
        event_ids = [event_id for event_id, _ in scored]
        details = self.store_memory.event_details(event_ids) if self.store_memory is not None else {}
        results = []
        for event_id, score in scored:
            event = self.memory.event(event_id)
            text = self.lm.tokenizer.decode(self.memory.tokens(event_id))
            document, created = details.get(event_id, (None, None))
            results.append(RecalledEvent(
                event_id=event_id, text=text, token_start=event.start, token_end=event.end, score=score,
                document=document, time=created,
            ))
        return results

    # ------------------------------------------------------------------ introspection
    @property
    def tokens_ingested(self) -> int:
        return self.state.n_tokens + len(self._pending)

    @property
    def events(self) -> int:
        return len(self.memory)

    def recent_surprise(self) -> tuple[list[float], list[int]]:
        """Surprise of the tokens still in the local window, and where events start among them (indices)."""
        values = self.state.local_surprise.tolist()
        starts = [b - self.state.local_start for b in self.state.boundaries]
        return values, [0, *starts] if values else []

    def stats(self) -> SessionStats:
        """Tokens, events, documents, memory tiers and disk use of this session's stream."""
        store = self.store_memory
        spec = self.lm.spec
        return SessionStats(
            model=spec.model_id, tokens=self.state.n_tokens, queued_tokens=len(self._pending), events=self.events,
            resident_tokens=self.state.sink_len + int(self.state.tail_tokens.numel()),
            documents=[d.name for d in store.documents()] if store is not None else [],
            store=str(store.store.path) if store is not None else None,
            namespace="/".join(store.names) if store is not None else None,
            codec=store.codec if store is not None else self.cfg.recall.memory_dtype,
            hot_bytes=store.hot.bytes if store is not None else 0,
            warm_bytes=store.warm.bytes if store is not None else self.memory.kv_bytes,
            disk_bytes=store.disk_bytes() if store is not None else 0,
            committed_tokens=store.committed_tokens if store is not None else 0,
        )


def _by_votes(chosen_per_layer: Iterable[list[int]]) -> list[tuple[int, int]]:
    """(event id, number of layers that chose it), most chosen first, then by id."""
    counts = Counter(event_id for chosen in chosen_per_layer for event_id in chosen)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def _last_whitespace(text: str, limit: int) -> int:
    cut = max(text.rfind(" ", 0, limit), text.rfind("\n", 0, limit))
    return cut + 1 if cut > 0 else limit
