"""The control channel: request/reply of typed messages between engine ranks over ZeroMQ.

:class:`ControlServer` binds a ROUTER socket on the configured host and answers each request
with the reply its handler returns, on one background thread. :class:`ControlClient` sends a
request to an address and waits (bounded) for the matching reply; a timeout raises
:class:`PeerUnreachable` and the socket is rebuilt, so a late reply can never be mistaken for the
answer to a later request.

Security: messages are typed msgspec structs (never pickle), size-bounded (ZMQ_MAXMSGSIZE and the
codec), and HMAC-authenticated when a shared secret is configured; a request failing any check is
dropped with a warning and never reaches the handler.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

import zmq

from kvbridge.errors import KVBridgeError, MessageError, PeerUnreachable
from kvbridge.messages import Ack, Codec, Message

__all__ = ["ControlServer", "ControlClient", "Handler"]

log = logging.getLogger("kvbridge.control")

Handler = Callable[[Message], Message]


class ControlServer:
    """Serve requests on ``tcp://host:port`` (port 0 picks a free one); see :attr:`address`.

    The handler runs on the server thread and must not block for long; an exception in it is
    answered with ``Ack(ok=False, error=...)``.
    """

    def __init__(self, handler: Handler, codec: Codec, host: str = "127.0.0.1", port: int = 0):
        self._handler = handler
        self._codec = codec
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, codec.max_bytes + 1024)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._sock.close()
            raise KVBridgeError(f"cannot bind the control channel to {host}:{port}: {exc}") from exc
        self.host, self.port = host, port
        self.address = f"tcp://{host}:{port}"
        # An inproc pair wakes the poller for a prompt, race-free shutdown.
        self._stop_addr = f"inproc://kvbridge-ctl-stop-{id(self)}-{os.getpid()}"
        self._stop_rx = self._ctx.socket(zmq.PAIR)
        self._stop_rx.bind(self._stop_addr)
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-control:{port}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._stop_rx in events:
                break
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if len(frames) != 3:
                log.warning("dropping a control request with %d frames", len(frames))
                continue
            ident, rid, data = frames
            try:
                msg = self._codec.decode(data)
            except MessageError as exc:
                log.warning("dropping a control request: %s", exc)
                continue
            try:
                reply = self._handler(msg)
            except Exception as exc:  # noqa: BLE001 - every failure is answered, never swallowed
                log.exception("control handler failed on %s", type(msg).__name__)
                reply = Ack(ok=False, error=f"{type(exc).__name__}: {exc}")
            try:
                self._sock.send_multipart([ident, rid, self._codec.encode(reply)])
            except (zmq.ZMQError, KVBridgeError) as exc:
                log.warning("cannot send a control reply: %s", exc)
        self._sock.close()
        self._stop_rx.close()

    def close(self) -> None:
        """Stop the server thread and close the socket. Idempotent."""
        if not self._thread.is_alive():
            return
        tx = self._ctx.socket(zmq.PAIR)
        tx.connect(self._stop_addr)
        tx.send(b"")
        tx.close()
        self._thread.join(5)


class ControlClient:
    """Request/reply to :class:`ControlServer` addresses. Thread-safe (a lock per address)."""

    def __init__(self, codec: Codec, timeout_s: float = 5.0) -> None:
        self._codec = codec
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    def _lock_for(self, address: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(address, threading.Lock())

    def _socket(self, address: str) -> zmq.Socket[bytes]:
        sock = self._socks.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._codec.max_bytes + 1024)
            sock.connect(address)
            self._socks[address] = sock
        return sock

    def request(self, address: str, msg: Message, timeout: float | None = None) -> Message:
        """Send ``msg`` and return the reply. Raises :class:`PeerUnreachable` on timeout."""
        if self._closed:
            raise PeerUnreachable("control client is closed")
        timeout = self.timeout_s if timeout is None else timeout
        data = self._codec.encode(msg)
        with self._lock_for(address):
            sock = self._socket(address)
            rid = next(self._ids).to_bytes(8, "little")
            sock.send_multipart([rid, data])
            deadline = time.monotonic() + timeout
            while True:
                remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not sock.poll(remaining_ms):
                    sock.close()
                    self._socks.pop(address, None)
                    raise PeerUnreachable(
                        f"no answer from {address} within {timeout:.1f} s to {type(msg).__name__}"
                    )
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == rid:
                    return self._codec.decode(frames[1])
                # A stale reply of an earlier request: skip it (bounded by the same deadline).

    def forget(self, address: str) -> None:
        """Drop the cached socket for ``address`` (e.g. after the peer restarted)."""
        with self._lock_for(address):
            sock = self._socks.pop(address, None)
            if sock is not None:
                sock.close()

    def close(self) -> None:
        self._closed = True
        with self._guard:
            addresses = list(self._socks)
        for address in addresses:
            self.forget(address)
