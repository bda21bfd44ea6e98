"""`engramkv serve`: an HTTP API over the library's own calls, the model loaded once per process.

Every namespace of one store is reachable at /v1/namespaces/{user}/{agent}/{session}/...: ingest (text or a
file, with NDJSON progress when streamed), chat (the reply streamed as plain text, or JSON with what the
answer read), recall, stats; /v1/namespaces lists and deletes. A namespace's session is opened on its first
request and kept (a chat turn joins its stream, as in the TUI) while it is among the `max_open` used last; its
requests run one at a time (a lock per namespace), different namespaces side by side (FastAPI runs these
handlers on its thread pool, and each forward pass carries its own engine state). The exception tree maps onto
status codes (`STATUS`); FastAPI writes the OpenAPI schema (/openapi.json, /docs). With a token, every request
must carry `Authorization: Bearer TOKEN`.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware
from pydantic import BaseModel, Field

from engramkv import (
    ConfigError,
    EmptyInputError,
    EngramError,
    EpisodicLM,
    EventStore,
    IngestReport,
    InputError,
    NamespaceError,
    NamespaceInfo,
    ReadOnlyError,
    RecalledEvent,
    Session,
    SessionError,
    SessionStats,
    StoreCorruptError,
    StoreFullError,
    StoreLockedError,
    StoreMismatchError,
)

# The exception tree onto HTTP: the most specific class listed first wins.
STATUS: list[tuple[type[EngramError], int]] = [
    (EmptyInputError, 400), (InputError, 400), (ConfigError, 400), (NamespaceError, 404),
    (StoreLockedError, 409), (StoreMismatchError, 409), (ReadOnlyError, 409), (SessionError, 409),
    (StoreFullError, 507), (StoreCorruptError, 500), (EngramError, 500),
]

Names = tuple[str, str, str]
log = logging.getLogger(__name__)


class IngestRequest(BaseModel):
    text: str | None = Field(default=None, description="Text to read into the stream.")
    path: str | None = Field(default=None, description="A UTF-8 text file on the server's disk (resumable).")
    stream: bool = Field(default=False, description="Reply with NDJSON progress lines, then the report.")


class ChatRequest(BaseModel):
    message: str = Field(description="The user's turn.")
    max_new_tokens: int | None = Field(default=None, ge=1, le=4096)
    budget_tokens: int | None = Field(default=None, ge=1, description="The most context the answer reads.")
    stream: bool = Field(default=False, description="Reply with the text as it is written (text/plain).")


class ChatReply(BaseModel):
    reply: str
    recalled: list[RecalledEvent]  # what the answer attended to, best match first


class RecallRequest(BaseModel):
    query: str
    k: int = Field(default=5, ge=1, le=100)


class Health(BaseModel):
    model: str
    store: str
    open_sessions: int = Field(description="Namespaces held open (each with its window and hot/warm tiers).")


class Sessions:
    """One open session per namespace, and the lock its requests take turns on. At most `max_open` sessions
    stay open: opening another closes the least recently used one that no request holds (a close commits it;
    its next request reopens it where it stopped). Each open session keeps its resident window and its own hot
    and warm tiers (up to 768 MiB by default), so a server reached by many users would otherwise grow without
    bound. Where every other open session is busy, the table runs over `max_open` until a later open finds
    one idle."""

    def __init__(self, lm: EpisodicLM, store: Path, max_open: int):
        if max_open < 1:
            raise ConfigError(f"max_open must be at least 1, not {max_open}")
        self.lm, self.store, self.max_open = lm, store, max_open
        self._open: OrderedDict[Names, Session] = OrderedDict()  # least recently used first
        self._locks: dict[Names, threading.Lock] = {}
        self._guard = threading.Lock()  # over the two dicts
        self._opening = threading.Lock()  # one session opens at a time: the first also opens the store

    def lock(self, names: Names) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(names, threading.Lock())

    def get(self, names: Names) -> Session:
        """The namespace's session (call with its lock held)."""
        with self._guard:
            session = self._open.get(names)
            if session is not None:
                self._open.move_to_end(names)
        if session is None:
            with self._opening:
                session = self.lm.session(store=self.store, user_id=names[0], agent_id=names[1],
                                          session_id=names[2])
            with self._guard:
                self._open[names] = session
            self._close_idle(keep=names)
        return session

    def count(self) -> int:
        with self._guard:
            return len(self._open)

    def _close_idle(self, keep: Names) -> None:
        """Close the least recently used sessions beyond `max_open` whose lock is free. The caller holds `keep`'s
        lock; the others are only tried (never waited for), so two threads closing at once cannot deadlock."""
        with self._guard:
            candidates = [n for n in self._open if n != keep]
        for names in candidates:
            lock = self.lock(names)
            if not lock.acquire(blocking=False):  # a request is using it
                continue
            try:
                with self._guard:
                    if len(self._open) <= self.max_open:  # counted again: another open may have closed one
                        return
                    session = self._open.pop(names, None)
                if session is not None:
                    with self._opening:  # a close changes the store's table of open namespaces, as an open does
                        session.close()
            except EngramError as err:  # its last commit stands; the request that opened another is not at fault
                log.warning("closing the idle session %s failed: %s", "/".join(names), err)
            finally:
                lock.release()

    def event_store(self) -> EventStore:
        """The store (opened once, like the sessions: the model's table of open stores is not thread-safe)."""
        with self._opening:
            return self.lm.open_store(self.store)

    def delete(self, names: Names) -> None:
        with self.lock(names):
            with self._guard:
                session = self._open.pop(names, None)
            if session is not None:
                with self._opening:
                    session.close()
            self.event_store().delete_namespace(*names)  # NamespaceError where there is none

    def close(self) -> None:
        with self._guard:
            sessions = list(self._open.values())
            self._open.clear()
        for session in sessions:
            session.close()
        self.lm.close()


def create_app(lm: EpisodicLM, store: str | Path, token: str | None = None, files_root: str | Path | None = None,
               allowed_hosts: list[str] | None = None, max_open: int = 8) -> FastAPI:
    """The API over `store`, answering with `lm`. `token`: required of every request when given. `files_root`:
    the directory whose files `ingest` may read by path (None: none; a path would let any client read any
    file of the server's). `allowed_hosts`: the Host headers accepted (a page in a browser on this machine
    can reach localhost under a name it controls: DNS rebinding). `max_open`: namespaces held open at once
    (`Sessions`)."""
    sessions = Sessions(lm, Path(store).expanduser(), max_open)
    root = None if files_root is None else Path(files_root).expanduser().resolve()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> Any:
        yield
        sessions.close()  # commit and release every namespace, then the store's lock

    app = FastAPI(title="engramkv", version="1", lifespan=lifespan,
                  description="Episodic memory inside a language model's attention, over HTTP.")

    @app.middleware("http")
    async def authorised(request: Request, call_next: Any) -> Any:
        # a middleware, not a route dependency: the schema and the docs pages are behind the token too
        given = request.headers.get("authorization", "")
        if token is not None and not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return JSONResponse({"detail": "a valid 'Authorization: Bearer TOKEN' header is required"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    if allowed_hosts is not None:  # added last, so it runs first
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)

    @app.exception_handler(EngramError)
    async def engram_error(_request: Request, err: EngramError) -> JSONResponse:
        status = next(code for cls, code in STATUS if isinstance(err, cls))
        return JSONResponse({"detail": str(err), "error": type(err).__name__}, status_code=status)

    @app.get("/v1/health", response_model=Health)
    def health() -> Health:
        return Health(model=lm.spec.model_id, store=str(sessions.store), open_sessions=sessions.count())

    @app.get("/v1/namespaces", response_model=list[NamespaceInfo])
    def list_namespaces() -> list[NamespaceInfo]:
        if not (sessions.store / "STORE_ID").exists():
            return []
        return sessions.event_store().namespaces()

    @app.delete("/v1/namespaces/{user}/{agent}/{session}", status_code=204)
    def delete_namespace(user: str, agent: str, session: str) -> Response:
        sessions.delete((user, agent, session))
        return Response(status_code=204)

    @app.post("/v1/namespaces/{user}/{agent}/{session}/ingest", response_model=IngestReport,
              responses={200: {"content": {"application/x-ndjson": {}}}})
    def ingest(user: str, agent: str, session: str, body: IngestRequest) -> Any:
        if (body.text is None) == (body.path is None):
            raise InputError("give exactly one of 'text' and 'path'")
        if body.path is not None:
            if root is None:
                raise InputError("this server reads no files by path (engramkv serve --files-root DIR); send 'text'")
            if not Path(body.path).expanduser().resolve().is_relative_to(root):
                raise InputError(f"{body.path} is outside {root}, the directory this server reads files from")
        names = (user, agent, session)

        def run(progress: Any) -> IngestReport:
            with sessions.lock(names):
                s = sessions.get(names)
                if body.path is not None:
                    return s.ingest_file(body.path, progress=progress)
                return s.ingest(body.text or "", progress=progress)

        if not body.stream:
            return run(None)
        return StreamingResponse(_streamed_ingest(run), media_type="application/x-ndjson")

    @app.post("/v1/namespaces/{user}/{agent}/{session}/chat", response_model=ChatReply,
              responses={200: {"content": {"text/plain": {}}}})
    def chat(user: str, agent: str, session: str, body: ChatRequest) -> Any:
        names = (user, agent, session)
        if not body.stream:
            with sessions.lock(names):
                s = sessions.get(names)
                reply = s.chat(body.message, max_new_tokens=body.max_new_tokens, budget_tokens=body.budget_tokens)
                return ChatReply(reply=reply, recalled=s.last_recalled)

        def write(put: Any) -> None:
            with sessions.lock(names):
                for piece in sessions.get(names).chat(body.message, stream=True, max_new_tokens=body.max_new_tokens,
                                                      budget_tokens=body.budget_tokens):
                    put(piece)

        # The reply is written on a thread of its own, which holds the namespace's lock to the end whether or not
        # the client stays; an error before the first piece (an empty message, a damaged store) is answered as one.
        pieces = _on_thread(write)
        first = next(pieces, "")
        return StreamingResponse(itertools.chain([first], pieces), media_type="text/plain; charset=utf-8")

    @app.post("/v1/namespaces/{user}/{agent}/{session}/recall", response_model=list[RecalledEvent])
    def recall(user: str, agent: str, session: str, body: RecallRequest) -> list[RecalledEvent]:
        names = (user, agent, session)
        with sessions.lock(names):
            return sessions.get(names).recall(body.query, k=body.k)

    @app.get("/v1/namespaces/{user}/{agent}/{session}/stats", response_model=SessionStats)
    def stats(user: str, agent: str, session: str) -> SessionStats:
        names = (user, agent, session)
        with sessions.lock(names):
            return sessions.get(names).stats()

    return app


def _on_thread(work: Any) -> Iterator[str]:
    """Run `work(put)` on a thread; yield what it puts, then raise what it raised (if anything)."""
    items: queue.Queue[Any] = queue.Queue()
    done = object()

    def run() -> None:
        try:
            work(items.put)
        except BaseException as err:  # noqa: BLE001 - handed to the reader of the pieces
            items.put(err)
        finally:
            items.put(done)

    threading.Thread(target=run, name="engramkv-reply", daemon=True).start()
    while (item := items.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def _streamed_ingest(run: Any) -> Iterator[str]:
    """NDJSON: a progress line per update while `run` ingests on a thread, then the report (or the error)."""
    outcome: dict[str, Any] = {}

    def work(put: Any) -> None:
        report = run(lambda p: put(json.dumps({"progress": p.model_dump(mode="json")}) + "\n"))
        outcome["report"] = report.model_dump(mode="json")

    try:
        yield from _on_thread(work)
    except Exception as err:  # noqa: BLE001 - the client learns of any failure; the stream cannot turn 500
        outcome = {"error": {"error": type(err).__name__, "detail": str(err)}}
    yield json.dumps(outcome) + "\n"
