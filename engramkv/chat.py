"""Chat formats, the stop-text streamer and sampling: how a turn becomes token ids and a reply becomes text.

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
"list" also begins the answer to a plural "What are X?" as a bulleted list ("X are:", a blank line, "*"),
where a several-item answer written on one line tends to name one item; not the default, since the
embedded model then repeats list items and copies the list form into later answers.

A reply ends before a sentence or line that comes back for the `GenerationConfig.repeat_stop`-th time
(`until_repeat`), the cut the evaluation's scorer makes (`cut_repeats`), so a reply reads as it is scored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engramkv.config import GenerationConfig
from engramkv.errors import InputError, SessionError


@dataclass(frozen=True)
class Turn:
    """One user turn, encoded: a preamble read first, then the prompt with the question's span in it."""

    preamble_ids: list[int]
    prompt_ids: list[int]
    question_span: tuple[int, int]  # [start, end) of the question's tokens in prompt_ids
    stop_text: str | None  # the reply ends where this text follows some output
    reply_start: str = ""  # the answer's first words, read after the prompt and the first piece of the reply


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


def chat_turn(tokenizer: Any, cfg: GenerationConfig, history: list[dict[str, str]], message: str) -> Turn:
    """The token ids of a user turn after `history`, in `cfg.chat_format`."""
    start = echo(message) if cfg.answer_start in ("echo", "list") else None
    if start is not None and cfg.answer_start == "list" and start.endswith(" are"):
        start += LIST_OPENER
    if cfg.chat_format == "qa":
        reply_start = "" if start is None else " " + start
        ids, span = encode_around(tokenizer, "\n\nQuestion:", " " + message.strip(), "\nAnswer:")
        return Turn([], ids + encode(tokenizer, reply_start), span, "\n\n", reply_start)
    turn = {"role": "user", "content": message}
    preamble, question = _template_turn(tokenizer, history, turn)
    split = len(message) if question.startswith(message) else 0  # 0: no known message span to match
    ids, span = encode_around(tokenizer, "", question[:split], question[split:])
    reply_start = start or ""
    return Turn(encode(tokenizer, preamble), ids + encode(tokenizer, reply_start), span, None, reply_start)


LIST_OPENER = ":\n\n*"  # after "X are": the reply's stop text (a blank line) does not end it after a colon
_WHAT = re.compile(r"(?i)^\s*what(?:\s+(is|are)\s+|'s\s+)(?:all\s+(?:of\s+)?)?(.+?)\s*\?\s*$", re.DOTALL)
# A last word that makes "X is" wrong English ("What is it called?", "What is the weather like?")
_NOT_A_SUBJECT_END = {"about", "at", "called", "do", "doing", "does", "for", "from", "going", "happening", "in",
                      "known", "like", "made", "mean", "means", "named", "of", "on", "to", "used", "with"}
_PERSON = {"i": "you", "me": "you", "my": "your", "mine": "yours", "myself": "yourself", "we": "you",
           "us": "you", "our": "your", "ours": "yours", "you": "I", "your": "my", "yours": "mine"}


def echo(message: str) -> str | None:
    """The start of an answer to a one-sentence "What is/are X?" question: "X is/are", in the answerer's
    person ("What is my sister's name?" -> "Your sister's name is"); None for any other message."""
    match = _WHAT.match(message)
    if match is None or "\n" in match[2] or re.search(r"[.?!]\s", match[2]):
        return None
    words = match[2].split()
    if words[-1].lower().strip("\"'") in _NOT_A_SUBJECT_END or words[0].lower() in ("it", "that", "this", "there"):
        return None
    if len(words) == 1 and words[0].lower() in _PERSON:  # "What are you?": "I are" would not agree
        return None
    words = [_PERSON.get(w.lower(), w) for w in words]
    subject = " ".join(words)
    verb = (match[1] or "is").lower()
    return subject[0].upper() + subject[1:] + " " + verb


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


def reply_text(tokenizer: Any, tokens: Iterator[int], stop_text: str | None, repeat_stop: int | None,
               reply_start: str = "") -> Iterator[str]:
    """The decoded pieces of a reply begun with `reply_start`: `stream_text`, then `until_repeat` unless
    `repeat_stop` is None."""
    pieces = stream_text(tokenizer, tokens, stop_text)
    return pieces if repeat_stop is None else until_repeat(pieces, repeat_stop, reply_start)


def sample(logits: torch.Tensor | None, decode: Callable[[int], torch.Tensor], limit: int, stop: set[int],
           cfg: GenerationConfig) -> Iterator[int]:
    """Up to `limit` new tokens: pick one from `logits` (V,), read it with `decode` (which returns the next
    logits, (1, V)), and so on; a stop token is read but not yielded, and ends the reply. Before
    `cfg.min_new_tokens` tokens no stop token is picked."""
    generator = torch.Generator().manual_seed(cfg.seed)
    masked = sorted(stop)
    for step in range(limit):
        if logits is None:
            raise SessionError("nothing to continue from: the stream holds no tokens")
        if step < cfg.min_new_tokens and masked:
            logits = logits.clone()
            logits[masked] = float("-inf")
        token = pick(logits, cfg.temperature, generator)
        logits = decode(token)[-1]
        if token in stop:
            return
        yield token


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:  # logits (V,)
    """The next token: greedy at temperature 0, else sampled from softmax(logits / temperature)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)  # (V,)
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_ids(tokenizer: Any) -> set[int]:
    eos = tokenizer.eos_token_id
    return {eos} if eos is not None else set()


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
