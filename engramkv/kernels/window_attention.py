"""Attention over one layer's assembled window, and the attention mass each key received, in one call.

The window is [sinks | memory | local | new tokens] (`engine.window`); its keys are stored without RoPE,
so every call rotates the queries and all N keys at the positions the caller chose (`cos`, `sin`: one
row per key; query i sits at key N - C + i). Query i sees keys 0 .. N - C + i (lower-right causal), each
query head reads the KV head of its group (GQA). Besides the output, the call can return how much
attention the last `n_probe` queries paid to every key, summed over those queries and the query heads
of each KV head: what picks an event's representatives. `padding` marks a run of columns that hold no key
(recall chosen on the device fills a fixed-size memory section, `kernels.selection`): no query sees them and
they receive nothing.

Two implementations of that contract:
- `window_attention_torch`, the twin: RoPE on q and every key, `scaled_dot_product_attention`, then a
  second float32 pass over the last `n_probe` queries for the received mass. What runs on the CPU.
- `_window_attention_triton`: RoPE applied as tiles load (no rotated copy of the window is written), a
  flash-style online-softmax pass per query tile that also keeps each query's log-sum-exp, and a pass
  per key tile that sums exp(score - lse) over the probing queries: the received mass without the
  (C, N) weight matrix. Written for head dims of 32, 64 and 128 (its halves feed `tl.dot`); other head
  dims take the twin.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engramkv.kernels.backend import Backend, triton_installed, use_triton

if triton_installed():
    import triton
    import triton.language as tl
else:  # the twin needs no Triton
    triton = tl = None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., N, D) rotated by cos/sin (N, D): x * cos + rotate_half(x) * sin, as transformers'
    apply_rotary_pos_emb, written half by half so no rotated copy of x is built."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def lower_right_causal_mask(n_queries: int, n_keys: int) -> torch.Tensor:  # (C, N) bool
    """Query i (the i-th of the last n_queries tokens) sees keys 0 .. n_keys - n_queries + i."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool).tril(n_keys - n_queries)


def causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:  # (C, N) bool view
    # A lower-right causal mask of width N is the right end of a wider one: one per query count (and
    # width class), sliced, since every layer (different recall sizes) wants another N.
    wide = _wide_mask(n_queries, max(4096, 1 << (n_keys - 1).bit_length()), device)
    return wide[:, wide.shape[1] - n_keys :]


@functools.lru_cache(maxsize=32)
def _wide_mask(n_queries: int, width: int, device: torch.device) -> torch.Tensor:
    return lower_right_causal_mask(n_queries, width).to(device)


def window_attention(
    q: torch.Tensor,  # (H, C, D) the new tokens' queries, not rotated
    keys: torch.Tensor,  # (Hkv, N, D) the assembled window, not rotated; its last C are the new tokens
    values: torch.Tensor,  # (Hkv, N, D)
    cos: torch.Tensor,  # (N, D) at each key's position
    sin: torch.Tensor,  # (N, D)
    scaling: float,
    n_probe: int,  # the last queries whose attention is summed per key (0: none)
    backend: Backend = "auto",
    padding: tuple[int, int, torch.Tensor] | None = None,  # (first, capacity, used (1,) int32): columns
    # first + used .. first + capacity are empty
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (H, C, D) output; (Hkv, N) float32 received mass, or None
    if use_triton(backend, q.device) and q.shape[-1] in (32, 64, 128):
        return _window_attention_triton(q, keys, values, cos, sin, scaling, n_probe, padding)
    return window_attention_torch(q, keys, values, cos, sin, scaling, n_probe, padding)


def window_attention_torch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, scaling: float, n_probe: int,
                           padding: tuple[int, int, torch.Tensor] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    n_new, n_keys = q.shape[1], keys.shape[1]
    q_rot = apply_rotary(q, cos[-n_new:], sin[-n_new:])  # (H, C, D)
    k_rot = apply_rotary(keys, cos, sin)  # (Hkv, N, D)
    mask = None if n_keys == n_new else causal_mask(n_new, n_keys, q.device)
    key_ok = None if padding is None else _filled(padding, n_keys, q.device)  # (N,)
    if key_ok is not None:
        mask = key_ok[None] if mask is None else mask & key_ok[None]
    out = F.scaled_dot_product_attention(
        q_rot[None], k_rot[None], values[None], attn_mask=mask, is_causal=mask is None and n_new > 1,
        scale=scaling, enable_gqa=True,
    )[0]  # (H, C, D)
    if n_probe == 0:
        return out, None
    return out, _received_torch(q_rot, k_rot, scaling, min(n_probe, n_new), key_ok)


def _filled(padding: tuple[int, int, torch.Tensor], n_keys: int, device: torch.device) -> torch.Tensor:  # (N,) bool
    first, capacity, used = padding
    cols = torch.arange(n_keys, device=device)
    return (cols < first + used) | (cols >= first + capacity)


def _received_torch(q_rot: torch.Tensor, k_rot: torch.Tensor, scaling: float, s: int,
                    key_ok: torch.Tensor | None = None) -> torch.Tensor:  # (Hkv, N)
    h, _, d = q_rot.shape
    hkv, n_keys = k_rot.shape[0], k_rot.shape[1]
    probe = q_rot[:, -s:].float().reshape(hkv, (h // hkv) * s, d)  # (Hkv, G*s, D)
    logits = (probe @ k_rot.float().transpose(1, 2) * scaling).view(hkv, h // hkv, s, n_keys)  # (Hkv, G, s, N)
    # Causality only bites inside the last s keys (the probing queries themselves).
    logits[..., n_keys - s :].masked_fill_(~causal_mask(s, s, q_rot.device), float("-inf"))
    if key_ok is not None:
        logits.masked_fill_(~key_ok, float("-inf"))
    return logits.softmax(dim=-1).sum(dim=(1, 2))  # (Hkv, N)


def _window_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, scaling: float, n_probe: int,
                             padding: tuple[int, int, torch.Tensor] | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    h, n_new, d = q.shape
    hkv, n_keys = keys.shape[0], keys.shape[1]
    # the kernels index the head dim (and the tables' rows) with unit stride
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(h, n_new, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(h, n_new, dtype=torch.float32, device=q.device)  # log2-sum-exp2 of each query's scores
    block = 16 if n_new <= 16 else 64
    # the empty columns; without padding the kernels never read `used` (any pointer will do)
    pad_from, pad_to, used = (0, 0, lse) if padding is None else (padding[0], padding[0] + padding[1], padding[2])
    _attention_kernel[(triton.cdiv(n_new, block), h)](
        q, keys, values, cos, sin, out, lse, used, pad_from, pad_to,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        out.stride(0), out.stride(1), cos.stride(0),
        n_new, n_keys, h // hkv, scaling,
        # float32 stays float32 (a GPU's tl.dot would take TF32); half precision inputs ignore it
        HALF=d // 2, BLOCK_M=block, BLOCK_N=64, PRECISION="ieee" if keys.dtype == torch.float32 else "tf32",
        PADDED=padding is not None,
    )
    if n_probe == 0:
        return out, None
    received = torch.empty(hkv, n_keys, dtype=torch.float32, device=q.device)
    _received_kernel[(triton.cdiv(n_keys, 64), hkv)](
        q, keys, cos, sin, lse, received, used, pad_from, pad_to,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), cos.stride(0),
        n_new, n_keys, min(n_probe, n_new), scaling,
        GROUP=h // hkv, HALF=d // 2, BLOCK_M=16, BLOCK_N=64, PADDED=padding is not None,
    )
    return out, received


if triton is not None:
    # scores are kept in log2 units: exp2 is the cheap exponential (a constexpr: compiled kernels read no
    # other globals)
    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _rotated(ptr, rows, row_stride, ok, cos_ptr, sin_ptr, trig_stride, positions, half: tl.constexpr):
        """Both halves of rows of a (., D) matrix, rotated at `positions`: (R, D/2) float32 each."""
        d = tl.arange(0, half)
        x1 = tl.load(ptr + rows[:, None] * row_stride + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(ptr + rows[:, None] * row_stride + half + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        at = positions[:, None] * trig_stride
        c1 = tl.load(cos_ptr + at + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + at + half + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + at + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + at + half + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2

    @triton.jit
    def _key_ok(cols, n_keys, USED, pad_from, pad_to, PADDED: tl.constexpr):
        """Which of `cols` hold a key: inside the window and, with padding, outside its empty columns."""
        ok = cols < n_keys
        if PADDED:
            ok = ok & ((cols < pad_from + tl.load(USED)) | (cols >= pad_to))
        return ok

    @triton.jit
    def _attention_kernel(Q, K, V, COS, SIN, OUT, LSE, USED, pad_from, pad_to, sq_h, sq_c, sk_h, sk_n, sv_h, sv_n,
                          so_h, so_c, s_trig, n_new, n_keys, group, scaling,
                          HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                          PADDED: tl.constexpr):
        head = tl.program_id(1)
        kv = head // group
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # the queries of this tile
        row_ok = rows < n_new
        pos = n_keys - n_new + rows  # each query's own key: it sees keys 0..pos
        q1, q2 = _rotated(Q + head * sq_h, rows, sq_c, row_ok, COS, SIN, s_trig, pos, HALF)
        dtype = K.dtype.element_ty
        q1, q2 = (q1 * (scaling * LOG2E)).to(dtype), (q2 * (scaling * LOG2E)).to(dtype)
        d = tl.arange(0, HALF)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc1 = tl.zeros((BLOCK_M, HALF), tl.float32)
        acc2 = tl.zeros((BLOCK_M, HALF), tl.float32)
        # Up to the tile's last visible key (tiles past n_keys, the last query tile's, are masked out whole).
        # A while loop: Triton's interpreter cannot take a program id in a range() bound.
        end = n_keys - n_new + (tl.program_id(0) + 1) * BLOCK_M
        start = 0
        while start < end:
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = _key_ok(cols, n_keys, USED, pad_from, pad_to, PADDED)
            k1, k2 = _rotated(K + kv * sk_h, cols, sk_n, col_ok, COS, SIN, s_trig, cols, HALF)
            scores = (tl.dot(q1, tl.trans(k1.to(dtype)), input_precision=PRECISION)
                      + tl.dot(q2, tl.trans(k2.to(dtype)), input_precision=PRECISION))  # (M, N) log2 units
            scores = tl.where(col_ok[None, :] & (cols[None, :] <= pos[:, None]), scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # a row that has seen no key yet (a tile of empty columns first) subtracts 0, not -inf - -inf = nan
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(scores - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_at = V + kv * sv_h + cols[:, None] * sv_n
            v1 = tl.load(v_at + d[None, :], mask=col_ok[:, None], other=0.0)
            v2 = tl.load(v_at + HALF + d[None, :], mask=col_ok[:, None], other=0.0)
            acc1 = acc1 * alpha[:, None] + tl.dot(p.to(dtype), v1, input_precision=PRECISION)
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(dtype), v2, input_precision=PRECISION)
            m_i = m_new
            start += BLOCK_N
        o_at = OUT + head * so_h + rows[:, None] * so_c
        tl.store(o_at + d[None, :], (acc1 / l_i[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(o_at + HALF + d[None, :], (acc2 / l_i[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + head * n_new + rows, m_i + tl.math.log2(l_i), mask=row_ok)

    @triton.jit
    def _received_kernel(Q, K, COS, SIN, LSE, RECEIVED, USED, pad_from, pad_to, sq_h, sq_c, sk_h, sk_n, s_trig,
                         n_new, n_keys, n_probe, scaling,
                         GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         PADDED: tl.constexpr):
        kv = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # the keys of this tile
        col_ok = _key_ok(cols, n_keys, USED, pad_from, pad_to, PADDED)
        k1, k2 = _rotated(K + kv * sk_h, cols, sk_n, col_ok, COS, SIN, s_trig, cols, HALF)
        total = tl.zeros((BLOCK_N,), tl.float32)
        for g in range(GROUP):
            head = kv * GROUP + g
            start = n_new - n_probe
            while start < n_new:
                rows = start + tl.arange(0, BLOCK_M)
                row_ok = rows < n_new
                pos = n_keys - n_new + rows
                q1, q2 = _rotated(Q + head * sq_h, rows, sq_c, row_ok, COS, SIN, s_trig, pos, HALF)
                # float32 throughout, as the twin: these weights rank keys, they do not feed the output
                scores = (tl.dot(q1, tl.trans(k1), input_precision="ieee")
                          + tl.dot(q2, tl.trans(k2), input_precision="ieee")) * (scaling * LOG2E)
                lse = tl.load(LSE + head * n_new + rows, mask=row_ok, other=0.0)
                visible = row_ok[:, None] & col_ok[None, :] & (cols[None, :] <= pos[:, None])
                total += tl.sum(tl.where(visible, tl.math.exp2(scores - lse[:, None]), 0.0), 0)
                start += BLOCK_M
        tl.store(RECEIVED + kv * n_keys + cols, total, mask=cols < n_keys)
