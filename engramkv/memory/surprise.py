"""Surprise: the next-token negative log-likelihood of each token actually read.

It comes from the logits of the same forward pass that ingests the chunk: the logit row
of token t-1 predicts token t. The first token of a chunk is scored by the last logit
row of the previous chunk, carried over by the caller.
"""

from __future__ import annotations

import torch


def token_surprise(
    logits: torch.Tensor,  # (T, V) float32, row t predicts token t+1
    token_ids: torch.Tensor,  # (T,)
    previous_logits: torch.Tensor | None,  # (V,) last row of the previous chunk, or None at stream start
) -> torch.Tensor:  # (T,) float32
    """-log p(x_t | x_<t) for every token of the chunk; the stream's first token gets 0."""
    predictors = logits[:-1]  # (T-1, V) predicts tokens 1..T-1
    if previous_logits is not None:
        predictors = torch.cat([previous_logits[None], predictors], dim=0)  # (T, V)
    targets = token_ids[token_ids.shape[0] - predictors.shape[0] :]  # not [-n:]: n may be 0
    # logsumexp - logit: same value as -log_softmax, without writing a (T, V) output.
    nll = torch.logsumexp(predictors, dim=-1) - predictors.gather(1, targets[:, None])[:, 0]  # (T or T-1,)
    if previous_logits is None:
        nll = torch.cat([nll.new_zeros(1), nll])
    return nll
