"""``KVBRIDGE_ENGINE_SPIN_MS``: keep idle vLLM engines from busy-spinning (imports vLLM lazily).

Called once per process from the connector's plugin entry point and constructor.

vLLM's shared-memory step queues (``shm_broadcast.MessageQueue``) hand every step from the
EngineCore to its worker, and every reply back, through a ring buffer whose reader waits in
``SpinCondition.wait``: it busy-spins (``sched_yield``) for ``busy_loop_s`` (1 s) after its last
read, then sleeps on a ZeroMQ SUB socket until the writer's PUB notification, for at most the
caller's ``timeout_ms`` (``SHM_READER_RECHECK_INTERVAL_MS``, 5 s). Shortening the spin lets an
engine that only waits for KV sleep instead of burning a core.

**Why the sleep is bounded here.** That notification is not reliable: the PUB socket has
``SNDHWM=1``, so a notification is dropped silently while the PUB still counts the previous one
as queued, i.e. until its ``send`` has taken in the acknowledgement that the previous one left,
which libzmq does at most once per ~3 M TSC ticks (about 1.2 ms here) and only after the
writer's I/O thread has forwarded it. With vLLM's 1 s spin nobody notices: a reader under load
never sleeps. With a 2 ms spin the reader goes to sleep right after a quick exchange, exactly
when notifications come that close, and a dropped one left it asleep for the full 5 s recheck
while the block it waited for was already written; the EngineCore, waiting for that reader's
reply, froze with it (every request queued behind). So while it sleeps, the reader re-checks the
ring buffer every few milliseconds: it still wakes at once on a notification, and a lost one
costs at most :data:`MAX_IDLE_POLL_MS` (docs/results/2026-12-03-load-through-the-proxy.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_IDLE_POLL_MS", "apply_engine_spin", "bounded_wait"]

log = logging.getLogger("kvbridge.connector")

MAX_IDLE_POLL_MS = 5
"""Longest one idle sleep of a step-queue reader before it re-checks the ring buffer (ms)."""

_spin_applied = False


def bounded_wait(
    original: Callable[[Any, int | None], None], spin_s: float, max_poll_ms: int = MAX_IDLE_POLL_MS
) -> Callable[[Any, int | None], None]:
    """``SpinCondition.wait`` with a *spin_s* busy window and an idle sleep of <= *max_poll_ms*.

    Readers only (a writer never waits). Within the busy window the call is vLLM's own. Past it,
    the sleep is bounded by the idle time so far (1 ms right after the window, growing to
    *max_poll_ms*), so the likeliest lost notification, the one right after a quick exchange,
    costs about a millisecond and a long-idle reader wakes ~1000 / *max_poll_ms* times a second.
    The caller (``MessageQueue.acquire_read``) re-checks the buffer after every return and keeps
    its own deadline, so returning early is always safe.
    """

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "is_reader", False):
            self.busy_loop_s = spin_s
            # Bounded on every call: vLLM reads the clock again and may find the busy window
            # over even when this read did not (within the window it ignores timeout_ms).
            idle_ms = (time.monotonic() - self.last_read - spin_s) * 1000.0
            bound = min(max_poll_ms, max(1, int(idle_ms)))
            timeout_ms = bound if timeout_ms is None else min(timeout_ms, bound)
        original(self, timeout_ms)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    return wait


def apply_engine_spin() -> None:
    """Apply ``KVBRIDGE_ENGINE_SPIN_MS`` to vLLM's step queues in this process (idempotent).

    vLLM's shared-memory step queues busy-spin (``sched_yield``) for one second after each read
    before they sleep on a socket. While a request only waits for KV, the engine keeps taking
    empty steps, so on a small host each engine burns a core doing nothing. Shortening that
    window lets kvbridge's idle wait actually idle the engine; the sleep that replaces the spin is
    bounded (module docstring: a notification can be lost). Off unless the variable is set.
    """
    global _spin_applied
    raw = os.environ.get("KVBRIDGE_ENGINE_SPIN_MS")
    if _spin_applied or raw is None:
        return
    spin_s = float(raw) / 1000.0
    if spin_s < 0:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: leave it alone
        log.warning("KVBRIDGE_ENGINE_SPIN_MS is set but vLLM has no SpinCondition; ignored")
        return
    SpinCondition.wait = bounded_wait(SpinCondition.wait, spin_s)
    _spin_applied = True
