"""MooncakeTransport: kvbridge's Transport over the Mooncake Transfer Engine.

Data moves through the engine's batched one-sided READ/WRITE (TCP on any host; RDMA or EFA on
clusters), peers find each other without etcd (``P2PHANDSHAKE``: a peer's session is
``host:rpc_port``), and notifications travel over kvbridge's control network because the engine
has none that works with asynchronous batches.

Contract (see :mod:`kvbridge.transport`): ``submit`` validates (including the remote ranges
against the peer's registered regions) and enqueues, never blocking on the network; each peer's
lane thread splits the descriptors into batches of at most ``max_batch`` entries, keeps at most
``window`` batches in flight, and finishes the handle. All methods are thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvbridge.blocks import BlockPair, BlockRequest, BlockTransport, check_in_regions
from kvbridge.errors import (
    ConfigError,
    DescriptorError,
    KVBridgeError,
    PeerForged,
    PeerUnreachable,
    TransportClosed,
    TransportError,
    UnknownPeer,
)
from kvbridge.messages import Codec
from kvbridge.transport import (
    Capabilities,
    DescriptorArray,
    HandleState,
    MemoryRegion,
    Op,
    TransferHandle,
    check_within,
)
from kvbridge.transports.notify import NotificationInbox, NotificationSender
from kvbridge.transports.proofs import ProofBoard, check_proof
from kvbridge_mooncake import _engine
from kvbridge_mooncake._lane import Job, Lane
from kvbridge_mooncake._metadata import MooncakeMetadata, decode_metadata, encode_metadata

__all__ = ["MooncakeTransport"]

log = logging.getLogger("kvbridge.transport.mooncake")

_PROTOCOLS = ("tcp", "rdma", "efa")
_DEFAULT_QUEUE_LIMIT = 1024  # MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER default in the TCP transport


class _Peer:
    def __init__(self, meta: MooncakeMetadata, lane: Lane) -> None:
        self.meta = meta
        self.lane = lane
        self.regions = [(int(a), int(n)) for a, n in meta.regions]


class MooncakeTransport(BlockTransport):
    """Transport backend ``mooncake``.

    Options (``backend_options`` / ``kv_connector_extra_config``):

    * ``protocol`` — ``tcp`` (default), ``rdma``, or ``efa`` (EFA needs a wheel built with it).
    * ``device_name`` — comma-separated RDMA/EFA devices to use; empty means all.
    * ``metadata_server`` — ``P2PHANDSHAKE`` (default, no etcd) or an etcd/http URL.
    * ``host`` — address this rank advertises and binds (default ``127.0.0.1``; on a cluster the
      node's reachable IP).
    * ``max_batch`` — descriptors per engine batch (default 256); larger lists are split.
    * ``window`` — batches in flight per peer (default 2).
    """

    name: ClassVar[str] = "mooncake"
    #: what to install when the engine is missing (kvbridge.registry.install_hint)
    install_hint: ClassVar[str] = ("pip install 'kvbridge[mooncake]' and apt-get install -y "
                                   "libibverbs1")
    capabilities: ClassVar[Capabilities] = Capabilities(
        read=True, write=True, notifications=True, device_memory=False, cross_host=True
    )

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(agent_name, options)
        opts = self.options
        self.protocol = str(opts.get("protocol", "tcp")).lower()
        if self.protocol not in _PROTOCOLS:
            raise ConfigError(
                f"mooncake option protocol={self.protocol!r}: "
                f"expected one of {', '.join(_PROTOCOLS)}"
            )
        self.device_name = str(opts.get("device_name", "") or "")
        self.metadata_server = str(opts.get("metadata_server", "P2PHANDSHAKE") or "P2PHANDSHAKE")
        self.host = str(opts.get("host", "127.0.0.1") or "127.0.0.1")
        self.max_batch = _positive_int(opts, "max_batch", 256)
        self.window = _positive_int(opts, "window", 2)
        limit = int(os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", _DEFAULT_QUEUE_LIMIT))
        if self.protocol == "tcp" and self.max_batch * self.window > limit:
            log.warning(
                "mooncake: max_batch %d x window %d exceeds the TCP per-peer queue of %d; "
                "raise MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER or batches may be rejected",
                self.max_batch, self.window, limit,
            )

        self._engine = _engine.create_engine(
            self.host, self.metadata_server, self.protocol, self.device_name
        )
        self.session = f"{self.host}:{self._engine.get_rpc_port()}"
        self._lock = threading.RLock()
        self._regions: list[tuple[int, int]] = []
        self._board = ProofBoard()
        for region in self._board.regions():
            rc = self._engine.register_memory(region.address, region.length)
            if rc != 0:
                raise TransportError(f"mooncake could not register the proof board (rc {rc})")
        self._peers: dict[str, _Peer] = {}
        self._retired: list[Lane] = []
        self._closing = False
        # Notification frames are authenticated with the fleet's secret when one is set.
        self._codec = Codec(self.options.get("secret"))
        self._inbox = NotificationInbox(
            self.host, codec=self._codec, thread_name=f"kvbridge-mooncake-notify[{agent_name}]"
        )
        log.info(
            "mooncake transport %r up: session %s, protocol %s, metadata %s, notifications %s",
            agent_name, self.session, self.protocol, self.metadata_server, self._inbox.address,
        )

    @classmethod
    def probe(cls) -> str:
        """A one-line status; raises :class:`BackendUnavailable` when the engine cannot load."""
        return _engine.probe()

    # -- memory and peers -----------------------------------------------------------------------

    def _metadata(self) -> bytes:
        return encode_metadata(
            MooncakeMetadata(
                agent=self.agent_name,
                session=self.session,
                regions=list(self._regions),
                notify_address=self._inbox.address,
                protocol=self.protocol,
                board=self._board.board,
            )
        )

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Register each new region once with the engine; return metadata covering all of them.

        Blocking (registration pins nothing on TCP, but RDMA registration can take a while).
        """
        with self._lock:
            self._check_open()
            known = set(self._regions)
            for region in regions:
                if region.kind.upper() != "DRAM":
                    raise ConfigError(
                        f"mooncake backend registers host memory (DRAM) only; got {region.kind!r} "
                        "(device memory needs the CUDA wheel, which kvbridge does not drive yet)"
                    )
                if region.length <= 0 or region.address <= 0:
                    raise DescriptorError(f"cannot register {region}: empty or null range")
                key = (int(region.address), int(region.length))
                if key in known:
                    continue
                rc = self._engine.register_memory(key[0], key[1])
                if rc != 0:
                    raise DescriptorError(
                        f"mooncake register_memory(0x{key[0]:x}, {key[1]}) failed with rc {rc}"
                    )
                self._regions.append(key)
                known.add(key)
            return self._metadata()

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        """Write ``proof`` on this engine's proof board, where the dialler READs it."""
        self._board.attest(proof)

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        """Load the peer once a READ of its proof board found ``proof`` there (else
        :class:`PeerForged`, and an earlier peer of that name is removed)."""
        proof = check_proof(proof)
        meta = decode_metadata(metadata)
        with self._lock:
            self._check_open()
        try:
            self._board.verify(lambda loc, rem, n: self._read_board(meta, loc, rem, n),
                               meta.board, proof, f"mooncake peer {meta.agent!r}")
        except KVBridgeError:
            self.remove_peer(meta.agent)
            raise
        with self._lock:
            self._check_open()
            old = self._peers.pop(meta.agent, None)
            if old is not None:
                old.lane.retire()
                self._retired = [lane for lane in self._retired if lane.alive] + [old.lane]
            outbox = NotificationSender(meta.notify_address, self.agent_name, self._codec)
            lane = Lane(
                self._engine, meta.agent, meta.session, outbox, self.max_batch, self.window,
                closing=lambda: self._closing, probe=self._probe_session,
            )
            self._peers[meta.agent] = _Peer(meta, lane)
        self._forget_blocks(meta.agent)
        log.info("mooncake transport %r: peer %r at %s", self.agent_name, meta.agent, meta.session)
        return meta.agent

    def _read_board(self, meta: MooncakeMetadata, local: int, remote: int, n: int) -> None:
        """One synchronous READ of the peer's proof board (the engine bounds it)."""
        try:
            rc = int(self._engine.transfer_sync_read(meta.session, local, remote, n))
        except Exception as exc:  # noqa: BLE001 - the engine's own exceptions
            raise PeerForged(f"READ of the proof board of {meta.agent!r} at {meta.session} "
                             f"failed: {exc!r}") from exc
        if rc != 0:
            why = self._probe_session(meta.session)
            if why is not None:
                raise PeerUnreachable(f"mooncake peer {meta.agent!r} at {meta.session} is "
                                      f"unreachable ({why})")
            raise PeerForged(f"READ of the proof board of {meta.agent!r} at {meta.session} "
                             f"failed (rc {rc}): the advertised board is not memory it "
                             "registered")

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            entry = self._peers.pop(peer, None)
            if entry is not None:
                entry.lane.retire()
                self._retired = [lane for lane in self._retired if lane.alive] + [entry.lane]
        self._forget_blocks(peer)

    def _peer(self, peer: str) -> _Peer:
        entry = self._peers.get(peer)
        if entry is None:
            raise UnknownPeer(f"mooncake transport {self.agent_name!r} has no peer {peer!r}")
        return entry

    def _probe_session(self, session: str) -> str | None:
        """None if the peer's engine answers a probe, else why not (for error messages)."""
        try:
            rc = int(self._engine.send_probe(session))
        except Exception as exc:  # a probe must never turn into a second failure
            return f"probe raised {exc!r}"
        return None if rc == 0 else f"probe rc {rc}"

    # -- data path ------------------------------------------------------------------------------

    def _submit(
        self,
        op: Op,
        peer: str,
        local: DescriptorArray,
        remote: DescriptorArray,
        notification: bytes | None,
    ) -> TransferHandle:
        with self._lock:
            self._check_open()
            entry = self._peer(peer)
            check_within(local, self._regions, "local")
            check_within(remote, entry.regions, f"remote ({peer})")
            handle = TransferHandle(
                op=op, peer=peer, nbytes=int(local[:, 1].sum()), count=int(local.shape[0])
            )
            entry.lane.post(Job(handle, local, remote, notification))
        return handle

    def _prepare_blocks(self, pair: BlockPair) -> _Peer:
        with self._lock:
            self._check_open()
            entry = self._peer(pair.peer)
            check_in_regions(pair.local, self._regions, "local")
            check_in_regions(pair.remote, entry.regions, f"remote ({pair.peer})")
        return entry

    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        """Enqueue; the lane builds the engine's address lists from the plane tables."""
        with self._lock:
            self._check_open()
            entry = self._peer(pair.peer)
            if entry is not pair.native:
                raise UnknownPeer(f"mooncake {self.agent_name!r}: peer {pair.peer!r} was "
                                  "re-added")
            handle = TransferHandle(op=op, peer=pair.peer, nbytes=req.nbytes,
                                    count=req.count)
            entry.lane.post(Job(handle, None, None, notification,
                                build=lambda: req.descriptors(pair)))
        return handle

    def poll(self, handle: TransferHandle) -> HandleState:
        return handle.state

    # -- notifications --------------------------------------------------------------------------

    def send_notification(self, peer: str, message: bytes) -> None:
        """Queue ``message`` to ``peer`` over the control network (blocks only while its queue
        is full, up to 5 s, then raises :class:`PeerUnreachable`)."""
        with self._lock:
            self._check_open()
            outbox = self._peer(peer).lane.outbox
        outbox.send(message)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self._inbox.drain()

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting work, let lanes finish what they posted (up to ``timeout``), fail
        queued jobs that never started, then release the engine. Idempotent.

        If a lane is still inside the engine after ``timeout`` (posted transfers cannot be
        aborted) the engine and registered memory are deliberately kept alive, with a warning.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing = True
            lanes = [p.lane for p in self._peers.values()] + self._retired
            self._peers.clear()
            self._retired = []
        self._forget_blocks(None)
        for lane in lanes:
            lane.retire()
        deadline = time.monotonic() + timeout
        stuck = [lane for lane in lanes if not lane.join(max(0.0, deadline - time.monotonic()))]
        self._inbox.close()
        if stuck:
            log.warning(
                "mooncake transport %r closed with %d lane(s) still inside the engine; "
                "keeping the engine and its registered memory alive",
                self.agent_name, len(stuck),
            )
            return
        for address, _length in self._regions:
            self._engine.unregister_memory(address)
        for region in self._board.regions():
            self._engine.unregister_memory(region.address)
        self._regions = []
        self._engine = None
        self._board.close()
        log.info("mooncake transport %r closed", self.agent_name)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"mooncake transport {self.agent_name!r} is closed")


def _positive_int(opts: Mapping[str, Any], key: str, default: int) -> int:
    raw = opts.get(key, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"mooncake option {key}={raw!r} is not an integer") from None
    if value <= 0:
        raise ConfigError(f"mooncake option {key}={value} must be positive")
    return value
