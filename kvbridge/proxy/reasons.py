"""Why a hand-off failed, asked of the engines' control channels after a leg failed.

When a P or D leg answers 5xx (or breaks off, or times out), the proxy asks every control address
it knows for that request's engines — a :class:`~kvbridge.messages.TransferQuery` for the one
``transfer_id`` — and puts the best answer in the client's error (``decode failed: transfer
xfer-…: <reason>``). The channel is ZeroMQ request/reply through the blocking
:class:`~kvbridge.control.ControlClient`, so every call runs in the event loop's default thread
executor with a short deadline: the loop never blocks, and a dead or slow engine only costs the
failed request that deadline. Any failure of the query (no answer, a refused or undecodable
reply, an engine that knows nothing) yields no reason, and the caller keeps its generic message.

The same query with ``timings`` fetches a transfer's flight records for ``GET /admin/why``
(:meth:`ReasonFinder.record`).

Thread safety: :class:`ReasonFinder` is used from one event loop; the client it owns is
thread-safe (a lock per address), which is what lets calls overlap in executor threads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Iterable

from kvbridge import trust
from kvbridge.control import ControlClient
from kvbridge.errors import KVBridgeError
from kvbridge.messages import Codec, TransferQuery, TransferReply

__all__ = ["QueryOutcome", "ReasonFinder", "pick_reason"]

log = logging.getLogger("kvbridge.proxy")


class QueryOutcome(enum.StrEnum):
    """How one control-channel query went (a metric label)."""

    ANSWERED = "answered"  # the rank remembers the transfer
    UNKNOWN = "unknown"  # the rank answered and does not know it
    ERROR = "error"  # no usable answer: timeout, refusal, undecodable reply


class ReasonFinder:
    """Asks engine ranks what happened to a transfer; see the module docstring."""

    def __init__(self, secret: str | None, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._secret = secret
        self._client: ControlClient | None = None

    def client(self) -> ControlClient:
        """The control-channel client (made on first use; closed by :meth:`close`)."""
        if self._client is None:
            try:  # no fleet secret: the per-user secret local engines use (kvbridge.trust)
                key = trust.for_tools(self._secret).secret
            except KVBridgeError as exc:
                log.warning("cannot read the engines' secret (%s); asking unauthenticated", exc)
                key = None
            self._client = ControlClient(Codec(key), self.timeout_s)
        return self._client

    async def _ask(self, address: str, transfer_id: str,
                   timings: bool) -> TransferReply | None:
        client = self.client()
        loop = asyncio.get_running_loop()
        msg = TransferQuery(transfer_ids=[transfer_id], timings=timings)
        call = loop.run_in_executor(None, client.request, address, msg, self.timeout_s)
        try:
            reply = await asyncio.wait_for(call, self.timeout_s + 0.5)
        except Exception as exc:  # noqa: BLE001 - any failure here only loses the reason
            log.debug("no answer from %s about %s: %s", address, transfer_id, exc)
            # drop the socket (and whatever it still queues); off the loop: forget() may wait
            # for the address lock held by a call still running in another executor thread
            loop.run_in_executor(None, client.forget, address)
            return None
        if not isinstance(reply, TransferReply):
            log.debug("%s answered %s to a TransferQuery", address, type(reply).__name__)
            return None
        return reply

    async def query(self, address: str, transfer_id: str) -> tuple[QueryOutcome, str | None]:
        """``(outcome, "state: reason" or None)`` of ``transfer_id`` on the rank at ``address``.

        Never raises (cancellation aside); returns within about ``timeout_s``.
        """
        reply = await self._ask(address, transfer_id, False)
        if reply is None:
            return QueryOutcome.ERROR, None
        outcome = reply.outcomes.get(transfer_id)
        if outcome is None:
            return QueryOutcome.UNKNOWN, None
        return QueryOutcome.ANSWERED, outcome

    async def record(self, address: str, transfer_id: str) -> dict[str, float] | None:
        """The flight record (``{step: wall-clock seconds}``) the rank at ``address`` kept of
        ``transfer_id`` (:mod:`kvbridge.scheduling.recorder`), or None (no answer, not known).
        Never raises (cancellation aside); returns within about ``timeout_s``."""
        reply = await self._ask(address, transfer_id, True)
        return None if reply is None else reply.timings.get(transfer_id)

    async def close(self) -> None:
        """Close the client's sockets (off the loop: closing may wait for running calls)."""
        client, self._client = self._client, None
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(None, client.close)


def pick_reason(outcomes: Iterable[str]) -> str | None:
    """The most telling of ``outcomes`` (in the caller's priority order), without a leading
    ``failed:``: a failure first, then any other end state (``cancelled by decode: …``), then a
    transfer still in progress; ``done`` says nothing about a failure and is skipped."""
    failed: list[str] = []
    other: list[str] = []
    progress: list[str] = []
    for text in outcomes:
        state = text.split(":", 1)[0].strip().lower()
        if state == "failed":
            failed.append(text.split(":", 1)[1].strip() if ":" in text else text)
        elif state == "done":
            continue
        elif state == "in progress":
            progress.append(text)
        else:
            other.append(text)
    for group in (failed, other, progress):
        if group and group[0]:
            return group[0]
    return None
