"""Chat formats and the stop-text streamer: how a turn becomes token ids and a reply becomes text (`sampling`
chooses its tokens).

Two formats (`GenerationConfig.chat_format`):

- "qa": `\\n\\nQuestion: MESSAGE\\nAnswer:`, the reply ending at the first blank line that does not
  follow a colon (a colon announces a list). The embedded 135M model reads recalled events in
  this form and ignores them under its chat template.
- "template": the model's own chat template; the preamble it adds (system prompt, role markers)
  is read as a step of its own, since recall queries are the mean over a step's tokens and the
  question must not be averaged with them.

Either way the question's own tokens are encoded on their own, so their span (what recall matches)
is known exactly.

With `GenerationConfig.answer_start` "echo", a question of the form "What is/are X?" has its answer begun
for the model as "X is/are" (`echo`), the way a benchmark prompt begins it; the reply includes that start.
A question for all of something ("What are all X?") is answered as a bulleted list ("X are:", a blank line,
"*") drafted on the stream (`Turn.listed`; the session reads it with `Reader.reading(draft=True)`), since
written on one line such an answer tends to name one item; its distinct items are the reply, as one sentence,
"X are: a, b." (`joined`), and the stream reads the question and that sentence: a list in the conversation's
memory is a form the embedded model copies into later answers. "list" begins the answer to every plural "What
are X?" as a bulleted list, kept as written; not the default, for that copying.

A reply ends before a sentence or line that comes back for the `GenerationConfig.repeat_stop`-th time
(`until_repeat`), the cut the evaluation's scorer makes (`cut_repeats`), so a reply reads as it is scored; a
drafted list's last line, if the token limit cut it, is left out. However a reply ends (the model's stop token, the
token limit, a repeat, a caller that stops reading), its turn then ends in the stream as the template ends a
finished one (`closing_ids`), and the chat history records the reply as shown.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from engramkv.config import GenerationConfig
from engramkv.errors import InputError


@dataclass(frozen=True)
class Turn:
    """One user turn, encoded: a preamble read first, then the prompt with the question's span in it."""

    preamble_ids: list[int]
    prompt_ids: list[int]
    question_span: tuple[int, int]  # [start, end) of the question's tokens in prompt_ids
    stop_text: str | None  # the reply ends where this text follows some output
    reply_start: str = ""  # the answer's first words, read after the prompt and the first piece of the reply
    listed: int | None = None  # a list answer, drafted (`Reader.reading`): where its answer start is in prompt_ids


def encode(tokenizer: Any, text: str) -> list[int]:
    if not isinstance(text, str):
        raise InputError(f"expected str, got {type(text).__name__}")
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_around(tokenizer: Any, before: str, question: str, after: str) -> tuple[list[int], tuple[int, int]]:
    """The ids of before + question + after, each encoded on its own, and the question's span."""
    before_ids, question_ids = encode(tokenizer, before), encode(tokenizer, question)
    ids = before_ids + question_ids + encode(tokenizer, after)
    return ids, (len(before_ids), len(before_ids) + len(question_ids))


def encode_prompt(tokenizer: Any, prompt: str, question: str | None) -> tuple[list[int], tuple[int, int] | None]:
    """The ids of a raw prompt, and, where `question` is given, the span of its last occurrence in them."""
    if question is None:
        return encode(tokenizer, prompt), None
    at = prompt.rfind(question) if isinstance(question, str) and question.strip() else -1
    if at < 0:
        raise InputError("question must be a non-blank part of prompt")
    return encode_around(tokenizer, prompt[:at], question, prompt[at + len(question) :])


def chat_turn(tokenizer: Any, cfg: GenerationConfig, history: list[dict[str, str]], message: str,
              list_room: int | None = None) -> Turn:
    """The token ids of a user turn after `history`, in `cfg.chat_format`. `list_room`: the most tokens the prompt,
    its answer start included, may take to be answered from a drafted list (`Turn.listed`; None: no limit); a
    longer one is only echoed."""
    preamble_ids: list[int] = []
    if cfg.chat_format == "qa":
        parts = ("\n\nQuestion:", " " + message.strip(), "\nAnswer:")
    else:
        turn = {"role": "user", "content": message}
        preamble, question = _template_turn(tokenizer, history, turn)
        split = len(message) if question.startswith(message) else 0  # 0: no known message span to match
        parts = ("", question[:split], question[split:])
        preamble_ids = encode(tokenizer, preamble)
    ids, span = encode_around(tokenizer, *(quoted(*parts) if cfg.question_span == "quoted" else parts))
    lead = " " if cfg.chat_format == "qa" else ""
    start = echo(message) if cfg.answer_start in ("echo", "list") else None
    plural = start is not None and start.endswith(" are")
    listed = plural and cfg.answer_start == "echo" and asks_for_all(message) and (
        list_room is None or len(ids) + len(encode(tokenizer, lead + f"{start}{LIST_OPENER}")) <= list_room)
    if plural and (listed or cfg.answer_start == "list"):
        start = f"{start}{LIST_OPENER}"
    reply_start = "" if start is None else lead + start
    stop = "\n\n" if cfg.chat_format == "qa" else None
    return Turn(preamble_ids, ids + encode(tokenizer, reply_start), span, stop, reply_start,
                len(ids) if listed else None)


def closing_ids(tokenizer: Any, cfg: GenerationConfig, history: list[dict[str, str]], message: str, turn: Turn,
                reply: str, last_read: int | None) -> list[int]:
    """What the stream reads once `turn` (asking `message` after `history`) has been answered with `reply`, as
    shown: a drafted list's question and `reply` (the draft itself is gone from the stream), then the end of the
    turn the template writes after a reply (`turn_end`), less the stop token the model read last (`last_read`)."""
    end = encode(tokenizer, turn_end(tokenizer, cfg, history, message, reply))
    if turn.listed is not None:
        return turn.prompt_ids[: turn.listed] + encode(tokenizer, reply) + end
    return end[1:] if end and end[0] == last_read else end


def turn_end(tokenizer: Any, cfg: GenerationConfig, history: list[dict[str, str]], message: str, reply: str) -> str:
    """The text the chat template writes after the assistant's `reply` to `message` ("<|im_end|>\\n" in ChatML), so
    that a reply cut short (by the token limit, a repeat, the caller) ends its turn as a finished one does; "" in
    the qa format, where the next turn's blank line ends a reply."""
    if cfg.chat_format == "qa":
        return ""
    asked = [*history, {"role": "user", "content": message}]
    before = tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=False)
    after = tokenizer.apply_chat_template([*asked, {"role": "assistant", "content": reply}], tokenize=False)
    written, text = (after[len(before):] if after.startswith(before) else ""), reply.strip()
    found = written.rfind(text) if text else 0
    return written[found + len(text):] if found >= 0 else ""


_QUOTED = re.compile(r'\s?(?:"[^"]*"|\u201c[^\u201d]*\u201d|`[^`]*`)')  # pairs from the left, as a reader pairs them


def quoted(before: str, question: str, after: str) -> tuple[str, str, str]:
    """(before, question, after), the question cut to what it quotes (first quote to last, with the space before it)
    and the rest moved to its sides; unchanged where it quotes nothing. Why: an identifier's words around it ("the
    value associated with the key") match any text that shares them (kv through chat, 4k: the value recalled for 1
    of 10 questions, 6 of 10 matched by the quote alone)."""
    found = [m for m in _QUOTED.finditer(question) if re.search(r"\w", m[0])]
    if not found or (found[0].start(), found[-1].end()) == (0, len(question)):
        return before, question, after
    start, end = found[0].start(), found[-1].end()
    return before + question[:start], question[start:end], question[end:] + after


ANSWER_FORMS = 2  # the answer start's rules, numbered: 2 drafts the list that answers "What are all X?"
LIST_OPENER = ":\n\n*"  # after "X are": the reply's stop text (a blank line) does not end it after a colon
_WHAT = re.compile(r"(?i)^\s*what(?:\s+(is|are)\s+|'s\s+)(all\s+(?:of\s+)?)?(.+?)\s*\?\s*$", re.DOTALL)
# A last word that makes "X is" wrong English ("What is it called?", "What is the weather like?")
_NOT_A_SUBJECT_END = {"about", "at", "called", "do", "doing", "does", "for", "from", "going", "happening", "in",
                      "known", "like", "made", "mean", "means", "named", "of", "on", "to", "used", "with"}
_PERSON = {"i": "you", "me": "you", "my": "your", "mine": "yours", "myself": "yourself", "we": "you",
           "us": "you", "our": "your", "ours": "yours", "you": "I", "your": "my", "yours": "mine"}


def echo(message: str) -> str | None:
    """The start of an answer to a one-sentence "What is/are X?" question: "X is/are", in the answerer's
    person ("What is my sister's name?" -> "Your sister's name is"); None for any other message."""
    match = _WHAT.match(message)
    if match is None or "\n" in match[3] or re.search(r"[.?!]\s", match[3]):
        return None
    words = match[3].split()
    if words[-1].lower().strip("\"'") in _NOT_A_SUBJECT_END or words[0].lower() in ("it", "that", "this", "there"):
        return None
    if len(words) == 1 and words[0].lower() in _PERSON:  # "What are you?": "I are" would not agree
        return None
    words = [_PERSON.get(w.lower(), w) for w in words]
    subject = " ".join(words)
    verb = (match[1] or "is").lower()
    return subject[0].upper() + subject[1:] + " " + verb


def asks_for_all(message: str) -> bool:
    """Whether `message` asks "What are all (of) X?": an enumeration."""
    match = _WHAT.match(message)
    return match is not None and match[2] is not None


_BULLET = re.compile(r"\s*(?:[*\-\u2022]|\d+[.)])(?:\s+|$)")  # "* ", "- ", "\u2022 ", "1. ", "2) "


def joined(reply_start: str, pieces: Iterable[str]) -> Iterator[str]:
    """A list answer, `pieces` written after `reply_start` (which ends in `LIST_OPENER`), as one sentence:
    "X are:", then its distinct items as their lines are finished (" a", ", b"), then "."."""
    yield reply_start.removesuffix(LIST_OPENER) + ":"
    n = 0
    for n, item in enumerate(list_items(pieces), 1):
        yield (", " if n > 1 else " ") + item
    if n:
        yield "."


def shown(turn: Turn, pieces: Iterable[str]) -> Iterator[str]:
    """The reply to `turn` as the user reads it, from the `pieces` the model wrote after its answer start: a drafted
    list's items as one sentence (`joined`), else the answer start, then the pieces."""
    if turn.listed is not None:
        yield from joined(turn.reply_start, pieces)
        return
    if turn.reply_start:
        yield turn.reply_start
    yield from pieces


def kept(pieces: Iterable[str], reply: Generator[str, None, None], shown: list[str]) -> Iterator[str]:
    """Yield `pieces` (what is shown of `reply`), each also appended to `shown`; close `reply` (its tokens read
    the stream) when they end or the caller stops reading."""
    try:
        for piece in pieces:
            shown.append(piece)
            yield piece
    finally:
        reply.close()


def list_items(pieces: Iterable[str]) -> Iterator[str]:
    """The distinct items of a bulleted list whose first bullet came before `pieces`, each as soon as its line is
    finished; the list ends at its first line that is neither an item nor blank. An item made only of earlier ones
    ("Miso and Pepper" after "Miso" and "Pepper") is not new either."""
    seen: set[str] = set()
    for n, line in enumerate(_lines(pieces)):
        bullet = _BULLET.match(line)
        if n > 0 and bullet is None:
            if line.strip():
                return
            continue
        item = (line if n == 0 else line[bullet.end():]).strip().rstrip(".,;").strip()  # type: ignore[union-attr]
        if item and not all(part in seen for part in _JOINS.split(item) if part):
            seen.add(item)
            yield item


_JOINS = re.compile(r"(?i)\s*(?:[,;&]|\band\b)\s*")


def _lines(pieces: Iterable[str]) -> Iterator[str]:
    """The lines of the text that `pieces` make, each as soon as it is finished, then the unfinished rest."""
    rest = ""
    for piece in pieces:
        *done, rest = (rest + piece).split("\n")
        yield from done
    yield rest


def _template_turn(tokenizer: Any, history: list[dict[str, str]], turn: dict[str, str]) -> tuple[str, str]:
    """The new text the chat template adds for `turn`, split into (preamble, question)."""
    rendered_before = tokenizer.apply_chat_template(history, tokenize=False) if history else ""
    rendered = tokenizer.apply_chat_template(history + [turn], add_generation_prompt=True, tokenize=False)
    delta = rendered[len(rendered_before) :] if rendered.startswith(rendered_before) else rendered
    at = delta.rfind(turn["content"])
    return (delta[:at], delta[at:]) if at > 0 else ("", delta)


def stream_text(tokenizer: Any, tokens: Iterator[int], stop_text: str | None = None) -> Iterator[str]:
    """Decoded pieces of `tokens`; with `stop_text`, the text ends where that text first follows some
    non-blank output that does not end in a colon (the stop text itself is not yielded)."""
    generated: list[int] = []
    emitted = ""
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


_SENTENCE = re.compile(r"[^.!?\n]*[.!?\n]+|[^.!?\n]+$")  # a sentence or a line, with its end marks


def cut_repeats(reply: str, times: int = 3) -> str:
    """The reply up to where a sentence or line comes back for the `times`-th time, without the blank after it (a
    degenerate reply: "The pass key is the pass key." eight times over), or all of it."""
    cut = "".join(until_repeat([reply], times))
    return reply if cut == reply else cut.rstrip()


def until_repeat(pieces: Iterable[str], times: int, before: str = "") -> Iterator[str]:
    """The `pieces` of a reply that begins with `before` (given already, not yielded again), ended before the
    sentence or line that comes back for the `times`-th time: however the reply is split into pieces, the same
    text up to trailing blanks. A finished sentence cannot change, so it is counted as soon as its end mark
    arrives; the unfinished rest is held back only while it could still become the repeat."""
    text, emitted, counted = before, len(before), 0  # counted: where the sentences not yet counted begin
    seen: dict[str, int] = {}

    def repeat(piece: re.Match[str]) -> bool:
        sentence = piece.group().strip()
        if sentence:
            seen[sentence] = seen.get(sentence, 0) + 1
        return bool(sentence) and seen[sentence] == times

    def before_piece(piece: re.Match[str]) -> int:  # where the reply ends if it ends before `piece`
        return max(emitted, len(text[: piece.start()].rstrip()))

    for new in pieces:
        text += new
        for piece in _SENTENCE.finditer(text, counted):
            if piece.group()[-1] not in ".!?\n":  # unfinished: it may still grow
                break
            if repeat(piece):
                yield text[emitted : before_piece(piece)]
                return
            counted = piece.end()
        rest = text[counted:].strip()
        could_repeat = any(n == times - 1 and sentence.startswith(rest) for sentence, n in seen.items())
        shown = counted if could_repeat else len(text)
        if shown > emitted:
            yield text[emitted:shown]
            emitted = shown
    last = _SENTENCE.match(text, counted)
    if last is not None and repeat(last):
        text = text[: before_piece(last)]
    if len(text) > emitted:
        yield text[emitted:]


def reply_text(tokenizer: Any, tokens: Generator[int, None, bool], stop_text: str | None, repeat_stop: int | None,
               reply_start: str = "", whole_lines: bool = False) -> Generator[str, None, None]:
    """The decoded pieces of a reply begun with `reply_start`: `stream_text`, then `until_repeat` unless
    `repeat_stop` is None; `tokens` (`sample`'s) closed when they end or the caller stops reading. `whole_lines`:
    a last line the token limit cut off is not yielded (a list's last item, half written)."""
    ended: list[bool] = []  # what `tokens` returned, once they ran out: True where the model ended the reply

    def read() -> Generator[int, None, None]:
        ended.append((yield from tokens))

    try:
        pieces = stream_text(tokenizer, read(), stop_text)
        pieces = pieces if repeat_stop is None else until_repeat(pieces, repeat_stop, reply_start)
        if not whole_lines:
            yield from pieces
            return
        held = ""
        for piece in pieces:
            held += piece
            if (cut := held.rfind("\n") + 1) > 0:
                yield held[:cut]
                held = held[cut:]
        if held and ended != [False]:  # []: the reply ended at its stop text or a repeat, not at the limit
            yield held
    finally:
        tokens.close()


def check_limits(budget_tokens: int | None, max_new_tokens: int | None) -> None:
    """A reply's limits as a caller gives them (None: the config's); an answer of no tokens is a mistake."""
    for name, value, least in (("budget_tokens", budget_tokens, 0), ("max_new_tokens", max_new_tokens, 1)):
        if value is not None and value < least:
            raise InputError(f"{name} must be {least} or more, got {value}")


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
