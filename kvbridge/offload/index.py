"""The scheduler's view of a tier as the manager keeps it: a LookupBuffer of tier keys.

:func:`tier_index` is a :class:`~kvbridge.lookup.LookupBuffer` home (no leases, the least
recently used evicted to make room). Each key's value is the vLLM block hash the KV events of the
tier name it by (:mod:`kvbridge.offload.events`), or None when events are off or the key was
found at start-up. :func:`hold` inserts or touches a chain of keys. Owned under the manager's
lock; nothing here locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvbridge.lookup import LookupBuffer, Overflow

__all__ = ["tier_index", "hold", "TierIndex", "KNOWN_KEYS"]

#: how many keys per unmanaged tier the manager remembers as stored (skips re-storing)
KNOWN_KEYS = 1 << 16

#: tier key → the vLLM block hash of its KV (None: unknown)
TierIndex = LookupBuffer[str, bytes | None]


def tier_index(name: str, chunks: int, *,
               clock: Callable[[], float] = time.monotonic) -> TierIndex:
    """The scheduler's view of one tier: the content keys it holds, at most ``chunks`` of
    them, no leases, the least recently used evicted to make room."""
    return LookupBuffer(f"offload tier {name}", chunks, overflow=Overflow.EVICT_LRU,
                        clock=clock)


def hold(index: TierIndex, keys: Sequence[str],
         hashes: Sequence[bytes | None] | None = None) -> list[tuple[str, bytes | None]]:
    """Insert or touch ``keys`` in ``index``, last to first (so a chain's head is used most
    recently and evicted last), with their block ``hashes`` when given (a key already held
    keeps a hash it has); return the ``(key, hash)`` entries evicted to make room."""
    evicted: list[tuple[str, bytes | None]] = []
    for i in range(len(keys) - 1, -1, -1):
        key = keys[i]
        if index.touch((key,)):
            if hashes is not None and hashes[i] is not None and index[key] is None:
                index.discard(key)
                evicted.extend(index.insert(key, hashes[i]))
            continue
        evicted.extend(index.insert(key, None if hashes is None else hashes[i]))
    return evicted
