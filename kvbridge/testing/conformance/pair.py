"""The pair every transport conformance test runs on: a connected local transport and a peer
(a real second process, or one in this process), with one KV buffer on each side.

Shared by the suites of :mod:`kvbridge.testing.conformance` (transport, blocks, hostile peers);
it lives apart so that they import it, and not one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.layout import KVLayout
from kvbridge.testing.peer import Peer, PeerMemory
from kvbridge.transport import Transport

__all__ = ["Pair"]


@dataclass
class Pair:
    """A connected local transport and peer, with one KV buffer on each side."""

    local: Transport
    peer: Peer
    local_buf: np.ndarray[Any, np.dtype[np.uint8]]
    local_layout: KVLayout
    remote: PeerMemory
    peer_name: str
    local_name: str
    local_meta: bytes = b""
    keep: list[Any] = field(default_factory=list)

    def readd(self) -> str:
        """Add the peer again, with a fresh proof (what a new handshake does)."""
        return self.local.add_peer(self.remote.metadata, self.peer.invite(self.local_meta))

    def remote_buf(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The peer's buffer now, shaped like ``local_buf``."""
        return self.peer.buffer(self.remote.index).reshape(self.local_buf.shape)
