"""Direct arrival, the scheduler's bookkeeping: which finished receives vLLM may be told of
before the workers' step output reports them, and which of those reports to drop afterwards.

Every worker rank sends an :class:`~kvbridge.scheduling.wake.Arrival` the moment its share of a
request's KV is in place. :class:`DirectArrivals` collects them per request; once every one of
the engine's tensor-parallel ranks has reported the transfer the request currently waits for,
the request is *ready*: the connector tells vLLM's scheduler, which schedules it in its very
next step (:mod:`kvbridge.integrations.vllm`). The ranks report the same receive again in their
step output, as they always do (that stays the authority: an arrival may be lost); the ones vLLM
was already told of are dropped from that output, so it learns of each receive exactly once.

An arrival for another transfer than the one the request waits for (a stale one, or one from a
rank number this engine does not have) is refused and counted. Nothing here imports vLLM; one
thread (the engine's) calls every method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvbridge.scheduling.wake import Arrival

__all__ = ["DirectArrivals"]


class DirectArrivals:
    """See the module docstring. ``receiving(req_id)`` is the transfer id of the request's
    receive in progress, or None (:meth:`kvbridge.scheduling.handoff.HandoffBook.receiving`)."""

    def __init__(self, tp_size: int, receiving: Callable[[str], str | None]) -> None:
        self.tp_size = tp_size
        self._receiving = receiving
        self._ranks: dict[str, tuple[str, set[int]]] = {}  # req_id -> (transfer_id, ranks)
        self._told: set[str] = set()

    def ready(self, arrivals: Iterable[Arrival]) -> tuple[set[str], int]:
        """``(requests whose every rank has arrived, arrivals refused as stale)``."""
        ready: set[str] = set()
        stale = 0
        for a in arrivals:
            tid = self._receiving(a.req_id)
            if tid is None or tid != a.transfer_id or not 0 <= a.rank < self.tp_size:
                stale += 1
                continue
            known = self._ranks.get(a.req_id)
            if known is None or known[0] != tid:
                known = self._ranks[a.req_id] = (tid, set())
            known[1].add(a.rank)
            if len(known[1]) == self.tp_size:
                del self._ranks[a.req_id]
                ready.add(a.req_id)
        return ready, stale

    def told(self, req_ids: Iterable[str]) -> None:
        """vLLM was told these receives finished: drop the workers' report of them later."""
        self._told.update(req_ids)

    def reported(self, finished_recving: Iterable[str]) -> set[str]:
        """The workers reported these receives finished: the ones vLLM already knows of (to
        drop from that report). Partial arrivals of every reported request are forgotten."""
        recving = set(finished_recving)
        for req_id in recving:
            self._ranks.pop(req_id, None)
        early = recving & self._told
        self._told -= early
        return early

    def forget(self, req_id: str) -> None:
        """The request ended: forget its partial arrivals (a told one is still reported)."""
        self._ranks.pop(req_id, None)

    def __len__(self) -> int:
        """Requests with some, not all, ranks arrived plus receives told and not yet reported."""
        return len(self._ranks) + len(self._told)
