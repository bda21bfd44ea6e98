"""The recall budget model (after Yue et al., "Inference Scaling for Long-Context RAG"): predict how
well a question will be answered under inference parameters theta, and choose theta under a limit.

theta = (k events pinned, s tokens of temporal context per hit, n recall rounds, m demonstrations,
w tokens of the resident window attended). Informativeness i (F,) is measured per question before it
is answered (match-score features, `informativeness`). The model, with eps = `AllocationConfig.eps`:

    logit(P) = (a + B i)^T log(theta + eps) + c          a (P,), B (P, F), c scalar

B generalises the paper's elementwise `b * i` to features that are not one per parameter (B diagonal
with F = P is the paper's form). It is fitted by least squares of P (the scores are 0/1 or a share per
answer, so on the score scale through the logit link), with a ridge term chosen by cross-validation
over samples (`select_ridge`); a question's features are clamped into the range the fit saw. Cost of
theta = sinks + attended window + k * s * n + prompt + demonstrations (effective context tokens). `choose`
takes the cheapest theta predicted within a tolerance of the best within a limit; `allocate` shares one
limit among many questions, each step of budget going to the question with the best predicted gain per
token.

`answering` uses it when `AllocationConfig.mode` is "model", or "auto" where coefficients ship; the
coefficients come from `engramkv calibrate` (`calibration`), those fitted for the embedded model ship in
the package, and `load_model` reads them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

from engramkv.config import AllocationConfig
from engramkv.errors import ConfigError, InputError

PARAMETERS = ("k", "s", "n", "m", "w")
FEATURES = ("margin", "entropy", "above", "window_margin", "i_doc", "several")

# A question after several things: a plural wh-verb ("What are", "Which were"), "all", "list", or terms
# joined by "and" or by a comma and a space (not "12,345"). Read from the words alone: the match scores
# cannot tell one fact stated in four events from four facts. ("each" and "every" are left out: "each
# week" asks for one thing.)
_SEVERAL = re.compile(r"\b(?:(?:what|which|who)\s+(?:are|were)|all|list)\b|\w,\s+\w|\w\s+and\s+\w",
                      re.IGNORECASE)


@dataclass(frozen=True, order=True)
class Theta:
    """Inference parameters of one answer."""

    k: int  # events pinned
    s: int  # tokens of temporal context per hit
    n: int  # recall rounds
    m: int  # worked demonstrations before the question
    w: int  # tokens of the resident window (sinks + local) attended

    def vector(self) -> torch.Tensor:  # (P,)
        return torch.tensor([self.k, self.s, self.n, self.m, self.w], dtype=torch.float64)


def cost(theta: Theta, fixed_tokens: int, demonstration_tokens: int, window_cap: int | None = None,
         memory_cap: int | None = None) -> int:
    """Effective context tokens of an answer under `theta`: the attended window (at most `window_cap`, the
    local text there is), the memory read over all rounds (at most `memory_cap` in all), what every answer
    reads (`fixed_tokens`: the sinks and the prompt) and the demonstrations."""
    window = theta.w if window_cap is None else min(theta.w, window_cap)
    memory = theta.k * theta.s * theta.n if memory_cap is None else min(theta.k * theta.s * theta.n, memory_cap)
    return window + memory + fixed_tokens + theta.m * demonstration_tokens


def asks_for_several(question: str) -> float:
    """1.0 where the question's words ask for several things (`_SEVERAL`), else 0.0."""
    return 1.0 if _SEVERAL.search(question) else 0.0


def informativeness(scores: torch.Tensor, window_margin: float, i_doc: float,
                    several: float) -> torch.Tensor:  # (F,)
    """Cheap features of a question, known before it is answered: of its match scores over the events
    (N,), the top-1 margin over the background (in std), the entropy of softmax(z-scores) over log N (the
    raw scores, mean cosines a few hundredths apart, would give a uniform softmax for every question) and
    the count above mean + 2 std; the window-versus-memory margin; i_doc (the change in the first answer
    token's log-probability with one recalled event against none); and whether its words ask for several
    things (`asks_for_several`)."""
    s = scores.double()
    if s.numel() < 2:
        return torch.tensor([0.0, 0.0, 0.0, window_margin, i_doc, several], dtype=torch.float64)
    mean, std = s.mean(), s.std().clamp(min=1e-9)
    margin = (s.max() - mean) / std
    p = torch.softmax((s - mean) / std, dim=0)
    entropy = -(p * p.clamp(min=1e-30).log()).sum() / torch.log(torch.tensor(float(s.numel())))
    above = (s > mean + 2 * std).sum()
    return torch.tensor([float(margin), float(entropy), float(above), window_margin, i_doc, several],
                        dtype=torch.float64)


class AllocationModel(BaseModel):
    """Fitted coefficients: a (P,), B (P, F) as nested lists, c; what `engramkv calibrate` writes as JSON.

    link "logit" is the paper's model; "linear" (the ablation) fits the score itself, clamped to [0, 1].
    """

    a: list[float]
    b: list[list[float]]
    c: float
    eps: float
    link: Literal["logit", "linear"] = "logit"
    # The thetas it was calibrated on (k, s, n, m, w each): answers choose among these, not the whole grid
    # (None: the config's grid), since the fit says nothing of combinations it never saw.
    thetas: list[list[int]] | None = None
    # The range of each feature over the calibration (F,) each: a question's features are clamped into it,
    # as a line fitted on 2-13 events above the background says nothing of 40 (None: no clamp).
    low: list[float] | None = None
    high: list[float] | None = None
    ridge: float | None = None  # the ridge term the fit kept (a record)
    best_fixed: list[int] | None = None  # the calibration's best single theta (`allocation.default_limit`)
    # The features B's columns (and low, high) are for, a subset of FEATURES in its order: a file fitted
    # before a feature was added keeps answering with the ones it was fitted on.
    features: list[str] = list(FEATURES[:5])

    def candidates(self, grid: Sequence[Theta]) -> list[Theta]:
        return [Theta(*t) for t in self.thetas] if self.thetas else list(grid)

    def logit(self, theta: Theta, info: torch.Tensor) -> float:
        """The linear predictor (the logit of the score under the "logit" link)."""
        a, b = torch.tensor(self.a, dtype=torch.float64), torch.tensor(self.b, dtype=torch.float64)
        info = info.double()[[FEATURES.index(name) for name in self.features]]
        if self.low is not None and self.high is not None:
            info = info.clamp(torch.tensor(self.low, dtype=torch.float64), torch.tensor(self.high, dtype=torch.float64))
        slope = a + b @ info  # (P,)
        return float(slope @ torch.log(theta.vector() + self.eps) + self.c)

    def predict(self, theta: Theta, info: torch.Tensor) -> float:
        """Predicted score in [0, 1]."""
        z = self.logit(theta, info)
        return float(torch.sigmoid(torch.tensor(z))) if self.link == "logit" else min(1.0, max(0.0, z))


def design_row(theta: Theta, info: torch.Tensor, eps: float, with_interaction: bool = True) -> torch.Tensor:
    """The regressors of one observation: log(theta + eps) (P,), its products with i (P * F,), 1."""
    log_theta = torch.log(theta.vector() + eps)  # (P,)
    parts = [log_theta]
    if with_interaction:
        parts.append(torch.outer(log_theta, info.double()).flatten())  # (P * F,) row-major: B[p, f]
    parts.append(torch.ones(1, dtype=torch.float64))
    return torch.cat(parts)


def fit(thetas: Sequence[Theta], infos: Sequence[torch.Tensor], scores: Sequence[float], cfg: AllocationConfig,
        ridge: float, with_interaction: bool = True, link: Literal["logit", "linear"] = "logit") -> AllocationModel:
    """Ridge least squares of the predicted score against the observed one: through the logit link
    (Gauss-Newton), or of the regressors on the score itself (link "linear", closed form). Without the
    interaction B is zero (the paper's ablation). The features of `infos` are the first F of FEATURES
    (features are only ever added at the end); the fit uses those of `cfg.features` (None: all F). The
    ridge acts on features standardised over the observations (a count and a cosine margin differ by
    orders of magnitude); the coefficients returned are for the raw features."""
    if not thetas or not len(thetas) == len(infos) == len(scores):
        raise InputError("fit needs as many thetas, feature vectors and scores, at least one")
    measured = FEATURES[: len(infos[0])]
    used = list(measured) if cfg.features is None else cfg.features
    if [name for name in measured if name in used] != used:
        raise InputError(f"allocation.features {used}: names of the features measured, {list(measured)}, "
                         "in that order")
    raw = torch.stack([i.double() for i in infos])[:, [measured.index(name) for name in used]]  # (N, F)
    mean, std = raw.mean(dim=0), raw.std(dim=0, unbiased=False)
    std = torch.where(std > 1e-9, std, torch.ones_like(std))  # a constant feature stays as it is
    x = torch.stack([design_row(t, (i - mean) / std, cfg.eps, with_interaction) for t, i in zip(thetas, raw)])  # (N, R)
    y = torch.tensor(scores, dtype=torch.float64)  # (N,)
    shrunk = torch.ones(x.shape[1], dtype=torch.float64)
    shrunk[-1] = 0.0  # the intercept is not shrunk
    if link == "logit":
        coef = _gauss_newton(x, y, ridge * shrunk, cfg.score_clip)
    else:
        coef = torch.linalg.lstsq(x.T @ x + torch.diag(ridge * shrunk), x.T @ y).solution  # (R,)
    n_params, n_features = len(PARAMETERS), raw.shape[1]
    a = coef[:n_params]
    b = (coef[n_params:-1].view(n_params, n_features) if with_interaction
         else torch.zeros(n_params, n_features, dtype=torch.float64))
    # slope = a + B (i - mean) / std = (a - B (mean / std)) + (B / std) i
    return AllocationModel(a=(a - b @ (mean / std)).tolist(), b=(b / std).tolist(), c=float(coef[-1]),
                           eps=cfg.eps, link=link, low=raw.min(dim=0).values.tolist(),
                           high=raw.max(dim=0).values.tolist(), ridge=ridge,
                           features=used)


def _gauss_newton(x: torch.Tensor, y: torch.Tensor, penalty: torch.Tensor, clip: float,
                  steps: int = 200) -> torch.Tensor:  # (R,)
    """argmin_c sum (sigmoid(x c) - y)^2 + sum penalty * c^2, from the intercept at logit(mean y).
    Least squares on logit(y) itself would fit 0/1 scores as +-logit(clip), which biases every mean; on
    the score scale a theta answered 3 times in 10 is predicted near 0.3."""
    coef = torch.zeros(x.shape[1], dtype=torch.float64)
    start = y.mean().clamp(clip, 1 - clip)
    coef[-1] = torch.log(start / (1 - start))
    damping = 1e-3
    loss = float(((torch.sigmoid(x @ coef) - y) ** 2).sum() + (penalty * coef**2).sum())
    for _ in range(steps):
        p = torch.sigmoid(x @ coef)  # (N,)
        jac = x * (p * (1 - p))[:, None]  # (N, R)
        grad = jac.T @ (p - y) + penalty * coef
        hess = jac.T @ jac + torch.diag(penalty)
        step = torch.linalg.solve(hess + damping * torch.eye(len(coef), dtype=torch.float64), grad)
        trial = coef - step
        trial_loss = float(((torch.sigmoid(x @ trial) - y) ** 2).sum() + (penalty * trial**2).sum())
        if trial_loss <= loss:  # Levenberg-Marquardt: accept and trust the quadratic more, else less
            coef, loss, damping = trial, trial_loss, max(damping / 10, 1e-12)
            if float(step.abs().max()) < 1e-10:
                break
        else:
            damping *= 10
            if damping > 1e12:
                break
    return coef


def assign_folds(labels: Iterable[object], folds: int) -> dict[object, int]:
    """Each label's fold of a cross-validation over `folds` (labels in sorted order, dealt round)."""
    return {label: i % folds for i, label in enumerate(sorted(set(labels), key=str))}


def whole_window(grid: Sequence[Theta], window_answers: bool, whole: int) -> list[Theta]:
    """The thetas of `grid` a question may take: where the window matches it better than memory
    (`retrieval.question.window_answers`), only those reading at least `whole` window tokens (else the
    widest), since text not yet sealed into events is only there; otherwise all of them."""
    if not window_answers:
        return list(grid)
    widest = max(t.w for t in grid)
    return [t for t in grid if t.w >= whole] or [t for t in grid if t.w == widest]


def select_ridge(thetas: Sequence[Theta], infos: Sequence[torch.Tensor], scores: Sequence[float],
                 groups: Sequence[object], cfg: AllocationConfig, folds: int, with_interaction: bool = True,
                 link: Literal["logit", "linear"] = "logit") -> float:
    """The ridge term of `cfg.ridge` whose fits predict held-out groups best (least MSE of the predicted
    score): the groups (one label per observation, a calibration sample) are cut into `folds`, each fitted
    without its own (fewer groups than folds: one fold per group). Ties go to the stronger ridge; one
    candidate, or a single group: the strongest."""
    labels = set(groups)
    folds = min(folds, len(labels))
    if len(cfg.ridge) == 1 or folds < 2:
        return max(cfg.ridge)  # nothing to cross-validate with: the strongest shrinkage
    fold_of = assign_folds(labels, folds)
    errors: dict[float, float] = {}
    for ridge in cfg.ridge:
        total = 0.0
        for fold in range(folds):
            train = [i for i, g in enumerate(groups) if fold_of[g] != fold]
            model = fit([thetas[i] for i in train], [infos[i] for i in train], [scores[i] for i in train], cfg,
                        ridge, with_interaction, link)
            total += sum((model.predict(thetas[i], infos[i]) - scores[i]) ** 2
                         for i, g in enumerate(groups) if fold_of[g] == fold)
        errors[ridge] = total
    return min(errors, key=lambda r: (errors[r], -r))


def r_squared(model: AllocationModel, thetas: Sequence[Theta], infos: Sequence[torch.Tensor],
              scores: Sequence[float], groups: Sequence[object] | None = None) -> tuple[float, float]:
    """(R^2, MSE) of the model's predicted scores against observed ones (on the score scale); with `groups`
    (one label per observation), of the group means instead (the paper fits and scores averaged metrics)."""
    predicted = torch.tensor([model.predict(t, i) for t, i in zip(thetas, infos)], dtype=torch.float64)
    observed = torch.tensor(scores, dtype=torch.float64)
    if groups is not None:
        labels = sorted(set(groups), key=str)
        index = torch.tensor([labels.index(g) for g in groups])
        counts = torch.zeros(len(labels), dtype=torch.float64).index_add_(0, index, torch.ones_like(observed))
        predicted = torch.zeros(len(labels), dtype=torch.float64).index_add_(0, index, predicted) / counts
        observed = torch.zeros(len(labels), dtype=torch.float64).index_add_(0, index, observed) / counts
    mse = float(((predicted - observed) ** 2).mean())
    variance = float(((observed - observed.mean()) ** 2).mean())
    return (1.0 - mse / variance if variance > 0 else float("nan")), mse


def choose(model: AllocationModel, grid: Sequence[Theta], info: torch.Tensor, limit: float,
           cost_of: Callable[[Theta], float], tolerance: float = 0.0) -> Theta | None:
    """The cheapest theta of `grid` within `limit` whose predicted score is within `tolerance` of the best
    predicted there (None: none fits); ties go to the better predicted, then the smaller theta. A gain
    smaller than the fit can tell apart is not worth its tokens."""
    predicted = {t: model.predict(t, info) for t in grid if cost_of(t) <= limit}
    predicted = {t: p for t, p in predicted.items() if math.isfinite(p)}  # a NaN feature predicts nothing
    if not predicted:
        return None
    feasible = list(predicted)
    best = max(predicted.values())
    return min((t for t in feasible if predicted[t] >= best - tolerance),
               key=lambda t: (cost_of(t), -predicted[t], t))


def allocate(model: AllocationModel, grids: Sequence[Sequence[Theta]], infos: Sequence[torch.Tensor], total: int,
             cost_of: Callable[[Theta], int]) -> list[Theta | None]:
    """One theta per question, from that question's grid (`grids[q]`: say, the window rule's candidates), all
    costs together within `total` (no tolerance here: a step is taken for any predicted gain, since the total
    is the caller's to spend). Each question starts at its cheapest theta while they fit; then, step by
    step, the question whose next dearer theta gains the most predicted score per extra token moves up,
    while the total allows."""
    if len(grids) != len(infos):
        raise ValueError(f"{len(grids)} grids for {len(infos)} questions")
    ladders = [sorted(set(grid), key=lambda t: (cost_of(t), t)) for grid in grids]
    chosen: list[Theta | None] = [None] * len(infos)
    spent = 0
    for q, ladder in enumerate(ladders):
        if ladder and spent + cost_of(ladder[0]) <= total:
            chosen[q], spent = ladder[0], spent + cost_of(ladder[0])
    while True:
        best: tuple[float, int, Theta] | None = None
        for q, info in enumerate(infos):
            current = chosen[q]
            if current is None:
                continue
            now, base = model.predict(current, info), cost_of(current)
            for candidate in ladders[q]:
                extra = cost_of(candidate) - base
                if extra <= 0 or spent + extra > total:
                    continue
                gain = (model.predict(candidate, info) - now) / extra
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, q, candidate)
        if best is None:
            return chosen
        _, q, candidate = best
        spent += cost_of(candidate) - cost_of(chosen[q])  # type: ignore[arg-type]  # only held thetas move up
        chosen[q] = candidate


SHIPPED = Path(__file__).resolve().parent.parent / "coefficients"  # fitted by `engramkv calibrate`, one file per model


def coefficients_path(model_id: str) -> Path:
    """Where the coefficients shipped for `model_id` live (the file may not exist)."""
    return SHIPPED / (model_id.replace("/", "--") + ".json")


def load_model(cfg: AllocationConfig, model_id: str) -> AllocationModel | None:
    """The fitted model mode "model" answers with (None in mode "fixed"), from `cfg.coefficients` or the
    package's file for `model_id`; a missing, unreadable or other model's file is a ConfigError. Mode
    "auto" without a file given, for a model none ships for, is "fixed" (None)."""
    if cfg.mode == "fixed":
        return None
    path = Path(cfg.coefficients).expanduser() if cfg.coefficients else coefficients_path(model_id)
    if cfg.mode == "auto" and not cfg.coefficients and not path.is_file():
        return None
    if not path.is_file():
        what = f"{path} is a directory, not a file" if path.is_dir() else f"no file {path}"
        raise ConfigError(f"allocation.mode '{cfg.mode}' needs fitted coefficients: {what}; "
                          "fit them with `engramkv calibrate` and pass allocation.coefficients")
    try:
        data = json.loads(path.read_text())
        model = AllocationModel(**data["model"])
        fitted_for = data["model_id"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path} is not a coefficients file of `engramkv calibrate`: {err}") from err
    if fitted_for != model_id:
        raise ConfigError(f"{path} was fitted for {fitted_for}, this model is {model_id}; "
                          "re-fit with `engramkv calibrate`")
    ranges = [r for r in (model.low, model.high) if r is not None]
    known = [name for name in FEATURES if name in model.features]
    if (len(model.a) != len(PARAMETERS) or len(model.b) != len(PARAMETERS) or known != model.features
            or any(len(row) != len(model.features) for row in [*model.b, *ranges])):
        raise ConfigError(f"{path}: coefficients of another shape than theta {PARAMETERS} "
                          f"by features {model.features} (of {FEATURES})")
    return model
