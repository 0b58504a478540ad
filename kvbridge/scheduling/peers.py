"""Peer table: one handshake per remote engine rank, compatibility checked, cached.

Peers are keyed by control address for lookup and by ``(engine_id, generation, rank)`` for
identity: a restarted engine has a new generation, is handshaken again, and messages naming an old
generation are fenced off.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvbridge.control import ControlClient
from kvbridge.errors import KVBridgeError, LayoutMismatch, MessageError, PeerError
from kvbridge.layout import KVLayout
from kvbridge.messages import PROTOCOL_VERSION, Ack, EngineInfo, Hello, HelloReply
from kvbridge.transport import Transport

__all__ = ["Peer", "PeerTable", "check_compatible"]

log = logging.getLogger("kvbridge.peers")


@dataclass(frozen=True)
class Peer:
    info: EngineInfo
    layout: KVLayout
    name: str  # the transport's name for it

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.info.engine_id, self.info.generation, self.info.rank)


def check_compatible(mine: EngineInfo, theirs: EngineInfo) -> KVLayout:
    """Raise :class:`LayoutMismatch` naming the first incompatible field; return their layout."""
    if theirs.protocol != mine.protocol:
        raise LayoutMismatch(
            f"kvbridge protocol version differs: {mine.protocol} here, {theirs.protocol} at "
            f"{theirs.engine_id}"
        )
    if theirs.backend != mine.backend:
        raise LayoutMismatch(
            f"backend differs: {mine.backend!r} here, {theirs.backend!r} at {theirs.engine_id}"
        )
    for key in sorted(set(mine.compat) | set(theirs.compat)):
        a, b = mine.compat.get(key), theirs.compat.get(key)
        if a != b:
            raise LayoutMismatch(f"{key} differs: {a!r} here, {b!r} at {theirs.engine_id}")
    layout = KVLayout.from_dict(theirs.layout)
    if layout.fingerprint() != theirs.layout_fingerprint:
        raise MessageError(f"layout fingerprint of {theirs.engine_id} does not match its layout")
    KVLayout.from_dict(mine.layout).check_compatible(layout)
    return layout


class PeerTable:
    """Thread-safe cache of handshaken peers for one local engine rank."""

    def __init__(self, me: EngineInfo, transport: Transport, client: ControlClient) -> None:
        self.me = me
        self._transport = transport
        self._client = client
        self._by_address: dict[str, Peer] = {}
        self._by_key: dict[tuple[str, str, int], Peer] = {}
        self._lock = threading.Lock()
        self.handshakes = 0

    def accept(self, info: EngineInfo) -> Peer:
        """Add a peer from its info (after checking compatibility); replaces older generations."""
        layout = check_compatible(self.me, info)
        name = self._transport.add_peer(info.transport_metadata)
        peer = Peer(info, layout, name)
        with self._lock:
            old = self._by_address.get(info.control_address)
            if old is not None and old.key != peer.key:
                log.info("peer %s restarted (generation %s -> %s); re-handshaken",
                         info.engine_id, old.info.generation, info.generation)
                self._by_key.pop(old.key, None)
            self._by_address[info.control_address] = peer
            self._by_key[peer.key] = peer
        return peer

    def get(self, address: str, timeout: float | None = None) -> Peer:
        """The peer at ``address``, handshaking on first use. Raises a :class:`PeerError` or
        :class:`LayoutMismatch`."""
        with self._lock:
            peer = self._by_address.get(address)
        if peer is not None:
            return peer
        reply = self._client.request(address, Hello(info=self.me), timeout)
        if isinstance(reply, Ack):
            if reply.error and reply.error.startswith("LayoutMismatch"):
                raise LayoutMismatch(f"handshake with {address} refused: {reply.error}")
            raise PeerError(f"handshake with {address} refused: {reply.error}")
        if not isinstance(reply, HelloReply):
            raise MessageError(f"unexpected handshake reply {type(reply).__name__} from {address}")
        peer = self.accept(reply.info)
        self.handshakes += 1
        log.info("handshake with %s (%s gen %s) done", address, reply.info.engine_id,
                 reply.info.generation)
        return peer

    def by_key(self, engine_id: str, generation: str, rank: int = 0) -> Peer:
        with self._lock:
            peer = self._by_key.get((engine_id, generation, rank))
        if peer is None:
            raise KVBridgeError(
                f"no handshake with {engine_id} generation {generation} rank {rank} (stale or "
                "unknown peer)"
            )
        return peer

    def forget(self, address: str) -> None:
        with self._lock:
            peer = self._by_address.pop(address, None)
            if peer is not None:
                self._by_key.pop(peer.key, None)
        if peer is not None:
            self._transport.remove_peer(peer.name)
        self._client.forget(address)


def make_info(
    *,
    engine_id: str,
    generation: str,
    rank: int,
    backend: str,
    transport_metadata: bytes,
    layout: KVLayout,
    control_address: str,
    compat: dict[str, str],
) -> EngineInfo:
    """Build this rank's :class:`EngineInfo`."""
    return EngineInfo(
        engine_id=engine_id,
        generation=generation,
        rank=rank,
        protocol=PROTOCOL_VERSION,
        backend=backend,
        transport_metadata=transport_metadata,
        layout=layout.to_dict(),
        layout_fingerprint=layout.fingerprint(),
        control_address=control_address,
        compat=compat,
    )
