"""Answering from memory: a question's match, its informativeness, the inference parameters theta, and
the `RecallPlan` the answer is read and written with.

    assess   probe the prompt after the stream (the stream does not change): the question's keys and
             the events each layer's queries recall; match the question (`retrieval.question.assess`) and
             measure its informativeness (`retrieval.allocation.informativeness`; i_doc costs two more
             probes of the prompt, with the best event and with none)
    theta    a caller's, the fixed default (`RecallConfig`: answer_hits events, answer_budget_tokens, one
             round, no demonstrations, the whole window), or the allocation model's choice within the limit
             (`choose`)
    plan     the k best hits with their neighbours in time, k * s memory tokens, the local window from w
             tokens before the prompt; with n > 1 rounds a short draft answer (made by probes, never read
             into the stream) is matched together with the question, and each round's new hits join the
             plan with k * s more tokens. A chosen theta where the window matches the question better
             than memory reads no memory, and of the window its best piece widened to k * s * n tokens

Demonstrations (theta.m) are worked question/answer pairs read just before the prompt; like everything
read, they join the stream.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engramkv import chat
from engramkv.config import EngineConfig
from engramkv.engine.state import EpisodicState
from engramkv.errors import InputError
from engramkv.memory.events import EventMemory
from engramkv.reading import Reader
from engramkv.retrieval import allocation, question
from engramkv.retrieval.allocation import AllocationModel, Theta
from engramkv.retrieval.question import QuestionMatch, RecallPlan

# Worked examples of reading a fact and answering with it in its own words; none shares a topic, or a
# telling word, with the evaluation's tasks (a demonstration about a "key" was measured to turn pass key
# answers into "The pass key is the pass key.").
DEMONSTRATIONS = (
    ("The night ferry to the island leaves from pier 14 at 22:40.",
     "From which pier does the night ferry leave?", "Pier 14."),
    ("The bakery on Elm Street closes at six on Saturdays.",
     "When does the Elm Street bakery close on Saturdays?", "At six."),
    ("The museum's new wing was designed by the architect Lena Varga.",
     "Who designed the museum's new wing?", "Lena Varga."),
)


def demonstration_text(m: int) -> str:
    """The first `m` demonstrations, in the "qa" chat format's words."""
    return "".join(f"\n\n{fact}\nQuestion: {asked}\nAnswer: {answer}" for fact, asked, answer in DEMONSTRATIONS[:m])


def demonstration_ids(tokenizer: Any) -> list[list[int]]:
    """The token ids of the first m demonstrations, for m = 0 .. len(DEMONSTRATIONS)."""
    return [list(tokenizer.encode(demonstration_text(m), add_special_tokens=False))
            for m in range(len(DEMONSTRATIONS) + 1)]


def nominal_cost(cfg: EngineConfig, demonstration_tokens: Sequence[int], theta: Theta, fixed_tokens: int,
                 local_tokens: int, piece: bool = False) -> int:
    """Effective context tokens of an answer under `theta` (`allocation.cost`), what a choice is made on:
    `fixed_tokens` are the sinks and the turn, `local_tokens` the local text before the turn,
    `demonstration_tokens[m]` the tokens of m demonstrations. `piece`: the answer reads no memory and, of
    the window, its best piece widened to k * s * n tokens (`Answerer.window_piece_plan`)."""
    demo = demonstration_tokens[theta.m] / max(theta.m, 1)
    if piece:
        window = min(theta.k * theta.s * theta.n, cfg.recall.budget_tokens, local_tokens)
        return fixed_tokens + window + theta.m * round(demo)
    if theta.w >= min(cfg.window.n_local, local_tokens):  # the whole window, however long it is now
        theta = dataclasses.replace(theta, w=local_tokens)
    return allocation.cost(theta, fixed_tokens, round(demo), window_cap=local_tokens,
                           memory_cap=cfg.recall.budget_tokens)


@dataclass(frozen=True)
class Assessment:
    """What is known of a question before it is answered."""

    matched: QuestionMatch
    features: torch.Tensor  # (F,) informativeness (`allocation.FEATURES`); i_doc 0 where not measured
    window_piece: tuple[int, int] | None = None  # stream indices [a, b) of the window's best piece (local text)
    window_centre: int | None = None  # the stream index where the question matches that piece best
    reported: dict[str, float | None] = dataclasses.field(default_factory=dict)  # by name; None: not measured


class Answerer:
    """Chooses theta and builds the plan for one session's answers (the session reads the tokens)."""

    def __init__(self, state: EpisodicState, memory: EventMemory, cfg: EngineConfig, tokenizer: Any,
                 model: AllocationModel | None):
        self.state, self.memory, self.cfg, self.tokenizer, self.model = state, memory, cfg, tokenizer, model
        alloc = cfg.allocation
        grid = [Theta(k, s, n, m, w) for k in alloc.k for s in alloc.s for n in alloc.n for m in alloc.m
                for w in alloc.w if m <= len(DEMONSTRATIONS)]
        self.grid = model.candidates(grid) if model is not None else grid  # the thetas a choice is made among
        self.demonstration_ids = demonstration_ids(tokenizer)
        self.demonstration_tokens = [len(ids) for ids in self.demonstration_ids]  # what `cost_of` prices

    @staticmethod
    def default_for(cfg: EngineConfig) -> Theta:
        """The fixed default: what every answer took before the allocation model."""
        recall = cfg.recall
        budget = question.answer_budget(recall)
        return Theta(recall.answer_hits, math.ceil(budget / recall.answer_hits), 1, 0, cfg.window.n_local)

    def default_theta(self) -> Theta:
        return self.default_for(self.cfg)

    def check(self, theta: Theta) -> None:
        if min(theta.k, theta.s, theta.n) < 1 or min(theta.m, theta.w) < 0:
            raise InputError(f"theta needs k, s, n >= 1 and m, w >= 0, got {theta}")
        if theta.m > len(DEMONSTRATIONS):
            raise InputError(f"theta.m: {len(DEMONSTRATIONS)} demonstrations ship, {theta.m} asked for")

    # ------------------------------------------------------------------ before the answer
    def assess(self, prompt_ids: list[int], span: tuple[int, int], with_i_doc: bool) -> Assessment:
        """Probe the prompt, match its question, measure the features (the stream does not change); i_doc
        (two more probes) only `with_i_doc` and `allocation.i_doc`, else 0 (reported as None)."""
        layers, recall = self.state.summary_layers, self.cfg.recall
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        probe = self.state.probe(ids)
        keys = torch.stack([probe.keys[layer][:, span[0] : span[1]] for layer in layers])  # (S, Hkv, C, D)
        k = max(recall.answer_hits, *self.cfg.allocation.k)
        matched = question.assess(self.memory, keys, layers, probe.recalled, self.state.resident_keys(layers),
                                  recall, k)
        margin = matched.window - matched.hits[0][1] if matched.hits else 0.0
        measured = with_i_doc and self.cfg.allocation.i_doc
        i_doc = self._i_doc(ids, matched) if measured else 0.0
        several = allocation.asks_for_several(self.tokenizer.decode(prompt_ids[span[0] : span[1]]))
        features = allocation.informativeness(torch.tensor(matched.scores), margin, i_doc, several)
        piece = self._stream_piece(matched.window_piece)
        centre = None if piece is None or matched.window_centre is None else self._stream_index(matched.window_centre)
        reported = {name: None if name == "i_doc" and not measured else value
                    for name, value in zip(allocation.FEATURES, features.tolist())}
        return Assessment(matched, features, piece, centre, reported)

    def _stream_piece(self, piece: tuple[int, int] | None) -> tuple[int, int] | None:
        """A piece of the resident keys (sinks, then local tokens) as stream indices of its local tokens
        (None: none, or all in the sinks, which every answer reads)."""
        if piece is None or piece[1] <= self.state.stream.sink_len:
            return None
        return self._stream_index(piece[0]), self._stream_index(piece[1])

    def _stream_index(self, resident: int) -> int:
        """The stream index of a resident key (sinks first); a sink maps to the first local token."""
        stream = self.state.stream
        return stream.local_start + max(resident - stream.sink_len, 0)

    def model_uses_i_doc(self) -> bool:
        """Whether the model's choice reads i_doc (its two probes are spent only then, or for a given theta)."""
        return self.model is not None and "i_doc" in self.model.features

    def _i_doc(self, ids: torch.Tensor, matched: QuestionMatch) -> float:
        """The change in the first answer token's log-probability with the best event against none."""
        if not matched.hits:
            return 0.0
        best = matched.hits[0][0]
        with_one = self.state.probe(ids, RecallPlan((best,), self.memory.event(best).length)).last_logits
        without = self.state.probe(ids, RecallPlan((), 0)).last_logits
        with_one, without = with_one.log_softmax(-1), without.log_softmax(-1)  # (V,) each
        token = int(with_one.argmax())
        return float(with_one[token] - without[token])

    def cost_of(self, theta: Theta, fixed_tokens: int, local_tokens: int, piece: bool = False) -> int:
        """`nominal_cost` of an answer of this session."""
        return nominal_cost(self.cfg, self.demonstration_tokens, theta, fixed_tokens, local_tokens, piece)

    def memory_budget(self, theta: Theta, limit: int | None, fixed_tokens: int, local_tokens: int,
                      piece: bool = False) -> int:
        """Memory tokens an answer under `theta` may read over all its rounds (with `piece`, of the window's
        best piece): k * s * n (the default theta: `answer_budget`), at most the reading budget, and no more
        than `limit` leaves after the rest."""
        recall = self.cfg.recall
        if theta == self.default_theta():
            budget = question.answer_budget(recall)
        else:
            budget = min(theta.k * theta.s * theta.n, recall.budget_tokens)
        if limit is not None:
            rest = self.cost_of(dataclasses.replace(theta, k=0), fixed_tokens, local_tokens, piece)
            budget = min(budget, max(0, limit - rest))
        return budget

    def default_limit(self, fixed_tokens: int, local_tokens: int) -> int | None:
        """The model's limit on its choice where the caller gives none (`allocation.default_limit`): the
        nominal cost of the calibration's best single theta for this question (it reads the window as
        calibrated: no piece). What the chosen theta then reads is bounded by `best_fixed_read`."""
        if self.model is None or self.model.best_fixed is None or self.cfg.allocation.default_limit == "none":
            return None
        return self.cost_of(Theta(*self.model.best_fixed), fixed_tokens, local_tokens)

    def choose(self, assessment: Assessment | None, limit: int | None, fixed_tokens: int,
               local_tokens: int) -> Theta:
        """The model's theta within `limit` (mode "model", or "auto" with coefficients): the cheapest predicted
        within `allocation.tolerance` of the best, among those that read the whole window where the window
        matches the question better than memory (`question.window_answers`: the calibration's documents seldom
        end in their answer, and a w = 0 answer cannot see the text not yet sealed into events). Else the
        fixed default."""
        if self.model is None or assessment is None:
            return self.default_theta()
        piece = self.reads_piece(assessment)
        candidates = allocation.whole_window(self.grid, question.window_answers(assessment.matched, self.cfg.recall),
                                             min(self.cfg.window.n_local, local_tokens))
        if limit is None:
            limit = self.default_limit(fixed_tokens, local_tokens)
        chosen = allocation.choose(self.model, candidates, assessment.features,
                                   limit if limit is not None else math.inf,
                                   lambda t: self.cost_of(t, fixed_tokens, local_tokens, piece),
                                   self.cfg.allocation.tolerance)
        return chosen or min(self.grid, key=lambda t: (self.cost_of(t, fixed_tokens, local_tokens), t))

    def reads_piece(self, assessment: Assessment) -> bool:
        """Whether a chosen theta reads the window's best piece and no memory (`window_piece_plan`)."""
        return (self.model is not None and assessment.window_piece is not None
                and question.window_answers(assessment.matched, self.cfg.recall))

    def recall(self, ids: list[int], k: int) -> list[tuple[int, float]]:
        """The `k` best (event id, score) for a query's token ids (`Session.recall`)."""
        probe = self.state.probe(torch.tensor(ids, dtype=torch.long))
        keys = torch.stack([probe.keys[layer] for layer in self.state.summary_layers])  # (S, Hkv, C, D)
        if self.cfg.recall.question_match == "keys":
            return question.match(self.memory, keys, self.state.summary_layers, probe.recalled, self.cfg.recall, k)
        return question.match_by_queries(self.memory, probe.queries, k)

    # ------------------------------------------------------------------ a turn
    def read_turn(self, reader: Reader, prompt_ids: list[int], preamble_ids: Sequence[int],
                  span: tuple[int, int] | None, limit: int | None, theta: Theta | None,
                  allocated: bool = False) -> RecallPlan:
        """Read a turn's preamble (and demonstrations) and return the plan its prompt is read with: matched
        against memory when `span` (the question's tokens in `prompt_ids`) is given, under `theta` or the
        chosen one, the whole answer within `limit` effective context tokens where one is given.
        `allocated`: `theta` is the model's choice made beforehand (`allocate_turns`), read as a chosen one."""
        stream = self.state.stream  # what the answer reads anyway: sinks, the local window and the turn
        turn_start, fixed = reader.tokens, stream.sink_len + len(preamble_ids) + len(prompt_ids)
        local = turn_start - stream.local_start
        plan = question.layer_recall_plan(question.answer_budget(self.cfg.recall, limit, fixed + local))
        if preamble_ids:
            reader.flush(plan, token_ids=preamble_ids)
        # Under the default theta a zero budget reads no memory: nothing to match.
        if span is None or (plan.budget == 0 and self.model is None and theta is None):
            return dataclasses.replace(plan, context_tokens=fixed + local + plan.budget)
        reader.flush()  # the probe reads the prompt after everything queued
        assessment = self.assess(prompt_ids, span, with_i_doc=theta is not None or self.model_uses_i_doc())
        chosen, theta = theta is None or allocated, theta or self.choose(assessment, limit, fixed, local)
        if theta.m:
            reader.flush(plan, token_ids=self.demonstration_ids[theta.m])
        piece = chosen and self.reads_piece(assessment)
        if chosen and limit is None:  # the default limit, on what is read: what the best fixed theta reads
            limit = self.best_fixed_read(assessment, theta, prompt_ids, span, turn_start, fixed, local)
        budget = self.memory_budget(theta, limit, fixed, local, piece)
        if piece:
            plan = self.window_piece_plan(assessment, theta, turn_start, budget)
        else:
            plan = self.plan(assessment, theta, prompt_ids, span, turn_start, budget)
        return dataclasses.replace(plan, context_tokens=self.context_tokens(plan, theta, fixed, local, turn_start))

    def context_tokens(self, plan: RecallPlan, theta: Theta, fixed: int, local: int, turn_start: int) -> int:
        """The effective context an answer under `plan` attends to besides its reply: `fixed` (sinks and the
        turn), the part of the `local` window read, the memory read and the demonstrations."""
        window = local if plan.window_from is None else min(local, turn_start - plan.window_from)
        if plan.window_gap is not None:
            window -= max(0, min(plan.window_gap[1], turn_start) - max(plan.window_gap[0], turn_start - window))
        if plan.events is None:
            memory = plan.budget
        elif plan.event_tokens is not None:
            memory = sum(end - first for first, end in plan.event_tokens)
        else:
            memory = sum(self.memory.event(e).length for e in plan.events)
        return fixed + window + memory + len(self.demonstration_ids[theta.m])

    def best_fixed_read(self, assessment: Assessment, theta: Theta, prompt_ids: list[int], span: tuple[int, int],
                        turn_start: int, fixed: int, local: int) -> int | None:
        """The effective context the calibration's best single theta reads for this question (None: no
        default limit, or `theta` is that theta). The choice is made on the thetas' nominal costs
        (`default_limit`); a theta may read less than its nominal cost (a hit near the start of memory, a
        short event), so what the chosen theta reads is bounded by what the best one actually reads."""
        if self.default_limit(fixed, local) is None:
            return None
        best = Theta(*self.model.best_fixed)  # type: ignore[union-attr, misc]  # default_limit checked both
        if theta == best:
            return None
        plan = self.plan(assessment, best, prompt_ids, span, turn_start, self.memory_budget(best, None, fixed, local))
        return self.context_tokens(plan, best, fixed, local, turn_start)

    # ------------------------------------------------------------------ the plan
    def plan(self, assessment: Assessment, theta: Theta, prompt_ids: list[int], span: tuple[int, int],
             window_end: int, budget: int) -> RecallPlan:
        """The plan under `theta`: the first round's hits, then (n > 1) each draft round's. `window_end`: the
        stream index the window's w tokens count back from (the turn's start); `budget`: the memory tokens of
        all rounds (`memory_budget`), shared evenly."""
        recall, n_local, surprise_floor = self.cfg.recall, self.cfg.window.n_local, self.cfg.segmentation.min_surprise
        local_tokens = window_end - self.state.stream.local_start
        window_from = None if theta.w >= min(n_local, local_tokens) else window_end - theta.w
        per_round = budget // theta.n
        plan = question.plan_answer(self.memory, assessment.matched, recall, self.state.n_tokens, per_round,
                                    theta.k, window_from, surprise_floor)
        hits = list(plan.hits)
        keyed = [(event_id, assessment.matched.keys) for event_id, _ in hits]  # the keys each hit was found by
        for round_ in range(2, theta.n + 1):
            if not plan.events:
                break  # nothing matched, or the window answers: no draft to match
            keys = self._draft_keys(plan, prompt_ids, span)
            if keys is None:
                break
            again = question.assess(self.memory, keys, self.state.summary_layers, [], [k[:, :0] for k in keys],
                                    recall, theta.k)
            for hit in again.hits:
                if all(abs(hit[0] - other) > recall.match_neighbours for other, _ in hits):
                    hits.append(hit)
                    keyed.append((hit[0], keys))
            events, parts = question.read_hits(self.memory, keyed, self.state.summary_layers, per_round * round_,
                                               recall, surprise_floor)
            plan = RecallPlan(events, per_round * round_, plan.memory_at, tuple(hits), window_from,
                              event_tokens=parts)
        return dataclasses.replace(plan, theta=theta, features=assessment.reported)

    def window_piece_plan(self, assessment: Assessment, theta: Theta, window_end: int, budget: int) -> RecallPlan:
        """The plan of a chosen theta where the window matches the question better than memory: no memory,
        and of the local window only its best-matching piece, widened to the theta's memory budget (what it
        would have read of a hit), then the turn. Why not the whole window: measured on the embedded model,
        a pass key 20 tokens into a 1,024-token window of filler is answered "The pass key is the pass key."
        through the chat template, and read as a hit of 128 tokens it is answered. A piece longer than the
        budget is cut to it, centred where the question matches it (as a hit is read, `centred_parts`): the
        budget bounds what the answer reads, and the limit it was derived from holds."""
        assert assessment.window_piece is not None
        start, end = assessment.window_piece
        first = self.state.stream.local_start
        start, end = max(start, first), min(end, window_end)
        if start >= end or budget == 0:  # the piece is in the turn, which every answer reads: none of the window
            return RecallPlan((), budget, window_from=window_end, theta=theta, features=assessment.reported)
        if end - start > budget:
            centre = (start + end) // 2 if assessment.window_centre is None else assessment.window_centre
            start = min(max(start, centre - budget // 2), end - budget)
            end = start + budget
        extra = max(0, budget - (end - start))
        lo, hi = start - extra // 2, end + extra - extra // 2
        if lo < first:  # widen on the other side what one side lacks
            lo, hi = first, hi + first - lo
        if hi > window_end:
            lo, hi = max(first, lo - (hi - window_end)), window_end
        gap = (hi, window_end) if hi < window_end else None
        return RecallPlan((), budget, window_from=lo, window_gap=gap, theta=theta, features=assessment.reported)

    def _draft_keys(self, plan: RecallPlan, prompt_ids: list[int], span: tuple[int, int]) -> torch.Tensor | None:
        """A greedy draft of the answer under `plan`, made by probing (the stream does not change), and the
        keys of the question and the draft at the summary layers (S, Hkv, C, D); None without a draft."""
        stop = {self.tokenizer.eos_token_id} - {None}
        draft: list[int] = []
        while True:
            probe = self.state.probe(torch.tensor(prompt_ids + draft, dtype=torch.long), plan)
            token = int(probe.last_logits.argmax())
            if len(draft) == self.cfg.allocation.draft_tokens or token in stop or "\n" in self.tokenizer.decode([token]):
                break
            draft.append(token)
        if not draft:
            return None
        layers = self.state.summary_layers
        return torch.stack([torch.cat([probe.keys[layer][:, span[0] : span[1]],
                                       probe.keys[layer][:, len(prompt_ids) :]], dim=1) for layer in layers])


def allocate_turns(answerer: Answerer, reader: Reader, messages: Sequence[str], total: int,
                   matching: bool) -> list[tuple[Theta | None, int]]:
    """(theta, context limit) for each of `messages` asked as chat turns, the limits together at most `total`:
    each question's features are measured now, each starts at the cheapest theta, and each next step of
    budget goes to the question with the best predicted gain per token (`allocation.allocate`); without a
    fitted model, the default theta. The stream does not change (the caller has flushed the reader)."""
    cfg = answerer.cfg
    turns = [chat.chat_turn(answerer.tokenizer, cfg.generation, reader.chat_history, m) for m in messages]
    # Bounds that hold for every turn of the batch, whatever the ones before it leave in the window.
    fixed = cfg.window.n_sink + max(len(t.preamble_ids) + len(t.prompt_ids) for t in turns) + 8
    local = cfg.window.n_local + cfg.segmentation.max_event + cfg.window.chunk_size
    if not matching:
        share = total // len(turns)
        if share < fixed + local:
            raise InputError(f"total_tokens {total} leaves {share} per question; each needs {fixed + local}")
        return [(None, share)] * len(turns)

    def cost_of(theta: Theta) -> int:
        return answerer.cost_of(theta, fixed, local)

    if answerer.model is None:
        thetas: list[Theta | None] = [answerer.default_theta()] * len(turns)
    else:
        assessed = [answerer.assess(t.prompt_ids, t.question_span, with_i_doc=answerer.model_uses_i_doc())
                    for t in turns]
        # The window rule of `Answerer.choose`, per question.
        grids = [allocation.whole_window(answerer.grid, question.window_answers(a.matched, cfg.recall),
                                         cfg.window.n_local) for a in assessed]
        thetas = allocation.allocate(answerer.model, grids, [a.features for a in assessed], total, cost_of)
    if any(theta is None for theta in thetas) or sum(cost_of(t) for t in thetas if t is not None) > total:
        cheapest = min(cost_of(t) for t in (answerer.grid if answerer.model is not None else thetas) if t)
        raise InputError(f"total_tokens {total} cannot answer {len(turns)} questions: each needs at least "
                         f"{cheapest} effective context tokens")
    return [(theta, cost_of(theta)) for theta in thetas if theta is not None]
