"""Per-peer lanes: a worker thread that posts one peer's batches and reports their completion.

Why a thread: the Transfer Engine's Python binding has a non-blocking *submit*
(``batch_transfer_async_read/write``) but its only batch completion check,
``get_batch_transfer_status``, blocks (GIL released) until the batch completes, fails or hits
the engine's timeout. So :meth:`Lane.post` only enqueues; the lane thread submits the job's
batches, at most ``window`` of them in flight, collects each one's status, and finishes the
kvbridge handle. The caller's thread never blocks on the network. Jobs of one lane run in FIFO
order, which keeps per-peer notification order; one slow peer cannot delay another peer's lane.

Partial failure: once a batch fails, no further batch of that job is submitted, every batch
already posted is still waited for (posted transfers cannot be aborted), and the handle fails.
A job's notification is sent only after all of its batches completed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.errors import KVBridgeError
from kvbridge.transport import Op, TransferHandle
from kvbridge.transports.notify import NotificationSender
from kvbridge_mooncake._engine import engine_transfer_timeout_s, is_bad_batch_id

__all__ = ["Job", "Lane"]

log = logging.getLogger("kvbridge.transport.mooncake")

DescriptorArray = npt.NDArray[np.int64]


@dataclass
class Job:
    """One kvbridge transfer: validated descriptors (or how to build them, called on the lane
    thread: a transfer by block ids), optional notification, its handle."""

    handle: TransferHandle
    local: DescriptorArray | None
    remote: DescriptorArray | None
    notification: bytes | None
    build: Callable[[], tuple[DescriptorArray, DescriptorArray]] | None = None

    def descriptors(self) -> tuple[DescriptorArray, DescriptorArray]:
        if self.local is None or self.remote is None:
            assert self.build is not None
            self.local, self.remote = self.build()
            self.build = None
        return self.local, self.remote


_STOP = object()


class Lane:
    """The worker for one peer session. ``post`` is thread-safe and never blocks."""

    def __init__(
        self,
        engine: Any,
        peer: str,
        session: str,
        outbox: NotificationSender,
        max_batch: int,
        window: int,
        closing: Callable[[], bool],
        probe: Callable[[str], str | None],
    ) -> None:
        self._engine = engine
        self.peer = peer
        self.session = session
        self.outbox = outbox
        self._max_batch = max_batch
        self._window = window
        self._closing = closing
        self._probe = probe
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"kvbridge-mooncake-lane[{peer}]", daemon=True
        )
        self._thread.start()

    def post(self, job: Job) -> None:
        self._queue.put(job)

    def retire(self) -> None:
        """Finish the jobs already posted, then stop the thread and close the outbox."""
        self._queue.put(_STOP)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread to stop; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- worker -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                job: Job = item
                try:
                    self._execute(job)
                except Exception as exc:  # never leave a handle pending
                    log.exception("mooncake lane %s: unexpected error", self.peer)
                    if not job.handle.state.terminal:
                        job.handle.fail(f"internal error: {exc!r}")
        finally:
            self.outbox.close()

    def _execute(self, job: Job) -> None:
        h = job.handle
        if self._closing():
            h.fail(f"mooncake transport closed before {h.op.value} started")
            return
        error = self._move(job)
        if error is None and job.notification is not None:
            try:
                self.outbox.send(job.notification)
            except KVBridgeError as exc:
                error = f"{h.op.value} completed but its notification failed: {exc}"
        if error is None:
            h.succeed()
            log.debug(
                "mooncake %s #%d: %d bytes in %d descriptors with %s in %.3f ms",
                h.op.value, h.id, h.nbytes, h.count, self.peer,
                (time.perf_counter() - h.started) * 1e3,
            )
        else:
            h.fail(error)
            log.warning("mooncake %s #%d with %s failed: %s", h.op.value, h.id, self.peer, error)

    def _move(self, job: Job) -> str | None:
        """Post every batch of ``job`` and wait for all of them; return an error or None."""
        local, remote = job.descriptors()
        n = local.shape[0]
        if n == 0:
            return None
        submit = (
            self._engine.batch_transfer_async_read
            if job.handle.op is Op.READ
            else self._engine.batch_transfer_async_write
        )
        in_flight: deque[tuple[int, int, float]] = deque()  # (batch id, first index, posted)
        error: str | None = None
        for first in range(0, n, self._max_batch):
            if self._closing():
                error = "mooncake transport closed during the transfer"
                break
            loc = local[first : first + self._max_batch]
            rem = remote[first : first + self._max_batch]
            batch_id = int(
                submit(self.session, loc[:, 0].tolist(), rem[:, 0].tolist(), loc[:, 1].tolist())
            )
            if is_bad_batch_id(batch_id):
                error = self._explain(f"submitting descriptors {first}..{first + len(loc) - 1}")
                break
            in_flight.append((batch_id, first, time.monotonic()))
            while len(in_flight) >= self._window and error is None:
                error = self._collect(*in_flight.popleft())
            if error is not None:
                break
        while in_flight:  # posted batches must stop before the handle may finish
            e = self._collect(*in_flight.popleft())
            error = error or e
        return error

    def _collect(self, batch_id: int, first: int, posted: float) -> str | None:
        """Block until batch ``batch_id`` is over (the engine frees it); return an error."""
        rc = self._engine.get_batch_transfer_status([batch_id])
        if rc == 0:
            return None
        elapsed = time.monotonic() - posted
        if elapsed >= engine_transfer_timeout_s():
            return (
                f"timed out after {elapsed:.1f} s at descriptor {first} "
                f"(MC_TRANSFER_TIMEOUT={engine_transfer_timeout_s():.0f} s)"
            )
        return self._explain(f"batch from descriptor {first} (rc {rc})")

    def _explain(self, what: str) -> str:
        reason = self._probe(self.session)
        if reason is not None:
            return f"{what}: peer {self.peer!r} at {self.session} is unreachable ({reason})"
        return f"{what} failed with peer {self.peer!r} at {self.session} (see the engine log)"
