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

**Direct arrival.** A rank whose receive succeeded (every byte of the request's KV in place)
sends an *arrival* instead of a bare poke: the request and transfer ids, behind the engine's
random 16-byte secret (:attr:`EngineWake.secret`, which reaches the ranks inside vLLM's own
scheduler → worker metadata). The listener queues valid arrivals for the engine thread
(:meth:`EngineWake.take_arrivals`), which can then tell vLLM's scheduler at once instead of
after one more engine-core ↔ worker step (:mod:`kvbridge.integrations.vllm`). An arrival is
only an early copy of what the rank's step output reports anyway, so any one may be lost —
too long to encode, the socket's queue full, :data:`MAX_ARRIVALS` queued — and nothing but
its head start is.

A bare poke carries no data: a forged one (any local process of the same network namespace can
send to the socket) only costs an early engine step. A forged or malformed arrival is counted
(``wake_refused``) and dropped: without the secret nobody can claim a receive finished. Linux
only (abstract Unix sockets); the engine and its worker ranks share a host, as vLLM's own step
queues require.

Nothing here imports vLLM. :class:`EngineWake` methods other than :meth:`~EngineWake.close` are
called from the engine thread; the listener thread only sets an event and calls ``nudge``.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineWake", "WakeSender", "Arrival", "encode_arrival", "decode_arrival",
           "DUE_STEPS", "MAX_ARRIVALS", "SECRET_BYTES"]

log = logging.getLogger("kvbridge.connector")

DUE_STEPS = 2
"""Idle points that return at once after a poke: the step that collects the result and the one
that acts on it. With vLLM's asynchronous scheduling (GPUs) a worker's answer is read one step
after the step that carried it; on CPU (synchronous) the second skip costs one empty step."""


SECRET_BYTES = 16
MAX_REQUEST_ID_BYTES = 1024
MAX_TRANSFER_ID_BYTES = 256
MAX_ARRIVALS = 4096
"""Arrivals queued for the engine thread at most; later ones are dropped (the step output still
reports them)."""
_KIND_ARRIVAL = b"A"
_HEAD = struct.Struct(">HH")  # rank, length of the request id
_DATAGRAM_BYTES = SECRET_BYTES + 1 + _HEAD.size + MAX_REQUEST_ID_BYTES + MAX_TRANSFER_ID_BYTES


@dataclass(frozen=True)
class Arrival:
    """Rank ``rank`` received all of ``req_id``'s KV for transfer ``transfer_id``."""

    rank: int
    req_id: str
    transfer_id: str


def encode_arrival(secret: bytes, rank: int, req_id: str, transfer_id: str) -> bytes | None:
    """The datagram for one arrival, or None when it does not fit the format's bounds (the
    sender pokes instead)."""
    req, tid = req_id.encode(), transfer_id.encode()
    if (len(secret) != SECRET_BYTES or not 0 <= rank < 1 << 16 or not req
            or len(req) > MAX_REQUEST_ID_BYTES or not tid or len(tid) > MAX_TRANSFER_ID_BYTES):
        return None
    return secret + _KIND_ARRIVAL + _HEAD.pack(rank, len(req)) + req + tid


def decode_arrival(data: bytes, secret: bytes) -> Arrival:
    """Parse one arrival datagram; ValueError naming what is wrong (never anything else)."""
    if len(data) > _DATAGRAM_BYTES:
        raise ValueError(f"arrival: {len(data)} bytes, more than {_DATAGRAM_BYTES}")
    if len(data) < SECRET_BYTES + 1 + _HEAD.size + 2:
        raise ValueError(f"arrival: {len(data)} bytes, too short")
    if not hmac.compare_digest(data[:SECRET_BYTES], secret):
        raise ValueError("arrival: secret: does not match this engine's")
    body = data[SECRET_BYTES:]
    if body[:1] != _KIND_ARRIVAL:
        raise ValueError(f"arrival: kind: {body[:1]!r} is not {_KIND_ARRIVAL!r}")
    rank, req_len = _HEAD.unpack_from(body, 1)
    start = 1 + _HEAD.size
    req, tid = body[start:start + req_len], body[start + req_len:]
    if not 0 < req_len <= MAX_REQUEST_ID_BYTES or len(req) != req_len:
        raise ValueError(f"arrival: req_id: length {req_len} does not fit the datagram")
    if not 0 < len(tid) <= MAX_TRANSFER_ID_BYTES:
        raise ValueError(f"arrival: transfer_id: {len(tid)} bytes")
    try:
        return Arrival(rank, req.decode(), tid.decode())
    except UnicodeDecodeError as exc:
        raise ValueError(f"arrival: ids are not UTF-8 ({exc.reason})") from None


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
        self.secret = os.urandom(SECRET_BYTES)
        #: False: valid arrivals only wake the engine (nobody takes them; see stop_arrivals)
        self.keep_arrivals = True
        self._arrivals: collections.deque[Arrival] = collections.deque()
        self.refused = 0  # forged or malformed arrivals (listener thread)
        self.dropped = 0  # valid arrivals dropped: MAX_ARRIVALS were queued (listener thread)
        self._seen_refused = self._seen_dropped = 0
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
            if not self._sort(self._drain()):
                continue
            nudge()  # the WAKEUP item itself ends the wait; the event then skips idle points
            self._poked.set()
            self.nudges += 1

    def _sort(self, datagrams: list[bytes]) -> bool:
        """Queue the valid arrivals among ``datagrams``; True when any was a poke or an
        arrival (the engine must wake), False when there were none or all were refused."""
        wake = False
        for data in datagrams:
            if not data:
                wake = True
                continue
            try:
                arrival = decode_arrival(data, self.secret)
            except ValueError as exc:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning("refused %d wake-up datagram(s); the last: %s", self.refused, exc)
                continue
            wake = True
            if not self.keep_arrivals:
                continue
            if len(self._arrivals) >= MAX_ARRIVALS:
                self.dropped += 1
            else:
                self._arrivals.append(arrival)
        return wake

    def take_arrivals(self) -> list[Arrival]:
        """The arrivals queued since the last call, oldest first (the engine thread)."""
        out: list[Arrival] = []
        while True:
            try:
                out.append(self._arrivals.popleft())
            except IndexError:
                return out

    def stop_arrivals(self) -> None:
        """Nobody will take arrivals any more: from now on they only wake the engine."""
        self.keep_arrivals = False
        self.take_arrivals()

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
                # the nudge's input landed as the wait ran out: the engine takes it next, so
                # the poke was not missed (and the next wait starts short)
                woke = woke or bool(inputs.queue)
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
        ``wake_nudges`` pokes passed on to the engine loop (hooked);
        ``wake_refused`` forged or malformed arrivals, ``wake_dropped`` arrivals beyond
        :data:`MAX_ARRIVALS`."""
        out = dict(self.counts)
        self.counts.clear()
        nudges = self.nudges  # written by the listener thread only
        if nudges != self._nudges_seen:
            out["wake_nudges"] = nudges - self._nudges_seen
            self._nudges_seen = nudges
        refused, dropped = self.refused, self.dropped
        if refused != self._seen_refused:
            out["wake_refused"] = refused - self._seen_refused
            self._seen_refused = refused
        if dropped != self._seen_dropped:
            out["wake_dropped"] = dropped - self._seen_dropped
            self._seen_dropped = dropped
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
            woke = bool(ready) and bool(self._drain())  # no engine to tell: arrivals are pokes
        self._waited(woke)

    def step_busy(self) -> None:
        """A step with work: the next wait starts from the shortest back-off again."""
        self.delay = 0.001

    def _drain(self) -> list[bytes]:
        """Every datagram waiting on the socket (bounded reads: a longer one is cut, and then
        refused as malformed)."""
        got: list[bytes] = []
        while True:
            try:
                got.append(self._sock.recv(_DATAGRAM_BYTES + 1))
            except (BlockingIOError, InterruptedError, OSError):
                return got

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
        self._secret: bytes | None = None
        self.address: str | None = None

    def connect(self, address: str, secret: bytes | None = None) -> None:
        """Point the pokes at ``address`` (an :attr:`EngineWake.address`); ValueError for
        anything else. ``secret`` (that engine's :attr:`EngineWake.secret`) lets
        :meth:`arrived` send arrivals; without it they are bare pokes. Later calls with the
        same address are no-ops."""
        if not address.startswith("unix:@") or len(address) > 100:
            raise ValueError(f"not a kvbridge wake address: {address[:100]!r}")
        if secret is not None and len(secret) != SECRET_BYTES:
            raise ValueError(f"a wake secret has {SECRET_BYTES} bytes, not {len(secret)}")
        with self._lock:
            self._secret = secret
            if self.address == address:
                return
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._target = "\0" + address[len("unix:@"):]
            self.address = address

    def poke(self) -> None:
        """Never blocks; a poke that cannot be sent is dropped (the wait is bounded)."""
        self._send(b"")

    def arrived(self, rank: int, req_id: str, transfer_id: str) -> None:
        """Rank ``rank`` received all of ``req_id``'s KV: an arrival (a poke where no secret is
        known or the ids do not fit). Never blocks; dropped like a poke."""
        secret = self._secret
        data = None if secret is None else encode_arrival(secret, rank, req_id, transfer_id)
        self._send(data or b"")

    def _send(self, data: bytes) -> None:
        with self._lock:
            if self._sock is not None and self._target is not None:
                try:
                    self._sock.sendto(data, self._target)
                except OSError:  # nobody listens, or its queue is full: it is awake anyway
                    pass

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
