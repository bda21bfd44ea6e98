"""The knobs of answering: the allocation model, its calibration, and generation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engramkv.config._base import _Strict
from engramkv.errors import ConfigError


class AllocationConfig(_Strict):
    """The recall budget model (`retrieval.allocation`): the inference parameters theta an answer may take,
    how they are chosen, and how the model is fitted (`engramkv calibrate`)."""

    mode: Literal["fixed", "model", "auto"] = Field(
        default="auto",
        description="'fixed': every answer takes the default theta (recall.answer_hits events, "
        "recall.answer_budget_tokens, one round, no demonstrations, the whole window). 'model': the fitted "
        "allocation model picks theta per question from the grid below, within the answer's context limit. "
        "'auto': 'model' where coefficients are given or shipped for the model, else 'fixed'.",
    )
    coefficients: str | None = Field(
        default=None,
        description="JSON file of fitted coefficients (what `engramkv calibrate` writes); None: the ones shipped "
        "for the model, if any (mode 'model' without either is a ConfigError; 'auto' answers fixed).",
    )
    k: list[int] = Field(default=[1, 2, 4, 8], min_length=1, description="Grid: events pinned.")
    s: list[int] = Field(default=[32, 64, 128, 256], min_length=1, description="Grid: memory tokens per hit.")
    n: list[int] = Field(default=[1, 2], min_length=1, description="Grid: recall rounds (2: re-match with a draft).")
    m: list[int] = Field(default=[0, 1, 2], min_length=1, description="Grid: worked demonstrations before the question.")
    w: list[int] = Field(
        default=[0, 128, 512, 1024], min_length=1,
        description="Grid: tokens of local text before the prompt the answer attends to (the sinks always).",
    )
    draft_tokens: int = Field(default=12, ge=1, description="Length of the draft a second recall round matches with.")
    i_doc: bool = Field(default=True, description="Measure i_doc (two extra probes of the prompt: with the best "
                        "event, with none) as a feature, where the model uses it or a theta is given.")
    eps: float = Field(default=0.01, gt=0, description="log(theta + eps): keeps a zero parameter finite (the paper's).")
    score_clip: float = Field(
        default=0.02, gt=0, lt=0.5,
        description="The fit starts from the logit of the mean score clipped to [clip, 1 - clip].",
    )
    default_limit: Literal["none", "best_fixed"] = Field(
        default="best_fixed",
        description="The model's limit on an answer's effective context where none is given (per call or "
        "recall.answer_context_tokens): 'best_fixed', what the calibration's best single theta would read for "
        "that question (so the model reads no more than it, and the thetas that read the window's best piece are "
        "costed at that piece); 'none': no limit.",
    )
    tolerance: float = Field(
        default=0.1, ge=0, le=1,
        description="The model answers with the cheapest theta predicted to score within this much of the best "
        "within the limit (0: the best predicted). On the embedded model's calibration (128 samples, out of fold, "
        "within the best fixed theta's cost) every tolerance from 0 to 0.2 scores 0.441 at 279 context tokens.",
    )
    ridge: list[float] = Field(
        default=[0.1, 1.0, 10.0, 100.0, 1000.0], min_length=1,
        description="Ridge terms tried by the least-squares fit, on standardised features (the intercept is not "
        "shrunk); the fit keeps the one of least held-out MSE (cross-validation over samples, "
        "`calibration.holdout` folds). The features vary per sample, not per answer, so a few dozen "
        "calibration samples carry B's 25 entries: the data decide how far to shrink them.",
    )
    features: list[str] | None = Field(default=None, min_length=1, description="Informativeness features the fit "
                                       "uses (of `allocation.FEATURES`, in its order); None: all. The embedded "
                                       "model's shipped fit leaves out i_doc (README, 'Recall budgets').")

    @model_validator(mode="after")
    def _grid_values(self) -> AllocationConfig:
        for name in ("k", "s", "n"):
            if min(getattr(self, name)) < 1:
                raise ConfigError(f"allocation.{name}: every value must be at least 1")
        for name in ("m", "w"):
            if min(getattr(self, name)) < 0:
                raise ConfigError(f"allocation.{name}: values must be 0 or more")
        if min(self.ridge) < 0:
            raise ConfigError("allocation.ridge: values must be 0 or more")
        return self


class CalibrationConfig(_Strict):
    """What `engramkv calibrate` (`calibration.calibrate`) runs to fit the allocation model."""

    tasks: list[str] = Field(default=["passkey", "niah-single", "niah-multikey", "niah-multivalue", "niah-multiquery",
                                      "conversation", "facts", "kv"], min_length=1, description="`engramkv.tasks`.")
    lengths: list[int] = Field(default=[4096, 8192], min_length=1, description="Document lengths in tokens.")
    samples: int = Field(default=4, ge=1, description="Samples per task and length (seeds from CALIBRATION_SEEDS).")
    design_size: int = Field(default=16, ge=1, description="Thetas drawn from the allocation grid (with a seed), "
                             "besides the default theta: every sample is answered under all of them.")
    design_seed: int = 0
    design_extra: list[list[int]] = Field(default=[[2, 64, 1, 0, 0], [4, 32, 1, 0, 0]], description="Thetas "
                                          "(k, s, n, m, w) of the grid answered besides the drawn ones.")
    holdout: int = Field(default=4, ge=2, description="Folds of the cross-validation over samples: each sample's "
                         "answers are predicted, and chosen for, by a fit without its fold.")
    max_new_tokens: int = Field(default=64, ge=1, description="Reply tokens, at least (`Sample.reply_tokens`).")


class GenerationConfig(_Strict):
    """Decoding defaults."""

    max_new_tokens: int = Field(default=64, ge=1)
    min_new_tokens: int = Field(default=1, ge=0, description="Tokens before a stop token may end a reply (it is "
                                "masked until then): 1, the model cannot end its turn at once (an empty reply).")
    temperature: float = Field(default=0.0, ge=0, description="0 is greedy.")
    seed: int = 0
    repeat_stop: int | None = Field(default=3, ge=2, description="A reply ends before a sentence or line that comes "
                                    "back for this many-th time (a degenerate reply; the scorer cuts so); None: never.")
    chat_format: Literal["qa", "template"] = Field(default="qa", description=(
        "How `chat` renders a turn. 'qa': 'Question: ...\nAnswer:', the reply ending at a blank line (not one "
        "after a colon). 'template': the model's chat template. Measured on the embedded 135M model: under its "
        "template it answers from its own weights and ignores recalled events that it uses in the 'qa' form."))
    question_span: Literal["message", "quoted"] = Field(default="quoted", description=(
        "What of a chat message recall matches against memory: 'message', all of it; 'quoted', where it quotes "
        "something (between double quotes or backticks), what it quotes (an identifier such as a UUID: the words "
        "around it would match any text that shares them)."))
    answer_start: Literal["none", "echo", "list"] = Field(default="echo", description=(
        "'echo': `chat` begins the answer to 'What is/are X?' as 'X is/are' (in the answerer's person), as a benchmark "
        "prompt does; 'What are all X?' is drafted as a bulleted list, answered with its items: 'X are: a, b.'. "
        "'list': every plural 'What are X?' as a bulleted list, kept (later turns copy the form). 'none': the "
        "model writes the whole answer."))
