"""SIGTERM drains a vLLM engine's HTTP side: new requests get 503 at once instead of hanging.

vLLM 0.32 with ``--shutdown-timeout N`` answers SIGTERM by draining: the engine core finishes
what it holds (and keeps stepping while a connector holds a request's KV, so a prefill engine's
pull leases are still served), but a request that *arrives* during the drain is aborted inside
the engine and its HTTP client waits, unanswered, until the server exits — while ``/health``
still says 200 (measured here: a new request timed out after 30 s, ``/health`` 200 throughout).
A router keeps sending work to an engine that is leaving.

:class:`SigtermDrain` makes the engine's HTTP side say so: once the process got SIGTERM,
``GET /health`` answers 503 (``{"status": "draining"}``) and a new ``POST /v1/completions`` or
``/v1/chat/completions`` answers 503 with ``Retry-After: 1`` and ``type`` ``EngineDraining``
before it reaches vLLM. A router (kvbridge's proxy among them) then retries it on another engine
— nothing of it was computed — and takes the engine out of rotation at its next health check.
What the engine core already holds runs to its end; vLLM's own shutdown proceeds unchanged.

What it cannot do: vLLM's drain starts at once, and a request still between vLLM's HTTP server
and its engine core at that moment is lost (measured: the core reported "request processing
complete" while requests were on their way to it; their clients got errors seconds later). Both
asyncio and uvloop dispatch the server's signal handler through the wakeup fd, so it cannot be
held back from here. Drain at the router first (``kvbridge drain``, a ``preStop`` hook) and
SIGTERM once drained; this module covers a SIGTERM that comes without it.

How it hears SIGTERM: :meth:`SigtermDrain.arm` (from the server's main thread, once the server
installed its own handler) chains a Python-level handler in front of the one in place; both the
mark and the server's own handler run on the signal.

Contract: :meth:`arm` runs on the main thread; :attr:`draining` only ever goes from False to
True. Plain ASGI and the standard library; no vLLM import.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from types import FrameType
from typing import Any

__all__ = ["SigtermDrain"]

log = logging.getLogger("kvbridge.connector.http")

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


class SigtermDrain:
    """Whether this engine got SIGTERM, and the 503 answers while it drains."""

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self.draining = False
        self.armed = False

    def arm(self) -> bool:
        """Chain the mark in front of the handler of :attr:`sig` in place (once); True once
        armed. Not before the server installed its own handler (default or ignored: False,
        retried on the next request), and only from the main thread."""
        if self.armed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(self.sig)
        if not callable(previous):
            return False

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if not self.draining:
                self.draining = True
                log.warning("SIGTERM: draining; new requests and /health are answered 503 "
                            "until the server exits")
            previous(signum, frame)

        try:
            signal.signal(self.sig, on_signal)
        except (ValueError, OSError):
            return False
        self.armed = True
        return True

    async def answer(self, send: Send, health: bool) -> None:
        """The 503 of a draining engine (``health``: the ``/health`` one)."""
        if health:
            body = json.dumps({"status": "draining"}).encode()
            headers = [(b"content-type", b"application/json")]
        else:
            error = {"message": "this engine is shutting down (SIGTERM): send the request to "
                                "another engine", "type": "EngineDraining", "param": None,
                     "code": 503}
            body = json.dumps({"error": error}).encode()
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
        await send({"type": "http.response.start", "status": 503,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
