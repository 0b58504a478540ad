"""Per-transfer observations of one rank, for histograms in vLLM's stats (vLLM-free).

The transfer loop records one sample per finished transfer (mode, backend, peer, outcome,
seconds on the wire, bytes, descriptors) and one per finished hand-off (D: the load started →
the KV usable, for pull the claim, READ and confirmation together; for push the registration
until P's DONE). The worker's stats hook drains them once per engine step.

Bounded twice: at most :data:`MAX_SAMPLES` samples wait between two drains (more are counted
in ``dropped`` and lost), and peer labels are the first :data:`MAX_PEERS` distinct peer engine
ids this rank met; every later peer is ``other``. Label values are therefore a fixed set per
deployment, whatever peers or clients send.

Thread safety: :meth:`Observations.transfer` and :meth:`Observations.handoff` are called from
the loop thread, :meth:`Observations.drain` from the model-runner thread; one lock guards the
buffers (a few appends per transfer, one swap per step).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Observations", "MAX_SAMPLES", "MAX_PEERS", "OTHER"]

MAX_SAMPLES = 4096
MAX_PEERS = 16
OTHER = "other"


class Observations:
    """See the module docstring."""

    def __init__(self, backend: str) -> None:
        self.backend = backend[:64]
        self._lock = threading.Lock()
        self._peers: dict[str, str] = {}
        self._transfers: list[list[Any]] = []
        self._handoffs: list[list[Any]] = []
        self._dropped = 0

    def peer_label(self, engine_id: str) -> str:
        """The bounded label of peer ``engine_id`` (its id, or ``other`` past the first 16)."""
        label = self._peers.get(engine_id)
        if label is None:
            if len(self._peers) >= MAX_PEERS:
                return OTHER
            label = self._peers[engine_id] = engine_id[:64]
        return label

    def transfer(self, mode: str, peer: str, ok: bool, seconds: float, nbytes: int,
                 descriptors: int, backend: str | None = None) -> None:
        """One finished READ/WRITE (a whole request's, or all layers of a layer-wise push)."""
        self._add(self._transfers, [mode, backend or self.backend, self.peer_label(peer),
                                    "ok" if ok else "failed", max(0.0, float(seconds)),
                                    int(nbytes), int(descriptors)])

    def handoff(self, mode: str, peer: str, seconds: float, backend: str | None = None) -> None:
        """One finished hand-off on D (see the module docstring)."""
        self._add(self._handoffs, [mode, backend or self.backend, self.peer_label(peer),
                                   max(0.0, float(seconds))])

    def _add(self, into: list[list[Any]], sample: list[Any]) -> None:
        with self._lock:
            if len(self._transfers) + len(self._handoffs) >= MAX_SAMPLES:
                self._dropped += 1
                return
            into.append(sample)

    def drain(self) -> dict[str, Any]:
        """The samples since the last drain (empty dict when none):
        ``{"transfers": [[mode, backend, peer, outcome, seconds, bytes, descriptors], …],
        "handoffs": [[mode, backend, peer, seconds], …], "dropped": n}``."""
        with self._lock:
            transfers, self._transfers = self._transfers, []
            handoffs, self._handoffs = self._handoffs, []
            dropped, self._dropped = self._dropped, 0
        out: dict[str, Any] = {}
        if transfers:
            out["transfers"] = transfers
        if handoffs:
            out["handoffs"] = handoffs
        if dropped:
            out["dropped"] = dropped
        return out
