"""The terminal chat: a Textual app over one session of a store.

    conversation (streamed answers)            | memory: model, namespace, tokens, events, tiers, disk
    [ingest progress bar, while /ingest runs]  | recalled for the last answer: score + text
    > prompt (/ingest PATH, /session NAME, ...) | surprise of recent input, event boundaries marked

Everything slow (loading the model, answering, ingesting) runs in a worker thread and reports back
with `call_from_thread`, so the interface never freezes. The session does one thing at a time; the
prompt says so when it is busy. Conversation turns join the stream and are committed to the store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Input, ProgressBar, Static

from engramkv import EngramError, EpisodicLM, IngestProgress, Session

HELP = """Commands:
  /ingest PATH     read a text or Markdown file into this session's memory (resumable)
  /session NAME    switch to (or create) session NAME in the same store
  /recall QUERY    show the events that best match QUERY
  /help            this text
Anything else is a chat message. Ctrl+Q quits."""

BARS = " ▁▂▃▄▅▆▇█"


def surprise_plot(values: list[float], boundaries: list[int], width: int = 36, tokens_per_column: int = 4) -> str:
    """Two text rows: surprise of recent tokens in `width` buckets, and '^' under buckets where an event starts.

    Only the last `width * tokens_per_column` tokens are drawn: events are tens of tokens long, and
    with more tokens per column every column would hold an event start.
    """
    if not values:
        return "(no input yet)"
    shown = width * tokens_per_column
    if len(values) > shown:
        cut = len(values) - shown
        values, boundaries = values[cut:], [b - cut for b in boundaries if b >= cut]
    per = max(1, -(-len(values) // width))  # tokens per bucket, rounded up
    buckets = [max(values[i : i + per]) for i in range(0, len(values), per)][-width:]
    offset = len(values) - len(buckets) * per  # tokens left of the first shown bucket
    lo, hi = min(buckets), max(buckets)
    span = (hi - lo) or 1.0
    bars = "".join(BARS[1 + int((b - lo) / span * (len(BARS) - 2))] for b in buckets)
    marks = [" "] * len(buckets)
    for b in boundaries:
        index = (b - offset) // per
        if 0 <= index < len(marks):
            marks[index] = "^"
    return f"{bars}\n{''.join(marks)}\n{len(values)} tokens, max {hi:.1f} nats; ^ = event start"


class Message(Static):
    """One conversation turn."""


class ChatApp(App[int]):
    """The engramkv chat. `model_factory` returns an EpisodicLM (tests pass a tiny one)."""

    TITLE = "engramkv"
    CSS = """
    #main { height: 1fr; }
    #left { width: 2fr; }
    #conversation { height: 1fr; padding: 0 1; }
    #sidebar { width: 1fr; min-width: 36; border-left: solid $accent; padding: 0 1; }
    #sidebar Static { margin-bottom: 1; }
    .user { color: $text; text-style: bold; margin-top: 1; }
    .assistant { color: $success; }
    .system { color: $warning; }
    #ingest-progress { display: none; }
    #ingest-progress.active { display: block; }
    """
    BINDINGS = [("ctrl+q", "quit", "Quit"), ("ctrl+l", "clear", "Clear conversation")]

    def __init__(self, model_factory: Callable[[], Any], store: str, user_id: str = "default",
                 agent_id: str = "default", session_id: str = "default"):
        super().__init__()
        self.model_factory = model_factory
        self.store, self.user_id, self.agent_id, self.session_id = store, user_id, agent_id, session_id
        self.lm: EpisodicLM | None = None
        self.session: Session | None = None
        self.busy: str | None = "loading the model"
        self._reading: str | None = None  # the file /ingest is reading

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield VerticalScroll(id="conversation")
                yield ProgressBar(id="ingest-progress", show_eta=True)
                yield Input(placeholder="loading the model ...", id="prompt")
            with Vertical(id="sidebar"):
                yield Static("memory: loading ...", id="memory")
                yield Static("recalled for the last answer: -", id="recalled")
                yield Static("surprise: -", id="surprise")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"{self.store} · {self.user_id}/{self.agent_id}/{self.session_id}"
        self.load_model()

    # ------------------------------------------------------------------ workers
    @work(thread=True, exclusive=True, group="session")
    def load_model(self) -> None:
        try:
            self.lm = self.model_factory()
            self.session = self._open_session(self.session_id)
        except EngramError as err:
            self.call_from_thread(self._say, f"error: {err}", "system")
            self.call_from_thread(self._set_busy, "unusable (see the error above)")
            return
        self.call_from_thread(self._idle, f"ready: {self.lm.spec.model_id}. Type /help for commands.")

    def _open_session(self, session_id: str) -> Any:
        return self.lm.session(store=self.store, user_id=self.user_id, agent_id=self.agent_id,
                               session_id=session_id)

    @work(thread=True, exclusive=True, group="session")
    def answer(self, message: str, widget: Static) -> None:
        try:
            text = ""
            for piece in self.session.chat(message, stream=True):
                if not text:  # the prompt has been read: its recall is known
                    self.call_from_thread(self._show_recalled, self.session.last_recalled[:5], self.session.last_plan)
                text += piece
                self.call_from_thread(widget.update, text)
            if not text:
                self.call_from_thread(self._show_recalled, self.session.last_recalled[:5], self.session.last_plan)
            if not text.strip():
                self.call_from_thread(widget.update, "(no answer)")
        except EngramError as err:
            self.call_from_thread(self._say, f"error: {err}", "system")
        self.call_from_thread(self._idle)

    @work(thread=True, exclusive=True, group="session")
    def ingest(self, path: str) -> None:
        bar = self.query_one("#ingest-progress", ProgressBar)
        try:
            size = Path(path).expanduser().stat().st_size
        except OSError:
            size = 0
        self.call_from_thread(self._start_progress, size)

        def progress(record: IngestProgress) -> None:
            if record.bytes_read is not None:
                self.call_from_thread(bar.update, progress=record.bytes_read)
            self.call_from_thread(self._refresh_panels)

        self._reading = path
        try:
            report = self.session.ingest_file(path, progress=progress)
            if report.already_ingested:
                note = f"{path} is already in memory ({report.document_tokens:,} tokens)"
            else:
                resumed = f", resumed at byte {report.resumed_from_byte:,}" if report.resumed_from_byte else ""
                note = (f"ingested {path}: {report.tokens:,} tokens, {report.events_sealed:,} events, "
                        f"{report.tokens_per_second:,.0f} tok/s{resumed}")
            self.call_from_thread(self._say, note, "system")
        except EngramError as err:
            self.call_from_thread(self._say, f"error: {err}", "system")
        finally:
            self._reading = None
        self.call_from_thread(self._stop_progress)
        self.call_from_thread(self._idle)

    @work(thread=True, exclusive=True, group="session")
    def switch(self, session_id: str) -> None:
        try:
            self.session.close()
            self.session = self._open_session(session_id)
            self.session_id = session_id
        except EngramError as err:
            self.call_from_thread(self._say, f"error: {err}", "system")
        self.call_from_thread(self._set_subtitle)
        self.call_from_thread(self._idle, f"session {self.session_id}: {self.session.tokens_ingested:,} tokens")

    @work(thread=True, exclusive=True, group="session")
    def show_recall(self, query: str) -> None:
        try:
            recalled = self.session.recall(query, k=5)
            self.call_from_thread(self._show_recalled, recalled)
            lines = [f"[{r.score:+.2f}] {_one_line(r.text, 200)}" for r in recalled] or ["no events yet"]
            self.call_from_thread(self._say, "\n".join(lines), "system")
        except EngramError as err:
            self.call_from_thread(self._say, f"error: {err}", "system")
        self.call_from_thread(self._idle)

    # ------------------------------------------------------------------ input
    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.busy is not None:
            self._say(f"busy: {self.busy}; wait for it to finish", "system")
            return
        event.input.value = ""
        command, _, rest = text.partition(" ")
        if command == "/help":
            self._say(HELP, "system")
        elif command == "/ingest" and rest.strip():
            self._set_busy(f"ingesting {rest.strip()}")
            self.ingest(rest.strip())
        elif command == "/session" and rest.strip():
            self._set_busy("switching session")
            self.switch(rest.strip())
        elif command == "/recall" and rest.strip():
            self._set_busy("recalling")
            self.show_recall(rest.strip())
        elif command.startswith("/"):
            self._say(f"unknown command {command!r}\n{HELP}", "system")
        else:
            self._say(text, "user")
            widget = self._say("…", "assistant")
            self._set_busy("answering")
            self.answer(text, widget)

    def action_clear(self) -> None:
        self.query_one("#conversation").remove_children()

    # ------------------------------------------------------------------ view updates (main thread)
    def _say(self, text: str, role: str) -> Static:
        widget = Message(text, classes=role, markup=False)
        conversation = self.query_one("#conversation", VerticalScroll)
        conversation.mount(widget)
        conversation.scroll_end(animate=False)
        return widget

    def _set_busy(self, what: str) -> None:
        self.busy = what
        self.query_one("#prompt", Input).placeholder = f"{what} ..."

    def _idle(self, note: str | None = None) -> None:
        self.busy = None
        prompt = self.query_one("#prompt", Input)
        prompt.placeholder = "message, or /help"
        prompt.focus()
        if note:
            self._say(note, "system")
        self._refresh_panels()

    def _set_subtitle(self) -> None:
        self.sub_title = f"{self.store} · {self.user_id}/{self.agent_id}/{self.session_id}"

    def _refresh_panels(self) -> None:
        if self.session is None:
            return
        stats = self.session.stats()
        mb = 2**20
        lines = [
            f"memory · {stats.model}",
            f"namespace  {stats.namespace}",
            f"tokens     {stats.tokens:,} ({stats.committed_tokens:,} committed)",
            f"events     {stats.events:,}",
            f"documents  {len(stats.documents)}",
            f"hot/warm   {stats.hot_bytes / mb:,.1f} / {stats.warm_bytes / mb:,.1f} MiB",
            f"disk       {stats.disk_bytes / mb:,.1f} MiB ({stats.codec})",
        ]
        if self._reading is not None:
            lines.insert(3, f"reading    {Path(self._reading).name}")
        self.query_one("#memory", Static).update("\n".join(lines))
        values, boundaries = self.session.recent_surprise()
        self.query_one("#surprise", Static).update("surprise (recent input)\n" + surprise_plot(values, boundaries))

    def _show_recalled(self, recalled: list[Any], plan: Any = None) -> None:
        lines = [f"[{r.score:+.2f}] #{r.event_id} {_one_line(r.text, 90)}" for r in recalled] or ["(nothing yet)"]
        header = "recalled for the last answer"
        if plan is not None and plan.theta is not None:  # the inference parameters the answer took
            t = plan.theta
            header += f" (k={t.k} s={t.s} n={t.n} m={t.m} w={t.w}; {plan.context_tokens:,} context tokens)"
        self.query_one("#recalled", Static).update(header + "\n" + "\n".join(lines))

    def _start_progress(self, total: int) -> None:
        bar = self.query_one("#ingest-progress", ProgressBar)
        bar.update(total=total or None, progress=0)
        bar.add_class("active")

    def _stop_progress(self) -> None:
        self.query_one("#ingest-progress", ProgressBar).remove_class("active")

    def on_unmount(self) -> None:
        if self.session is not None:
            try:
                self.session.close()
            except EngramError:
                pass
        if self.lm is not None:
            self.lm.close()


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
