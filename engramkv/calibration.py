"""Calibrating the allocation model (`engramkv calibrate`): answer calibration questions under a design of
theta, fit `retrieval.allocation`'s model, and report it on held-out samples.

1. Samples: every task at every length, `samples` seeds from `tasks.CALIBRATION_SEEDS` on (the
   evaluation's seeds stay below it, so no sample is shared).
2. Each sample's document is ingested once into its own store under the work directory (an interrupted
   run ingests it again); its question is asked as a chat turn (`Session.chat`: what `ask` and the TUI do)
   under every theta of the design, each time from the store opened read-only, so no answer sees another.
3. Each answer is one JSON line of the observations file (sample, theta, features, reply, score, context
   tokens, and the answer path: the settings besides theta that shape the answer, `answer_path`); a run
   skips the answers the file already holds, so it resumes where it stopped, and refuses a file answered
   on another path (a fit on answers of two forms predicts neither).
4. The fit is cross-validated over samples (`holdout` folds): each sample's answers are predicted by a fit
   without it, giving R^2 and MSE of the model and of the ablations (no interaction: B = 0; linear instead
   of logit), and each sample is answered by that fit's choice, against the default theta and the best
   single theta of the other samples. The coefficients written are fitted on every sample.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel

from engramkv import chat, hf
from engramkv.answering import Answerer, demonstration_ids, nominal_cost
from engramkv.config import EngineConfig
from engramkv.errors import InputError
from engramkv.lm import EpisodicLM
from engramkv.retrieval import allocation
from engramkv.retrieval.allocation import AllocationModel, Theta
from engramkv.retrieval.question import RecallPlan
from engramkv.tasks import CALIBRATION_SEEDS, TASKS, Sample


class FitReport(BaseModel):
    """One fit's quality on the held-out samples (score scale): per answer, and per cell (the mean over the
    held-out samples of one task, length and theta, as the paper scores its fit)."""

    r2: float
    mse: float
    r2_cells: float
    mse_cells: float
    ridge: float  # the ridge term its fit on every sample kept


class CalibrationReport(BaseModel):
    """What a calibration wrote and measured; `model` is what `allocation.mode = "model"` answers with."""

    model_id: str
    model: AllocationModel  # fitted on every observation
    observations: int  # answers fitted on
    held_out: int  # answers predicted out of fold (each sample's by a fit without it)
    fits: dict[str, FitReport]  # per name of `FITS`
    design: list[dict[str, int]]  # the thetas every sample was answered under
    default_theta: dict[str, int]
    best_fixed_theta: dict[str, int]  # the best mean score over the fitted samples (`_best_fixed`)
    held_out_scores: dict[str, float]  # mean held-out score per name of `CHOICES`
    held_out_context: dict[str, float]  # mean effective context tokens of the same answers
    held_out_per_sample: dict[str, list[float]]  # the same answers' scores, one per sample in one order
    config: dict[str, Any]  # the allocation and calibration settings, and the observations' answer path


def answer_path(cfg: EngineConfig) -> dict[str, Any]:
    """The settings besides theta that shape a calibration answer (the chat turn's form, what the answer reads of
    its hits): coefficients predict answers of their path, so a change of these defaults needs a new calibration."""
    g = cfg.generation
    return {"chat_format": g.chat_format, "answer_start": g.answer_start, "answer_forms": chat.ANSWER_FORMS,
            "min_new_tokens": g.min_new_tokens, "temperature": g.temperature, "question_span": g.question_span,
            "answer_reading": cfg.recall.answer_reading, "answer_layout": cfg.recall.answer_layout}


def _one_path(rows: list[dict[str, Any]], observations: Path) -> dict[str, Any] | None:
    """The answer path every row of `observations` was answered on (None: written before paths were
    recorded); rows of two paths are an InputError."""
    paths = {json.dumps(row.get("answer_path"), sort_keys=True) for row in rows}
    if len(paths) > 1:
        raise InputError(f"{observations} mixes answers of {len(paths)} answer paths ({sorted(paths)}): a fit "
                         "on answers of two forms predicts neither; answer each path in its own --work-dir")
    return json.loads(paths.pop()) if paths else None


def design(cfg: EngineConfig, default: Theta) -> list[Theta]:
    """The default theta, `design_size` others of the allocation grid (drawn with `design_seed`), `design_extra`."""
    a = cfg.allocation
    grid = sorted({Theta(k, s, n, m, w) for k in a.k for s in a.s for n in a.n for m in a.m for w in a.w} - {default})
    drawn = random.Random(cfg.calibration.design_seed).sample(grid, min(cfg.calibration.design_size, len(grid)))
    extra = []
    for values in cfg.calibration.design_extra:
        theta = Theta(*values) if len(values) == len(allocation.PARAMETERS) else None
        if theta is None or (theta not in grid and theta != default):
            raise InputError(f"calibration.design_extra {values}: not a theta (k, s, n, m, w) of the allocation grid")
        extra.append(theta)
    return [default, *sorted((set(drawn) | set(extra)) - {default})]


def samples(cfg: EngineConfig, tokenizer: Any) -> list[Sample]:
    c = cfg.calibration
    if unknown := sorted(set(c.tasks) - set(TASKS)):
        raise InputError(f"unknown calibration tasks {unknown}; known: {sorted(TASKS)}")
    try:
        return [TASKS[task](tokenizer, length, CALIBRATION_SEEDS + i)
                for task in c.tasks for length in c.lengths for i in range(c.samples)]
    except FileNotFoundError as err:  # the facts task's corpus is not installed
        raise InputError(f"{err} (or leave facts out: --tasks ...)") from err


def _key(sample: Sample) -> str:
    return f"{sample.task}-{sample.length}-{sample.seed}"


def _rows(observations: Path) -> list[dict[str, Any]]:
    """The observations written so far. A last line cut short by a kill mid-write is cut off the file (its
    answer is asked again), so the next line starts clean."""
    if not observations.exists():
        return []
    text = observations.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        observations.write_text(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run(lm: EpisodicLM, cfg: EngineConfig, work_dir: Path, observations: Path,
        progress: Callable[[str], None]) -> int:
    """Answer every sample under every theta of the design not yet in `observations`; returns the answers
    added. Each sample's store lives under `work_dir` until all its answers are in."""
    default = Answerer.default_for(cfg)
    thetas = design(cfg, default)
    rows, added = _rows(observations), 0
    path = answer_path(cfg)
    if rows and (answered := _one_path(rows, observations)) != path:
        raise InputError(f"{observations} was answered on another answer path ({answered}) than this run's "
                         f"({path}): use another --work-dir, or the settings it was answered with")
    done = {(row["sample"], tuple(row["theta"].values())) for row in rows}
    # Samples answered before a feature was added: their rows get the features of their first new answer.
    stale = {row["sample"] for row in rows if len(row["features"]) != len(allocation.FEATURES)}
    observations.parent.mkdir(parents=True, exist_ok=True)
    answer_cfg = cfg.with_allocation_mode("fixed")
    for sample in samples(cfg, lm.tokenizer):
        missing = [t for t in thetas if (_key(sample), tuple(asdict(t).values())) not in done]
        if not missing:
            continue
        store = work_dir / _key(sample)
        if not (store / "ingested").exists():
            shutil.rmtree(store, ignore_errors=True)
            progress(f"{_key(sample)}: ingesting")
            with lm.session(answer_cfg, store=store) as session:
                for piece in sample.context:
                    session.ingest(piece)
            (store / "ingested").write_text("")
        for theta in missing:
            with lm.session(answer_cfg, store=store, read_only=True) as session:
                room = sample.reply_tokens(lm.tokenizer, cfg.calibration.max_new_tokens)
                reply = session.chat(sample.chat_question, max_new_tokens=room, theta=theta)
                plan = session.last_plan
            row = {"sample": _key(sample), "task": sample.task, "length": sample.length, "seed": sample.seed,
                   "theta": asdict(theta), "features": _fitted_features(plan), "reply": reply,
                   "score": sample.score(reply), "context_tokens": plan.context_tokens, "answer_path": path}
            with observations.open("a") as out:
                out.write(json.dumps(row) + "\n")
            added += 1
            if row["sample"] in stale:
                _set_features(observations, row["sample"], row["features"])
                stale.discard(row["sample"])
            progress(f"{_key(sample)} {theta}: {row['score']:.2f} {reply[:60]!r}")
        lm.close()  # the sample's stores, before the next one opens
        shutil.rmtree(store, ignore_errors=True)
    return added


def refeature(lm: EpisodicLM, cfg: EngineConfig, work_dir: Path, observations: Path,
              progress: Callable[[str], None]) -> int:
    """Measure the features again for the samples of `observations` whose features are not those of
    `allocation.FEATURES` (a feature was added): each document is ingested again and its question assessed
    as its answers were (one token generated), and every row of the sample gets the new features; the
    replies and scores stay, since the features never change what a given theta reads. The file is
    rewritten after each sample, so a run resumes where it stopped. Returns the samples measured."""
    rows = _rows(observations)
    stale = sorted({row["sample"] for row in rows if len(row["features"]) != len(allocation.FEATURES)})
    by_key = {_key(sample): sample for sample in samples(_all_tasks(cfg, rows), lm.tokenizer)}
    missing = [key for key in stale if key not in by_key]
    if missing:
        raise InputError(f"{observations}: samples {missing[:3]} are not in the calibration's tasks, lengths "
                         "and samples (--tasks, --lengths, --samples)")
    answer_cfg, default = cfg.with_allocation_mode("fixed"), Answerer.default_for(cfg)
    for done, key in enumerate(stale, 1):
        sample, store = by_key[key], work_dir / key
        shutil.rmtree(store, ignore_errors=True)
        with lm.session(answer_cfg, store=store) as session:
            for piece in sample.context:
                session.ingest(piece)
            session.chat(sample.chat_question, max_new_tokens=1, theta=default)
            features = _fitted_features(session.last_plan)
        lm.close()
        shutil.rmtree(store, ignore_errors=True)
        old = next(row["features"] for row in rows if row["sample"] == key)
        _set_features(observations, key, features)
        progress(f"{key} ({done}/{len(stale)}): features {[round(f, 3) for f in old]} -> "
                 f"{[round(f, 3) for f in features]}")
    return len(stale)


def _fitted_features(plan: RecallPlan) -> list[float]:
    """A plan's features in `allocation.FEATURES` order as the fit reads them: one not measured (i_doc with
    `allocation.i_doc` off) as 0, the value a choice then reads."""
    values = [plan.features[name] for name in allocation.FEATURES]
    return [0.0 if value is None else value for value in values]


def _set_features(observations: Path, key: str, features: list[float]) -> None:
    """Give every row of sample `key` `features`; the replies and scores stay, since the features never
    change what a given theta reads. The file is replaced whole, so a kill leaves the old or the new one."""
    rows = _rows(observations)
    for row in rows:
        if row["sample"] == key:
            row["features"] = features
    partial = observations.with_suffix(".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    partial.replace(observations)


def _all_tasks(cfg: EngineConfig, rows: list[dict[str, Any]]) -> EngineConfig:
    """`cfg` with the tasks, lengths and sample count the observations were made with."""
    seeds = max(row["seed"] for row in rows) - CALIBRATION_SEEDS + 1
    update = {"tasks": sorted({row["task"] for row in rows}), "lengths": sorted({row["length"] for row in rows}),
              "samples": max(seeds, cfg.calibration.samples)}
    return cfg.model_copy(update={"calibration": cfg.calibration.model_copy(update=update)})


def _columns(part: list[dict[str, Any]]) -> tuple[list[Theta], list[torch.Tensor], list[float]]:
    return ([Theta(**row["theta"]) for row in part], [torch.tensor(row["features"], dtype=torch.float64)
                                                      for row in part], [float(row["score"]) for row in part])


FITS: dict[str, tuple[bool, Literal["logit", "linear"]]] = {  # name: (with the interaction B i, link)
    "model": (True, "logit"), "no_interaction": (False, "logit"), "linear": (True, "linear")}


def _fits(part: list[dict[str, Any]], cfg: EngineConfig) -> dict[str, AllocationModel]:
    """The model and its two ablations fitted on `part`, each with the ridge term that predicts `part`'s own
    held-out samples best (an inner cross-validation: the samples scored outside `part` never choose it)."""
    a, columns, groups = cfg.allocation, _columns(part), [row["sample"] for row in part]
    fitted = {}
    for name, (with_interaction, link) in FITS.items():
        ridge = allocation.select_ridge(*columns, groups, a, cfg.calibration.holdout, with_interaction, link)
        fitted[name] = allocation.fit(*columns, a, ridge, with_interaction, link)
    return fitted


def _best_fixed(part: list[dict[str, Any]]) -> Theta:
    """The theta of the best mean score in `part` over the samples every theta was answered on (one answered on
    fewer, easier samples is not favoured; none shared: each theta's own; ties: the fewest memory tokens)."""
    by: dict[Theta, dict[str, float]] = {}
    for row in part:
        by.setdefault(Theta(**row["theta"]), {})[row["sample"]] = float(row["score"])
    shared = set.intersection(*map(set, by.values()))
    return max(by, key=lambda t: (_mean([v for k, v in by[t].items() if k in shared or not shared]), -t.k * t.s * t.n))


def fit_observations(cfg: EngineConfig, model_id: str, observations: Path, demonstration_tokens: Sequence[int]
                     ) -> CalibrationReport:
    """Fit the allocation model on `observations` and report it, cross-validated over samples: the samples are
    cut into `holdout` folds; each fold is predicted, and answered by the model's choice, from a fit on the
    others (and the best fixed theta chosen on the others). The model returned is fitted on every sample.
    `demonstration_tokens[m]`: the model's tokens of m demonstrations (what a choice prices them at)."""
    rows = _rows(observations)
    if not rows:
        raise InputError(f"{observations} holds no observations; run `engramkv calibrate` without --fit-only")
    path = _one_path(rows, observations)
    keys = sorted({row["sample"] for row in rows})
    folds = cfg.calibration.holdout
    if len(keys) < folds:
        raise InputError(f"{len(keys)} samples are too few for {folds} folds (calibration.holdout)")
    fold_of = allocation.assign_folds(keys, folds)
    default = Answerer.default_for(cfg)
    predicted: dict[str, list[tuple[dict[str, Any], AllocationModel]]] = {name: [] for name in FITS}
    chosen: dict[str, list[dict[str, Any]]] = {name: [] for name in CHOICES}
    for fold in range(folds):
        train = [row for row in rows if fold_of[row["sample"]] != fold]
        test = [row for row in rows if fold_of[row["sample"]] == fold]
        fitted = _fits(train, cfg)
        for name, model in fitted.items():
            predicted[name] += [(row, model) for row in test]
        for name, picked in _held_out_choice(fitted["model"], test, default, _best_fixed(train), cfg,
                                              demonstration_tokens).items():
            chosen[name] += picked
    everything = _fits(rows, cfg)
    fits = {}
    for name, pairs in predicted.items():
        per_answer = _pooled_r2(pairs, lambda row: id(row))
        per_cell = _pooled_r2(pairs, lambda row: (row["task"], row["length"], json.dumps(row["theta"])))
        fits[name] = FitReport(r2=per_answer[0], mse=per_answer[1], r2_cells=per_cell[0], mse_cells=per_cell[1],
                               ridge=everything[name].ridge)
    design_thetas = [list(t) for t in sorted({tuple(row["theta"].values()) for row in rows})]
    model = everything["model"].model_copy(update={"thetas": design_thetas,
                                                   "best_fixed": list(asdict(_best_fixed(rows)).values())})
    return CalibrationReport(
        model_id=model_id, model=model, observations=len(rows), held_out=len(rows), fits=fits,
        design=[json.loads(t) for t in sorted({json.dumps(row["theta"]) for row in rows})],
        default_theta=asdict(default), best_fixed_theta=asdict(_best_fixed(rows)),
        held_out_scores={name: _mean([r["score"] for r in picked]) for name, picked in chosen.items()},
        held_out_context={name: _mean([r["context_tokens"] for r in picked]) for name, picked in chosen.items()},
        held_out_per_sample={name: [r["score"] for r in picked] for name, picked in chosen.items()},
        config={"allocation": cfg.allocation.model_dump(), "calibration": cfg.calibration.model_dump(),
                "answer_path": path},
    )


def _pooled_r2(pairs: list[tuple[dict[str, Any], AllocationModel]], cell: Callable[[dict[str, Any]], object]
               ) -> tuple[float, float]:
    """(R^2, MSE) of out-of-fold predictions (each answer by the model fitted without its sample), over the
    means of `cell` groups."""
    predicted: dict[object, list[float]] = {}
    observed: dict[object, list[float]] = {}
    for row, model in pairs:
        key = cell(row)
        features = torch.tensor(row["features"], dtype=torch.float64)
        predicted.setdefault(key, []).append(model.predict(Theta(**row["theta"]), features))
        observed.setdefault(key, []).append(float(row["score"]))
    p = torch.tensor([_mean(v) for v in predicted.values()], dtype=torch.float64)
    o = torch.tensor([_mean(observed[k]) for k in predicted], dtype=torch.float64)
    mse = float(((p - o) ** 2).mean())
    variance = float(((o - o.mean()) ** 2).mean())
    return (1.0 - mse / variance if variance > 0 else float("nan")), mse


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")  # nan: no held-out sample has that theta


CHOICES = ("default", "best_fixed", "model", "model_as_shipped")


def _held_out_choice(model: AllocationModel, test: list[dict[str, Any]], default: Theta, best_fixed: Theta,
                     cfg: EngineConfig, demonstration_tokens: Sequence[int]) -> dict[str, list[dict[str, Any]]]:
    """Per held-out sample, the answer under the default theta, under the best fixed one, and under the
    model's choice among the thetas that sample was answered under, made as `Answerer.choose` makes it: on
    nominal costs (`answering.nominal_cost`; the thetas' measured contexts differ by a few tokens where
    their nominal costs tie, which must not decide) with the tolerance, among those that read the whole
    window where the window matches better than memory; within the best fixed theta's nominal cost
    (`model`) and as shipped (`model_as_shipped`: `allocation.default_limit`, that limit or none). A
    session prices a whole-window theta there as the window's best piece, which no observation read (they
    read the window whole): where no whole-window theta fits the limit at its whole cost, the choice is
    made without the window rule."""
    window = cfg.window.n_local  # a calibration document ends in a full window

    def cost(theta: Theta) -> int:  # the sinks and the turn are the same for every theta
        return nominal_cost(cfg, demonstration_tokens, theta, 0, window)

    by_sample: dict[str, dict[Theta, dict[str, Any]]] = {}
    for row in test:
        by_sample.setdefault(row["sample"], {})[Theta(**row["theta"])] = row
    picked: dict[str, list[dict[str, Any]]] = {name: [] for name in CHOICES}
    for answers in by_sample.values():
        if default not in answers or best_fixed not in answers:
            continue
        features = torch.tensor(answers[default]["features"], dtype=torch.float64)
        # The window-versus-memory margin feature is what `question.window_answers` compares.
        window_answers = float(features[allocation.FEATURES.index("window_margin")]) > cfg.recall.window_margin
        allowed = allocation.whole_window(list(answers), window_answers, window)
        within = cost(best_fixed)
        shipped = within if cfg.allocation.default_limit == "best_fixed" else math.inf
        for name, limit in (("model", within), ("model_as_shipped", shipped)):
            pool = [t for t in allowed if cost(t) <= limit] or list(answers)
            choice = allocation.choose(model, pool, features, limit, cost, cfg.allocation.tolerance)
            picked[name].append(answers[choice])  # type: ignore[index]  # the best fixed theta always fits
        picked["default"].append(answers[default])
        picked["best_fixed"].append(answers[best_fixed])
    return picked


def calibrate(lm: EpisodicLM | None, cfg: EngineConfig, out: Path, work_dir: Path, fit_only: bool = False,
              model_id: str | None = None, progress: Callable[[str], None] | None = None,
              refeature_only: bool = False) -> CalibrationReport:
    """Run what is missing of the calibration on `lm` (unless `fit_only`: then `lm` may be None, the fit
    loads `cfg.model`'s tokenizer alone, and `model_id` names the model, by default `cfg.model`'s), fit, and
    write the report to `out` (JSON; what `allocation.coefficients` reads). `refeature_only`: instead of
    answering, measure again the features of observations made before a feature was added (`refeature`).
    The observations live in `work_dir/observations.jsonl`."""
    observations = work_dir / "observations.jsonl"
    if not fit_only:
        if lm is None:
            raise InputError("calibrate needs a model unless fit_only")
        step = refeature if refeature_only else run
        step(lm, cfg, work_dir, observations, progress or (lambda line: None))
    tokenizer, loaded_id = (lm.tokenizer, lm.spec.model_id) if lm is not None else hf.load_tokenizer(cfg.model)
    demonstrations = [len(ids) for ids in demonstration_ids(tokenizer)]
    report = fit_observations(cfg, model_id or loaded_id, observations, demonstrations)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.model_dump_json(indent=2) + "\n")
    return report
