"""A tensor that grows along one dim: the in-RAM memory's KV, representatives and columns."""

from __future__ import annotations

import torch


class GrowingBuffer:
    """A tensor growing along one dim with capacity doubling (amortised O(1) appends)."""

    def __init__(self, shape_before: tuple[int, ...], shape_after: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | None = None):
        self.before, self.after, self.dtype, self.device = shape_before, shape_after, dtype, device
        self.data = torch.empty((*shape_before, 64, *shape_after), dtype=dtype, device=device)
        self.size = 0

    @property
    def dim(self) -> int:
        return len(self.before)

    def append(self, block: torch.Tensor) -> None:
        n = block.shape[self.dim]
        capacity = self.data.shape[self.dim]
        if self.size + n > capacity:
            new_capacity = max(2 * capacity, self.size + n)
            grown = torch.empty((*self.before, new_capacity, *self.after), dtype=self.dtype, device=self.device)
            grown.narrow(self.dim, 0, self.size).copy_(self.data.narrow(self.dim, 0, self.size))
            self.data = grown
        self.data.narrow(self.dim, self.size, n).copy_(block)
        self.size += n

    def view(self) -> torch.Tensor:
        return self.data.narrow(self.dim, 0, self.size)
