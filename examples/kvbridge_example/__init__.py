"""``loopback``: the smallest kvbridge transport, the worked example of docs/writing-a-backend.md.

It moves bytes between transports of ONE process (``ctypes.memmove``): enough to show the whole
contract of :class:`kvbridge.transport.Transport` and to pass kvbridge's conformance suite
(``tests/test_conformance.py``), but useless between engines, so it asks for no vLLM connector
name (``connector_word = ""``). This package is installed as its own distribution
(``pyproject.toml`` here: one entry point in ``kvbridge.backends``) and touches nothing in
``kvbridge/``.

How the contract maps here:

* ``register_memory`` records the regions and returns metadata naming this transport instance;
* ``attest`` remembers a proof; ``add_peer`` finds the live instance the metadata names and
  loads it only if *that instance* attested the proof (else :class:`PeerForged`); an instance
  that is gone is :class:`PeerUnreachable`; metadata that does not decode is
  :class:`MessageError`;
* ``_submit`` checks both descriptor lists against registered memory (:func:`check_within`),
  copies at once under the target's lock (so a peer closing meanwhile waits for the copy), and
  settles the handle at once (``succeed()``, or ``fail(...)`` when the peer closed); the
  base class's ``poll`` reads it;
* no notifications: it does not implement the optional ``Notifying`` protocol
  (``send_notification``/``get_notifications``), so ``check_notification`` refuses one given to
  ``submit``, and the conformance suite skips those tests.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import msgspec

from kvbridge.errors import DescriptorError, MessageError, PeerForged, PeerUnreachable, UnknownPeer
from kvbridge.identity import PROOF_BYTES
from kvbridge.transport import (
    Capabilities,
    MemoryRegion,
    Op,
    TransferHandle,
    Transport,
    check_notification,
    check_within,
)

__all__ = ["LoopbackTransport"]

#: live transports of this process by instance id: what ``add_peer`` can reach
_LIVE: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()


class _Metadata(msgspec.Struct, forbid_unknown_fields=True):
    agent: str
    instance: str


class LoopbackTransport(Transport):
    """In-process transport over ``memmove``; see the module docstring."""

    name: ClassVar[str] = "loopback"
    capabilities: ClassVar[Capabilities] = Capabilities(notifications=False)
    #: no ``KVBridge…Connector`` name: it cannot reach another engine
    connector_word: ClassVar[str] = ""
    #: what ``kvbridge backends`` prints when this class cannot load
    install_hint: ClassVar[str] = "pip install -e examples/kvbridge_example"

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(agent_name, options)
        self._lock = threading.Lock()
        self._instance = uuid.uuid4().hex
        self._regions: list[tuple[int, int]] = []
        self._proofs: collections.deque[bytes] = collections.deque(maxlen=256)
        self._peers: dict[str, LoopbackTransport] = {}
        with _LIVE_LOCK:
            _LIVE[self._instance] = self

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        with self._lock:
            for r in regions:
                if r.kind.upper() != "DRAM":
                    raise DescriptorError(f"loopback moves host DRAM only, not {r.kind}")
                self._regions.append((r.address, r.length))
        return msgspec.msgpack.encode(_Metadata(self.agent_name, self._instance))

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        _check_proof(proof)
        with self._lock:
            self._proofs.append(bytes(proof))

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        _check_proof(proof)
        try:
            meta = msgspec.msgpack.decode(metadata, type=_Metadata)
        except msgspec.MsgspecError as exc:
            raise MessageError(f"malformed loopback metadata: {exc}") from exc
        with _LIVE_LOCK:
            peer = _LIVE.get(meta.instance)
        if peer is None or peer.closed:
            raise PeerUnreachable(f"loopback peer {meta.agent!r} is gone")
        with peer._lock:
            proven = proof in peer._proofs and peer.agent_name == meta.agent
        if not proven:
            raise PeerForged(f"loopback peer {meta.agent!r} did not attest that proof")
        with self._lock:
            self._peers[meta.agent] = peer
        return meta.agent

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._peers.pop(peer, None)

    def _submit(self, op: Op, peer: str, local: Any, remote: Any,
                notification: bytes | None) -> TransferHandle:
        check_notification(self, notification)  # no Notifying protocol here: refused
        with self._lock:
            target = self._peers.get(peer)
            check_within(local, self._regions, "local")
        if target is None:
            raise UnknownPeer(f"unknown loopback peer {peer!r}")
        handle = TransferHandle(op, peer, int(local[:, 1].sum()), int(local.shape[0]))
        with target._lock:  # the target cannot close (and free its memory) while we copy
            check_within(remote, target._regions, "remote")
            if target.closed:
                handle.fail(f"loopback peer {peer!r} closed")
                return handle
            for (mine, length, _), (theirs, _, _) in zip(local.tolist(), remote.tolist(),
                                                         strict=True):
                dst, src = (theirs, mine) if op is Op.WRITE else (mine, theirs)
                ctypes.memmove(dst, src, length)
        handle.succeed()
        return handle

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            self._peers.clear()
        with _LIVE_LOCK:
            _LIVE.pop(self._instance, None)


def _check_proof(proof: bytes) -> None:
    if len(proof) != PROOF_BYTES:
        raise DescriptorError(f"a proof has {PROOF_BYTES} bytes, got {len(proof)}")
