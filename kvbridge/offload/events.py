"""The KV-events stream of one rank's offload tiers: a bounded FIFO pipe the manager's threads
fill and the worker drains once a step.

Routers that place requests by prefix (Dynamo's KV router, llm-d's precise prefix-cache scorer)
read vLLM's KV events: ``BlockStored`` / ``BlockRemoved`` with vLLM's block hashes and a storage
medium. kvbridge's tiers add their own: when a tier stored chunks, and when a managed tier
evicted some (a tier that evicts on its own server — Mooncake Store, LMCache remote — cannot say
when, and publishes stores only). The scheduler turns them into vLLM's event classes and vLLM
publishes them with its own (``--kv-events-config``; :mod:`kvbridge.integrations.vllm_events`).

Contract:

- :meth:`TierEvents.stored` / :meth:`TierEvents.removed` are called by the manager's threads,
  never block (the pipe holds :data:`MAX_EVENTS`; past it an event is dropped and counted
  through ``on_drop``, ``offload_kv_events_dropped``: a slow consumer never stalls a tier), and
  ignore hashes that are
  None (blocks whose vLLM hash is unknown: found at start-up, or stored with events off).
- :meth:`TierEvents.take` is called by the worker once a step and returns what arrived, in
  order. Only rank 0 streams (every rank stores its own shard of the same blocks).
- A disabled stream (:attr:`enabled` False) records nothing and costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.errors import PipeClosed
from kvbridge.transports.pipe import memory_pipe

__all__ = ["TierEvent", "TierEvents", "MAX_EVENTS"]

#: events one rank holds for the worker to take; past it they are dropped (and counted)
MAX_EVENTS = 65536


@dataclass(frozen=True)
class TierEvent:
    """Blocks a tier stored (``kind`` "stored") or evicted ("removed"), by vLLM block hash."""

    kind: str
    tier: str
    medium: str
    hashes: tuple[bytes, ...]


class TierEvents:
    """See the module docstring."""

    def __init__(self, enabled: bool, capacity: int = MAX_EVENTS,
                 on_drop: Callable[[int], None] = lambda n: None) -> None:
        self.enabled = enabled
        self._tx, self._rx = memory_pipe(capacity, sender="tier-events", kind=TierEvent)
        self._on_drop = on_drop  # thread-safe: called from the manager's threads

    def stored(self, tier: str, medium: str, hashes: Sequence[bytes | None]) -> None:
        self._send("stored", tier, medium, hashes)

    def removed(self, tier: str, medium: str, hashes: Sequence[bytes | None]) -> None:
        self._send("removed", tier, medium, hashes)

    def _send(self, kind: str, tier: str, medium: str, hashes: Sequence[bytes | None]) -> None:
        known = tuple(h for h in hashes if h is not None)
        if not (self.enabled and known):
            return
        try:
            self._tx.send(TierEvent(kind, tier, medium, known), timeout=0)
        except (TimeoutError, PipeClosed):
            self._on_drop(1)

    def take(self) -> list[TierEvent]:
        """Every event sent since the last call, in order (never blocks)."""
        out: list[TierEvent] = []
        while self.enabled:
            try:
                out.append(self._rx.recv(timeout=0)[1])
            except (TimeoutError, PipeClosed):
                break
        return out

    def close(self) -> None:
        self._tx.close()
