"""Notifications over kvbridge's control network: one ZeroMQ inbox per transport.

Transports without a native notification channel (``shm``; ``mooncake``) reuse this helper:

* :class:`NotificationInbox` binds a :class:`~kvbridge.pipe.PipeReceiver` and runs one background
  thread that receives into a queue; :meth:`~NotificationInbox.drain` empties it without blocking,
  :meth:`~NotificationInbox.wait` blocks (no polling) until something arrived.
* :class:`NotificationSender` is one peer's outbound half (a :class:`~kvbridge.pipe.PipeSender`).
  Each sender instance has its own identity ``"<agent>#<nonce>"`` on the wire, so a peer that
  re-creates its sender (restart, remove/re-add) starts a fresh sequence instead of tripping the
  receiver's gap check; the inbox reports the plain agent name.

Ordering: messages from one sender instance arrive in the order they were sent. Thread safety:
every public method may be called from any thread. Nothing is pickled; frames are msgspec.
"""

from __future__ import annotations

import collections
import logging
import os
import threading

import zmq

from kvbridge.errors import MessageError, PeerUnreachable, PipeClosed, TransportClosed
from kvbridge.messages import Codec
from kvbridge.pipe import PipeReceiver, PipeSender

__all__ = ["NotificationInbox", "NotificationSender", "agent_of"]

log = logging.getLogger("kvbridge.transport.notify")

_WAKE = "\x00wake"


def agent_of(identity: str) -> str:
    """The agent name inside a sender identity ``"<agent>#<nonce>"``."""
    return identity.rsplit("#", 1)[0] if "#" in identity else identity


class NotificationInbox:
    """Receives ``(agent, message)`` pairs on ``tcp://host:port`` (port 0 = any free port)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        codec: Codec | None = None,
        thread_name: str = "kvbridge-notify",
    ) -> None:
        self._codec = codec or Codec()
        self._receiver = PipeReceiver(host, port, self._codec)
        self.address = self._receiver.address
        self._items: collections.deque[tuple[str, bytes]] = collections.deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sender, payload = self._receiver.recv(timeout=1.0)
            except TimeoutError:
                continue
            except PipeClosed:
                continue  # a sender ended its stream (or the wake-up frame of close())
            except MessageError as exc:
                log.warning("dropped a malformed notification frame: %s", exc)
                continue
            except zmq.ZMQError as exc:
                if not self._stop.is_set():
                    log.error("notification inbox %s failed: %s", self.address, exc)
                return
            with self._cond:
                self._items.append((agent_of(sender), payload))
                self._cond.notify_all()

    def drain(self) -> list[tuple[str, bytes]]:
        """Return and forget everything received so far (non-blocking)."""
        with self._cond:
            out = list(self._items)
            self._items.clear()
            return out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until at least one message is queued or ``timeout`` passes; True if one is."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._items) or self._closed, timeout) and bool(
                self._items
            )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the receive thread and release the socket. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._stop.set()
        try:  # wake the receive thread at once instead of waiting for its poll timeout
            waker = PipeSender(self.address, f"{_WAKE}#{os.urandom(4).hex()}", self._codec)
            waker.close()
        except zmq.ZMQError:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("notification thread of %s did not stop in %.1f s", self.address, timeout)
            return
        self._receiver.close()


class NotificationSender:
    """Sends notifications from ``agent`` to one peer's inbox ``address``. Thread-safe."""

    def __init__(self, address: str, agent: str, codec: Codec | None = None) -> None:
        self.address = address
        self._pipe = PipeSender(address, f"{agent}#{os.urandom(6).hex()}", codec)

    def send(self, message: bytes, timeout: float = 5.0) -> None:
        """Queue ``message`` for the peer (returns once ZeroMQ holds it).

        Raises :class:`PeerUnreachable` if the queue stays full for ``timeout`` seconds and
        :class:`TransportClosed` after :meth:`close`.
        """
        try:
            self._pipe.send(message, timeout)
        except TimeoutError as exc:
            raise PeerUnreachable(f"notification queue to {self.address} is full: {exc}") from exc
        except PipeClosed as exc:
            raise TransportClosed(f"notification sender to {self.address} is closed") from exc

    def close(self) -> None:
        """Send end-of-stream and release the socket. Idempotent."""
        try:
            self._pipe.close()
        except zmq.ZMQError as exc:
            log.debug("closing notification sender to %s: %s", self.address, exc)
