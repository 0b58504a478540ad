"""Heartbeats: D keeps P's lease on a transfer alive while the request waits on D.

A decode request can sit in D's queue for a long time before D allocates blocks and starts its
READ (pull) or registration (push). Meanwhile P holds the prefilled blocks under a lease; this
sender renews it every ``interval`` seconds with one :class:`~kvbridge.messages.Heartbeat` per
prefill address, so P never frees blocks a live decode request still wants, and a dead D stops
renewing and lets P reclaim them.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from kvbridge.control import ControlClient
from kvbridge.errors import KVBridgeError
from kvbridge.messages import Heartbeat

__all__ = ["HeartbeatSender"]

log = logging.getLogger("kvbridge.lease")


class HeartbeatSender:
    """Background thread renewing leases. ``add``/``remove`` are thread-safe and non-blocking."""

    def __init__(self, client: ControlClient, interval: float) -> None:
        self._client = client
        self.interval = interval
        self._targets: dict[str, str] = {}  # transfer_id -> prefill control address
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0

    def add(self, transfer_id: str, address: str) -> None:
        with self._lock:
            self._targets[transfer_id] = address
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvbridge-heartbeat",
                                                daemon=True)
                self._thread.start()

    def remove(self, transfer_id: str) -> None:
        with self._lock:
            self._targets.pop(transfer_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._targets)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                groups: dict[str, list[str]] = defaultdict(list)
                for tid, address in self._targets.items():
                    groups[address].append(tid)
            for address, tids in groups.items():
                try:
                    self._client.request(address, Heartbeat(transfer_ids=tids),
                                         timeout=min(self.interval, 2.0))
                    self.sent += 1
                except KVBridgeError as exc:
                    log.warning("heartbeat to %s failed: %s", address, exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
