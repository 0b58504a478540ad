"""Wake on arrival: how an engine that only waits for hand-offs sleeps, and who wakes it.

An engine whose requests only wait for KV (D waiting for a push or a READ; P holding blocks
until D has them) has nothing to compute, yet its loop must notice at once when a worker rank's
transfer loop finishes something: that is when the request can take its first decode step, or
its blocks can be freed. Two halves, across processes:

- :class:`WakeSender` (each worker rank): :meth:`~WakeSender.poke` from the transfer loop's
  progress callback, one tiny ZeroMQ message to the scheduler's :class:`EngineWake`.
- :class:`EngineWake` (the scheduler side, one per engine): receives the pokes and decides how
  the engine loop waits when a step had nothing to compute:

  * **hooked** (:meth:`EngineWake.attach`, the normal case with vLLM's ``EngineCoreProc``):
    a listener thread turns each poke into a call of ``nudge`` (which puts vLLM's ``WAKEUP``
    on the engine's input queue), and :meth:`EngineWake.idle` replaces vLLM's fixed idle sleep:
    it returns at once while work is due (a poke, or results the scheduler just learned, whose
    consequences take up to two steps to show with asynchronous scheduling), else blocks on the
    engine's own input queue — so new client requests end the wait too — for a back-off of 1 ms
    doubling up to ``idle_wait_ms`` (the bound on a lost poke).
  * **fallback** (no hook): :meth:`EngineWake.poll_wait`, called where the connector builds the
    step's metadata, polls the poke socket for the same back-off (the behaviour before the hook).

Nothing here imports vLLM. :class:`EngineWake` methods other than :meth:`~EngineWake.close` are
called from the engine thread; the listener thread only sets an event and calls ``nudge``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["EngineWake", "WakeSender", "DUE_STEPS"]

log = logging.getLogger("kvbridge.connector")

DUE_STEPS = 2
"""Idle points that return at once after a poke: with vLLM's asynchronous scheduling a
worker's answer is read one step after the step that carried it."""


class EngineWake:
    """The scheduler's end (see the module docstring). ``idle_wait_ms`` <= 0 disables waiting."""

    def __init__(self, idle_wait_ms: float) -> None:
        self.max_delay = idle_wait_ms / 1000.0
        self.delay = 0.001
        self.nudges = 0  # pokes turned into a nudge of the engine loop (listener thread)
        self.counts: Counter[str] = Counter()  # engine thread: see take_counters
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._poked = threading.Event()
        self._nudges_seen = 0
        self._due = 0
        self._thread: threading.Thread | None = None
        self._stop: zmq.Socket[bytes] | None = None

    # -- hooked ------------------------------------------------------------------------------

    @property
    def hooked(self) -> bool:
        return self._thread is not None

    def attach(self, nudge: Callable[[], bool]) -> None:
        """Hand the poke socket to a listener thread that calls ``nudge()`` on every poke."""
        if self._thread is not None:
            return
        stop_addr = f"inproc://kvbridge-wake-{id(self)}"
        stop_rx = self._ctx.socket(zmq.PAIR)
        stop_rx.bind(stop_addr)
        self._stop = self._ctx.socket(zmq.PAIR)
        self._stop.setsockopt(zmq.LINGER, 0)
        self._stop.connect(stop_addr)
        self._thread = threading.Thread(target=self._listen, args=(nudge, stop_rx),
                                        name="kvbridge-wake", daemon=True)
        self._thread.start()

    def _listen(self, nudge: Callable[[], bool], stop_rx: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(stop_rx, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if stop_rx in ready:
                    return
                if not self._drain():
                    continue
                self._poked.set()
                self.nudges += 1
                nudge()
        except zmq.ZMQError as exc:  # the context was terminated under us
            log.debug("wake listener stopped: %s", exc)
        finally:
            stop_rx.close()
            self._sock.close()

    def idle(self, inputs: queue.Queue[Any], seconds: float, busy: bool) -> None:
        """Replaces vLLM's idle ``sleep(seconds)``; ``busy``: hand-offs are in progress."""
        if self._poked.is_set():
            self._poked.clear()
            self._due = max(self._due, DUE_STEPS)
        if self._due > 0:
            self._due -= 1
            self.counts["wake_skipped"] += 1
            self.delay = 0.001
            return
        if not busy or self.max_delay <= 0:
            time.sleep(seconds)
            return
        with inputs.not_empty:
            woke = bool(inputs.queue) or self._poked.is_set()
            if not woke:
                woke = inputs.not_empty.wait(self.delay)
        self._waited(woke)

    def _waited(self, woke: bool) -> None:
        self.counts["wake_waits"] += 1
        self.counts["wake_woken" if woke else "wake_timeouts"] += 1
        self.delay = 0.001 if woke else min(self.delay * 2, self.max_delay)

    def take_counters(self) -> dict[str, int]:
        """Counters since the last call: ``wake_waits`` idle waits, of which ``wake_woken``
        ended early (a poke, or input for the engine) and ``wake_timeouts`` ran out their
        back-off; ``wake_skipped`` idle points that did not wait (work was due);
        ``wake_nudges`` pokes passed on to the engine loop (hooked)."""
        out = dict(self.counts)
        self.counts.clear()
        nudges = self.nudges  # written by the listener thread only
        if nudges != self._nudges_seen:
            out["wake_nudges"] = nudges - self._nudges_seen
            self._nudges_seen = nudges
        return out

    def work_due(self) -> None:
        """The scheduler just learned of finished hand-offs: its next idle point must not wait."""
        self._due = max(self._due, 1)

    # -- fallback ------------------------------------------------------------------------------

    def poll_wait(self, busy: bool) -> None:
        """Nothing to compute this step: wait for a poke (bounded back-off). Hooked: only until
        the hook takes over, on the event the listener sets."""
        if not busy or self.max_delay <= 0:
            return
        if self._thread is not None:
            woke = self._poked.wait(self.delay)
            self._poked.clear()
        else:
            woke = bool(self._sock.poll(int(self.delay * 1000) or 1))
            self._drain()
        self._waited(woke)

    def step_busy(self) -> None:
        """A step with work: the next wait starts from the shortest back-off again."""
        self.delay = 0.001

    def _drain(self) -> bool:
        got = False
        while True:
            try:
                self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True

    def close(self) -> None:
        """Stop the listener (if any) and close the socket. Idempotent; any thread."""
        if self._thread is not None:
            if self._stop is not None:
                try:
                    self._stop.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._thread.join(5.0)
            if self._stop is not None:
                self._stop.close()
                self._stop = None
        elif not self._sock.closed:
            self._sock.close()


class WakeSender:
    """A worker rank's end: pokes the scheduler's :class:`EngineWake` (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: zmq.Socket[bytes] | None = None
        self.address: str | None = None

    def connect(self, address: str) -> None:
        """Point the pokes at ``address`` (once; later calls with the same address are no-ops)."""
        with self._lock:
            if self.address == address:
                return
            if self._sock is not None:
                self._sock.close()
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.connect(address)
            self._sock, self.address = sock, address

    def poke(self) -> None:
        """Never blocks; a poke that cannot be queued is dropped (the wait is bounded)."""
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
