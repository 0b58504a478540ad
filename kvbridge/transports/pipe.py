"""FIFO pipes: ordered channels with send and receive halves, close and end-of-stream.

The FIFO pipe is one of the core's two hand-off abstractions (the other is the
:class:`~kvbridge.lookup.LookupBuffer`). Two kinds, one contract (:class:`SendHalf` and
:class:`RecvHalf`; modelled on anyio's memory object streams):

* :func:`memory_pipe` — an in-process pair, bounded (``send`` blocks while full: back-pressure).
  It carries layer-by-layer tier loads to the forward pass
  (:mod:`kvbridge.offload.layerwise`), the layers the forward pass wrote to the transfer loop
  (layer-wise push, :mod:`kvbridge.scheduling.layer_stream`) and the offload tiers'
  write-behind jobs (:mod:`kvbridge.offload.manager`).
* :class:`PipeReceiver` / :class:`PipeSender` — over ZeroMQ PUSH/PULL on the control network.
  Many senders may feed one receiver; order is kept per sender (ZeroMQ keeps per-connection
  order) and checked with sequence numbers, so a gap is reported, never silently skipped. It
  carries notifications (:mod:`kvbridge.transports.notify`).

Both halves of both kinds take and give the same types: ``send(payload: bytes, timeout)`` and
``recv(timeout) -> (sender, payload)``. ``recv`` raises :class:`PipeClosed` once the stream
ended (the sender closed it, or this half was closed) and :class:`TimeoutError` when nothing
arrived in time; ``send`` raises :class:`PipeClosed` once either half closed and
:class:`TimeoutError` while the pipe stays full. Payloads are bytes (a payload of another type
is a ``TypeError``); over ZeroMQ they are framed in typed :class:`~kvbridge.messages.PipeFrame`
messages — never pickle. An in-process pipe may be made for another payload type
(``memory_pipe(kind=WriteJob)``): it never leaves the process, and still refuses any other
type.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Generic, Protocol, TypeVar, cast, overload

import zmq

from kvbridge.errors import MessageError, PipeClosed
from kvbridge.messages import Codec, PipeFrame

__all__ = ["memory_pipe", "MemorySendHalf", "MemoryRecvHalf", "PipeSender", "PipeReceiver",
           "RecvHalf", "SendHalf"]

_MAX_SENDER_BYTES = 1024

T = TypeVar("T")


class SendHalf(Protocol):
    """The sending end of a FIFO pipe (see the module docstring)."""

    def send(self, payload: bytes, timeout: float | None = ...) -> None: ...

    def close(self) -> None: ...


class RecvHalf(Protocol):
    """The receiving end of a FIFO pipe: ``recv`` gives ``(sender, payload)`` in order."""

    def recv(self, timeout: float | None = None) -> tuple[str, bytes]: ...

    def close(self) -> None: ...


_BYTES = (bytes, bytearray, memoryview)


def _check_payload(payload: object) -> None:
    if not isinstance(payload, _BYTES):
        raise TypeError(f"a pipe carries bytes, not {type(payload).__name__}")


class _MemoryState(Generic[T]):
    def __init__(self, capacity: int, kind: type[T]) -> None:
        self.items: collections.deque[tuple[str, T]] = collections.deque()
        self.capacity = capacity
        self.kind = kind
        self.cond = threading.Condition()
        self.send_closed = False
        self.recv_closed = False


class MemorySendHalf(Generic[T]):
    """Send half of :func:`memory_pipe`. Thread-safe."""

    def __init__(self, state: _MemoryState[T], sender: str) -> None:
        self._s = state
        self.sender = sender

    def send(self, payload: T, timeout: float | None = None) -> None:
        """Append ``payload``; blocks while the pipe is full (up to ``timeout``; None: no
        bound). Raises :class:`PipeClosed`, ``TimeoutError`` or ``TypeError`` (a payload not
        of the pipe's kind; bytes-like payloads of a bytes pipe are copied to ``bytes``)."""
        s = self._s
        if s.kind is bytes:
            _check_payload(payload)
            payload = cast(T, bytes(cast(bytes, payload)))
        elif not isinstance(payload, s.kind):
            raise TypeError(f"this pipe carries {s.kind.__name__}, not "
                            f"{type(payload).__name__}")
        item = (self.sender, payload)
        deadline = None if timeout is None else time.monotonic() + timeout
        with s.cond:
            while True:
                if s.send_closed or s.recv_closed:
                    raise PipeClosed("pipe is closed")
                if s.capacity <= 0 or len(s.items) < s.capacity:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("pipe full")
                s.cond.wait(left)
            s.items.append(item)
            s.cond.notify_all()

    def close(self) -> None:
        """End the stream: the receiver drains what was sent, then gets :class:`PipeClosed`."""
        with self._s.cond:
            self._s.send_closed = True
            self._s.cond.notify_all()


class MemoryRecvHalf(Generic[T]):
    """Receive half of :func:`memory_pipe`. Thread-safe."""

    def __init__(self, state: _MemoryState[T]) -> None:
        self._s = state

    def recv(self, timeout: float | None = None) -> tuple[str, T]:
        """Next ``(sender, payload)``; raises :class:`PipeClosed` after end-of-stream (once
        everything sent was received) and ``TimeoutError``."""
        s = self._s
        deadline = None if timeout is None else time.monotonic() + timeout
        with s.cond:
            while not s.items:
                if s.send_closed or s.recv_closed:
                    raise PipeClosed("end of stream")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("nothing received")
                s.cond.wait(left)
            item = s.items.popleft()
            s.cond.notify_all()
            return item

    def close(self) -> None:
        """Stop receiving; pending items are dropped and senders get :class:`PipeClosed`."""
        with self._s.cond:
            self._s.recv_closed = True
            self._s.items.clear()
            self._s.cond.notify_all()


@overload
def memory_pipe(capacity: int = ..., sender: str = ...
                ) -> tuple[MemorySendHalf[bytes], MemoryRecvHalf[bytes]]: ...


@overload
def memory_pipe(capacity: int = ..., sender: str = ..., *, kind: type[T]
                ) -> tuple[MemorySendHalf[T], MemoryRecvHalf[T]]: ...


def memory_pipe(capacity: int = 0, sender: str = "memory", *, kind: type[Any] = bytes
                ) -> tuple[MemorySendHalf[Any], MemoryRecvHalf[Any]]:
    """An in-memory FIFO pair; ``capacity`` 0 means unbounded; ``sender`` is the name ``recv``
    gives with each payload (as a ZeroMQ pipe gives its sender's); ``kind`` the payload type
    (bytes unless said: what the ZeroMQ halves carry)."""
    state = _MemoryState(capacity, kind)
    return MemorySendHalf(state, sender), MemoryRecvHalf(state)


class PipeSender:
    """Send half over ZeroMQ to a :class:`PipeReceiver` address. Thread-safe (one lock)."""

    def __init__(
        self, address: str, sender: str, codec: Codec | None = None, hwm: int = 10000
    ) -> None:
        self._codec = codec or Codec()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.connect(address)
        self._sender = sender.encode()
        self._seq = 0
        self._lock = threading.Lock()
        self._closed = False
        self.address = address

    def send(self, payload: bytes, timeout: float | None = 5.0) -> None:
        """Queue ``payload``; raises :class:`PipeClosed` if closed, TimeoutError if the peer
        stays unreachable while the queue is full."""
        _check_payload(payload)
        with self._lock:
            if self._closed:
                raise PipeClosed(f"pipe to {self.address} is closed")
            self._send(PipeFrame(seq=self._seq, payload=bytes(payload)), timeout)
            self._seq += 1

    def _send(self, frame: PipeFrame, timeout: float | None) -> None:
        data = self._codec.encode(frame)
        self._sock.setsockopt(zmq.SNDTIMEO, -1 if timeout is None else int(timeout * 1000))
        try:
            self._sock.send_multipart([self._sender, data])
        except zmq.Again as exc:
            raise TimeoutError(f"pipe to {self.address} is full") from exc

    def close(self) -> None:
        """Send end-of-stream (best effort) and release the socket. Idempotent.

        Frames still queued keep going out for up to 2 s (the socket's linger) in ZeroMQ's I/O
        thread, but only while the process lives: a process about to exit must call
        ``zmq.Context.instance().term()`` first, which waits for them (pyzmq does not at exit).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._send(PipeFrame(seq=self._seq, eos=True), 1.0)
            except (TimeoutError, zmq.ZMQError):
                pass
            self._sock.close()


class PipeReceiver:
    """Receive half over ZeroMQ: binds ``tcp://host:port`` (0 = any free port).

    ``recv`` returns ``(sender, payload)`` in per-sender FIFO order. Frames from a sender after
    its end-of-stream, out of sequence, or with a sender name over 1 KiB raise
    :class:`MessageError`. The per-sender sequence table remembers at most ``max_senders`` live
    and ``max_senders`` ended senders (the least recently heard from is forgotten first), so a
    stream of made-up sender names cannot grow it without bound.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        codec: Codec | None = None,
        max_senders: int = 65536,
    ) -> None:
        self._codec = codec or Codec()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self._codec.max_bytes + 1024)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._max_senders = max(1, int(max_senders))
        self._next: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def recv(self, timeout: float | None = None) -> tuple[str, bytes]:
        """Next ``(sender, payload)``. Raises TimeoutError, :class:`PipeClosed` or
        :class:`MessageError`. An end-of-stream from a sender raises :class:`PipeClosed`
        naming it."""
        with self._lock:
            if self._closed:
                raise PipeClosed("receiver is closed")
            if not self._sock.poll(None if timeout is None else int(timeout * 1000)):
                raise TimeoutError("nothing received")
            parts = self._sock.recv_multipart()
            if len(parts) != 2:
                raise MessageError(f"pipe frame with {len(parts)} parts")
            if len(parts[0]) > _MAX_SENDER_BYTES:
                raise MessageError(f"pipe sender name of {len(parts[0])} bytes")
            sender = parts[0].decode(errors="replace")
            frame = self._codec.decode(parts[1])
            if not isinstance(frame, PipeFrame):
                raise MessageError(f"expected a pipe frame, got {type(frame).__name__}")
            if sender in self._ended:
                raise MessageError(f"frame from {sender!r} after its end-of-stream")
            expected = self._next.get(sender, 0)
            if frame.seq != expected:
                raise MessageError(f"pipe from {sender!r}: frame {frame.seq}, expected {expected}")
            if frame.eos:
                self._next.pop(sender, None)
                self._ended[sender] = None
                if len(self._ended) > self._max_senders:
                    self._ended.popitem(last=False)
                raise PipeClosed(f"end of stream from {sender!r}")
            self._next[sender] = expected + 1
            self._next.move_to_end(sender)
            if len(self._next) > self._max_senders:
                self._next.popitem(last=False)
            return sender, frame.payload

    def reset_sender(self, sender: str) -> None:
        """Forget a sender's sequence (it restarted and will count from zero again)."""
        with self._lock:
            self._next.pop(sender, None)
            self._ended.pop(sender, None)

    def fileno(self) -> Any:
        return self._sock.getsockopt(zmq.FD)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._sock.close()
