"""``dram``: a bounded pool of chunks in this worker's host memory (entry point in kvbridge.tiers).

Chunks are immutable ``bytes`` objects in a dict; the manager keeps the LRU order and the
capacity. A chunk handed out by :meth:`DramTier.load` stays valid after it is evicted (the
caller holds a reference), which is what lets the manager pin a hit without copying it.
Non-blocking and thread-safe (one lock around the dict). Lost when the engine stops.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

from kvbridge.offload.tier import Tier, TierContext, check_chunk

__all__ = ["DramTier"]


class DramTier(Tier):
    """See the module docstring. Options: ``capacity_bytes`` (default 1 GiB)."""

    blocking: ClassVar[bool] = False
    medium: ClassVar[str] = "CPU"

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self._chunks: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def contains(self, keys: Sequence[str]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._chunks:
                    break
                n += 1
            return n

    def load(self, keys: Sequence[str]) -> list[bytes]:
        out: list[bytes] = []
        with self._lock:
            for key in keys:
                chunk = self._chunks.get(key)
                if chunk is None:
                    break
                out.append(chunk)
        return out

    def store(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        stored = []
        for key, data in items:
            check_chunk(self.ctx, key, data)
            chunk = bytes(data)  # a private immutable copy
            with self._lock:
                self._chunks[key] = chunk
            stored.append(key)
        return stored

    def evict(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._chunks.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
