"""Positions for the assembled attention window.

The window of one layer is  [sinks (S) | recalled memory (M) | local window (L) | new tokens (C)].
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


def lower_right_causal_mask(n_queries: int, n_keys: int) -> torch.Tensor:  # (C, N) bool
    """Query i (the i-th of the last n_queries tokens) sees keys 0 .. n_keys - n_queries + i."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool).tril(n_keys - n_queries)
