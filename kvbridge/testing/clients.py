"""Control-channel clients for tests and tools that talk to local engines as a peer would.

Engines authenticate every control frame (:mod:`kvbridge.trust`): with ``KVBRIDGE_SECRET`` when
it is set, else with the per-user secret of this host. :func:`engine_codec` builds a
:class:`~kvbridge.messages.Codec` with that same secret, :func:`engine_client` a blocking
:class:`~kvbridge.control.ControlClient` around it. A test that plays a stranger (a process
without the secret) uses a plain ``Codec()`` instead.
"""

from __future__ import annotations

from typing import Any

from kvbridge import trust
from kvbridge.control import ControlClient
from kvbridge.messages import Codec

__all__ = ["engine_codec", "engine_client"]


def engine_codec(**kwargs: Any) -> Codec:
    """A codec with the secret local engines use (``kwargs`` go to :class:`Codec`)."""
    return Codec(trust.for_tools().secret, **kwargs)


def engine_client(timeout: float = 5.0, **kwargs: Any) -> ControlClient:
    """A blocking control client with the secret local engines use."""
    return ControlClient(engine_codec(**kwargs), timeout)
