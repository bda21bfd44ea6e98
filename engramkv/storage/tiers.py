"""The two in-memory tiers above the disk: byte-bounded LRU caches.

    hot    decoded KV of (event, layer) on the compute device, in the model's dtype: what
           attention concatenates. Filled on demand and, when prefetch is on, for the next layer; with
           write-through, also each new event's exact KV as it is stored, until the next commit (`HotTier`).
    warm   encoded event blobs (all layers) in host RAM: one disk read serves every layer.
    cold   the segment files (`segments.py`), memory-mapped.

Both caches are thread-safe because the prefetcher fills the hot tier from a worker thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch

Key = TypeVar("Key")
Value = TypeVar("Value")


class LRUBytes(Generic[Key, Value]):
    """Least-recently-used cache bounded by the total size of its values (as `size_of` counts it)."""

    def __init__(self, capacity_bytes: int, size_of: Callable[[Value], int]):
        self.capacity = capacity_bytes
        self.size_of = size_of
        self.bytes = 0
        self._items: OrderedDict[Key, Value] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Key) -> Value | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: Key, value: Value) -> None:
        size = self.size_of(value)
        if size > self.capacity:  # would evict everything and still not fit
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= self.size_of(old)
            self._items[key] = value
            self.bytes += size
            while self.bytes > self.capacity:
                _, evicted = self._items.popitem(last=False)
                self.bytes -= self.size_of(evicted)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)


class HotTier(LRUBytes[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]):
    """The hot tier: (keys, values) (Hkv, T, D) of (event, layer) on `device` in `dtype`, LRU by bytes.

    With `write_through`, a new event's exact KV goes in as it is stored (`stored`): while a session reads on,
    recalls of it skip the codec's error and its decode. Those entries are held beside the LRU, not evicted
    by it (at most one commit interval's KV): an exact entry evicted part-way through an interval was read
    through the codec again, and a lowrank store lost a 64k passkey that way. A commit empties the tier
    (`committed`): a run resumed from that commit starts with an empty one, and one that goes on must read as
    it will, or the two would cut different events (exact and decoded KV differ). A read-only namespace writes
    nothing through: no commit would ever empty the tier.
    """

    def __init__(self, capacity_bytes: int, device: torch.device, dtype: torch.dtype, write_through: bool):
        super().__init__(capacity_bytes, lambda kv: kv[0].nbytes + kv[1].nbytes)
        self.device, self.dtype, self.write_through = device, dtype, write_through
        self._exact: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # written through, until a commit
        self.exact_bytes = 0

    @property
    def held_bytes(self) -> int:
        """The LRU's bytes and the written-through ones."""
        return self.bytes + self.exact_bytes

    def get(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            exact = self._exact.get(key)
        return exact if exact is not None else super().get(key)

    def __contains__(self, key: tuple[int, int]) -> bool:
        with self._lock:
            if key in self._exact:
                return True
        return super().__contains__(key)

    def stored(self, event_id: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # (L, Hkv, T, D) each
        if self.write_through:
            for layer in range(len(keys)):  # copies: the caller's window buffers move on
                kv = (keys[layer].to(self.device, self.dtype, copy=True),
                      values[layer].to(self.device, self.dtype, copy=True))
                with self._lock:
                    self._exact[(event_id, layer)] = kv
                    self.exact_bytes += self.size_of(kv)

    def committed(self) -> None:
        if self.write_through:
            self.clear()

    def clear(self) -> None:
        super().clear()
        with self._lock:
            self._exact.clear()
            self.exact_bytes = 0


class Prefetcher:
    """One background thread that decodes the next layer's recalled blocks while this layer attends (on CUDA),
    or, off, nothing. `wait` before anything else touches the tiers it fills, so their order is not timing's."""

    def __init__(self, on: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engramkv-prefetch") if on else None
        self._running: Future[Any] | None = None

    @property
    def on(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._pool is not None:
            self._running = self._pool.submit(fn, *args)

    def wait(self) -> None:
        if self._running is not None:
            self._running.result()
            self._running = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
