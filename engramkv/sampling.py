"""Sampling: a reply's tokens, one at a time, from the logits of the one before."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from engramkv.config import GenerationConfig
from engramkv.errors import SessionError


def sample(logits: torch.Tensor | None, decode: Callable[[int], torch.Tensor], limit: int, stop: set[int],
           cfg: GenerationConfig) -> Generator[int, None, bool]:
    """Up to `limit` new tokens: pick one from `logits` (V,), read it with `decode` (which returns the next
    logits, (1, V)), and so on; a stop token is read but not yielded, and ends the reply. Before
    `cfg.min_new_tokens` tokens no stop token is picked. Returns True where a stop token ended the reply, False
    where `limit` did."""
    generator = torch.Generator().manual_seed(cfg.seed)
    masked = sorted(stop)
    for step in range(limit):
        if logits is None:
            raise SessionError("nothing to continue from: the stream holds no tokens")
        if step < cfg.min_new_tokens and masked:
            logits = logits.clone()
            logits[masked] = float("-inf")
        token = pick(logits, cfg.temperature, generator)
        logits = decode(token)[-1]
        if token in stop:
            return True
        yield token
    return False


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:  # logits (V,)
    """The next token: greedy at temperature 0, else sampled from softmax(logits / temperature)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)  # (V,)
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_ids(tokenizer: Any) -> set[int]:
    eos = tokenizer.eos_token_id
    return {eos} if eos is not None else set()
