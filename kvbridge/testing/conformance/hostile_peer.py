"""Hostile-peer conformance: a transport loads a peer only if the peer proved it (mixin).

:class:`HostilePeerConformance` is part of
:class:`kvbridge.testing.conformance.TransportConformance`, so every backend's conformance
module runs it, the built-in transports and the plugins alike.
It checks the transport's half of :mod:`kvbridge.identity` with a real peer (another process by
default):

* **relay** — the peer's genuine metadata with a proof the peer never attested (another
  endpoint attested it: here, the local transport itself, standing in for the rogue that
  answered the handshake) is refused with :class:`PeerForged`, and nothing is loaded under the
  peer's name;
* **impersonation / forged proof** — a random proof, or one of the wrong length
  (:class:`DescriptorError`), is refused the same way;
* **stale generation** — metadata of a peer whose process (or transport) is gone is refused
  (:class:`PeerForged` or :class:`PeerUnreachable`) within the handshake bound, never loaded;
* **a proven peer** — metadata with the proof the peer attested is loaded, and the peer then
  moves bytes; a peer refused first and proven afterwards works too (a refusal poisons nothing).

The core's half (the reply's control address, the proof derived from the dialled address and
the claimed identity, the peer name) is tested in ``tests/process/test_identity.py``.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import numpy as np
import pytest

from kvbridge.errors import DescriptorError, PeerError, PeerForged, UnknownPeer
from kvbridge.identity import PROOF_BYTES
from kvbridge.layout import descriptor_pair
from kvbridge.testing.conformance.pair import Pair
from kvbridge.testing.peer import Peer, kv_buffer
from kvbridge.transport import MemoryRegion, Op, Transport

__all__ = ["HostilePeerConformance"]


class HostilePeerConformance:
    """Mixed into :class:`~kvbridge.testing.conformance.TransportConformance`; uses its
    ``local``/``peer`` fixtures and ``connect``."""

    timeout: ClassVar[float] = 30.0

    def connect(self, local: Transport, peer: Peer, block_bytes: int = 4096,
                num_blocks: int = 16, layers: int = 2, seed: int = 0) -> Pair:
        raise NotImplementedError

    def _registered(self, local: Transport, peer: Peer) -> tuple[bytes, Any, Any, Any]:
        """Memory on both sides, nobody added: (local metadata, peer memory, local buffer,
        local layout)."""
        buf, layout = kv_buffer(2, 8, 4096, 3)
        meta = local.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
        remote = peer.setup(2, 8, 4096, 4)
        self._keep = buf  # registered memory stays alive for the test
        return meta, remote, buf, layout

    def _not_loaded(self, local: Transport, name: str, remote: Any, buf: Any) -> None:
        loc = np.array([[buf.ctypes.data, 4096, 0]], dtype=np.int64)
        rem = np.array([[remote.layout.planes[0].base, 4096, 0]], dtype=np.int64)
        with pytest.raises(UnknownPeer):
            local.submit(Op.WRITE, name, loc, rem)

    def test_hostile_relayed_metadata_is_refused(self, local: Transport, peer: Peer) -> None:
        """The peer's real metadata with a proof some other endpoint attested."""
        meta, remote, buf, _ = self._registered(local, peer)
        token = local.invite(remote.metadata)  # the "rogue" attests, not the peer
        with pytest.raises(PeerForged):
            local.add_peer(remote.metadata, token)
        self._not_loaded(local, peer.name, remote, buf)

    def test_hostile_forged_proof_is_refused(self, local: Transport, peer: Peer) -> None:
        _, remote, buf, _ = self._registered(local, peer)
        with pytest.raises(PeerForged):
            local.add_peer(remote.metadata, os.urandom(PROOF_BYTES))
        self._not_loaded(local, peer.name, remote, buf)
        for bad in (b"", b"x" * (PROOF_BYTES - 1), b"x" * (PROOF_BYTES + 1)):
            with pytest.raises(DescriptorError):
                local.add_peer(remote.metadata, bad)

    def test_hostile_proof_of_an_earlier_handshake_does_not_prove_a_new_one(
            self, local: Transport, peer: Peer) -> None:
        """A proof the peer attested proves that handshake only: another random proof (a new
        handshake the peer never saw) is refused even after the first one succeeded."""
        pair = self.connect(local, peer)
        with pytest.raises(PeerForged):
            local.add_peer(pair.remote.metadata, os.urandom(PROOF_BYTES))

    def test_hostile_stale_peer_is_refused(self, local: Transport, peer: Peer) -> None:
        """Metadata of a peer that is gone (a generation that ended) is never loaded."""
        meta, remote, buf, _ = self._registered(local, peer)
        token = peer.invite(meta)
        peer.kill()
        started = time.monotonic()
        with pytest.raises(PeerError):
            local.add_peer(remote.metadata, token)
        assert time.monotonic() - started < self.timeout
        self._not_loaded(local, peer.name, remote, buf)

    def test_hostile_refused_peer_then_proven_moves_bytes(self, local: Transport,
                                                          peer: Peer) -> None:
        if not (local.capabilities.write and local.capabilities.read):
            pytest.skip("needs one-sided READ and WRITE")
        meta, remote, buf, layout = self._registered(local, peer)
        with pytest.raises(PeerForged):
            local.add_peer(remote.metadata, os.urandom(PROOF_BYTES))
        name = local.add_peer(remote.metadata, peer.invite(meta))
        loc, rem = descriptor_pair(layout, [1, 2], remote.layout, [5, 6])
        handle = local.submit(Op.WRITE, name, loc, rem)
        assert local.wait(handle, self.timeout).value == "done", handle.error
        theirs = peer.buffer(remote.index).reshape(buf.shape)
        np.testing.assert_array_equal(theirs[:, :, [5, 6]], buf[:, :, [1, 2]])
