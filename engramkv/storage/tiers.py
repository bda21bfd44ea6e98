"""The two in-memory tiers above the disk: byte-bounded LRU caches.

    hot    decoded KV of (event, layer) on the compute device, in the model's dtype: what
           attention concatenates. Filled on demand and, when prefetch is on, for the next layer.
    warm   encoded event blobs (all layers) in host RAM: one disk read serves every layer.
    cold   the segment files (`segments.py`), memory-mapped.

Both caches are thread-safe because the prefetcher fills the hot tier from a worker thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

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
