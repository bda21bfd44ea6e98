"""Gather recalled tokens out of quantised KV and dequantise them, in one pass.

The codes and parameters are those of `storage.codec`'s int8/int4/int2 layout (keys per channel: one
scale and zero per event, KV head and dim; values per token: one per KV head and token), held as an
arena: every event's codes of one layer joined along the tokens, and the parameters beside them
(`storage.codec.quant_parts` splits one encoded layer into these tensors). A gather names arena rows
(`rows`) and each row's event (`events`), and returns keys and values in the compute dtype, as the
codec's own decoding gives them (float32 arithmetic, rounded to float16, then to `dtype`).

- `gather_torch`, the twin: index, unpack, `addcmul`.
- `_gather_triton`: one program per (token tile, KV head) loads the packed bytes, shifts the codes out
  and applies scale and zero in registers: only the gathered tokens' bytes cross memory. Written for
  power-of-two head dims; others take the twin.
"""

from __future__ import annotations

import torch

from engramkv.kernels.backend import Backend, triton_installed, use_triton

if triton_installed():
    import triton
    import triton.language as tl
else:  # the twin needs no Triton
    triton = tl = None


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:  # (..., D * bits / 8) uint8 -> (..., D)
    """Element i of a row sits in byte i // (8 / bits), at bit (i % (8 / bits)) * bits."""
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (bits * j)) & mask for j in range(8 // bits)], dim=-1).flatten(-2)


def gather(
    k_codes: torch.Tensor,  # (Hkv, T, D * bits / 8) uint8, the arena's key codes
    v_codes: torch.Tensor,  # (Hkv, T, D * bits / 8) uint8
    k_scale: torch.Tensor,  # (E, Hkv, D) float16, per event
    k_zero: torch.Tensor,  # (E, Hkv, D) float16
    v_scale: torch.Tensor,  # (Hkv, T) float16, per token
    v_zero: torch.Tensor,  # (Hkv, T) float16
    rows: torch.Tensor,  # (M,) long: the arena rows to gather, in order
    events: torch.Tensor,  # (M,) long: each row's event (its row of k_scale)
    bits: int,
    dtype: torch.dtype,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values (Hkv, M, D) in dtype
    head_dim = k_codes.shape[-1] * 8 // bits
    if use_triton(backend, k_codes.device) and head_dim & (head_dim - 1) == 0 and rows.numel() > 0:
        return _gather_triton(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, rows, events, bits, dtype)
    return gather_torch(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, rows, events, bits, dtype)


def gather_torch(k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                 v_scale: torch.Tensor, v_zero: torch.Tensor, rows: torch.Tensor, events: torch.Tensor, bits: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    def codes(packed: torch.Tensor) -> torch.Tensor:  # (Hkv, M, D) float32
        picked = packed.index_select(1, rows)
        return (picked if bits == 8 else unpack_codes(picked, bits)).float()

    scale = k_scale.index_select(0, events).transpose(0, 1).float()  # (Hkv, M, D)
    zero = k_zero.index_select(0, events).transpose(0, 1).float()
    keys = torch.addcmul(zero, codes(k_codes), scale).half().to(dtype)
    v_s = v_scale.index_select(1, rows).float()[..., None]  # (Hkv, M, 1)
    v_z = v_zero.index_select(1, rows).float()[..., None]
    return keys, torch.addcmul(v_z, codes(v_codes), v_s).half().to(dtype)


def _gather_triton(k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                   v_scale: torch.Tensor, v_zero: torch.Tensor, rows: torch.Tensor, events: torch.Tensor, bits: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    hkv, n_out = k_codes.shape[0], rows.shape[0]
    head_dim = k_codes.shape[-1] * 8 // bits
    keys = torch.empty(hkv, n_out, head_dim, dtype=dtype, device=k_codes.device)
    values = torch.empty_like(keys)
    k_codes, v_codes, k_scale, k_zero = (t.contiguous() for t in (k_codes, v_codes, k_scale, k_zero))
    v_scale, v_zero, rows, events = v_scale.contiguous(), v_zero.contiguous(), rows.contiguous(), events.contiguous()
    block = 32
    _gather_kernel[(triton.cdiv(n_out, block), hkv)](
        k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, rows, events, keys, values,
        n_out, k_codes.shape[1], hkv,
        D=head_dim, BITS=bits, BLOCK_T=block,
    )
    return keys, values


if triton is not None:

    @triton.jit
    def _gather_kernel(KC, VC, KS, KZ, VS, VZ, ROWS, EVENTS, KOUT, VOUT, n_out, n_arena, n_heads,
                       D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr):
        head = tl.program_id(1)
        m = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = m < n_out
        row = tl.load(ROWS + m, mask=ok, other=0)
        event = tl.load(EVENTS + m, mask=ok, other=0)
        d = tl.arange(0, D)
        width: tl.constexpr = D * BITS // 8  # bytes per token and head
        per_byte: tl.constexpr = 8 // BITS
        byte = d // per_byte
        shift = ((d % per_byte) * BITS).to(tl.uint8)
        code_at = (head * n_arena + row[:, None]) * width + byte[None, :]  # (T, D)
        k_code = ((tl.load(KC + code_at, mask=ok[:, None], other=0) >> shift[None, :]) & ((1 << BITS) - 1))
        v_code = ((tl.load(VC + code_at, mask=ok[:, None], other=0) >> shift[None, :]) & ((1 << BITS) - 1))
        param_at = (event[:, None] * n_heads + head) * D + d[None, :]
        k_scale = tl.load(KS + param_at, mask=ok[:, None], other=0.0).to(tl.float32)
        k_zero = tl.load(KZ + param_at, mask=ok[:, None], other=0.0).to(tl.float32)
        v_scale = tl.load(VS + head * n_arena + row, mask=ok, other=0.0).to(tl.float32)
        v_zero = tl.load(VZ + head * n_arena + row, mask=ok, other=0.0).to(tl.float32)
        key = (k_code.to(tl.float32) * k_scale + k_zero).to(tl.float16)
        value = (v_code.to(tl.float32) * v_scale[:, None] + v_zero[:, None]).to(tl.float16)
        out_at = (head * n_out + m[:, None]) * D + d[None, :]
        tl.store(KOUT + out_at, key.to(KOUT.dtype.element_ty), mask=ok[:, None])
        tl.store(VOUT + out_at, value.to(VOUT.dtype.element_ty), mask=ok[:, None])
