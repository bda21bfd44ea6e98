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
   for each question token and layer, the best cosine with any of the event's keys, averaged. This
   keeps a short question word from being averaged away by a long event, and a needle from being
   crowded out of the candidates by a thousand identical filler events.

The best `answer_hits` events, with their temporal neighbours up to the answer budget, are then
what every layer attends to while the answer is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engramkv.memory.events import EventMemory
from engramkv.retrieval.recall import add_neighbours


def summary_layer_ids(num_layers: int, count: int) -> list[int]:
    """`count` evenly spaced layers (the middle of `count` equal bands); 0 or too many means all."""
    if count <= 0 or count >= num_layers:
        return list(range(num_layers))
    return [int((i + 0.5) * num_layers / count) for i in range(count)]


def key_summary(keys: torch.Tensor) -> torch.Tensor:  # keys (S, Hkv, T, D) -> (S * Hkv * D,)
    """Mean of the unit-normalised keys over the tokens, per layer and head, flattened."""
    return F.normalize(keys.float(), dim=-1).mean(dim=2).flatten()


def rerank(
    memory: EventMemory,
    candidates: Sequence[int],
    question_keys: torch.Tensor,  # (S, Hkv, C, D), the layers of `layers`
    layers: Sequence[int],
) -> list[float]:
    """Token-level score of each candidate: best key cosine per question token, averaged over tokens and layers."""
    if not candidates:
        return []
    lengths = torch.tensor([memory.event(e).length for e in candidates])
    owner = torch.repeat_interleave(torch.arange(len(candidates)), lengths)  # (M,) candidate of each token
    keys = [memory.gather(layer, list(candidates))[0] for layer in layers]  # (Hkv, M, D) per layer
    return token_match(keys, owner, len(candidates), question_keys).tolist()


def token_match(
    keys: Sequence[torch.Tensor],  # (Hkv, M, D) per summary layer: the tokens of one or more spans
    owner: torch.Tensor,  # (M,) which span each token belongs to
    n_spans: int,
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
) -> torch.Tensor:  # (n_spans,)
    """Per span: for each question token and layer the best key cosine in the span, averaged."""
    scores = torch.zeros(n_spans)
    for layer_keys, question in zip(keys, question_keys):
        span_keys = F.normalize(layer_keys.float().cpu(), dim=-1)
        question = F.normalize(question.float(), dim=-1)  # (Hkv, C, D)
        cosine = torch.einsum("hmd,hcd->mc", span_keys, question) / span_keys.shape[0]  # (M, C) mean over heads
        best = torch.full((n_spans, cosine.shape[1]), -2.0)
        best.scatter_reduce_(0, owner[:, None].expand_as(cosine), cosine, "amax")  # (n_spans, C)
        scores += best.mean(dim=1)
    return scores / len(keys)


def match_question(
    memory: EventMemory,
    question_keys: torch.Tensor,  # (S, Hkv, C, D)
    layers: Sequence[int],
    k: int,
    candidates: int,
    also: Sequence[int] = (),
) -> list[tuple[int, float]]:
    """The `k` events that best match the question, best first, with their re-ranking scores.

    `also`: more candidates for the re-ranking (the session passes the events the reading queries
    recall for the question): a summary search alone can be crowded out by many near-identical events.
    """
    if len(memory) == 0 or question_keys.shape[2] == 0:
        return []
    ids, _ = memory.search_keys(key_summary(question_keys), max(k, candidates))
    ids = list(dict.fromkeys([*ids, *also]))
    scores = rerank(memory, ids, question_keys, layers)
    ranked = sorted(zip(ids, scores), key=lambda pair: -pair[1])
    return ranked[:k]


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
