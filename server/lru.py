"""``LRUCache``: a bounded, thread-safe map that drops its least recently used entry.

For what never changes once written, so that nothing needs invalidating: a device's token hash and user (fixed at
enrollment; devices are never re-keyed or deleted) and a compiled program's manifest (a program row is written once
and never deleted). Each API process keeps its own; a miss reads the database.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    def __init__(self, size: int) -> None:
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)
