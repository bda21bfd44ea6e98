"""Question recall by key matching: which events is a question about?

Recall while reading scores events by the reading queries against representative keys
(`recall.select_events`). For a question that works badly on natural text: measured on the
embedded 135M model over a 113k-token technical document, a question's mean query ranks the
event holding its answer 200-500th of 8,000, behind headings and rules that attract attention
from any query. The question's *keys* do much better: a token's key says what the token is, so
the keys of "release manager" in the question resemble the keys of "release manager" in the
document, at every layer, in context.

So a question is matched in two steps:

1. Key summary. Every event stores, for a few evenly spaced layers, the mean of its tokens'
   unit-normalised keys, concatenated over those layers (one vector, one FAISS index). The
   question's tokens get the same summary; the inner product ranks the events.
2. Re-ranking. The best `rerank_candidates` events, and as many of those the reading queries
   recall for the question (what the per-layer recall would have used), are scored token by token:
   for each question token and layer, the best cosine with any key of the event or of its
   `match_neighbours` neighbours on each side, averaged. This keeps a short question word from
   being averaged away by a long event, a needle from being crowded out of the candidates by a
   thousand identical filler events, and a sentence cut in two by a boundary from losing to a whole one.

The best `answer_hits` events, with their temporal neighbours up to the answer budget, are then
what every layer attends to while the answer is written, unless the resident window (sinks and local
text) matches the question better by more than `window_margin`: then the answer recalls nothing. `assess`
matches a question; `plan_answer` turns a match into a `RecallPlan`, which the engine's steps take as an
argument. How many hits, tokens and how much of the window an answer takes is `answering`'s choice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engramkv.config import RecallConfig
from engramkv.memory.events import EventMemory
from engramkv.memory.summary import key_summary
from engramkv.retrieval.allocation import Theta
from engramkv.retrieval.recall import add_neighbours


@dataclass(frozen=True)
class RecallPlan:
    """How a prompt and its answer read memory: which events, where they sit, and the token budget.

    events: the events every layer attends to (chronological); `None` lets each layer recall by its own
    queries within `budget`, `()` recalls nothing. event_tokens: for each of `events`, the [first, end)
    token offsets within it that are read (`None`: whole events; `recall.answer_reading = "centred"`).
    memory_at: the stream index the recalled events sit
    before (the prompt's start, for `answer_layout = "before_question"`), or `None` for before the local
    window. window_from: the stream index of the oldest local token attended (older ones are skipped;
    `None`: the whole local window). window_gap: stream indices [a, b) of local tokens skipped as well (an
    answer that reads one piece of the window and the turn after it). hits: the matched events with their
    scores, best first (what an answer reports). theta, features and context_tokens: the inference
    parameters the answer took, the question's informativeness (`retrieval.allocation`) and the tokens it
    attends to besides its reply, for reports.
    """

    events: tuple[int, ...] | None
    budget: int
    memory_at: int | None = None
    hits: tuple[tuple[int, float], ...] = ()
    window_from: int | None = None
    window_gap: tuple[int, int] | None = None  # stream indices [a, b) of local tokens also skipped
    event_tokens: tuple[tuple[int, int], ...] | None = None  # per event of `events`: [first, end) offsets read
    theta: Theta | None = None
    features: dict[str, float | None] = field(default_factory=dict)  # by name; None: not measured (i_doc)
    context_tokens: int = 0  # effective context of the answer: sinks, attended window, turn, memory


@dataclass(frozen=True)
class QuestionMatch:
    """A question matched against memory: its hits, every candidate's score, and the resident window's."""

    hits: tuple[tuple[int, float], ...]  # (event id, score), best first, no two within match_neighbours
    scores: tuple[float, ...]  # the span score of every re-ranked candidate (what informativeness reads)
    window: float  # the best piece of the resident window, scored the same way (-inf: nothing to compare)
    window_piece: tuple[int, int] | None = None  # that piece: [start, end) in the resident keys (sinks first)
    window_centre: int | None = None  # where in the resident keys the question matches that piece best
    keys: torch.Tensor | None = field(default=None, compare=False)  # (S, Hkv, C, D) the question's, as matched
    layers: tuple[int, ...] = ()  # the summary layers of `keys`


def answer_budget(cfg: RecallConfig, limit: int | None = None, context_tokens: int = 0) -> int:
    """Memory tokens per layer while a prompt is read and answered: at most the reading budget, and, under
    a limit on the answer's effective context, what the limit leaves after the `context_tokens` the answer
    reads anyway (the resident window and the prompt)."""
    budget = cfg.budget_tokens if cfg.answer_budget_tokens is None else min(cfg.budget_tokens, cfg.answer_budget_tokens)
    if limit is not None:
        budget = min(budget, max(0, limit - context_tokens))
    return budget


def layer_recall_plan(budget: int) -> RecallPlan:
    """An answer without a question to match: each layer recalls by its own queries, within `budget`."""
    return RecallPlan(events=None, budget=budget)


def assess(
    memory: EventMemory,
    question_keys: torch.Tensor,  # (S, Hkv, C, D) the question's pre-RoPE keys at the summary layers
    layers: Sequence[int],  # the summary layers
    recalled_per_layer: Iterable[list[int]],  # what each layer's query recall chose for the probed prompt
    resident_keys: Sequence[torch.Tensor],  # (Hkv, R, D) per summary layer: sinks and local window
    cfg: RecallConfig,
    k: int,  # hits to keep
) -> QuestionMatch:
    """The question's best `k` hits, the scores of all candidates, and what the resident window offers
    (cut into pieces as long as the spans of the first `answer_hits` hits, whatever `k`)."""
    voted = _voted(recalled_per_layer, cfg)
    hits, scores = rank_question(memory, question_keys, layers, k, cfg.rerank_candidates, also=voted,
                                 neighbours=cfg.match_neighbours)
    window, piece, centre = window_score(memory, hits[: cfg.answer_hits], resident_keys, question_keys,
                                         cfg.match_neighbours)
    return QuestionMatch(tuple(hits), tuple(scores), window, piece, centre, question_keys, tuple(layers))


def window_answers(matched: QuestionMatch, cfg: RecallConfig) -> bool:
    """Whether a piece of the resident window matches the question better than its best event does, by more
    than `window_margin`: then the answer should read the window (the whole of it, or for a chosen theta
    that piece: `Answerer.window_piece_plan`), and no memory."""
    return bool(matched.hits) and matched.window > matched.hits[0][1] + cfg.window_margin


def plan_answer(
    memory: EventMemory,
    matched: QuestionMatch,
    cfg: RecallConfig,
    prompt_start: int,  # stream index of the prompt's first token
    budget: int,  # memory tokens per layer (`answer_budget`, or k * s * n of a theta)
    k: int | None = None,  # hits pinned (default cfg.answer_hits)
    window_from: int | None = None,  # the oldest local token attended (None: the whole window)
    surprise_floor: float = 0.0,  # the segmentation's floor, `min_surprise` (`recall.add_neighbours`)
) -> RecallPlan:
    """The events an answer attends to: the best `k` hits and their neighbours in time, or nothing when the
    whole resident window is attended and matches the question better (memory would only crowd it:
    measured, a passkey in the window answered with 512 recalled filler tokens was lost, with none found)."""
    hits = matched.hits[: cfg.answer_hits if k is None else k]
    if not hits:
        return RecallPlan(events=None, budget=budget, window_from=window_from)  # the per-layer recall decides
    if window_from is None and window_answers(matched, cfg):
        return RecallPlan(events=(), budget=budget)
    before_question = cfg.answer_layout == "before_question" and cfg.positions == "contiguous"
    memory_at = prompt_start if before_question else None
    events, parts = read_hits(memory, [(e, matched.keys) for e, _ in hits], matched.layers, budget, cfg, surprise_floor)
    return RecallPlan(events, budget, memory_at, tuple(hits), window_from, event_tokens=parts)


def read_hits(
    memory: EventMemory,
    hits: Sequence[tuple[int, torch.Tensor | None]],  # (event id, the keys it was matched with), best first
    layers: Sequence[int],
    budget: int,
    cfg: RecallConfig,
    surprise_floor: float = 0.0,  # the segmentation's floor, `min_surprise` (`recall.add_neighbours`)
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...] | None]:
    """What an answer reads of its hits within `budget` (`recall.answer_reading`): the events, chronological,
    and their parts read (None: whole events)."""
    if cfg.answer_reading == "centred" and all(keys is not None for _, keys in hits):
        return centred_parts(memory, hits, layers, budget, cfg)  # type: ignore[arg-type]  # keys checked above
    return tuple(answer_events(memory, [e for e, _ in hits], budget, cfg.max_neighbour_distance, surprise_floor)), None


def match(
    memory: EventMemory,
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
    layers: Sequence[int],
    recalled_per_layer: Iterable[list[int]],
    cfg: RecallConfig,
    k: int,
) -> list[tuple[int, float]]:
    """The best `k` (event id, score) for a question; the events the layers' query recall chose are
    re-ranked too, most voted first (a summary search alone can be crowded out)."""
    return match_question(memory, question_keys, layers, k, cfg.rerank_candidates,
                          also=_voted(recalled_per_layer, cfg), neighbours=cfg.match_neighbours)


def window_score(
    memory: EventMemory,
    matches: Sequence[tuple[int, float]],
    resident_keys: Sequence[torch.Tensor],  # (Hkv, R, D) per summary layer
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
    neighbours: int,
) -> tuple[float, tuple[int, int] | None, int | None]:
    """The best score of a piece of the resident window, cut into pieces as long as the matched spans, where
    that piece lies ([start, end) in the resident keys) and where in it the question matches (the median
    position of the tokens that best match each question token at each layer, as `centred_parts` finds it
    in a hit): what the window offers, measured the way the events were (-inf, None, None when there is
    nothing to compare)."""
    if not matches or question_keys.shape[2] == 0 or resident_keys[0].shape[1] == 0:
        return float("-inf"), None, None
    span_tokens = sum(memory.event(m).length for e, _ in matches for m in match_span(memory, e, neighbours))
    span_tokens = max(1, round(span_tokens / len(matches)))
    n_resident = resident_keys[0].shape[1]
    owner = torch.arange(n_resident) // span_tokens  # (R,)
    scores = token_match(resident_keys, owner, int(owner[-1]) + 1, question_keys)  # (pieces,)
    best = int(scores.argmax())
    start, end = best * span_tokens, min(n_resident, (best + 1) * span_tokens)
    positions = best_positions([keys[:, start:end] for keys in resident_keys], question_keys)  # (S * C,)
    return float(scores[best]), (start, end), start + int(positions.float().median())


def _voted(recalled_per_layer: Iterable[list[int]], cfg: RecallConfig) -> list[int]:
    """The events the layers' query recall chose, most voted first: re-ranked beside the summary search's."""
    return [event_id for event_id, _ in votes(recalled_per_layer)[: cfg.rerank_candidates]]


def votes(chosen_per_layer: Iterable[list[int]]) -> list[tuple[int, int]]:
    """(event id, number of layers that chose it), most chosen first, then by id."""
    counts = Counter(event_id for chosen in chosen_per_layer for event_id in chosen)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def match_span(memory: EventMemory, event_id: int, neighbours: int) -> range:
    """The events scored together with `event_id`: itself and `neighbours` on each side."""
    return range(max(0, event_id - neighbours), min(len(memory), event_id + neighbours + 1))


def span_scores(
    memory: EventMemory, candidates: Sequence[int], question_keys: torch.Tensor, layers: Sequence[int], neighbours: int
) -> tuple[list[float], dict[int, float]]:
    """(score of each candidate's span, score of every event in those spans alone): for each question token
    and layer the best key cosine anywhere in the span (`match_span`), averaged over tokens and layers.

    Why the neighbours: a surprise boundary falls where a sentence turns informative, so "One of the
    magic numbers for" and "nimbus-brisk is: 8995970." land in two events; scored alone, neither
    matches the question as well as a whole sentence about another key (measured: RULER multi-key).
    """
    if not candidates:
        return [], {}
    spans = [match_span(memory, e, neighbours) for e in candidates]
    members = sorted({m for span in spans for m in span})
    row = {event_id: i for i, event_id in enumerate(members)}
    lengths = torch.tensor([memory.event(e).length for e in members])
    owner = torch.repeat_interleave(torch.arange(len(members)), lengths)  # (M,) member of each token
    keys = [memory.gather(layer, members)[0] for layer in layers]  # (Hkv, M, D) per layer
    best = best_cosines(keys, owner, len(members), question_keys)  # (S, members, C)
    span_best = torch.stack([best[:, [row[m] for m in span]].amax(dim=1) for span in spans], dim=1)  # (S, N, C)
    own = best.mean(dim=(0, 2)).tolist()  # (members,)
    return span_best.mean(dim=(0, 2)).tolist(), {m: own[i] for m, i in row.items()}


def best_cosines(
    keys: Sequence[torch.Tensor],  # (Hkv, M, D) per summary layer: the tokens of one or more spans
    owner: torch.Tensor,  # (M,) which span each token belongs to
    n_spans: int,
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
) -> torch.Tensor:  # (S, n_spans, C)
    """Per layer, span and question token: the best key cosine (mean over heads) among the span's tokens."""
    out = []
    for layer_keys, question in zip(keys, question_keys):
        span_keys = F.normalize(layer_keys.float().cpu(), dim=-1)
        question = F.normalize(question.float(), dim=-1)  # (Hkv, C, D)
        cosine = torch.einsum("hmd,hcd->mc", span_keys, question) / span_keys.shape[0]  # (M, C) mean over heads
        best = torch.full((n_spans, cosine.shape[1]), -2.0)
        best.scatter_reduce_(0, owner[:, None].expand_as(cosine), cosine, "amax")  # (n_spans, C)
        out.append(best)
    return torch.stack(out)


def best_positions(
    keys: Sequence[torch.Tensor],  # (Hkv, M, D) per summary layer: the tokens of one span
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
) -> torch.Tensor:  # (S * C,)
    """For each summary layer and question token, the span token whose key has the best cosine with it
    (mean over heads)."""
    out = []
    for layer_keys, question in zip(keys, question_keys):
        span_keys = F.normalize(layer_keys.float().cpu(), dim=-1)
        question = F.normalize(question.float(), dim=-1)  # (Hkv, C, D)
        out.append(torch.einsum("hmd,hcd->mc", span_keys, question).argmax(dim=0))  # (C,)
    return torch.cat(out)


def token_match(
    keys: Sequence[torch.Tensor],  # (Hkv, M, D) per summary layer: the tokens of one or more spans
    owner: torch.Tensor,  # (M,) which span each token belongs to
    n_spans: int,
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
) -> torch.Tensor:  # (n_spans,)
    """Per span: for each question token and layer the best key cosine in the span, averaged."""
    return best_cosines(keys, owner, n_spans, question_keys).mean(dim=(0, 2))


def match_question(
    memory: EventMemory,
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
    layers: Sequence[int],
    k: int,
    candidates: int,
    also: Sequence[int] = (),
    neighbours: int = 0,
) -> list[tuple[int, float]]:
    """The `k` events that best match the question, best first, with their re-ranking scores; no two
    within `neighbours` of each other (their spans would be one stretch of text).

    `also`: more candidates for the re-ranking (the session passes the events the reading queries
    recall for the question): a summary search alone can be crowded out by many near-identical events.
    """
    return rank_question(memory, question_keys, layers, k, candidates, also, neighbours)[0]


def rank_question(
    memory: EventMemory,
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
    layers: Sequence[int],
    k: int,
    candidates: int,
    also: Sequence[int] = (),
    neighbours: int = 0,
) -> tuple[list[tuple[int, float]], list[float]]:
    """`match_question`'s hits, and the span scores of all the candidates it re-ranked."""
    if len(memory) == 0 or question_keys.shape[2] == 0:
        return [], []
    ids, _ = memory.search_keys(key_summary(question_keys), max(k, candidates))
    ids = list(dict.fromkeys([*ids, *also]))
    scores, own_scores = span_scores(memory, ids, question_keys, layers, neighbours)
    hits: list[tuple[int, float]] = []
    for candidate, score in sorted(zip(ids, scores), key=lambda pair: -pair[1]):
        # The span's hit is the member that matches best by itself (a neighbour's span holds the match too).
        hit = max(match_span(memory, candidate, neighbours), key=lambda m: own_scores[m])
        if all(abs(hit - other) > neighbours for other, _ in hits):  # one hit per stretch of text
            hits.append((hit, score))
        if len(hits) == k:
            break
    return hits, scores


def answer_events(memory: EventMemory, hits: Sequence[int], budget: int, max_distance: int,
                  surprise_floor: float = 0.0) -> list[int]:
    """The hits (best first, while they fit) and their temporal neighbours, up to `budget` tokens; chronological."""
    chosen: set[int] = set()
    used = 0
    for event_id in hits:
        length = memory.event(event_id).length
        if used + length <= budget:
            chosen.add(event_id)
            used += length
    add_neighbours(memory, chosen, [h for h in hits if h in chosen], used, budget, max_distance, surprise_floor)
    return sorted(chosen)


def centred_parts(
    memory: EventMemory,
    hits: Sequence[tuple[int, torch.Tensor]],  # (event id, (S, Hkv, C, D) the keys it was matched with), best first
    layers: Sequence[int],  # the summary layers those keys are of
    budget: int,
    cfg: RecallConfig,
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """What an answer reads with `answer_reading = "centred"`: for each hit, budget / hits consecutive tokens
    of its neighbourhood (up to `max_neighbour_distance` events each side), centred where the question
    matches it (the median position of the tokens that best match each question token at each summary
    layer, within the hit's match span). Returns the events touched (chronological) and, for each, the
    [first, end) token offsets read (parts of one event merged into the range that covers them).

    Why: whole events spend a budget on whatever the event holds. Measured on the embedded model, a pass key
    split as " pass key is 8489" | "4. Remember it. 84894" | " is the pass key. The grass is green..." (128
    tokens of filler) is matched at the third event, which alone fills a 128-token budget: the key is not
    read. The question's words sit next to the answer, whichever event boundaries fall between them.
    """
    per_hit = budget // len(hits) if hits else 0
    read: dict[int, tuple[int, int]] = {}
    for hit, question_keys in hits if per_hit > 0 else []:
        reach = max(cfg.max_neighbour_distance, cfg.match_neighbours)  # the region holds the match span
        region = list(range(max(0, hit - reach), min(len(memory), hit + reach + 1)))
        lengths = [memory.event(e).length for e in region]
        starts = [sum(lengths[:i]) for i in range(len(region))]  # of each event in the region's tokens
        span = list(match_span(memory, hit, cfg.match_neighbours))
        keys = [memory.gather(layer, span)[0] for layer in layers]  # (Hkv, M, D) per summary layer
        positions = best_positions(keys, question_keys)  # (S * C,) in the span's tokens
        centre = starts[region.index(span[0])] + int(positions.float().median())
        total = sum(lengths)
        first = min(max(0, centre - per_hit // 2), max(0, total - per_hit))
        last = min(total, first + per_hit)
        for event_id, start, length in zip(region, starts, lengths):
            a, b = max(first, start) - start, min(last, start + length) - start
            if a < b:
                old = read.get(event_id)
                read[event_id] = (a, b) if old is None else (min(a, old[0]), max(b, old[1]))
    events = tuple(sorted(read))
    return events, tuple(read[e] for e in events)


def match_by_queries(memory: EventMemory, queries: Sequence[torch.Tensor], k: int) -> list[tuple[int, float]]:
    """The best `k` (event id, score) by the reading queries (`question_match = "attention"`): per layer, the
    inner products of the layer's recall query (Hkv * D,) with every representative, z-scored; averaged."""
    n_events = len(memory)
    total = torch.zeros(n_events)  # (N,)
    for layer, layer_query in enumerate(queries):
        event_ids, scores = memory.search(layer, layer_query, k=n_events)
        s = torch.tensor(scores)  # (N,)
        z = (s - s.mean()) / s.std().clamp(min=1e-6) if s.numel() > 1 else s * 0
        total[torch.tensor(event_ids)] += z
    total /= len(queries)
    best = torch.topk(total, min(k, n_events))
    return list(zip(best.indices.tolist(), best.values.tolist()))
