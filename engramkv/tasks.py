"""Long-context tasks, generated offline from a seed: what `engramkv calibrate` fits the allocation model on
and what the evaluation (`benchmarks/evaluate.py`) measures. Each makes a `Sample` of about `length` tokens.

  passkey       InfiniteBench passkey: a 5-digit key in repeated filler sentences
  kv            InfiniteBench key-value retrieval: a JSON object of UUID pairs, asked for one value
  niah-single   RULER needle in a haystack: one "special magic number" in real text
  niah-multikey RULER: four needles with different keys; asked for one
  niah-multivalue RULER: four values for one key; asked for all of them
  niah-multiquery RULER: four needles; asked for two keys at once
  conversation  facts stated in the early turns of a long chat, asked for at the end
  facts         one fact about a fictional office, stated in plain words inside real modern prose (the
                Debian Administrator's Handbook, Debian package debian-handbook), asked in other words

The haystack is natural English: Python's language reference (`pydoc_data.topics`, shipped with
CPython), sections in a seeded random order, cut to length. Each sample ends with its benchmark's
prompt (InfiniteBench's and RULER's templates: the question, then the answer begun for the model;
the conversation asks as a next user turn). Asked through chat, a sample's question is typed as a user
would (`Sample.chat_question`: the question itself, or for kv a sentence around its key). A sample is
scored by the share of its expected answers that appear in the reply, case ignored as RULER's scorer ignores
it, the reply cut first where it starts to repeat itself (`match_share`, `chat.cut_repeats`).

Seeds: the evaluation uses 0, 1, 2, ...; calibration starts at `CALIBRATION_SEEDS` so the two never share a
sample.
"""

from __future__ import annotations

import html
import json
import os
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pathlib import Path

import pydoc_data.topics

from engramkv.chat import cut_repeats


@dataclass
class Sample:
    task: str
    length: int
    seed: int
    context: list[str]  # pieces read in order (one document, or one piece per chat turn)
    prompt: str  # what follows the context, in the benchmark's own words; the reply continues it
    question: str  # the part of `prompt` that asks (what engramkv matches against memory)
    answers: list[str]  # every one should appear in the reply
    meta: dict[str, Any] = field(default_factory=dict)
    # The question as a user types it in a chat turn (`Session.chat`); `question` where that already is one.
    # kv's `question` is InfiniteBench's bare 'Key: "..."' line, which asks nothing without the prompt around it.
    chat_question: str = ""

    def __post_init__(self) -> None:
        self.chat_question = self.chat_question or self.question

    def reply_tokens(self, tokenizer: Tokenizer, at_least: int) -> int:
        """The most tokens a reply may take: room to restate the question, give every expected answer and a
        few words between (`REPLY_GLUE_TOKENS`), and never fewer than `at_least`. The model answers a chat
        question by restating it: 'The value associated with the key "<UUID>" is <UUID>' is ~80 tokens (a
        UUID is 35), so a flat 64 cut every such kv reply before its value. The other tasks' questions and
        answers take 11-64 tokens together, so they keep a limit of 64."""
        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        needed = count(self.chat_question) + sum(count(answer) for answer in self.answers) + REPLY_GLUE_TOKENS
        return max(at_least, needed)

    def score(self, reply: str) -> float:
        """Share of the expected answers in the reply (`match_share`)."""
        return match_share(self.answers, reply)


REPLY_GLUE_TOKENS = 16  # the words of a reply besides the question it restates and the answers
CALIBRATION_SEEDS = 100_000  # calibration samples use seeds from here on; the evaluation's stay below


def match_share(answers: list[str], reply: str) -> float:
    """Share of `answers` in `reply` cut at its first repeat (`chat.cut_repeats`), each matched as RULER's
    `string_match_all` matches: a substring, case ignored ("Blue" answers "blue")."""
    reply = cut_repeats(reply).lower()
    return sum(answer.lower() in reply for answer in answers) / len(answers)


Tokenizer = Any
TASKS: dict[str, Callable[[Tokenizer, int, int], Sample]] = {}


def task(name: str) -> Callable[[Callable[[Tokenizer, int, int], Sample]], Callable[[Tokenizer, int, int], Sample]]:
    def register(make: Callable[[Tokenizer, int, int], Sample]) -> Callable[[Tokenizer, int, int], Sample]:
        TASKS[name] = make
        return make
    return register


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------------------------- passkey
# The one passkey generator of the benchmarks (passkey.py is a preset of evaluate.py over it; _common's
# passkey_sample, the tests, examples/quickstart.py and passkey_file.py read their passkey text from it).
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                 "I will quiz you about the important information there.\n\n")
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_PROMPT = f"\n\n{PASSKEY_QUESTION} The pass key is"


@task("passkey")
def passkey(tokenizer: Tokenizer, length: int, seed: int, depth: float | None = None) -> Sample:
    """The key is drawn from the seed; so is its depth (0.1-0.9 of the filler) unless `depth` (0..1) is given."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    per_filler = _count(tokenizer, FILLER * 20) / 20
    n = max(1, int((length - _count(tokenizer, PASSKEY_INTRO + needle) - 16) / per_filler))
    before = int(n * (rng.uniform(0.1, 0.9) if depth is None else depth))
    context = (PASSKEY_INTRO + FILLER * before + needle + FILLER * (n - before)).rstrip()
    return Sample("passkey", length, seed, [context], PASSKEY_PROMPT, PASSKEY_QUESTION, [key],
                  {"depth": before / n})


# ---------------------------------------------------------------------------------------------- kv
@task("kv")
def kv_retrieval(tokenizer: Tokenizer, length: int, seed: int) -> Sample:
    rng = random.Random(seed)

    def make_uuid() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    per_pair = _count(tokenizer, json.dumps({make_uuid(): make_uuid() for _ in range(20)})) / 20
    pairs = {make_uuid(): make_uuid() for _ in range(max(2, int((length - 80) / per_pair)))}
    keys = list(pairs)
    asked = keys[int(len(keys) * rng.uniform(0.1, 0.9))]
    context = "Extract the value corresponding to the specified key in the JSON object below.\n\n" + json.dumps(pairs)
    question = f'Key: "{asked}"'
    return Sample("kv", length, seed, [context], f"\n\n{question}\nThe value associated with the specified key is:",
                  question, [pairs[asked]], chat_question=f'What is the value associated with the key "{asked}"?')


# ---------------------------------------------------------------------------------------------- RULER NIAH
WORDS = ("amber", "brisk", "cedar", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lantern", "meadow", "nimbus", "orchid", "pebble", "quartz", "raven", "saffron", "tundra", "umber",
         "velvet", "willow", "yonder", "zephyr")


def haystack(tokenizer: Tokenizer, n_tokens: int, rng: random.Random) -> list[str]:
    """Paragraphs of Python's language reference, in a seeded order, about `n_tokens` long in all."""
    sections = [text.strip() for text in pydoc_data.topics.topics.values()]
    rng.shuffle(sections)
    paragraphs = [p.strip() for section in sections for p in section.split("\n\n") if p.strip()]
    out: list[str] = []
    total = 0
    i = 0
    while total < n_tokens:
        paragraph = paragraphs[i % len(paragraphs)]
        total += _count(tokenizer, paragraph) + 1
        out.append(paragraph)
        i += 1
    return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _niah(tokenizer: Tokenizer, length: int, seed: int, name: str, needles: list[tuple[str, str]],
          question: str, answer_start: str, answers: list[str]) -> Sample:
    """RULER's template: needles "One of the special magic numbers for KEY is: VALUE.", the question
    ending in "mentioned in the provided text?", the answer begun for the model."""
    rng = random.Random(seed + 1)
    sentences = [f"One of the special magic numbers for {key} is: {value}." for key, value in needles]
    budget = length - sum(_count(tokenizer, s) for s in sentences) - 90  # intro + the prompt
    paragraphs = haystack(tokenizer, budget, rng)
    depths = sorted(rng.uniform(0.1, 0.9) for _ in sentences)
    for sentence, depth in zip(reversed(sentences), reversed(depths)):
        paragraphs.insert(int(depth * len(paragraphs)), sentence)
    intro = "Some special magic numbers are hidden within the following text. Make sure to memorize them.\n\n"
    question += " mentioned in the provided text?"
    prompt = f"\n\n{question} {answer_start} mentioned in the provided text are"
    if name in ("niah-single", "niah-multikey"):
        prompt = prompt.removesuffix(" are") + " is"
    return Sample(name, length, seed, [intro + "\n\n".join(paragraphs)], prompt, question, answers,
                  {"depths": depths})


@task("niah-single")
def niah_single(tokenizer: Tokenizer, length: int, seed: int) -> Sample:
    rng = random.Random(seed)
    key, value = _key(rng), _number(rng)
    return _niah(tokenizer, length, seed, "niah-single", [(key, value)],
                 f"What is the special magic number for {key}", f"The special magic number for {key}", [value])


def _distinct_keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        if (key := _key(rng)) not in keys:
            keys.append(key)
    return keys


@task("niah-multikey")
def niah_multikey(tokenizer: Tokenizer, length: int, seed: int) -> Sample:
    rng = random.Random(seed)
    needles = [(key, _number(rng)) for key in _distinct_keys(rng, 4)]
    key, value = needles[rng.randrange(4)]
    return _niah(tokenizer, length, seed, "niah-multikey", needles,
                 f"What is the special magic number for {key}", f"The special magic number for {key}", [value])


@task("niah-multivalue")
def niah_multivalue(tokenizer: Tokenizer, length: int, seed: int) -> Sample:
    rng = random.Random(seed)
    key = _key(rng)
    values = [_number(rng) for _ in range(4)]
    return _niah(tokenizer, length, seed, "niah-multivalue", [(key, v) for v in values],
                 f"What are all the special magic numbers for {key}", f"The special magic numbers for {key}", values)


@task("niah-multiquery")
def niah_multiquery(tokenizer: Tokenizer, length: int, seed: int) -> Sample:
    rng = random.Random(seed)
    needles = [(key, _number(rng)) for key in _distinct_keys(rng, 4)]
    (k1, v1), (k2, v2) = rng.sample(needles, 2)
    return _niah(tokenizer, length, seed, "niah-multiquery", needles,
                 f"What are all the special magic numbers for {k1} and {k2}",
                 f"The special magic numbers for {k1} and {k2}", [v1, v2])


# ---------------------------------------------------------------------------------------------- conversation
NAMES = ("Ilse", "Marjatta", "Tobias", "Anouk", "Rafael", "Sigrun", "Emeka", "Priya", "Lorenzo", "Hana")
CITIES = ("Ghent", "Tartu", "Porto", "Bergen", "Kraków", "Lyon", "Tampere", "Graz", "Aarhus", "Trieste")
PETS = ("parrot", "tortoise", "ferret", "goldfish", "rabbit", "gecko")


@task("conversation")
def conversation(tokenizer: Tokenizer, length: int, seed: int) -> Sample:
    """The user tells three facts in the first turns, then chats about Python for `length` tokens."""
    rng = random.Random(seed)
    sister, city, pet, pet_name = rng.choice(NAMES), rng.choice(CITIES), rng.choice(PETS), rng.choice(NAMES)
    facts = [
        (f"My sister is called {sister} and she lives in {city}.", "Nice, say hello to her from me."),
        (f"I have a {pet} named {pet_name}.", f"{pet_name} is a lovely name for a {pet}."),
    ]
    turns = [f"User: {said}\nAssistant: {reply}\n\n" for said, reply in facts]
    used = sum(_count(tokenizer, t) for t in turns) + 40
    for paragraph in haystack(tokenizer, length, random.Random(seed + 1)):
        topic = paragraph.split("\n", 1)[0][:60]
        turn = f"User: Tell me about this: {topic}\nAssistant: {paragraph}\n\n"
        used += _count(tokenizer, turn)
        if used > length:
            break
        turns.append(turn)
    asked = rng.choice([("In which city does my sister live?", city), ("What is the name of my pet?", pet_name),
                        ("What is my sister called?", sister)])
    turns[-1] = turns[-1].rstrip()
    return Sample("conversation", length, seed, turns, f"\n\nUser: {asked[0]}\nAssistant:", asked[0], [asked[1]])


# ---------------------------------------------------------------------------------------------- facts
# The facts task's prose: the paragraphs of the Debian Administrator's Handbook (`apt-get install
# debian-handbook`, or ENGRAMKV_FACTS_CORPUS naming a directory of its HTML pages).
FACTS_CORPUS = "/usr/share/doc/debian-handbook/html/en-US"
_FIRST = ("Ines", "Tomasz", "Ayodele", "Grete", "Matthias", "Leila", "Oskar", "Noor", "Benedikt", "Chiara")
_CITIES = ("Lisbon", "Ostrava", "Nantes", "Utrecht", "Bilbao", "Turku", "Ljubljana", "Cork", "Bremen", "Varna")
_COLOURS = ("green", "blue", "purple", "yellow", "grey", "red", "white", "brown")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
_MACHINES = ("heron", "walrus", "marigold", "basalt", "comet", "thistle", "otter", "juniper")
# (fact, the question in other words, answer) with {slots} filled from the seed
_FACT_TEMPLATES = (
    ("At the Falcot office in {city}, the backup server is named {machine}.",
     "What name was given to the machine that stores the {city} office's backups?", "{machine}"),
    ("The weekly review meeting of the administration team now takes place on {day} afternoons.",
     "On which afternoon does the admin team hold its review each week?", "{day}"),
    ("{first} ordered {number} replacement disks for the storage array last month.",
     "How many new drives did {first} request for the storage array?", "{number}"),
    ("The spare keys to the server room are kept in a {colour} envelope in the reception desk.",
     "What colour is the envelope that holds the spare keys of the server room?", "{colour}"),
    ("The new intern on the network team, {first}, moved here from {city}.",
     "Which city does the network team's new trainee come from?", "{city}"),
    ("The wireless network for visitors uses the password {word}-{number}.",
     "What do guests type to join the visitors' wifi?", "{word}-{number}"),
    ("{first} is the person to call when the printers on the second floor jam.",
     "Who should be phoned about a paper jam in the second-floor printers?", "{first}"),
    ("The old mail relay will be switched off for good on {day} the {number}th.",
     "On what date is the former mail gateway being decommissioned?", "{number}th"),
)


def facts_paragraphs(corpus: str | None = None) -> list[str]:
    """The prose paragraphs (over 200 characters, code left out) of the handbook's HTML pages, in file order."""
    root = Path(corpus or os.environ.get("ENGRAMKV_FACTS_CORPUS", FACTS_CORPUS))
    pages = sorted(root.glob("*.html")) if root.is_dir() else []
    if not pages:
        raise FileNotFoundError(f"the facts task reads the Debian Administrator's Handbook and found no HTML pages "
                                f"in {root}: `apt-get install debian-handbook`, or set ENGRAMKV_FACTS_CORPUS")
    out = []
    for page in pages:
        text = re.sub(r"<pre.*?</pre>", "", page.read_text(errors="replace"), flags=re.S)
        for block in re.findall(r'<div class="para"[^>]*>(.*?)</div>', text, flags=re.S):
            paragraph = " ".join(html.unescape(re.sub(r"<[^>]+>", "", block)).split())
            if len(paragraph) > 200:
                out.append(paragraph)
    return out


@task("facts")
def facts(tokenizer: Tokenizer, length: int, seed: int, corpus: str | None = None) -> Sample:
    """One fact in plain words at a seeded depth of handbook prose (a run of paragraphs from a seeded
    start), asked in other words; the benchmark prompt is the "qa" form."""
    rng = random.Random(seed)
    template, asked, answer = _FACT_TEMPLATES[rng.randrange(len(_FACT_TEMPLATES))]
    slots = {"city": rng.choice(_CITIES), "machine": rng.choice(_MACHINES), "day": rng.choice(_DAYS),
             "first": rng.choice(_FIRST), "number": str(rng.randint(12, 28)), "colour": rng.choice(_COLOURS),
             "word": rng.choice(WORDS)}
    fact, question, value = (t.format(**slots) for t in (template, asked, answer))
    paragraphs = facts_paragraphs(corpus)
    start = rng.randrange(len(paragraphs))
    chosen: list[str] = []
    total = _count(tokenizer, fact) + 40
    while total < length:
        paragraph = paragraphs[(start + len(chosen)) % len(paragraphs)]
        total += _count(tokenizer, paragraph) + 1
        chosen.append(paragraph)
    if len(chosen) > 1:  # stay under the length
        last = chosen.pop()
        total -= _count(tokenizer, last) + 1
        if total < 0.9 * length:  # a long last paragraph: keep the words of it that fit
            words = last.split()
            keep = max(1, int(len(words) * (length - total) / (_count(tokenizer, last) + 1)) - 1)
            chosen.append(" ".join(words[:keep]))
    at = int(rng.uniform(0.1, 0.9) * len(chosen))
    chosen.insert(at, fact)
    return Sample("facts", length, seed, ["\n\n".join(chosen)], f"\n\nQuestion: {question}\nAnswer:", question,
                  [value], {"fact": fact, "depth": at / len(chosen)})
