"""The assembled attention window: positions, assembly, and which columns are the residents'.

The attention over it (RoPE, causal mask, received mass) is `kernels.window_attention`.

The window of one layer is  [sinks (S) | recalled memory (M) | local window (L) | new tokens (C)],
or, while an answer reads its prompt and writes (`RecallConfig.answer_layout = "before_question"`),
[sinks | local text before the prompt | memory | the prompt and answer so far | new tokens], the way a
retrieval-augmented prompt puts its chunks right before the question.
Keys are stored without RoPE, so each forward chooses their positions:

- "contiguous" (ReAttention): number the window 0..N-1. Every position stays inside the
  trained length, whatever the stream length.
- "fixed" (InfLLM / EM-LLM): every memory token sits at one position, just before the
  local window; sinks, local and new tokens are numbered contiguously around it. Memory
  is then always at distance ~L from the queries, whatever its true age.
"""

from __future__ import annotations

from typing import Literal

import torch


def window_positions(
    n_sink: int, n_memory: int, n_local: int, n_new: int, scheme: Literal["contiguous", "fixed"]
) -> torch.Tensor:  # (S + M + L + C,) long
    if scheme == "contiguous" or n_memory == 0:
        return torch.arange(n_sink + n_memory + n_local + n_new)
    memory = torch.full((n_memory,), n_sink, dtype=torch.long)
    resident = torch.arange(n_sink + 1, n_sink + 1 + n_local + n_new)
    return torch.cat([torch.arange(n_sink), memory, resident])


def assemble(sink: torch.Tensor, local: torch.Tensor, memory: torch.Tensor, new: torch.Tensor,
             memory_at: int) -> torch.Tensor:  # (Hkv, S + L + M + C, D)
    """The window's keys (or values) in attention order: memory after the first `memory_at` local tokens."""
    return torch.cat([sink, local[:, :memory_at], memory, local[:, memory_at:], new], dim=1)


def resident_columns(weights: torch.Tensor, n_sink: int, memory_at: int, n_memory: int) -> torch.Tensor:
    """The columns of an assembled window's (..., N) weights that belong to local and new tokens, in order."""
    start = n_sink + memory_at
    return torch.cat([weights[..., n_sink:start], weights[..., start + n_memory :]], dim=-1)
