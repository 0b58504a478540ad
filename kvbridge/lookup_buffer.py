"""LookupBuffer: a bounded, keyed hand-off store with leases.

One side ``insert``s an entry under a key (a transfer_id) when it is ready; the matching side
``drop_select``s it when it shows up. Whichever arrives first waits in the buffer, under a lease
that ``extend`` (heartbeats) renews; ``expire`` removes and returns every entry whose lease ended,
scanning all entries (never only an ordered head). Capacity gives back-pressure: ``insert`` waits
for room up to its timeout and then raises :class:`LookupBufferFull`.

Thread-safe: every method takes one internal lock; ``drop_select`` and ``insert`` may block
(bounded by their timeouts), the others never do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvbridge.errors import KVBridgeError, LookupBufferFull

__all__ = ["LookupBuffer"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Slot(Generic[V]):
    value: V
    deadline: float


class LookupBuffer(Generic[K, V]):
    """See the module docstring. ``clock`` is injectable for tests."""

    def __init__(
        self,
        capacity: int = 4096,
        name: str = "lookup",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity <= 0:
            raise KVBridgeError(f"LookupBuffer capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.name = name
        self._clock = clock
        self._slots: dict[K, _Slot[V]] = {}
        self._cond = threading.Condition()

    def insert(self, key: K, value: V, lease_s: float, timeout: float | None = 0.0) -> None:
        """Store ``value`` under ``key`` for ``lease_s`` seconds.

        Waits up to ``timeout`` (None: forever) while full, then raises
        :class:`LookupBufferFull`. A key already present raises :class:`KVBridgeError`
        (a transfer_id is used once).
        """
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            if key in self._slots:
                raise KVBridgeError(f"{self.name}: key {key!r} is already present")
            while len(self._slots) >= self.capacity:
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    raise LookupBufferFull(
                        f"{self.name} is full ({self.capacity} entries); {key!r} not stored"
                    )
                self._cond.wait(left)
            self._slots[key] = _Slot(value, self._clock() + lease_s)
            self._cond.notify_all()

    def drop_select(self, key: K, timeout: float | None = 0.0) -> V | None:
        """Remove and return the entry under ``key``, waiting up to ``timeout`` for it.

        Returns None if it did not arrive in time. An expired entry still present (not yet
        reaped) is returned: expiry is decided by :meth:`expire` alone.
        """
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while key not in self._slots:
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            slot = self._slots.pop(key)
            self._cond.notify_all()
            return slot.value

    def peek(self, key: K) -> V | None:
        with self._cond:
            slot = self._slots.get(key)
            return None if slot is None else slot.value

    def extend(self, key: K, lease_s: float) -> bool:
        """Renew ``key``'s lease to at least now + ``lease_s``; False if absent."""
        with self._cond:
            slot = self._slots.get(key)
            if slot is None:
                return False
            slot.deadline = max(slot.deadline, self._clock() + lease_s)
            return True

    def expire(self) -> list[tuple[K, V]]:
        """Remove and return every entry whose lease has ended (full scan)."""
        now = self._clock()
        with self._cond:
            dead = [k for k, s in self._slots.items() if s.deadline <= now]
            out = [(k, self._slots.pop(k).value) for k in dead]
            if out:
                self._cond.notify_all()
            return out

    def next_deadline(self) -> float | None:
        """The earliest lease end, or None when empty."""
        with self._cond:
            return min((s.deadline for s in self._slots.values()), default=None)

    def items(self) -> list[tuple[K, V]]:
        with self._cond:
            return [(k, s.value) for k, s in self._slots.items()]

    def __len__(self) -> int:
        with self._cond:
            return len(self._slots)

    def __contains__(self, key: object) -> bool:
        with self._cond:
            return key in self._slots
