"""Wake on arrival: how an engine that only waits for hand-offs sleeps, and who wakes it.

An engine whose requests only wait for KV (D waiting for a push or a READ; P holding blocks
until D has them) has nothing to compute, yet its loop must notice at once when a worker rank's
transfer loop finishes something: that is when the request can take its first decode step, or
its blocks can be freed. Two halves, across processes:

- :class:`WakeSender` (each worker rank): :meth:`~WakeSender.poke` from the transfer loop's
  progress callback, one empty datagram on a Unix socket (abstract namespace) to the
  scheduler's :class:`EngineWake`: one system call, no broker or I/O thread between the two
  processes, so under load the wake-up costs as few thread wake-ups as possible.
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

A poke carries no data: a forged one (any local process of the same network namespace can send
to the socket) only costs an early engine step. Linux only (abstract Unix sockets); the engine
and its worker ranks share a host, as vLLM's own step queues require.

Nothing here imports vLLM. :class:`EngineWake` methods other than :meth:`~EngineWake.close` are
called from the engine thread; the listener thread only sets an event and calls ``nudge``.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["EngineWake", "WakeSender", "DUE_STEPS"]

log = logging.getLogger("kvbridge.connector")

DUE_STEPS = 2
"""Idle points that return at once after a poke: the step that collects the result and the one
that acts on it. With vLLM's asynchronous scheduling (GPUs) a worker's answer is read one step
after the step that carried it; on CPU (synchronous) the second skip costs one empty step."""


class EngineWake:
    """The scheduler's end (see the module docstring). ``idle_wait_ms`` <= 0 disables waiting."""

    def __init__(self, idle_wait_ms: float) -> None:
        self.max_delay = idle_wait_ms / 1000.0
        self.delay = 0.001
        self.nudges = 0  # pokes turned into a nudge of the engine loop (listener thread)
        self.counts: Counter[str] = Counter()  # engine thread: see take_counters
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(f"\0kvbridge-wake-{os.getpid()}-{os.urandom(8).hex()}")
        self._sock.setblocking(False)
        name = self._sock.getsockname()
        self.address = "unix:@" + (name[1:] if isinstance(name, str) else name[1:].decode())
        self._poked = threading.Event()
        self._nudges_seen = 0
        self._due = 0
        self._thread: threading.Thread | None = None
        self._stop_r, self._stop_w = -1, -1
        self._closed = False

    # -- hooked ------------------------------------------------------------------------------

    @property
    def hooked(self) -> bool:
        return self._thread is not None

    def attach(self, nudge: Callable[[], bool]) -> None:
        """Hand the poke socket to a listener thread that calls ``nudge()`` on every poke."""
        if self._thread is not None or self._closed:
            return
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._listen, args=(nudge,),
                                        name="kvbridge-wake", daemon=True)
        self._thread.start()

    def _listen(self, nudge: Callable[[], bool]) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            fds = {fd for fd, _ in poller.poll()}
            if self._stop_r in fds:
                return
            if not self._drain():
                continue
            nudge()  # the WAKEUP item itself ends the wait; the event then skips idle points
            self._poked.set()
            self.nudges += 1

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
        if not woke and self._poked.is_set():
            self.counts["wake_missed"] += 1  # a poke came, yet the wait ran out
        self._waited(woke)

    def _waited(self, woke: bool) -> None:
        self.counts["wake_waits"] += 1
        self.counts["wake_woken" if woke else "wake_timeouts"] += 1
        self.delay = 0.001 if woke else min(self.delay * 2, self.max_delay)

    def take_counters(self) -> dict[str, int]:
        """Counters since the last call: ``wake_waits`` idle waits, of which ``wake_woken``
        ended early (a poke, or input for the engine) and ``wake_timeouts`` ran out their
        back-off (``wake_missed``: although a poke had come, which the nudge should prevent);
        ``wake_skipped`` idle points that did not wait (work was due);
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
            ready, _, _ = select.select([self._sock], [], [], self.delay)
            woke = bool(ready) and self._drain()
        self._waited(woke)

    def step_busy(self) -> None:
        """A step with work: the next wait starts from the shortest back-off again."""
        self.delay = 0.001

    def _drain(self) -> bool:
        got = False
        while True:
            try:
                self._sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return got
            except OSError:
                return got
            got = True

    def close(self) -> None:
        """Stop the listener (if any) and close the socket. Idempotent; any thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join(5.0)
            for fd in (self._stop_r, self._stop_w):
                os.close(fd)
        self._sock.close()


class WakeSender:
    """A worker rank's end: pokes the scheduler's :class:`EngineWake` (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._target: str | None = None
        self.address: str | None = None

    def connect(self, address: str) -> None:
        """Point the pokes at ``address`` (an :attr:`EngineWake.address`); ValueError for
        anything else. Later calls with the same address are no-ops."""
        if not address.startswith("unix:@") or len(address) > 100:
            raise ValueError(f"not a kvbridge wake address: {address[:100]!r}")
        with self._lock:
            if self.address == address:
                return
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._target = "\0" + address[len("unix:@"):]
            self.address = address

    def poke(self) -> None:
        """Never blocks; a poke that cannot be sent is dropped (the wait is bounded)."""
        with self._lock:
            if self._sock is not None and self._target is not None:
                try:
                    self._sock.sendto(b"", self._target)
                except OSError:  # nobody listens, or its queue is full: it is awake anyway
                    pass

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
