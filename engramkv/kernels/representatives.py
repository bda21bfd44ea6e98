"""Representative search: score queries against every layer's event representatives, exact top-k.

One call scores L layers at once: `reps` (L, E, Dq) against `queries` (L, Dq), the k best events per
layer by inner product, as `torch.topk` returns them (values descending, their indices).

- `search_torch`, the twin: a batched matrix-vector product and `torch.topk`.
- `_search_triton`: one launch over (event tile, layer); each program scores its tile and keeps the
  tile's own k best by k rounds of argmax. Every event of the global top k is in its tile's top k, so a
  final `torch.topk` over the tiles' candidates is exact (ReAttention's published kernel keeps one
  candidate per tile, which is not).
"""

from __future__ import annotations

import torch

from engramkv.kernels.backend import Backend, triton_installed, use_triton

if triton_installed():
    import triton
    import triton.language as tl
else:  # the twin needs no Triton
    triton = tl = None

TILE = 128  # events per program


def search(reps: torch.Tensor, queries: torch.Tensor, k: int, backend: Backend = "auto"
           ) -> tuple[torch.Tensor, torch.Tensor]:  # (L, k') scores, (L, k') long event ids; k' = min(k, E)
    k = min(k, reps.shape[1])
    if k <= 0:
        empty = reps.new_empty(reps.shape[0], 0, dtype=torch.float32)
        return empty, empty.long()
    # On an H200 the kernel took 0.53 ms where the twin took 0.29 (25,000 events, 30 layers, top 32;
    # benchmarks/results/gpu/gpu.md): it does not pay, so 'auto' keeps the twin and only 'triton' runs it.
    if backend == "triton" and use_triton(backend, reps.device) and k <= TILE:
        return _search_triton(reps, queries, k)
    return search_torch(reps, queries, k)


def search_torch(reps: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.bmm(reps.float(), queries.float()[:, :, None])[:, :, 0]  # (L, E)
    top = torch.topk(scores, k, dim=1)
    return top.values, top.indices


def _search_triton(reps: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_layers, n_events, dim = reps.shape
    reps, queries = (t if t.stride(-1) == 1 else t.contiguous() for t in (reps, queries))
    tiles = triton.cdiv(n_events, TILE)
    width = triton.next_power_of_2(k)  # candidates kept per tile (the extra ones are -inf)
    values = torch.empty(n_layers, tiles * width, dtype=torch.float32, device=reps.device)
    indices = torch.empty(n_layers, tiles * width, dtype=torch.long, device=reps.device)
    _tile_topk_kernel[(tiles, n_layers)](
        reps, queries, values, indices, n_events, dim,
        reps.stride(0), reps.stride(1), queries.stride(0), tiles,
        K=k, WIDTH=width, BLOCK_E=TILE, BLOCK_D=64,
    )
    top = torch.topk(values, k, dim=1)  # (L, k) over every tile's candidates
    return top.values, indices.gather(1, top.indices)


if triton is not None:

    @triton.jit
    def _tile_topk_kernel(REPS, QUERIES, VALUES, INDICES, n_events, dim, s_layer, s_event, sq_layer, tiles,
                          K: tl.constexpr, WIDTH: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
        tile, layer = tl.program_id(0), tl.program_id(1)
        rows = tile * BLOCK_E + tl.arange(0, BLOCK_E)
        ok = rows < n_events
        scores = tl.zeros((BLOCK_E,), tl.float32)
        d0 = 0
        while d0 < dim:  # (a while loop: Triton's interpreter cannot take a runtime range() bound)
            d = d0 + tl.arange(0, BLOCK_D)
            r = tl.load(REPS + layer * s_layer + rows[:, None] * s_event + d[None, :],
                        mask=ok[:, None] & (d[None, :] < dim), other=0.0).to(tl.float32)
            q = tl.load(QUERIES + layer * sq_layer + d, mask=d < dim, other=0.0).to(tl.float32)
            scores += tl.sum(r * q[None, :], 1)
            d0 += BLOCK_D
        scores = tl.where(ok, scores, float("-inf"))
        slots = tl.arange(0, WIDTH)
        best = tl.full((WIDTH,), float("-inf"), tl.float32)
        at = tl.zeros((WIDTH,), tl.int64)
        for t in tl.static_range(K):  # the tile's k best, best first
            top = tl.max(scores, 0)
            where = tl.argmax(scores, 0)
            best = tl.where(slots == t, top, best)
            at = tl.where(slots == t, tile * BLOCK_E + where, at)
            scores = tl.where(tl.arange(0, BLOCK_E) == where, float("-inf"), scores)
        out = layer * tiles * WIDTH + tile * WIDTH + slots
        tl.store(VALUES + out, best)
        tl.store(INDICES + out, at)
