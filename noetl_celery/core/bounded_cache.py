"""A process-local cache of decoded values, least recently used dropped first, bounded by the
JSON size of what it holds. Used by the store's values read by reference (store/blobs.py) and the
cursor frames a process read (engine/decision/cursor_loop.py). Imports nothing of the package."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any


class SizeBoundedCache:
    """Values under keys of the caller's, at most `bound()` JSON bytes in all (read at each
    `hold`); a value above the bound is not held."""

    def __init__(self, bound: Callable[[], int]) -> None:
        self._values: OrderedDict[Hashable, tuple[int, Any]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._bound = bound

    def lookup(self, key: Hashable, default: Any = None) -> Any:
        """The value held under `key` (`default` when none is)."""
        with self._lock:
            found = self._values.get(key)
            if found is None:
                return default
            self._values.move_to_end(key)
            return found[1]

    def hold(self, key: Hashable, size: int, value: Any) -> None:
        """Hold `value` (`size`: its JSON bytes) under `key`; a value above the bound is not held."""
        bound = self._bound()
        if size > bound:
            return
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= old[0]
            self._values[key] = (size, value)
            self._bytes += size
            while self._bytes > bound:
                _, (dropped, _) = self._values.popitem(last=False)
                self._bytes -= dropped

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[Hashable]:
        with self._lock:
            return iter(list(self._values))

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._bytes = 0
