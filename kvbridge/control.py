"""The control channel: typed request/reply between engine ranks over ZeroMQ.

Three pieces, none of which ever blocks on a peer:

* :class:`ControlServer` — a ROUTER socket bound on the configured host. It does not run a
  thread: its owner (the transfer loop) polls :attr:`ControlServer.socket` and calls
  :meth:`~ControlServer.receive`, which decodes up to a batch of requests. A frame that fails
  authentication (or is replayed) is dropped and counted, never answered; an authentic (or,
  without a secret, any) frame that does not parse is answered with ``Ack(kind=MALFORMED)``
  naming what is wrong. Replies go out with :meth:`~ControlServer.reply`,
  once or several times per request (a :class:`~kvbridge.messages.PushRegister` gets an
  immediate ``Ack`` and, later, its :class:`~kvbridge.messages.PushResult`).
* :class:`RpcClient` — asynchronous calls from the owner's thread to many peers: one DEALER
  socket per address, any number of calls in flight, each with its own deadline and callback.
  A dead or slow peer only ever delays its own calls.
* :class:`ControlClient` — a small blocking client for tools and tests (``kvbridge stats``).

Security: frames are built by :class:`~kvbridge.messages.Codec` (bounded types, HMAC over the
whole frame plus the request id, replay window) and ZeroMQ refuses frames above the size limit
before they are read. Without a secret the server refuses to bind a routable address unless
``allow_insecure`` is set (see docs/security.md).

Thread safety: :class:`ControlServer` and :class:`RpcClient` belong to one thread (their
owner's); :class:`ControlClient` is thread-safe (a lock per address).
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvbridge.advertise import advertised_host, bind_endpoint, format_address
from kvbridge.errors import AuthError, ConfigError, KVBridgeError, MessageError, PeerUnreachable
from kvbridge.messages import Ack, Codec, ErrorKind, Message

__all__ = [
    "RequestContext",
    "ControlServer",
    "RpcClient",
    "ReplyCallback",
    "ControlClient",
    "is_loopback",
    "request_context",
    "reply_context",
]

log = logging.getLogger("kvbridge.control")

ReplyCallback = Callable[[Message | KVBridgeError], bool]
"""Called with each reply (or the failure) of a call; return True to keep the call open for
further replies (a streamed answer), False when done."""


def request_context(rid: bytes) -> bytes:
    """The codec context of a request frame (binds its MAC to its request id)."""
    return b"Q" + rid


def reply_context(rid: bytes) -> bytes:
    """The codec context of a reply frame (a request cannot be reflected as a reply)."""
    return b"A" + rid


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class RequestContext:
    """Where a request came from: the connection (ROUTER identity, unforgeable by another
    connection) and the request id to answer on."""

    conn: bytes
    rid: bytes


class ControlServer:
    """See the module docstring. ``port=0`` picks a free port. :attr:`address` is what peers
    dial: ``advertise_host`` if given, else ``host`` — a wildcard ``host`` (``0.0.0.0``, ``::``,
    empty) is replaced by the default-route interface's address or refused with a
    :class:`ConfigError` naming ``advertise_host`` (:func:`kvbridge.advertise.advertised_host`)."""

    def __init__(self, codec: Codec, host: str = "127.0.0.1", port: int = 0, *,
                 allow_insecure: bool = False, advertise_host: str | None = None) -> None:
        if not codec.authenticated and not is_loopback(host) and not allow_insecure:
            raise ConfigError(
                f"refusing to bind the control channel to {host!r} without a shared secret: "
                "anyone who can reach it could steer transfers. Set KVBRIDGE_SECRET (same on "
                "every engine) or, on a trusted network, KVBRIDGE_ALLOW_INSECURE_CONTROL=1"
            )
        shown = advertised_host(host, advertise_host)  # before binding: a refusal leaks nothing
        self._codec = codec
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.socket: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, codec.max_bytes + 1024)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.socket.setsockopt(zmq.SNDHWM, 10000)
        self.socket.setsockopt(zmq.IPV6, 1 if ":" in host else 0)
        try:
            if port:
                self.socket.bind(bind_endpoint(host, port))
            else:
                port = self.socket.bind_to_random_port(bind_endpoint(host))
        except zmq.ZMQError as exc:
            self.socket.close()
            raise KVBridgeError(f"cannot bind the control channel to {host}:{port}: {exc}") from exc
        self.host, self.port = host, port
        self.address = format_address(shown, port)
        self.dropped_auth = 0
        self.dropped_malformed = 0
        self._last_warning = 0.0

    def _warn(self, text: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 1.0:  # at most one line a second, however hostile
            self._last_warning = now
            log.warning(text, *args)

    def receive(self, limit: int = 64) -> list[tuple[RequestContext, Message]]:
        """Decode up to ``limit`` waiting requests (non-blocking)."""
        out: list[tuple[RequestContext, Message]] = []
        for _ in range(limit):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[1]) != 8:
                self.dropped_malformed += 1
                self._warn("dropping a control request with %d frames", len(frames))
                continue
            ctx = RequestContext(frames[0], frames[1])
            try:
                msg = self._codec.decode(frames[2], request_context(ctx.rid))
            except AuthError as exc:  # not the secret's holder: never answered
                self.dropped_auth += 1
                self._warn("dropping a control request: %s", exc)
                continue
            except MessageError as exc:  # a peer that may talk to us sent what we cannot read
                self.dropped_malformed += 1
                self._warn("refusing a malformed control request: %s", exc)
                self.reply(ctx, Ack(ok=False, kind=ErrorKind.MALFORMED, error=str(exc)[:4000]))
                continue
            out.append((ctx, msg))
        return out

    def reply(self, ctx: RequestContext, msg: Message) -> None:
        """Send ``msg`` as (one more) answer to the request of ``ctx``. Never raises: a peer
        that went away simply does not get it."""
        try:
            data = self._codec.encode(msg, reply_context(ctx.rid))
            self.socket.send_multipart([ctx.conn, ctx.rid, data], zmq.NOBLOCK)
        except (zmq.ZMQError, KVBridgeError) as exc:
            log.debug("cannot send a control reply: %s", exc)

    def close(self) -> None:
        self.socket.close()


@dataclass
class _Call:
    id: int
    address: str
    rid: bytes
    callback: ReplyCallback
    deadline: float | None
    timeout: float | None = None
    replies: int = 0


@dataclass
class _Conn:
    sock: zmq.Socket[bytes]
    calls: dict[bytes, _Call] = field(default_factory=dict)


class RpcClient:
    """Asynchronous calls to many peers, owned by one thread (see the module docstring).

    ``on_socket(sock, added)`` lets the owner add/remove each new DEALER socket in its poller.
    """

    def __init__(self, codec: Codec, on_socket: Callable[[zmq.Socket[bytes], bool], None],
                 *, max_calls_per_peer: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._codec = codec
        self._on_socket = on_socket
        self._max_calls = max_calls_per_peer
        self._clock = clock
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._conns: dict[str, _Conn] = {}
        self._by_sock: dict[zmq.Socket[bytes], str] = {}
        self._calls: dict[int, _Call] = {}
        self._heap: list[tuple[float, int]] = []
        self._ids = itertools.count(1)
        self._rids = itertools.count(int.from_bytes(os.urandom(4), "little") << 24)

    def _conn(self, address: str) -> _Conn:
        conn = self._conns.get(address)
        if conn is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._codec.max_bytes + 1024)
            sock.setsockopt(zmq.SNDHWM, self._max_calls)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.connect(address)
            conn = _Conn(sock)
            self._conns[address] = conn
            self._by_sock[sock] = address
            self._on_socket(sock, True)
        return conn

    def call(self, address: str, msg: Message, timeout: float | None,
             callback: ReplyCallback) -> int:
        """Send ``msg`` to ``address``; ``callback`` gets each reply, or a
        :class:`PeerUnreachable` when ``timeout`` passes before the first one. Returns the call
        id (for :meth:`cancel`). Never blocks; a send that cannot be queued fails the call at
        once through the callback."""
        call_id = next(self._ids)
        rid = (next(self._rids) & ((1 << 64) - 1)).to_bytes(8, "little")
        deadline = None if timeout is None else self._clock() + timeout
        call = _Call(call_id, address, rid, callback, deadline, timeout)
        try:
            conn = self._conn(address)
            if len(conn.calls) >= self._max_calls:
                raise PeerUnreachable(f"{len(conn.calls)} calls already pending to {address}")
            data = self._codec.encode(msg, request_context(rid))
            conn.sock.send_multipart([rid, data], zmq.NOBLOCK)
        except zmq.Again:
            self._fail(call, PeerUnreachable(f"send queue to {address} is full"))
            return call_id
        except zmq.ZMQError as exc:
            self._fail(call, PeerUnreachable(f"cannot reach {address}: {exc}"))
            return call_id
        except KVBridgeError as exc:
            self._fail(call, exc)
            return call_id
        conn.calls[rid] = call
        self._calls[call_id] = call
        if deadline is not None:
            heapq.heappush(self._heap, (deadline, call_id))
        return call_id

    @staticmethod
    def _fail(call: _Call, exc: KVBridgeError) -> None:
        try:
            call.callback(exc)
        except Exception:  # noqa: BLE001 - a callback bug must not break the client
            log.exception("control call callback failed")

    def cancel(self, call_id: int) -> None:
        """Stop listening for replies of ``call_id`` (no-op if it ended)."""
        call = self._calls.pop(call_id, None)
        if call is not None:
            conn = self._conns.get(call.address)
            if conn is not None:
                conn.calls.pop(call.rid, None)

    def pending(self) -> int:
        return len(self._calls)

    def is_pending(self, call_id: int) -> bool:
        return call_id in self._calls

    def on_readable(self, sock: zmq.Socket[bytes], limit: int = 256) -> None:
        """Deliver the replies waiting on ``sock``."""
        address = self._by_sock.get(sock)
        if address is None:
            return
        conn = self._conns[address]
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            call = conn.calls.get(frames[0])
            if call is None:
                continue  # a late reply to a call that timed out or was cancelled
            try:
                reply: Message | KVBridgeError = self._codec.decode(
                    frames[1], reply_context(call.rid))
            except MessageError as exc:
                reply = exc
            call.replies += 1
            call.deadline = None  # a streamed call is now timed by its owner
            keep = False
            try:
                keep = bool(call.callback(reply)) and not isinstance(reply, KVBridgeError)
            except Exception:  # noqa: BLE001
                log.exception("control call callback failed")
            if not keep:
                self.cancel(call.id)

    def expire(self) -> None:
        """Fail every call whose deadline passed before its first reply."""
        now = self._clock()
        while self._heap and self._heap[0][0] <= now:
            _, call_id = heapq.heappop(self._heap)
            call = self._calls.get(call_id)
            if call is None or call.deadline is None or call.deadline > now:
                continue
            self.cancel(call_id)
            self._fail(call, PeerUnreachable(
                f"no answer from {call.address} within {call.timeout or 0:.1f} s"))

    def next_deadline(self) -> float | None:
        while self._heap and self._heap[0][1] not in self._calls:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def forget(self, address: str) -> None:
        """Close the socket to ``address``; its pending calls fail with PeerUnreachable."""
        conn = self._conns.pop(address, None)
        if conn is None:
            return
        self._by_sock.pop(conn.sock, None)
        self._on_socket(conn.sock, False)
        conn.sock.close()
        for call in list(conn.calls.values()):
            self._calls.pop(call.id, None)
            self._fail(call, PeerUnreachable(f"connection to {address} was closed"))

    def close(self) -> None:
        for address in list(self._conns):
            self.forget(address)


class ControlClient:
    """Blocking request/reply for tools and tests. Thread-safe (a lock per address)."""

    def __init__(self, codec: Codec | None = None, timeout_s: float = 5.0) -> None:
        self._codec = codec or Codec()
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._rids = itertools.count(int.from_bytes(os.urandom(4), "little") << 24)
        self._closed = False

    def _lock_for(self, address: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(address, threading.Lock())

    def request(self, address: str, msg: Message, timeout: float | None = None) -> Message:
        """Send ``msg`` and return the first reply. Raises :class:`PeerUnreachable` on timeout
        and a :class:`MessageError` for a reply that does not decode."""
        if self._closed:
            raise PeerUnreachable("control client is closed")
        timeout = self.timeout_s if timeout is None else timeout
        with self._lock_for(address):
            sock = self._socks.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, self._codec.max_bytes + 1024)
                sock.connect(address)
                self._socks[address] = sock
            rid = (next(self._rids) & ((1 << 64) - 1)).to_bytes(8, "little")
            sock.send_multipart([rid, self._codec.encode(msg, request_context(rid))])
            deadline = time.monotonic() + timeout
            while True:
                remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not sock.poll(remaining_ms):
                    raise PeerUnreachable(
                        f"no answer from {address} within {timeout:.1f} s to {type(msg).__name__}"
                    )
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == rid:
                    return self._codec.decode(frames[1], reply_context(rid))

    def forget(self, address: str) -> None:
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
