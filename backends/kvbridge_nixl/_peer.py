"""What a NIXL peer is to :class:`~kvbridge_nixl.transport.NixlTransport`: the metadata it
sends (:class:`NixlPeerInfo`, strict msgpack), the state kept for it (:class:`PeerState`, and
:class:`PreparedPair` for a prepared block pair), and how NIXL's native errors map onto
kvbridge's (:func:`translate`). Plain data and pure functions: no locking, no blocking.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvbridge.errors import (
    KVBridgeError,
    MessageError,
    PeerUnreachable,
    TransferFailed,
    UnknownPeer,
)
from kvbridge.transport import Op

__all__ = ["METADATA_VERSION", "NixlPeerInfo", "PeerState", "PreparedPair", "describe",
           "info_decoder", "info_encoder", "translate"]

METADATA_VERSION = 2


class NixlPeerInfo(msgspec.Struct, frozen=True, tag="kvbridge-nixl"):
    """What :meth:`NixlTransport.register_memory` returns (msgpack): a peer's metadata."""

    version: int
    agent: str
    mem_type: str
    regions: list[tuple[int, int, int]]
    nixl: bytes
    #: ``(address, length)`` of the agent's proof board (host DRAM, registered with NIXL, not
    #: part of ``regions``: :class:`kvbridge.transports.proofs.ProofBoard`)
    board: tuple[int, int] = (0, 0)


info_decoder = msgspec.msgpack.Decoder(NixlPeerInfo)
info_encoder = msgspec.msgpack.Encoder()


@dataclass
class PeerState:
    name: str
    regions: list[tuple[int, int, int]]
    mem_type: str
    grids: OrderedDict[int, Any] = field(default_factory=OrderedDict)  # granule -> dlist handle
    inflight: int = 0
    removed: bool = False


@dataclass(eq=False)
class PreparedPair:
    """Native state of a prepared block pair."""

    peer: PeerState
    local: Any  # prepared dlist handle of the local layout (shared, see _layout_dlists)
    remote: Any  # prepared dlist handle of the remote layout (this pair's own)


def describe(op: Op, nbytes: int, peer: str) -> str:
    """How errors name one transfer."""
    return f"{op.value} of {nbytes} bytes with peer {peer!r}"


def translate(exc: BaseException, what: str, peer: str | None = None) -> KVBridgeError:
    """Map a native NIXL exception to kvbridge's error tree."""
    kind = type(exc).__name__
    text = f"{what}: NIXL {kind} ({exc})"
    if kind == "nixlRemoteDisconnectError":
        return PeerUnreachable(text)
    if kind == "nixlNotFoundError" and peer is not None:
        return UnknownPeer(f"{text}; is peer {peer!r} added?")
    if kind in ("nixlMismatchError", "nixlInvalidParamError"):
        return MessageError(text)
    return TransferFailed(text)
