"""A real second process holding a transport and registered memory, for transport test suites.

:class:`PeerProcess` spawns (``multiprocessing`` "spawn" context) a child that creates a
transport by backend name and obeys commands sent over a ``multiprocessing`` pipe: allocate and
register a KV buffer, add a peer, run a transfer, send or collect notifications, return its
buffer for checking. Every call is bounded by a timeout; :meth:`PeerProcess.close` always ends the
child (exit command, then terminate, then kill), so a failing test leaves no process behind.

The child's command pipe is a local ``socketpair`` between two processes of the test; its
messages are Python objects (pickled by ``multiprocessing``), never network input.

Errors raised in the child come back as the same :mod:`kvbridge.errors` class (anything else
as :class:`PeerCommandError` carrying the child's traceback).

:class:`Peer` is the protocol suites program against: :class:`PeerProcess` and
:class:`kvbridge.testing.inprocess.InProcessPeer` (a second transport in this process) both
satisfy it.

Example::

    with PeerProcess("shm") as peer:
        mem = peer.setup(layers=2, num_blocks=16, block_bytes=4096, seed=1)
        name = transport.add_peer(mem.metadata, peer.invite(my_metadata))
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvbridge import errors, registry
from kvbridge.errors import PeerUnreachable
from kvbridge.layout import KVLayout
from kvbridge.transport import MemoryRegion, Op, Transport, notifying

__all__ = [
    "Peer",
    "PeerProcess",
    "PeerMemory",
    "PeerCommandError",
    "kv_buffer",
    "collect_notifications",
]

log = logging.getLogger("kvbridge.testing.peer")

U8 = npt.NDArray[np.uint8]


class PeerCommandError(RuntimeError):
    """A command failed in the peer process with an error outside kvbridge's tree."""


def kv_buffer(layers: int, num_blocks: int, block_bytes: int, seed: int) -> tuple[U8, KVLayout]:
    """A random uint8 KV cache ``(layers, 2, num_blocks, block_bytes)`` and its layout.

    The layout comes from :meth:`KVLayout.from_tensors` (one tensor per layer, a K and a V
    plane each), as an engine would build it.
    """
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(layers, 2, num_blocks, block_bytes), dtype=np.uint8)
    layout = KVLayout.from_tensors(
        {f"layer{i}": arr[i] for i in range(layers)}, num_blocks, block_size=16
    )
    return arr, layout


def collect_notifications(
    transport: Transport, count: int, timeout: float, into: list[tuple[str, bytes]] | None = None
) -> list[tuple[str, bytes]]:
    """Drain ``transport``'s notifications until ``count`` arrived or ``timeout`` passed.

    Polls with back-off (1 → 20 ms). Returns everything received (possibly fewer than ``count``).
    """
    got: list[tuple[str, bytes]] = [] if into is None else into
    deadline = time.monotonic() + timeout
    delay = 1e-3
    while True:
        got.extend(notifying(transport).get_notifications())
        if len(got) >= count or time.monotonic() >= deadline:
            return got
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


# -- child side -----------------------------------------------------------------------------------


class _PeerServer:
    def __init__(self, backend: str, name: str, options: Mapping[str, Any]) -> None:

        self.transport: Transport = registry.create(backend, name, options)
        self.buffers: list[U8] = []
        self.notifications: list[tuple[str, bytes]] = []

    def cmd_setup(self, layers: int, num_blocks: int, block_bytes: int, seed: int) -> Any:
        arr, layout = kv_buffer(layers, num_blocks, block_bytes, seed)
        self.buffers.append(arr)
        meta = self.transport.register_memory([MemoryRegion(arr.ctypes.data, arr.nbytes)])
        return meta, layout.to_dict(), len(self.buffers) - 1

    def cmd_add_peer(self, metadata: bytes, proof: bytes) -> str:
        return self.transport.add_peer(metadata, proof)

    def cmd_attest(self, proof: bytes, peer_metadata: bytes | None) -> None:
        self.transport.attest(proof, peer_metadata)

    def cmd_invite(self, peer_metadata: bytes | None) -> bytes:
        return self.transport.invite(peer_metadata)

    def cmd_remove_peer(self, name: str) -> None:
        self.transport.remove_peer(name)

    def cmd_get(self, index: int) -> bytes:
        return self.buffers[index].tobytes()

    def cmd_transfer(
        self, op: str, peer: str, local: Any, remote: Any, notification: bytes | None,
        timeout: float,
    ) -> tuple[str, str | None]:
        handle = self.transport.submit(Op(op), peer, local, remote, notification)
        state = self.transport.wait(handle, timeout)
        return state.value, handle.error

    def cmd_send_notification(self, peer: str, message: bytes) -> None:
        notifying(self.transport).send_notification(peer, message)

    def cmd_notifications(
        self, count: int, timeout: float, snapshot: int | None
    ) -> tuple[list[tuple[str, bytes]], bytes | None]:
        collect_notifications(self.transport, count, timeout, self.notifications)
        snap = self.buffers[snapshot].tobytes() if snapshot is not None else None
        out, self.notifications = self.notifications, []
        return out, snap

    def cmd_close(self, timeout: float) -> None:
        self.transport.close(timeout)

    def cmd_ping(self) -> int:
        return os.getpid()


def peer_main(
    conn: Connection, backend: str, name: str, options: dict[str, Any], env: dict[str, str]
) -> None:
    """Entry point of the spawned peer process (importable by the spawn context)."""
    os.environ.update(env)
    logging.basicConfig(level=os.environ.get("KVBRIDGE_TEST_PEER_LOG", "WARNING"))
    try:
        server = _PeerServer(backend, name, options)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        conn.send(("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ok", os.getpid()))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            command, args = msg[0], msg[1:]
            if command == "exit":
                break
            try:
                result = getattr(server, f"cmd_{command}")(*args)
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
                conn.send(("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
            else:
                conn.send(("ok", result))
    finally:
        try:
            server.transport.close(5.0)
        finally:
            conn.close()


# -- parent side ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerMemory:
    """One buffer the peer allocated and registered (see :meth:`PeerProcess.setup`)."""

    metadata: bytes
    layout: KVLayout
    index: int


class Peer(Protocol):
    """What a test suite drives on the other side: a transport holding registered memory."""

    name: str

    def start(self) -> Peer: ...

    def setup(self, layers: int, num_blocks: int, block_bytes: int, seed: int) -> PeerMemory: ...

    def add_peer(self, metadata: bytes, proof: bytes) -> str: ...

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None: ...

    def invite(self, peer_metadata: bytes | None = None) -> bytes: ...

    def remove_peer(self, name: str) -> None: ...

    def buffer(self, index: int = 0) -> U8: ...

    def transfer(
        self, op: Op, peer: str, local: Any, remote: Any, notification: bytes | None = None
    ) -> tuple[str, str | None]: ...

    def send_notification(self, peer: str, message: bytes) -> None: ...

    def notifications(
        self, count: int, timeout: float = 10.0, snapshot: int | None = None
    ) -> tuple[list[tuple[str, bytes]], U8 | None]: ...

    def close_transport(self, timeout: float = 5.0) -> None: ...

    def kill(self) -> None: ...

    def close(self) -> None: ...


class PeerProcess:
    """Parent-side handle of a peer process; see the module docstring. Not thread-safe."""

    def __init__(
        self,
        backend: str,
        options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.backend = backend
        self.options = dict(options or {})
        self.env = dict(env or {})
        self.name = name or f"peer-{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        self.pid: int | None = None
        self._proc: Any = None
        self._conn: Connection | None = None

    def start(self) -> PeerProcess:
        """Spawn the child and wait until its transport exists; raises the child's error."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._conn = parent
        self._proc = ctx.Process(
            target=peer_main,
            args=(child, self.backend, self.name, self.options, self.env),
            name=f"kvbridge-peer-{self.name}",
            daemon=True,
        )
        self._proc.start()
        child.close()
        try:
            self.pid = self._reply("start", self.timeout * 2)
        except BaseException:
            self.close()
            raise
        return self

    def call(self, command: str, *args: Any, timeout: float | None = None) -> Any:
        """Run ``command`` in the child and return its result (bounded by ``timeout``)."""
        if self._conn is None:
            raise PeerUnreachable(f"peer {self.name} is not running")
        self._conn.send((command, *args))
        return self._reply(command, self.timeout if timeout is None else timeout)

    def _reply(self, command: str, timeout: float) -> Any:
        assert self._conn is not None
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise PeerUnreachable(
                    f"peer {self.name} died (exit code {self._proc.exitcode}) during {command}"
                )
            if time.monotonic() >= deadline:
                raise PeerUnreachable(f"peer {self.name} did not answer {command} in {timeout} s")
        try:
            status, *rest = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._proc.join(1)
            raise PeerUnreachable(
                f"peer {self.name} closed its pipe during {command} "
                f"(exit code {self._proc.exitcode})"
            ) from exc
        if status == "ok":
            return rest[0]
        cls_name, text = rest
        cls = getattr(errors, cls_name, None)
        if isinstance(cls, type) and issubclass(cls, errors.KVBridgeError):
            raise cls(f"(in peer {self.name}) {text}")
        raise PeerCommandError(f"{command} failed in peer {self.name}: {cls_name}: {text}")

    # -- commands -------------------------------------------------------------------------------

    def setup(self, layers: int, num_blocks: int, block_bytes: int, seed: int) -> PeerMemory:
        """Allocate a random KV buffer (see :func:`kv_buffer`), register it, return metadata."""
        meta, layout, index = self.call("setup", layers, num_blocks, block_bytes, seed)
        return PeerMemory(meta, KVLayout.from_dict(layout), index)

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        return str(self.call("add_peer", metadata, proof))

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        """The peer's transport attests ``proof`` (for the process ``peer_metadata`` names)."""
        self.call("attest", proof, peer_metadata)

    def invite(self, peer_metadata: bytes | None = None) -> bytes:
        """A fresh proof the peer's transport attested (see :meth:`Transport.invite`)."""
        return bytes(self.call("invite", peer_metadata))

    def remove_peer(self, name: str) -> None:
        self.call("remove_peer", name)

    def buffer(self, index: int = 0) -> U8:
        """A writable copy of the peer's buffer ``index`` (flat uint8)."""
        return np.frombuffer(bytearray(self.call("get", index)), dtype=np.uint8)

    def transfer(
        self, op: Op, peer: str, local: Any, remote: Any, notification: bytes | None = None
    ) -> tuple[str, str | None]:
        """Submit and wait in the peer; returns ``(state value, error)``."""
        state, error = self.call(
            "transfer", op.value, peer, local, remote, notification, self.timeout,
            timeout=self.timeout + 5,
        )
        return str(state), None if error is None else str(error)

    def send_notification(self, peer: str, message: bytes) -> None:
        self.call("send_notification", peer, message)

    def notifications(
        self, count: int, timeout: float = 10.0, snapshot: int | None = None
    ) -> tuple[list[tuple[str, bytes]], U8 | None]:
        """Wait in the peer for ``count`` notifications (or ``timeout``); with ``snapshot``, also
        return buffer ``snapshot`` as it was right after they arrived."""
        got, snap = self.call("notifications", count, timeout, snapshot, timeout=timeout + 10)
        arr = None if snap is None else np.frombuffer(bytearray(snap), dtype=np.uint8)
        return [(str(n), bytes(m)) for n, m in got], arr

    def close_transport(self, timeout: float = 5.0) -> None:
        self.call("close", timeout, timeout=timeout + 10)

    # -- lifecycle ------------------------------------------------------------------------------

    def kill(self) -> None:
        """Kill the child at once (to test a vanished peer)."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def close(self) -> None:
        """End the child: exit command, then terminate, then kill. Idempotent, never raises."""
        proc, conn = self._proc, self._conn
        self._conn = None
        if conn is not None:
            try:
                conn.send(("exit",))
            except (OSError, ValueError):
                pass
        if proc is not None:
            proc.join(10)
            if proc.is_alive():
                log.warning("peer %s did not exit; terminating", self.name)
                proc.terminate()
                proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(3)
            if not proc.is_alive():
                proc.close()
            self._proc = None
        if conn is not None:
            conn.close()

    def __enter__(self) -> PeerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
