"""Per-transfer observations of one rank, for histograms in vLLM's stats (vLLM-free).

The transfer loop records one sample per finished transfer (mode, backend, peer, outcome,
seconds on the wire, bytes, descriptors) and one per finished hand-off (D: the load started →
the KV usable, for pull the claim, READ and confirmation together; for push the registration
until P's DONE). The worker's stats hook drains them once per engine step.

Bounded twice: at most :data:`MAX_SAMPLES` samples wait between two drains (more are counted
in ``dropped`` and lost), and peer labels are the first :data:`MAX_PEERS` peer engine ids
*admitted* (:meth:`Observations.admit`: the peer table calls it when a handshake with a proven
peer completed, i.e. the engine answered on the control address this rank dialled); every other
id, never admitted or admitted past the first 16, is ``other``. An id that only appears in a
message (a registration, a claim) never gets a label of its own, so junk ids cannot take the
labels from real peers. Label values are therefore a fixed set per deployment, whatever peers
or clients send.

The flight recorder (:mod:`kvbridge.scheduling.recorder`) adds one sample per phase it timed
(:meth:`Observations.phase`, from whichever thread marked the phase's end).

Thread safety: :meth:`Observations.admit`, :meth:`Observations.transfer` and
:meth:`Observations.handoff` are called from the loop thread, :meth:`Observations.drain` from
the model-runner thread; one lock guards the buffers (a few appends per transfer, one swap per
step).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Observations", "MAX_SAMPLES", "MAX_PEERS", "OTHER", "UNKNOWN", "EVENTS"]

MAX_SAMPLES = 4096
MAX_PEERS = 16
OTHER = "other"
#: The peer label of an event whose peer engine is not known here (e.g. P, about a decode
#: engine that dialled it).
UNKNOWN = "-"
#: Events counted with labels (mode, backend, peer): the failures an operator looks for.
EVENTS = ("lease_expired", "checksum_mismatch", "push_timeout", "transfer_timeout",
          "push_failed", "recv_failed")


class Observations:
    """See the module docstring."""

    def __init__(self, backend: str) -> None:
        self.backend = backend[:64]
        self._lock = threading.Lock()
        self._peers: dict[str, str] = {}
        self._transfers: list[list[Any]] = []
        self._handoffs: list[list[Any]] = []
        self._events: dict[tuple[str, str, str, str], int] = {}
        self._phases: list[list[Any]] = []
        self._dropped = 0

    def admit(self, engine_id: str) -> None:
        """A handshake with the proven peer ``engine_id`` completed: it gets a label of its own
        if fewer than :data:`MAX_PEERS` peers have one (labels are never reassigned)."""
        with self._lock:
            if engine_id not in self._peers and len(self._peers) < MAX_PEERS:
                self._peers[engine_id] = engine_id[:64]

    def peer_label(self, engine_id: str) -> str:
        """The bounded label of peer ``engine_id``: its id if it is one of the first
        :data:`MAX_PEERS` admitted (:meth:`admit`), else ``other``."""
        return self._peers.get(engine_id, OTHER)

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

    def phase(self, name: str, seconds: float) -> None:
        """One phase of a hand-off this rank timed (:data:`kvbridge.scheduling.recorder.PHASES`,
        from the flight recorder, any thread)."""
        self._add(self._phases, [name[:32], max(0.0, float(seconds))])

    def event(self, name: str, mode: str, peer: str | None = None,
              backend: str | None = None) -> None:
        """One failure event of :data:`EVENTS` (others are ignored); ``peer`` None: unknown."""
        if name not in EVENTS:
            return
        key = (name, mode, backend or self.backend,
               UNKNOWN if peer is None else self.peer_label(peer))
        with self._lock:
            self._events[key] = self._events.get(key, 0) + 1

    def _add(self, into: list[list[Any]], sample: list[Any]) -> None:
        with self._lock:
            if len(self._transfers) + len(self._handoffs) + len(self._phases) >= MAX_SAMPLES:
                self._dropped += 1
                return
            into.append(sample)

    def drain(self) -> dict[str, Any]:
        """The samples since the last drain (empty dict when none):
        ``{"transfers": [[mode, backend, peer, outcome, seconds, bytes, descriptors], …],
        "handoffs": [[mode, backend, peer, seconds], …], "phases": [[phase, seconds], …],
        "events": [[name, mode, backend, peer, count], …], "dropped": n}``."""
        with self._lock:
            transfers, self._transfers = self._transfers, []
            handoffs, self._handoffs = self._handoffs, []
            events, self._events = self._events, {}
            phases, self._phases = self._phases, []
            dropped, self._dropped = self._dropped, 0
        out: dict[str, Any] = {}
        if events:
            out["events"] = [[*key, n] for key, n in events.items()]
        if transfers:
            out["transfers"] = transfers
        if handoffs:
            out["handoffs"] = handoffs
        if phases:
            out["phases"] = phases
        if dropped:
            out["dropped"] = dropped
        return out
