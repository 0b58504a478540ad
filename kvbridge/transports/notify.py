"""Notifications over kvbridge's control network: one ZeroMQ inbox per transport.

Transports without a native notification channel (``shm``; ``mooncake``) reuse this helper:

* :class:`NotificationInbox` binds a :class:`~kvbridge.transports.pipe.PipeReceiver` and runs
  one background thread that receives into a queue; :meth:`~NotificationInbox.drain` empties it
  without blocking, :meth:`~NotificationInbox.wait` blocks (no polling) until something arrived.
* :class:`NotificationSender` is one peer's outbound half (a
  :class:`~kvbridge.transports.pipe.PipeSender`).
  Each sender instance has its own identity ``"<agent>#<nonce>"`` on the wire, so a peer that
  re-creates its sender (restart, remove/re-add) starts a fresh sequence instead of tripping the
  receiver's gap check; the inbox reports the plain agent name.

Trust: the inbox listens on the control network, so every frame is hostile until the
:class:`~kvbridge.messages.Codec` accepted it. Give the inbox the codec built from the engine's
shared secret (transports take it from their ``secret`` option, and the core must pass its
``secret`` there): with a secret, frames that are not authenticated with it are dropped. Frames the
codec refuses (authentication, replay, size, malformed) and frames out of sequence are dropped and
counted in :attr:`NotificationInbox.dropped_invalid`.

Fair limits: the queue is bounded (``max_messages``, default 4096, and ``max_bytes`` of payload,
default 4 MiB) and shared fairly among the sending agents (the agent of the authenticated sender
identity, :func:`agent_of`). Below both bounds every message is queued. Past either, a message
is still queued if its agent holds fewer than its fair share of messages, ``max_messages //
senders``, and of bytes, ``max_bytes // senders`` (at least 1 each; ``senders``: the agents
holding messages, its own included), so one sender flooding the inbox cannot starve another.
Hard bound: at most 2 × ``max_messages`` messages and 2 × ``max_bytes`` bytes are held, and a
single message larger than ``max_bytes`` is never queued. Every other message is dropped (the
*newest*, on arrival) and counted in :attr:`NotificationInbox.dropped_full`, so an owner that
never drains holds at most that much. Drops are logged at WARNING at most once a second.
Without a secret, anyone who can reach the address can queue messages under any agent name
(and so claim any number of fair shares, within the hard bound).

Ordering: messages from one sender instance arrive in the order they were sent. Thread safety:
every public method may be called from any thread. Nothing is pickled; frames are msgspec.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

import zmq

from kvbridge.errors import MessageError, PeerUnreachable, PipeClosed, TransportClosed
from kvbridge.messages import Codec
from kvbridge.transports.pipe import PipeReceiver, PipeSender

__all__ = [
    "DEFAULT_MAX_NOTIFICATIONS",
    "DEFAULT_MAX_NOTIFICATION_BYTES",
    "NotificationInbox",
    "NotificationSender",
    "agent_of",
]

log = logging.getLogger("kvbridge.transport.notify")

_WAKE = "\x00wake"
DEFAULT_MAX_NOTIFICATIONS = 4096
DEFAULT_MAX_NOTIFICATION_BYTES = 4 << 20
_WARN_EVERY_S = 1.0


def agent_of(identity: str) -> str:
    """The agent name inside a sender identity ``"<agent>#<nonce>"``."""
    return identity.rsplit("#", 1)[0] if "#" in identity else identity


class NotificationInbox:
    """Receives ``(agent, message)`` pairs on ``tcp://host:port`` (port 0 = any free port).

    ``codec`` must carry the shared secret when one is configured (see the module docstring);
    ``max_messages`` and ``max_bytes`` bound what is held until :meth:`drain`, shared fairly per
    sending agent (past them, an agent under its fair share is still admitted; hard bound: 2 ×
    each, see "Fair limits" in the module docstring).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        codec: Codec | None = None,
        thread_name: str = "kvbridge-notify",
        max_messages: int = DEFAULT_MAX_NOTIFICATIONS,
        max_bytes: int = DEFAULT_MAX_NOTIFICATION_BYTES,
    ) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("an inbox needs room for at least one message and one byte")
        self._codec = codec or Codec()
        self.max_messages, self.max_bytes = int(max_messages), int(max_bytes)
        self._receiver = PipeReceiver(host, port, self._codec)
        self.address = self._receiver.address
        self._items: collections.deque[tuple[str, bytes]] = collections.deque()
        self._bytes = 0
        self._by_agent: dict[str, list[int]] = {}  # agent -> [messages, bytes] held now
        #: frames refused by the codec (authentication, replay, size, malformed) or out of order
        self.dropped_invalid = 0
        #: valid messages dropped because the inbox was full
        self.dropped_full = 0
        self._last_warning = float("-inf")
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Every message or frame dropped so far (invalid + full)."""
        return self.dropped_invalid + self.dropped_full

    @property
    def held_bytes(self) -> int:
        """Payload bytes queued now."""
        with self._cond:
            return self._bytes

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sender, payload = self._receiver.recv(timeout=1.0)
            except TimeoutError:
                continue
            except PipeClosed:
                continue  # a sender ended its stream (or the wake-up frame of close())
            except MessageError as exc:
                with self._cond:
                    self.dropped_invalid += 1
                self._warn("dropped a notification frame the codec refused", exc)
                continue
            except zmq.ZMQError as exc:
                if not self._stop.is_set():
                    log.error("notification inbox %s failed: %s", self.address, exc)
                return
            except Exception as exc:  # noqa: BLE001 - hostile input must never end the thread
                with self._cond:
                    self.dropped_invalid += 1
                self._warn("dropped an unreadable notification frame", exc)
                time.sleep(1e-3)  # never spin on an error that repeats
                continue
            agent = agent_of(sender)
            with self._cond:
                if not self._admits(agent, len(payload)):
                    self.dropped_full += 1
                    full = True
                else:
                    self._items.append((agent, payload))
                    self._bytes += len(payload)
                    held = self._by_agent.setdefault(agent, [0, 0])
                    held[0] += 1
                    held[1] += len(payload)
                    self._cond.notify_all()
                    full = False
            if full:
                self._warn("notification inbox full; dropped the newest message (past the bounds "
                           "and its sender's fair share)", None)

    def _admits(self, agent: str, size: int) -> bool:
        """Whether a message of ``size`` bytes from ``agent`` is queued now (caller holds the
        lock; see "Fair limits" in the module docstring)."""
        count, total = len(self._items), self._bytes + size
        if count < self.max_messages and total <= self.max_bytes:
            return True
        if size > self.max_bytes or count >= 2 * self.max_messages or total > 2 * self.max_bytes:
            return False
        held = self._by_agent.get(agent)
        senders = len(self._by_agent) + (held is None)
        messages, nbytes = held if held is not None else (0, 0)
        return (messages < max(1, self.max_messages // senders)
                and nbytes < max(1, self.max_bytes // senders))

    def _warn(self, what: str, exc: BaseException | None) -> None:
        """Log a drop at WARNING at most once a second (with the running counts), else DEBUG."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning(
                "inbox %s: %s%s (dropped so far: %d refused, %d over the bound of %d messages / "
                "%d bytes)", self.address, what, f": {exc}" if exc is not None else "",
                self.dropped_invalid, self.dropped_full, self.max_messages, self.max_bytes,
            )
        else:
            log.debug("inbox %s: %s%s", self.address, what, f": {exc}" if exc else "")

    def drain(self) -> list[tuple[str, bytes]]:
        """Return and forget everything received so far (non-blocking)."""
        with self._cond:
            out = list(self._items)
            self._items.clear()
            self._bytes = 0
            self._by_agent.clear()
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
