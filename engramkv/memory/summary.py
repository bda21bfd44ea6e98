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


def representatives_of_events(
    keys: torch.Tensor,  # (layers, Hkv, sum n, D) the events' keys, joined along the tokens in order
    received: torch.Tensor,  # (layers, Hkv, sum n)
    counts: list[int],  # n of each event
    keys_per_head: int,
) -> torch.Tensor:  # (E, layers, Hkv * D)
    """Each event's representative per layer (the module's `r`), for E events at once: a dozen operations for a
    sealing, not a dozen per event, and on the keys' device.

    Each event's attention is padded with -inf to the longest event's length, so one top-k serves them all;
    an event shorter than `keys_per_head` averages all its keys. Bit for bit what one event alone gets
    (tests/test_sealing.py)."""
    n_layers, n_heads, total, _ = keys.shape
    device = keys.device
    lengths = torch.tensor(counts, device=device)  # (E,)
    starts = torch.cumsum(lengths, 0) - lengths  # (E,)
    longest = max(counts)
    offsets = torch.arange(longest, device=device)  # (P,)
    inside = offsets[None] < lengths[:, None]  # (E, P)
    at = (starts[:, None] + offsets[None]).clamp(max=total - 1)  # (E, P) token of each padded slot
    padded = received[:, :, at].masked_fill(~inside, float("-inf"))  # (layers, Hkv, E, P)
    r = min(longest, keys_per_head)
    top = padded.topk(r, dim=3).indices  # (layers, Hkv, E, r), an event's own tokens first
    token = (starts[:, None] + top).clamp(max=total - 1)  # (layers, Hkv, E, r) into the joined tokens (pads: any)
    layer = torch.arange(n_layers, device=device)[:, None, None, None]
    head = torch.arange(n_heads, device=device)[None, :, None, None]
    chosen = keys[layer, head, token].float()  # (layers, Hkv, E, r, D)
    taken = lengths.clamp(max=keys_per_head)  # (E,) keys averaged per event
    kept = (torch.arange(r, device=device)[None] < taken[:, None]).to(chosen.dtype)  # (E, r)
    mean = (chosen * kept[:, :, None]).sum(dim=3) / taken[:, None].to(chosen.dtype)  # (layers, Hkv, E, D)
    return mean.permute(2, 0, 1, 3).flatten(2)  # (E, layers, Hkv * D)
