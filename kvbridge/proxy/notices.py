"""Drain notices: the proxy tells a drained engine's ranks to write their hot KV out.

When ``/admin/drain`` (or ``kvbridge drain``) drains an engine, the proxy sends a
:class:`~kvbridge.messages.DrainNotice` to each of the engine's control addresses; a rank with
offload tiers answers ``Ack(ok=True)`` and writes its local tiers' most recently used chunks into
its lasting tiers in the background (:mod:`kvbridge.offload.warm`), so the engine that replaces
it finds them there. The frame is authenticated like every control frame (the fleet secret, else
the per-user one: :func:`kvbridge.trust.for_tools`); an engine drops a notice without it.

Each call runs the blocking :class:`~kvbridge.control.ControlClient` in the event loop's default
executor with a deadline, so the loop never blocks. A notice is best effort: no answer, a refusal
or a rank without tiers is logged and reported, never raised; the drain itself does not depend
on it. Thread safety: one :class:`DrainNotices` per event loop; its client is thread-safe.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Iterable

from kvbridge.control import ControlClient
from kvbridge.messages import Ack, DrainNotice

__all__ = ["DrainNotices", "NoticeOutcome"]

log = logging.getLogger("kvbridge.proxy")


class NoticeOutcome(enum.StrEnum):
    """What one rank answered a drain notice."""

    WRITING = "writing"  # Ack(ok=True): its write-out runs
    NO_TIERS = "no_tiers"  # answered, but it has nothing to write (no offload tiers)
    ERROR = "error"  # no usable answer: timeout, refusal, undecodable reply


class DrainNotices:
    """Sends drain notices; see the module docstring."""

    def __init__(self, client: Callable[[], ControlClient], timeout_s: float) -> None:
        """``client``: the control-channel client to notify with (the owner's, which it
        closes; :meth:`kvbridge.proxy.reasons.ReasonFinder.client` in the proxy)."""
        self.timeout_s = timeout_s
        self._get_client = client

    async def tell(self, addresses: Iterable[str]) -> dict[str, NoticeOutcome]:
        """Notify every rank at ``addresses`` at once; what each answered. Never raises
        (cancellation aside); returns within about ``timeout_s``."""
        addresses = list(addresses)
        outcomes = await asyncio.gather(*(self._one(a) for a in addresses))
        return dict(zip(addresses, outcomes, strict=True))

    async def _one(self, address: str) -> NoticeOutcome:
        client = self._get_client()
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(None, client.request, address, DrainNotice(), self.timeout_s)
        try:
            reply = await asyncio.wait_for(call, self.timeout_s + 0.5)
        except Exception as exc:  # noqa: BLE001 - a lost notice only loses the write-out
            log.warning("drain notice to %s: no answer (%s); its KV is not written out",
                        address, exc)
            loop.run_in_executor(None, client.forget, address)
            return NoticeOutcome.ERROR
        if isinstance(reply, Ack) and reply.ok:
            log.info("drain notice to %s: it writes its hot KV out", address)
            return NoticeOutcome.WRITING
        if isinstance(reply, Ack) and reply.kind is None:
            log.info("drain notice to %s: %s", address, reply.error)
            return NoticeOutcome.NO_TIERS
        log.warning("drain notice to %s: answered %s (an engine that predates drain "
                    "notices refuses them as malformed)", address, reply)
        return NoticeOutcome.ERROR
