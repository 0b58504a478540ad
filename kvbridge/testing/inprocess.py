"""A peer in this process: a second transport object, driven like :class:`PeerProcess`.

:class:`InProcessPeer` has the methods of :class:`kvbridge.testing.peer.PeerProcess` that the
suites use (it satisfies :class:`kvbridge.testing.peer.Peer`) but holds its transport and buffers
in the calling process, for backends that only reach their own process (``memory``) and for tests
that must not spawn processes. Calls run in the caller's thread; the transport's own threads make
progress, so a call that waits (``transfer``, ``notifications``) is bounded by its timeout.

Differences from :class:`PeerProcess`: errors are the transport's own exceptions (no "in peer"
prefix), ``env`` must be empty (an in-process peer shares this process's environment), and
:meth:`InProcessPeer.kill` closes the transport at once instead of killing a process.

Example::

    with InProcessPeer("memory") as peer:
        mem = peer.setup(layers=2, num_blocks=16, block_bytes=4096, seed=1)
        name = transport.add_peer(mem.metadata, peer.invite(my_metadata))
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

from kvbridge import registry
from kvbridge.errors import PeerUnreachable
from kvbridge.testing.peer import U8, PeerMemory, collect_notifications, kv_buffer
from kvbridge.transport import MemoryRegion, Op, Transport, notifying

__all__ = ["InProcessPeer"]

log = logging.getLogger("kvbridge.testing.peer")


class InProcessPeer:
    """A transport of backend ``backend`` in this process, with the API of PeerProcess."""

    def __init__(
        self,
        backend: str,
        options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        if env:
            raise ValueError(
                f"an in-process peer shares this process's environment; cannot apply {dict(env)}"
            )
        self.backend = backend
        self.options = dict(options or {})
        self.name = name or f"peer-{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        self.pid: int | None = None
        self._transport: Transport | None = None
        self._buffers: list[U8] = []  # kept for the peer's lifetime: registered memory
        self._notifications: list[tuple[str, bytes]] = []

    @property
    def transport(self) -> Transport:
        """The peer's transport (after :meth:`start`)."""
        if self._transport is None:
            raise PeerUnreachable(f"peer {self.name} is not running")
        return self._transport

    def start(self) -> InProcessPeer:
        """Create the transport; raises what the backend raises."""
        self._transport = registry.create(self.backend, self.name, self.options)
        self.pid = os.getpid()
        return self

    # -- commands -------------------------------------------------------------------------------

    def setup(self, layers: int, num_blocks: int, block_bytes: int, seed: int) -> PeerMemory:
        """Allocate a random KV buffer (see :func:`kv_buffer`), register it, return metadata."""
        arr, layout = kv_buffer(layers, num_blocks, block_bytes, seed)
        meta = self.transport.register_memory([MemoryRegion(arr.ctypes.data, arr.nbytes)])
        self._buffers.append(arr)
        return PeerMemory(meta, layout, len(self._buffers) - 1)

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        return self.transport.add_peer(metadata, proof)

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        self.transport.attest(proof, peer_metadata)

    def invite(self, peer_metadata: bytes | None = None) -> bytes:
        return self.transport.invite(peer_metadata)

    def remove_peer(self, name: str) -> None:
        self.transport.remove_peer(name)

    def buffer(self, index: int = 0) -> U8:
        """A writable copy of buffer ``index`` (flat uint8), as :meth:`PeerProcess.buffer`."""
        return self._buffers[index].reshape(-1).copy()

    def transfer(
        self, op: Op, peer: str, local: Any, remote: Any, notification: bytes | None = None
    ) -> tuple[str, str | None]:
        """Submit and wait; returns ``(state value, error)``."""
        handle = self.transport.submit(op, peer, local, remote, notification)
        state = self.transport.wait(handle, self.timeout)
        return state.value, handle.error

    def send_notification(self, peer: str, message: bytes) -> None:
        notifying(self.transport).send_notification(peer, message)

    def notifications(
        self, count: int, timeout: float = 10.0, snapshot: int | None = None
    ) -> tuple[list[tuple[str, bytes]], U8 | None]:
        """Wait for ``count`` notifications (or ``timeout``); with ``snapshot``, also return
        buffer ``snapshot`` as it was right after they arrived."""
        collect_notifications(self.transport, count, timeout, self._notifications)
        snap = self.buffer(snapshot) if snapshot is not None else None
        out, self._notifications = self._notifications, []
        return out, snap

    def close_transport(self, timeout: float = 5.0) -> None:
        self.transport.close(timeout)

    # -- lifecycle ------------------------------------------------------------------------------

    def kill(self) -> None:
        """The in-process stand-in for a vanished peer: close the transport without waiting."""
        if self._transport is not None:
            self._transport.close(timeout=0.0)

    def close(self) -> None:
        """Close the transport. Idempotent, never raises (a failure is logged)."""
        t, self._transport = self._transport, None
        if t is not None:
            try:
                t.close(5.0)
            except Exception as exc:  # noqa: BLE001 - teardown must not mask the test's failure
                log.warning("closing in-process peer %s failed: %s", self.name, exc)

    def __enter__(self) -> InProcessPeer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
