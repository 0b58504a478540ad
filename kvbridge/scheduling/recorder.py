"""The flight recorder of one engine rank: per-transfer timestamps in a bounded ring.

Every step of a hand-off a rank sees is one :meth:`Recorder.mark` (P: ``arrived``,
``scheduled``, ``kv_ready``, ``ready_seen``, ``write_posted``, ``write_done``; D: ``arrived``,
``scheduled``, ``recv_start``, ``read_posted``, ``recv_done``, ``recv_seen``, ``first_step``).
A mark takes one ``time.monotonic_ns()`` and, for the first mark of a transfer, one
``time.time_ns()`` as the record's wall-clock anchor; nothing else happens on the hot path
beyond a dict insert under a lock and, when the mark ends a phase of :data:`PHASES`, one
subtraction handed to ``on_phase`` (the per-phase histogram).

Durations between two marks of one record are differences of the monotonic clock (they do not
move when the wall clock is stepped); wall-clock times (what :meth:`Recorder.get` and
:meth:`Recorder.snapshot` return, what ``kvbridge bench`` and ``kvbridge why`` read) are the
anchor plus the monotonic offset. A mark given an explicit wall time (``when``, an event another
thread or process stamped with ``time.time()``, e.g. vLLM's ``arrival_time``) is placed on the
record's monotonic scale through the anchor.

Off (``enabled=False``, the engine's ``flight_recorder`` setting): :meth:`mark` returns at once
and nothing is recorded, timed or histogrammed. One transfer can be left out the same way
(:meth:`mute`, a request's ``kvbridge_record: false``): its marks return after one set lookup.

Bounded: at most ``capacity`` records (the oldest is evicted), at most :data:`MAX_EVENTS`
events per record (later ones are ignored), the first mark of an event wins, transfer ids and
event names longer than :data:`MAX_ID` are cut. Thread safety: every method may be called from
any thread (one lock); ``on_phase`` is called outside the lock and must not raise.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

__all__ = ["Recorder", "PHASES", "MAX_EVENTS", "MAX_ID", "local_phases"]

MAX_EVENTS = 32
MAX_ID = 256

#: Phases one engine can time on its own clock: (phase, start event, end event). A phase ends
#: when its end event is marked and its start event is in the record.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("queue", "arrived", "scheduled"),  # P and D: vLLM's waiting queue (arrival → first step)
    ("prefill", "scheduled", "kv_ready"),  # P: scheduled → the forward wrote the prompt's KV
    ("post", "kv_ready", "write_posted"),  # P (push): KV ready → the WRITE is posted
    ("wire", "write_posted", "write_done"),  # P (push): the WRITE on the wire
    ("plan", "scheduled", "recv_start"),  # D: blocks allocated → the worker starts the receive
    ("claim", "recv_start", "read_posted"),  # D (pull): claim and READ built → posted
    ("wire", "read_posted", "recv_done"),  # D (pull): the READ on the wire (+ DONE to P)
    ("notified", "recv_done", "recv_seen"),  # D: the KV is here → vLLM's scheduler knows
    ("first_step", "recv_seen", "first_step"),  # D: known → the request is scheduled
)
_ENDING: dict[str, tuple[tuple[str, str], ...]] = {}
for _phase, _start, _end in PHASES:
    _ENDING[_end] = (*_ENDING.get(_end, ()), (_phase, _start))


class _Record:
    __slots__ = ("wall0", "mono0", "events")

    def __init__(self, wall0: int, mono0: int) -> None:
        self.wall0 = wall0
        self.mono0 = mono0
        self.events: dict[str, int] = {}

    def wall(self) -> dict[str, float]:
        return {e: (self.wall0 + (t - self.mono0)) / 1e9 for e, t in self.events.items()}


class Recorder:
    """See the module docstring."""

    def __init__(self, capacity: int = 1024,
                 on_phase: Callable[[str, float], None] | None = None,
                 enabled: bool = True) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        #: off (the ``flight_recorder`` setting): :meth:`mark` returns at once, nothing is kept
        self.enabled = enabled
        self.on_phase = on_phase
        self.evicted = 0
        self._lock = threading.Lock()
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()
        # transfers left out (mute); bounded like the records, the oldest forgotten first
        self._muted: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def mark(self, transfer_id: str, event: str, when: float | None = None,
             mono_ns: int | None = None) -> None:
        """Record ``event`` of ``transfer_id`` now, or at wall time ``when`` (seconds, an event
        another process stamped), or at ``time.monotonic_ns()`` value ``mono_ns`` (an event this
        process stamped before marking it: on the same clock as "now", so it orders exactly
        against the events marked now)."""
        if not self.enabled:
            return
        tid = transfer_id[:MAX_ID]
        if tid in self._muted:  # one dict lookup (atomic under the GIL), no clock read
            return
        now = time.monotonic_ns()
        event = event[:MAX_ID]
        ended: list[tuple[str, float]] = []
        with self._lock:
            rec = self._records.get(tid)
            if rec is None:
                rec = self._records[tid] = _Record(time.time_ns(), now)
                if len(self._records) > self.capacity:
                    self._records.popitem(last=False)
                    self.evicted += 1
            else:
                self._records.move_to_end(tid)
            if event in rec.events or len(rec.events) >= MAX_EVENTS:
                return
            # an event stamped elsewhere happened before it is marked: never after "now" (a
            # float wall time of ~1.8e9 s carries ~0.2 us of rounding, the anchor as much)
            if mono_ns is not None:
                t = min(now, mono_ns)
            elif when is not None:
                t = min(now, rec.mono0 + int(when * 1e9) - rec.wall0)
            else:
                t = now
            rec.events[event] = t
            if self.on_phase is not None:
                for phase, start in _ENDING.get(event, ()):
                    t0 = rec.events.get(start)
                    if t0 is not None:
                        ended.append((phase, max(0, t - t0) / 1e9))
        for phase, seconds in ended:
            self.on_phase(phase, seconds)  # type: ignore[misc]

    def mute(self, transfer_id: str) -> None:
        """Keep no record of ``transfer_id`` from now on (its marks are ignored; what it had
        recorded is dropped). Bounded: the last ``capacity`` muted ids are remembered."""
        tid = transfer_id[:MAX_ID]
        with self._lock:
            self._records.pop(tid, None)
            self._muted[tid] = None
            self._muted.move_to_end(tid)
            if len(self._muted) > self.capacity:
                self._muted.popitem(last=False)

    def get(self, transfer_id: str) -> dict[str, float] | None:
        """``{event: wall-clock seconds}`` of one transfer, or None when not (or no longer)
        recorded."""
        with self._lock:
            rec = self._records.get(transfer_id[:MAX_ID])
            return None if rec is None else rec.wall()

    def many(self, transfer_ids: list[str]) -> dict[str, dict[str, float]]:
        """:meth:`get` of each id this rank recorded (unknown ids are left out)."""
        with self._lock:
            return {t: r.wall() for t in transfer_ids
                    if (r := self._records.get(t[:MAX_ID])) is not None}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Every record, oldest first, as :meth:`get` gives it."""
        with self._lock:
            return {t: r.wall() for t, r in self._records.items()}


def local_phases(events: dict[str, float]) -> dict[str, float]:
    """The :data:`PHASES` (seconds) one record's events give (events of one clock)."""
    out: dict[str, float] = {}
    for phase, start, end in PHASES:
        if start in events and end in events and phase not in out:
            out[phase] = max(0.0, events[end] - events[start])
    return out
