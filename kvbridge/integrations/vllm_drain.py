"""SIGTERM drains a vLLM engine's HTTP side: new requests get 503 at once instead of hanging.

vLLM 0.32 with ``--shutdown-timeout N`` answers SIGTERM by draining: the engine core finishes
what it runs (and keeps stepping while a connector holds a request's KV, so a prefill engine's
pull leases are still served), but a request that *arrives* during the drain is aborted inside
the engine and its HTTP client waits, unanswered, until the server exits — while ``/health``
still says 200 (measured here: a new request timed out after 30 s; ``/health`` 200 during the
drain). A router keeps sending work to an engine that is leaving.

:class:`SigtermDrain` makes the engine's HTTP side say so: once the process got SIGTERM,
``GET /health`` answers 503 (``{"status": "draining"}``) and a new ``POST /v1/completions`` or
``/v1/chat/completions`` answers 503 with ``Retry-After: 1`` and ``type`` ``EngineDraining``
before it reaches vLLM. A router (kvbridge's proxy among them) then retries it on another engine
— nothing of it was computed — and takes the engine out of rotation at its next health check.
vLLM's own shutdown begins once every generation request that went in before the signal has
ended (at most ``wait_s``, 120 s; a second SIGTERM starts it at once): vLLM's drain finishes
the requests its engine core holds, but one still between its HTTP server and its engine core
when the drain starts is lost (measured here: the core reported "request processing complete"
at once while a request was in flight, and the client got an error seconds later).

How it hears SIGTERM: vLLM's server installs its SIGTERM handler with
``loop.add_signal_handler``, which keeps one handler per signal. :meth:`SigtermDrain.arm`,
called from the server's event loop, wraps that handler with one that marks the drain first and
then calls vLLM's (through asyncio's handler table, ``loop._signal_handlers``; where that is
missing or holds no SIGTERM handler yet it does nothing and is retried on the next request).
Used by :class:`kvbridge.integrations.vllm_http.KVTransferParamsGuard`, the ``--middleware``
kvbridge's engines run with.

Contract: :meth:`arm` and :meth:`answer` run on the server's event loop; :attr:`draining` only
ever goes from False to True. Plain ASGI and asyncio; no vLLM import.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["SigtermDrain"]

log = logging.getLogger("kvbridge.connector.http")

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


class SigtermDrain:
    """Whether this engine got SIGTERM, and the 503 answers while it drains."""

    def __init__(self, sig: int = signal.SIGTERM, wait_s: float = 120.0) -> None:
        self.sig = sig
        self.wait_s = wait_s
        self.draining = False
        self.armed = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None
        self._waiter: asyncio.Task[None] | None = None

    def enter(self) -> None:
        """A generation request went in to vLLM (call :meth:`leave` when its answer ended)."""
        self.in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def _then(self, callback: Callable[..., object], args: tuple[object, ...]) -> None:
        """vLLM's own handler, once every request in flight ended (or ``wait_s`` passed)."""
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            self._idle.set()
        try:
            await asyncio.wait_for(self._idle.wait(), self.wait_s)
        except TimeoutError:
            log.warning("SIGTERM: %d requests still in flight after %.0f s; shutting down",
                        self.in_flight, self.wait_s)
        callback(*args)

    def arm(self) -> bool:
        """Wrap the running loop's handler of :attr:`sig` (once); True once armed."""
        if self.armed:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        handlers = getattr(loop, "_signal_handlers", None)
        handle = handlers.get(self.sig) if isinstance(handlers, dict) else None
        callback = getattr(handle, "_callback", None)
        if callback is None:
            return False  # the server has not installed its handler yet
        args = tuple(getattr(handle, "_args", None) or ())

        def on_signal() -> None:
            if self.draining or self.in_flight == 0:  # a second signal: no more waiting
                self.draining = True
                callback(*args)
                return
            self.draining = True
            log.warning("SIGTERM: draining; new requests are answered 503 and /health 503; "
                        "vLLM's shutdown begins once the %d requests in flight ended (at most "
                        "%.0f s)", self.in_flight, self.wait_s)
            self._waiter = loop.create_task(self._then(callback, args))

        try:
            loop.add_signal_handler(self.sig, on_signal)
        except (RuntimeError, ValueError, NotImplementedError):
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
