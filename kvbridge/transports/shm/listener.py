"""The listener side of the shm handshake: who may fetch this transport's registration.

:class:`_Listener` binds an abstract Unix socket with a random name (the one the metadata
carries) and answers each connection once with what ``answer`` says: the registration (and the
memfds behind the shared memory, sent with ``SCM_RIGHTS``) for a query it lets in, a
:class:`~kvbridge.transports.shm.wire._Refused` for one it does not. The client's pid and uid
come from the kernel (``SO_PEERCRED``), never from the client. The same thread watches proven
peers' pidfds and runs a callback the moment one of those processes exits.

Thread-safety and blocking: one daemon thread owns every socket and the selector; it never
blocks on a client (non-blocking sockets, per-connection deadlines) and nothing a client sends
can raise out of it. :meth:`_Listener.watch`, :meth:`_Listener.unwatch` and
:meth:`_Listener.close` may be called from any thread; ``answer`` and the exit callbacks run on
the listener thread and must not block.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvbridge.errors import MessageError
from kvbridge.messages import Codec, PipeFrame
from kvbridge.transports.shm.cma import _peercred
from kvbridge.transports.shm.wire import (
    _MAX_REQUEST_BYTES,
    _encoder,
    _query_decoder,
    _Refused,
)

log = logging.getLogger("kvbridge.transport.shm")

_SOCKET_PREFIX = "\0kvbridge-shm-"
_WARN_EVERY_S = 1.0


class _NotLetIn(Exception):
    """A query the listener answers with a refusal (its message says why)."""


@dataclass
class _Conn:
    """One inbound connection of the listener."""

    sock: socket.socket
    deadline: float
    pid: int
    size: int = -1
    buf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None
    fds: list[int] = field(default_factory=list)  # sent with the answer's first bytes


class _Listener:
    """Answers registration queries on an abstract Unix socket, from one daemon thread.

    Each connection gets one answer and is closed; at most ``max_conns`` are open at a time (more
    are closed at once), each for at most ``timeout`` seconds; a request is one 4-byte big-endian
    length and at most 4 KiB of :class:`Codec` frame. Clients of another user, garbage, oversized
    or unauthenticated requests close the connection and count in :attr:`refused`; nothing a
    client sends can raise out of the thread or block it. ``answer(proof, fds, pid)`` gets the
    query's proof, whether it asks for memfds and the kernel-proven pid of the client; it returns
    the payload and the fds to send, or raises :class:`_NotLetIn` to answer a refusal.

    The same thread watches peers' pidfds (:meth:`watch`): the moment a watched process exits,
    its callback runs (on this thread).
    """

    def __init__(
        self,
        codec: Codec,
        answer: Callable[[bytes, bool, int], tuple[bytes, list[int]]],
        timeout: float,
        max_conns: int,
        thread_name: str,
    ) -> None:
        self.name = _SOCKET_PREFIX + os.urandom(16).hex()
        self._codec, self._answer = codec, answer
        self._timeout, self._max_conns = timeout, max_conns
        self.served = 0
        self.refused = 0
        self._last_warning = float("-inf")
        self._uid = os.geteuid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.name)
            self._sock.listen(max_conns)
            self._sock.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
        except OSError:
            self._sock.close()
            raise
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self._watch_lock = threading.Lock()
        #: watch (key, dup fd, callback) and unwatch (key, -1, None) requests, in order
        self._watch_changes: list[tuple[int, int, Callable[[], None] | None]] = []
        self._watched: dict[int, tuple[int, Callable[[], None]]] = {}  # key -> (dup fd, cb)
        self._watch_keys = iter(range(1, 1 << 62))
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop:
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - the listener must outlive any surprise
                    log.exception("shm listener %r: unexpected error (continuing)", self.name[1:])
                    time.sleep(0.05)
        finally:
            for c in list(self._conns.values()):
                self._drop(c)
            for key in list(self._watched):
                self._unwatch_now(key)

    def watch(self, pidfd: int, on_exit: Callable[[], None]) -> int:
        """Run ``on_exit()`` on the listener thread once the process of ``pidfd`` exited (the
        listener watches a duplicate: the caller may close ``pidfd`` at any time). Returns a key
        for :meth:`unwatch`. Thread-safe."""
        dup = os.dup(pidfd)
        os.set_inheritable(dup, False)
        with self._watch_lock:
            key = next(self._watch_keys)
            self._watch_changes.append((key, dup, on_exit))
        self._wake()
        return key

    def unwatch(self, key: int) -> None:
        """Stop watching (no-op if the callback already ran). Thread-safe."""
        with self._watch_lock:
            self._watch_changes.append((key, -1, None))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass

    def _apply_watch_changes(self) -> None:
        with self._watch_lock:
            changes, self._watch_changes = self._watch_changes, []
        for key, dup, cb in changes:
            if cb is None:
                self._unwatch_now(key)
            else:
                self._watched[key] = (dup, cb)
                self._sel.register(dup, selectors.EVENT_READ, ("pidfd", key))

    def _unwatch_now(self, key: int) -> None:
        entry = self._watched.pop(key, None)
        if entry is not None:
            self._sel.unregister(entry[0])
            os.close(entry[0])

    def _exited(self, key: int) -> None:
        entry = self._watched.get(key)
        self._unwatch_now(key)
        if entry is not None:
            entry[1]()

    def _step(self) -> None:
        timeout = 1.0
        if self._conns:
            first = min(c.deadline for c in self._conns.values())
            timeout = min(max(first - time.monotonic(), 0.0), 1.0)
        self._apply_watch_changes()
        for key, _ in self._sel.select(timeout):
            if key.fileobj is self._sock:
                self._accept()
            elif key.fileobj is self._wake_r:
                try:
                    self._wake_r.recv(64)
                except OSError:
                    pass
            elif isinstance(key.data, tuple):
                self._exited(key.data[1])
            else:
                self._service(key.data)
        now = time.monotonic()
        for c in [c for c in self._conns.values() if c.deadline <= now]:
            self._refuse(c, f"no complete request within {self._timeout} s")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                self._warn(f"cannot accept: {exc}")
                time.sleep(0.05)
                return
            if len(self._conns) >= self._max_conns:
                self.refused += 1
                log.debug("shm listener: %d connections open; refusing one", len(self._conns))
                conn.close()
                continue
            try:
                conn.setblocking(False)
                pid, uid, _ = _peercred(conn)
            except OSError:
                conn.close()
                continue
            if uid != self._uid:
                self.refused += 1
                self._warn(f"refused a client of uid {uid} (this transport runs as {self._uid})")
                conn.close()
                continue
            c = _Conn(conn, time.monotonic() + self._timeout, pid)
            self._conns[conn.fileno()] = c
            self._sel.register(conn, selectors.EVENT_READ, c)

    def _service(self, c: _Conn) -> None:
        try:
            if c.out is None:
                self._read(c)
            else:
                self._write(c)
        except (BlockingIOError, InterruptedError):
            return
        except Exception as exc:  # noqa: BLE001 - whatever a client sends ends its connection
            self._refuse(c, f"{type(exc).__name__}: {exc}")

    def _read(self, c: _Conn) -> None:
        want = 4 if c.size < 0 else c.size
        chunk = c.sock.recv(want - len(c.buf))
        if not chunk:
            raise ConnectionError("closed before sending a whole request")
        c.buf += chunk
        if len(c.buf) < want:
            return
        if c.size < 0:
            c.size = int.from_bytes(c.buf, "big")
            c.buf.clear()
            if not 0 < c.size <= _MAX_REQUEST_BYTES:
                raise MessageError(f"request of {c.size} bytes announced")
            return
        reply, c.fds = self._reply(bytes(c.buf), c.pid)
        c.out = memoryview(len(reply).to_bytes(4, "big") + reply)
        self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        assert c.out is not None
        if c.fds:  # the fds travel with the first bytes that go out (and stay ours)
            sent = socket.send_fds(c.sock, [c.out], c.fds)
            c.fds = []
        else:
            sent = c.sock.send(c.out)
        c.out = c.out[sent:]
        if not c.out:
            self.served += 1
            self._drop(c)

    def _reply(self, data: bytes, pid: int) -> tuple[bytes, list[int]]:
        frame = self._codec.decode(data)
        if not isinstance(frame, PipeFrame):
            raise MessageError(f"expected a query frame, got {type(frame).__name__}")
        try:
            query = _query_decoder.decode(frame.payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MessageError(f"malformed query: {exc}") from None
        try:
            payload, fds = self._answer(query.proof, query.fds, pid)
        except _NotLetIn as exc:
            self.refused += 1
            self._warn(f"did not let in process {pid}: {exc}")
            payload, fds = _encoder.encode(_Refused(reason=str(exc)[:512])), []
        return self._codec.encode(PipeFrame(seq=0, payload=payload)), fds

    def _warn(self, what: str) -> None:
        """WARNING at most once a second (the rest at DEBUG): a flood must not flood the log."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning("shm listener %r %s (%d refused so far)", self.name[1:], what,
                        self.refused)
        else:
            log.debug("shm listener %r %s", self.name[1:], what)

    def _refuse(self, c: _Conn, why: str) -> None:
        self.refused += 1
        log.debug("shm listener %r dropped a connection: %s", self.name[1:], why)
        self._drop(c)

    def _drop(self, c: _Conn) -> None:
        self._conns.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close every socket. Idempotent."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("shm listener %r did not stop in %.1f s", self.name[1:], timeout)
            return
        with self._watch_lock:  # watches the thread never took
            for _, dup, _ in self._watch_changes:
                if dup >= 0:
                    os.close(dup)
            self._watch_changes.clear()
        self._sel.close()
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()
