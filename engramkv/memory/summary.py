"""How an event is summarised for search: representatives (reading recall) and key summaries (questions).

- Representative, one per layer: the mean of the pre-RoPE keys of the `keys_per_head` tokens that
  received the most attention while the event sat in the local window, per KV head, concatenated over
  heads: `r = concat_h mean_{t in top_r(a_h)} k_{h,t}`, shape (Hkv * D,). A reading query scores it by
  inner product (`retrieval.recall`).
- Key summary, one per event: for a few evenly spaced layers (`summary_layer_ids`), the mean of the
  event's unit-normalised keys per head, flattened, shape (S * Hkv * D,). A question's tokens get
  the same summary, and the inner product ranks the events (`retrieval.question`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def summary_layer_ids(num_layers: int, count: int) -> list[int]:
    """`count` evenly spaced layers (the middle of `count` equal bands); 0 or too many means all."""
    if count <= 0 or count >= num_layers:
        return list(range(num_layers))
    return [int((i + 0.5) * num_layers / count) for i in range(count)]


def key_summary(keys: torch.Tensor) -> torch.Tensor:  # keys (S, Hkv, T, D) -> (S * Hkv * D,)
    """Mean of the unit-normalised keys over the tokens, per layer and head, flattened."""
    return F.normalize(keys.float(), dim=-1).mean(dim=2).flatten()


def key_summaries(keys: torch.Tensor, counts: list[int]) -> torch.Tensor:  # (S, Hkv, sum T, D) -> (N, S * Hkv * D)
    """`key_summary` of N events at once, their tokens joined along dim 2 (`counts` tokens each, in order).

    Each event's mean is taken alone, as `key_summary` takes it, so a summary rebuilt from a lossless store is
    bit for bit the one written (a batched sum rounds differently, and ranks ties differently)."""
    unit = F.normalize(keys.float(), dim=-1)  # (S, Hkv, sum T, D)
    if not counts:
        return unit.new_zeros(0, unit.shape[0] * unit.shape[1] * unit.shape[3])
    return torch.stack([part.contiguous().mean(dim=2).flatten() for part in unit.split(list(counts), dim=2)])


def representatives(
    keys: torch.Tensor,  # (layers, Hkv, n, D) pre-RoPE keys of the event's tokens
    received: torch.Tensor,  # (layers, Hkv, n) attention each token received while resident
    keys_per_head: int,
) -> torch.Tensor:  # (layers, Hkv * D)
    """Per layer, the mean of the most-attended keys per KV head, concatenated over heads.

    Every layer at once and on the keys' device: on a GPU, sealing an event costs no host round trip."""
    r = min(keys.shape[2], keys_per_head)
    top = received.topk(r, dim=2).indices  # (layers, Hkv, r)
    chosen = keys.float().gather(2, top[..., None].expand(-1, -1, -1, keys.shape[-1]))  # (layers, Hkv, r, D)
    return chosen.mean(dim=2).flatten(1)
