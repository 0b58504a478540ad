"""``KVBRIDGE_ENGINE_SPIN_MS``: keep idle vLLM engines from busy-spinning (imports vLLM lazily).

Called once per process from the connector's plugin entry point and constructor.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["apply_engine_spin"]

log = logging.getLogger("kvbridge.connector")

_spin_applied = False


def apply_engine_spin() -> None:
    """Apply ``KVBRIDGE_ENGINE_SPIN_MS`` to vLLM's step queues in this process (idempotent).

    vLLM's shared-memory step queues busy-spin (``sched_yield``) for one second after each read
    before they sleep on a socket. While a request only waits for KV, the engine keeps taking
    empty steps, so on a small host each engine burns a core doing nothing. Shortening that
    window lets kvbridge's idle wait actually idle the engine. Off unless the variable is set.
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
    original = SpinCondition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "is_reader", False):
            self.busy_loop_s = spin_s
        original(self, timeout_ms)

    SpinCondition.wait = wait
    _spin_applied = True
