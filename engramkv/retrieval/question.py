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
what every layer attends to while the answer is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engramkv.memory.events import EventMemory
from engramkv.memory.summary import key_summary
from engramkv.retrieval.recall import add_neighbours


def match_span(memory: EventMemory, event_id: int, neighbours: int) -> range:
    """The events scored together with `event_id`: itself and `neighbours` on each side."""
    return range(max(0, event_id - neighbours), min(len(memory), event_id + neighbours + 1))


def rerank(
    memory: EventMemory,
    candidates: Sequence[int],
    question_keys: torch.Tensor,  # (S, Hkv, C, D), the layers of `layers`
    layers: Sequence[int],
    neighbours: int = 0,
) -> list[float]:
    """Token-level score of each candidate with `neighbours` events on each side (`match_span`): for each
    question token and layer the best key cosine anywhere in that span, averaged over tokens and layers.

    Why the neighbours: a surprise boundary falls where a sentence turns informative, so "One of the
    magic numbers for" and "nimbus-brisk is: 8995970." land in two events; scored alone, neither
    matches the question as well as a whole sentence about another key (measured: RULER multi-key).
    """
    return _span_and_own_scores(memory, candidates, question_keys, layers, neighbours)[0]


def _span_and_own_scores(
    memory: EventMemory, candidates: Sequence[int], question_keys: torch.Tensor, layers: Sequence[int], neighbours: int
) -> tuple[list[float], dict[int, float]]:
    """(score of each candidate's span, score of every event in those spans alone)."""
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
    if len(memory) == 0 or question_keys.shape[2] == 0:
        return []
    ids, _ = memory.search_keys(key_summary(question_keys), max(k, candidates))
    ids = list(dict.fromkeys([*ids, *also]))
    span_scores, own_scores = _span_and_own_scores(memory, ids, question_keys, layers, neighbours)
    hits: list[tuple[int, float]] = []
    for candidate, score in sorted(zip(ids, span_scores), key=lambda pair: -pair[1]):
        # The span's hit is the member that matches best by itself (a neighbour's span holds the match too).
        hit = max(match_span(memory, candidate, neighbours), key=lambda m: own_scores[m])
        if all(abs(hit - other) > neighbours for other, _ in hits):  # one hit per stretch of text
            hits.append((hit, score))
        if len(hits) == k:
            break
    return hits


def answer_events(memory: EventMemory, hits: Sequence[int], budget: int) -> list[int]:
    """The hits (best first, while they fit) and their temporal neighbours, up to `budget` tokens; chronological."""
    chosen: set[int] = set()
    used = 0
    for event_id in hits:
        length = memory.event(event_id).length
        if used + length <= budget:
            chosen.add(event_id)
            used += length
    add_neighbours(memory, chosen, [h for h in hits if h in chosen], used, budget)
    return sorted(chosen)
