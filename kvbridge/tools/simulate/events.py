"""The discrete-event core: a clock with a queue of callbacks, and the two shared resources.

- :class:`EventLoop`: callbacks ordered by (time, insertion order); time never goes backwards
  (scheduling in the past is a :class:`SimulationError`).
- :class:`Server`: a FIFO single server (a background thread that posts transfers one after the
  other): a job submitted at ``t`` costing ``c`` finishes at ``max(t, free) + c``.
- :class:`Nic`: one endpoint's share of the fabric (per rank); a transfer reserves P's and D's
  NIC together, FIFO in submission order (:func:`reserve`).

Single-threaded and deterministic: the same inputs give the same event order.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from kvbridge.errors import KVBridgeError

__all__ = ["SimulationError", "EventLoop", "Server", "Nic", "reserve"]

_EPS = 1e-12


class SimulationError(KVBridgeError):
    """The model reached a state that must not happen (a broken invariant), or a request can
    never be served by the fleet as configured (e.g. a prompt larger than the KV pool)."""


class EventLoop:
    """A clock and its pending callbacks."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(t, *args)`` at time ``t`` (>= now)."""
        if t < self.now - _EPS or t != t:
            raise SimulationError(f"event scheduled at {t!r}, before now ({self.now!r})")
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))
        self._seq += 1

    def run(self, max_events: int = 50_000_000) -> None:
        """Run until no event is left (SimulationError after ``max_events``: a livelock)."""
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            if self.events > max_events:
                raise SimulationError(f"more than {max_events} events: the model does not settle")
            fn(t, *args)


class Server:
    """A FIFO single server; :meth:`run` returns when a job submitted now finishes."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def run(self, t: float, cost: float) -> float:
        start = max(t, self.free_at)
        self.free_at = start + cost
        self.busy_s += cost
        return self.free_at


class Nic:
    """One engine's fabric endpoint (per rank)."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0


def reserve(src: Nic, dst: Nic, t: float, service: float, latency: float) -> float:
    """Reserve both endpoints for one transfer submitted at ``t``; when its last byte lands."""
    start = max(t, src.free_at, dst.free_at)
    src.free_at = dst.free_at = start + service
    src.busy_s += service
    dst.busy_s += service
    return start + service + latency
