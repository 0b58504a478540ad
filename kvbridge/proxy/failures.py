"""How a leg of the proxy fails: :class:`LegFailed`, and the :class:`~routing.Cause` of an error.

A *leg* is one exchange with one engine: a probe, P's prefill, D's answer or stream. Every way a
leg can fail (no connection, a broken or late answer, a 4xx or 5xx, a malformed
``kv_transfer_params``) becomes one :class:`LegFailed` carrying the HTTP status and error type the
client will see and the :class:`~kvbridge.proxy.routing.Cause` the retry policy reads. It never
escapes the proxy: the HTTP handlers turn it into a JSON error (or D's own answer).

Plain values, no I/O; safe to build and read from any task of the proxy's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
from aiohttp import web

from kvbridge.params import TransferParams
from kvbridge.proxy.routing import Cause, Engine, Role

__all__ = ["LegFailed", "cause_of"]


class LegFailed(Exception):
    """An upstream leg failed; becomes a JSON error at the HTTP boundary, never escapes it.

    ``cause`` is what the retry policy reads. :meth:`within` records the dispatch the leg
    belonged to (its transfer id and the engines to ask why); ``response`` is D's own unsent
    error answer, passed on when no engine can say more.
    """

    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 cause: Cause = Cause.SERVER_ERROR,
                 response: web.StreamResponse | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.cause = cause
        self.response = response
        self.tid: str | None = None
        self.legs: Sequence[tuple[Engine, TransferParams | None]] = ()

    @property
    def role(self) -> Role:
        """The role of the leg that failed (a probe is P's)."""
        return Role.DECODE if self.kind.startswith("decode") else Role.PREFILL

    def within(self, tid: str, legs: Sequence[tuple[Engine, TransferParams | None]]
               ) -> LegFailed:
        self.tid = tid
        self.legs = legs
        return self


def cause_of(exc: BaseException) -> Cause:
    """How a request to an engine failed, from the exception aiohttp (or a parser) raised."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return Cause.UNREACHABLE  # no connection: nothing was sent
    if isinstance(exc, TimeoutError):
        return Cause.TIMEOUT
    if isinstance(exc, aiohttp.ClientResponseError):
        return Cause.SERVER_ERROR if exc.status >= 500 else Cause.REFUSED
    if isinstance(exc, aiohttp.ClientError):
        return Cause.BROKEN
    return Cause.MALFORMED
