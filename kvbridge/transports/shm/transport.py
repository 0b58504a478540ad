"""The shm transport itself: :class:`ShmTransport`, the contract in the package docstring.

It owns the registration (regions, version, the memfds of ``map_memory``), the peers proven by
:class:`~.proof.Dialler`, the listener (:mod:`.listener`) that answers this engine's attested
diallers, the notification inbox, and the :class:`~.worker.Worker` that runs transfers. Every
public method may be called from any thread (one lock guards the regions and the peers);
``add_peer`` blocks for one local handshake, ``close`` for up to its timeout, the rest never
block (``submit`` validates and queues).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvbridge.blocks import (
    BlockPair,
    BlockRequest,
    BlockTransport,
    PreparedRequest,
    check_in_regions,
)
from kvbridge.errors import (
    ConfigError,
    DescriptorError,
    MessageError,
    PeerUnreachable,
    TransportClosed,
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
from kvbridge.transports.notify import (
    DEFAULT_MAX_NOTIFICATION_BYTES,
    DEFAULT_MAX_NOTIFICATIONS,
    NotificationInbox,
)
from kvbridge.transports.proofs import Attestations, check_proof
from kvbridge.transports.shm.cma import IOV_MAX, _boot_id, _explain, _iov, _Libc, _pid_ns
from kvbridge.transports.shm.listener import _Listener, _NotLetIn
from kvbridge.transports.shm.memfd import MAX_FDS, SharedArea, share
from kvbridge.transports.shm.proof import Dialler, _Peer
from kvbridge.transports.shm.wire import (
    _MAX_ADDR,
    _MAX_REPLY_BYTES,
    MAX_REGIONS,
    ShmMetadata,
    _encoder,
    _Registration,
    decode_metadata,
)
from kvbridge.transports.shm.worker import Worker, _BlockJob, _Job, _Prepared, all_mapped
from kvbridge.values import parse_bool

__all__ = ["ShmTransport", "DEFAULT_THREADS"]

log = logging.getLogger("kvbridge.transport.shm")

#: Default ``threads``: two copy threads where there are two CPUs. Measured on a quiet 2-vCPU
#: host, 64 MiB per transfer (docs/benchmarks.md): kvbridge/memcpy 0.65 -> 0.84 at 256 KiB
#: blocks and 0.80 -> 1.01 at 1 MiB; only transfers of at least ``split_bytes`` are split.
DEFAULT_THREADS = min(2, os.cpu_count() or 1)


def _check_bounds(local: DescriptorArray, remote: DescriptorArray) -> None:
    """Refuse addresses/lengths whose sum could overflow the int64 range check (one reduction
    per list: this runs on every submit)."""
    if local.shape[0] and (local.max() > _MAX_ADDR or remote.max() > _MAX_ADDR):
        raise DescriptorError("descriptors hold an address or length above 2**62")


def _word(peer: _Peer, address: int) -> int:
    """Where the peer's 8-byte-aligned word at ``address`` is mapped here; 0 where it is not
    (no mapping, not aligned, not wholly inside one piece the peer shared)."""
    if peer.mapping is None or address <= 0 or address % 8 or address > _MAX_ADDR:
        return 0
    inside, here = peer.mapping.translate(np.array([address], dtype=np.int64),
                                          np.array([8], dtype=np.int64))
    return int(here[0]) if inside[0] else 0


def _option(options: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    try:
        value = float(options.get(key, default))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"shm option {key} must be a number: {exc}") from None
    if not lo <= value <= hi:
        raise ConfigError(f"shm option {key} must be in [{lo}, {hi}], got {value}")
    return value


class ShmTransport(BlockTransport):
    """Same-host transport over cross-memory attach; see the package docstring."""

    name = "shm"
    capabilities = Capabilities(
        read=True, write=True, notifications=True, device_memory=False, cross_host=False,
        map_memory=True, copies_landing=True,
    )

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(agent_name, options)
        self._libc = _Libc.get()
        iov_max = int(self.options.get("iov_max", IOV_MAX))
        if not 1 <= iov_max <= IOV_MAX:
            raise DescriptorError(f"iov_max must be in [1, {IOV_MAX}], got {iov_max}")
        opts = self.options
        self._threads = int(_option(opts, "threads", DEFAULT_THREADS, 1, 64))
        split_bytes = int(_option(opts, "split_bytes", 16 << 20, 1, 1 << 40))
        self._map_memory = parse_bool(opts.get("map_memory", False), "shm option map_memory")
        map_peers = parse_bool(opts.get("map_peers", True), "shm option map_peers")
        self._areas: list[SharedArea] = []
        hs_timeout = _option(opts, "handshake_timeout", 5.0, 0.01, 600.0)
        listener_timeout = _option(opts, "listener_timeout", 2.0, 0.01, 600.0)
        max_conns = int(_option(opts, "listener_max_connections", 16, 1, 4096))
        max_msgs = int(_option(opts, "max_notifications", DEFAULT_MAX_NOTIFICATIONS, 1, 1 << 24))
        max_bytes = int(_option(
            opts, "max_notification_bytes", DEFAULT_MAX_NOTIFICATION_BYTES, 1, 1 << 34
        ))
        secret = opts.get("secret")
        self._codec = Codec(secret)
        self._hs_codec = Codec(secret, _MAX_REPLY_BYTES)
        self._dialler = Dialler(agent_name, self._codec, self._hs_codec, hs_timeout, map_peers)
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []
        self._version = 0
        self._peers: dict[str, _Peer] = {}
        self._attested = Attestations()
        self._boot_id, self._pid_ns = _boot_id(), _pid_ns()
        self._inbox = NotificationInbox(
            str(opts.get("notify_host", "127.0.0.1")),
            int(opts.get("notify_port", 0)),
            self._codec,
            thread_name=f"kvbridge-shm-notify-{agent_name}",
            max_messages=max_msgs,
            max_bytes=max_bytes,
        )
        try:
            self._listener = _Listener(
                self._hs_codec, self._registration, listener_timeout, max_conns,
                f"kvbridge-shm-listen-{agent_name}",
            )
        except BaseException:
            self._inbox.close()
            raise
        self._worker = Worker(agent_name, self._libc, iov_max, self._threads, split_bytes)
        log.info("shm transport %r ready (pid %d, notifications at %s, socket @%s)",
                 agent_name, os.getpid(), self._inbox.address, self._listener.name[1:])

    @property
    def dropped_notifications(self) -> int:
        """Inbound notification frames dropped: refused by the codec, or over the inbox bound."""
        return self._inbox.dropped

    @property
    def mapped_bytes(self) -> int:
        """Bytes copied through peers' mapped memory (successful transfers)."""
        return self._worker.mapped_bytes

    @property
    def cma_bytes(self) -> int:
        """Bytes copied by cross-memory attach (successful transfers)."""
        return self._worker.cma_bytes

    @property
    def _helpers(self) -> ThreadPoolExecutor | None:
        """The worker's copy helper threads (None until a transfer was split)."""
        return self._worker.helpers

    # -- memory and peers -----------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Record host-DRAM ``regions``; return metadata (the registration version goes up)."""
        new: list[tuple[int, int]] = []
        for r in regions:
            if r.kind.upper() != "DRAM":
                raise DescriptorError(
                    f"the shm transport moves host DRAM only, not {r.kind} (device {r.device})"
                )
            if not (0 < r.address <= _MAX_ADDR and 0 < r.length <= _MAX_ADDR):
                raise DescriptorError(f"bad region [0x{r.address:x}, +{r.length})")
            new.append((int(r.address), int(r.length)))
        self._libc.allow_ptracer_any()
        with self._lock:
            if len(self._regions) + len(new) > MAX_REGIONS:
                raise DescriptorError(f"more than {MAX_REGIONS} regions registered")
            areas = len(self._areas)
        area = self._share(new) if self._map_memory and areas < MAX_FDS else None
        with self._lock:
            self._regions.extend(new)
            if area is not None:
                self._areas.append(area)
            self._version += 1
            meta = self._metadata()
        log.info("shm %r registered %d region(s), %d bytes", self.agent_name, len(new),
                 sum(n for _, n in new))
        return meta

    def _share(self, regions: list[tuple[int, int]]) -> SharedArea | None:
        """Back ``regions`` with a sealed memfd for peers to map (``map_memory``); not where
        they overlap memory shared before (peers would then hold a stale mapping of it)."""
        with self._lock:
            old = [(p.address, p.address + p.length) for a in self._areas for p in a.pieces]
        if any(a < hi and lo < a + n for a, n in regions for lo, hi in old):
            log.info("shm %r: the new regions overlap memory shared before; they are not "
                     "shared again and move by cross-memory attach", self.agent_name)
            return None
        t0 = time.monotonic()
        area = share(regions, f"kvbridge-shm-{self.agent_name}"[:200])
        total = sum(n for _, n in regions)
        if area.error:
            log.warning("shm %r: %d of %d registered bytes shared through a memfd (%s); "
                        "the rest moves by cross-memory attach", self.agent_name, area.nbytes,
                        total, area.error)
        else:
            log.info("shm %r: %d of %d registered bytes shared through a memfd (%d on huge "
                     "pages) in %.2f s", self.agent_name, area.nbytes, total, area.huge_bytes,
                     time.monotonic() - t0)
        return area if area.pieces else None

    def _metadata(self) -> bytes:
        return _encoder.encode(
            ShmMetadata(
                agent=self.agent_name,
                pid=os.getpid(),
                hostname=socket.gethostname(),
                boot_id=self._boot_id,
                pid_ns=self._pid_ns,
                socket=self._listener.name,
                version=self._version,
            )
        )

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        """Let in the dialler that queries with ``proof`` — only the process ``peer_metadata``
        names, when given (metadata that does not decode, or names another host or PID
        namespace, admits no one)."""
        pid: int | None = None
        if peer_metadata is not None:
            try:
                meta = decode_metadata(peer_metadata)
                ok = meta.boot_id == self._boot_id and meta.pid_ns == self._pid_ns
                pid = meta.pid if ok else -1
            except MessageError:
                pid = -1
        self._attested.add(proof, pid)

    def _registration(self, proof: bytes, want_fds: bool, pid: int) -> tuple[bytes, list[int]]:
        """The listener's answer to a query with ``proof`` from process ``pid``: what this
        process registered, now (and, when asked, the memfds behind its shared pieces) — only
        for a proof this engine attested for that process; else :class:`_NotLetIn`."""
        why = self._attested.take(proof, pid)
        if why is not None:
            raise _NotLetIn(why)
        with self._lock:
            areas = self._areas if want_fds else []
            reg = _Registration(
                agent=self.agent_name,
                pid=os.getpid(),
                version=self._version,
                regions=list(self._regions),
                notify_address=self._inbox.address,
                proof=proof,
                shared=[(p.address, p.length, i, p.offset)
                        for i, a in enumerate(areas) for p in a.pieces],
            )
            fds = [a.fd for a in areas]
        return _encoder.encode(reg), fds

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        """Load a peer after proving who it is (see the package docstring).

        Raises :class:`MessageError` (metadata), :class:`PeerForged` (the process behind the
        socket did not let us in with ``proof``) or :class:`PeerUnreachable` (other host, PID
        namespace or user; nothing listening; a claim the socket disproves; no memory access).
        """
        self._check_open()
        proof = check_proof(proof)
        meta = decode_metadata(metadata)
        if meta.boot_id != self._boot_id:
            raise PeerUnreachable(
                f"peer {meta.agent!r} runs on another host ({meta.hostname}, boot id "
                f"{meta.boot_id}; this host is {socket.gethostname()}, boot id {self._boot_id}): "
                "the shm transport only reaches processes on the same host — use nixl or mooncake"
            )
        if meta.pid_ns != self._pid_ns:
            raise PeerUnreachable(
                f"peer {meta.agent!r} (pid {meta.pid}) lives in another PID namespace (another "
                "container?): the shm transport needs both processes in one PID namespace"
            )
        peer = self._dialler.prove(meta, proof)
        try:
            if peer.regions:
                self._probe(peer)
        except BaseException:
            peer.retire()
            raise
        with self._lock:
            closed = self._closed
            old = None if closed else self._peers.get(peer.agent)
            if not closed:
                self._peers[peer.agent] = peer
        if closed:
            peer.retire()
            self._check_open()
        if peer.pidfd >= 0:
            peer.watch = (self._listener, self._listener.watch(
                peer.pidfd, lambda: self._exited(peer)))
        self._forget_blocks(peer.agent)
        if old is not None:
            self._retire(old)
        log.info("shm %r added peer %r (pid %d proven, registration v%d, %d region(s))",
                 self.agent_name, peer.agent, peer.pid, peer.version, len(peer.regions))
        return peer.agent

    def _exited(self, peer: _Peer) -> None:
        """The listener saw ``peer``'s process exit: forget it and unmap its memory now (behind
        the transfers already queued for it, which fail: the process is gone)."""
        with self._lock:
            if self._peers.get(peer.agent) is not peer:
                return
            del self._peers[peer.agent]
        self._forget_blocks(peer.agent)
        self._retire(peer)
        log.info("shm %r: peer %r (pid %d) exited; forgotten and unmapped", self.agent_name,
                 peer.agent, peer.pid)
        self._peer_lost(peer.agent)

    def _probe(self, peer: _Peer) -> None:
        """Read one byte of the peer: a missing permission or process fails the handshake."""
        buf = np.zeros(1, dtype=np.uint8)
        loc = np.array([[buf.ctypes.data, 1]], dtype=np.uint64)
        rem = np.array([[peer.regions[0][0], 1]], dtype=np.uint64)
        if self._libc.readv(peer.pid, loc.ctypes.data, 1, rem.ctypes.data, 1, 0) == 1:
            return
        err = ctypes.get_errno()
        if err in (errno.EPERM, errno.ESRCH):
            raise PeerUnreachable(
                f"cannot access peer {peer.agent!r}'s memory: {_explain(err, peer.pid)}"
            )
        log.warning("probe of peer %r's first region failed: %s", peer.agent,
                    _explain(err, peer.pid))

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
        self._forget_blocks(peer)
        if old is not None:
            self._retire(old)
            log.info("shm %r removed peer %r", self.agent_name, peer)

    def _retire(self, peer: _Peer) -> None:
        # Retire behind every transfer already queued for it (the worker is FIFO).
        with self._lock:
            if not self._closed:
                self._worker.put(peer.retire)
                return
        peer.retire()

    def _peer(self, name: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeer(f"shm {self.agent_name!r} has no peer {name!r}")
        return peer

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"shm transport {self.agent_name!r} is closed")

    # -- data path ------------------------------------------------------------------------------

    def _submit(
        self,
        op: Op,
        peer: str,
        local: DescriptorArray,
        remote: DescriptorArray,
        notification: bytes | None,
    ) -> TransferHandle:
        p = self._peer(peer)
        with self._lock:
            regions = list(self._regions)
        _check_bounds(local, remote)
        check_within(local, regions, "local")
        check_within(remote, p.regions, f"remote ({peer})")
        handle = TransferHandle(op, peer, int(local[:, 1].sum()), int(local.shape[0]))
        job = _Job(handle, p, self._worker.parts(p, op, _iov(local), _iov(remote),
                                                 handle.nbytes), notification)
        log.debug("shm %r posting %s #%d: %d bytes in %d descriptors to %r", self.agent_name,
                  op.value, handle.id, handle.nbytes, handle.count, peer)
        self._queue(job)
        return handle

    def _prepare_blocks(self, pair: BlockPair) -> _Peer:
        """Check both layouts against the registered and the proven regions (once)."""
        p = self._peer(pair.peer)
        with self._lock:
            regions = list(self._regions)
        check_in_regions(pair.local, regions, "local")
        check_in_regions(pair.remote, p.regions, f"remote ({pair.peer})")
        return p

    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        """Queue the request; the worker builds its iovecs (O(blocks) here)."""
        p = self._pair_peer(pair)
        handle = TransferHandle(op, pair.peer, req.nbytes, req.count)
        self._queue(_BlockJob(handle, p, pair, req, notification))
        return handle

    def _prepare_request(self, op: Op, pair: BlockPair, req: BlockRequest,
                         notification: bytes | None) -> _Prepared:
        """Build the iovecs (and the parts the copy threads take) now, off the hand-off."""
        peer = self._pair_peer(pair)
        return _Prepared(peer, self._worker.block_parts(peer, op, pair, req))

    def _takes_landing(self, native: _Prepared) -> bool:
        """The worker copies with the caller's copy where every range is mapped (Worker._run)."""
        return all_mapped(native.peer, native.parts)

    def _post_prepared(self, prep: PreparedRequest, native: _Prepared) -> TransferHandle:
        """Queue the prepared parts: nothing is built or validated on this path."""
        handle = TransferHandle(prep.op, prep.pair.peer, prep.req.nbytes, prep.req.count)
        progress = _word(native.peer, prep.progress) if prep.landing is not None else 0
        self._queue(_Job(handle, native.peer, native.parts, prep.notification, prep.landing,
                         progress))
        return handle

    def _pair_peer(self, pair: BlockPair) -> _Peer:
        p: _Peer = pair.native
        if self._peer(pair.peer) is not p:
            raise UnknownPeer(f"shm {self.agent_name!r}: peer {pair.peer!r} was re-added")
        return p

    def _queue(self, job: _Job | _BlockJob) -> None:
        with self._lock:
            self._check_open()
            self._worker.put(job)

    def poll(self, handle: TransferHandle) -> HandleState:
        """The handle's state (non-blocking; the worker thread makes progress)."""
        return handle.state

    # -- notifications --------------------------------------------------------------------------

    def send_notification(self, peer: str, message: bytes) -> None:
        self._check_open()
        if not isinstance(message, bytes):
            raise DescriptorError("a notification must be bytes")
        self._peer(peer).sender.send(message)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self._inbox.drain()

    def wait_notification(self, timeout: float | None = None) -> bool:
        """Block (without polling) until a notification is queued; True if one is."""
        return self._inbox.wait(timeout)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued transfers for up to ``timeout`` s, fail the rest, release everything."""
        with self._close_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                self._worker.put(None)
                peers = list(self._peers.values())
                self._peers.clear()
            self._forget_blocks(None)
            self._listener.close()
            stuck = self._worker.stop(timeout)  # a copy may still read a mapping: keep them
            for p in peers:
                p.retire(unmap=not stuck)
            for area in self._areas:  # private pages again, unless a copy may still run
                area.close(restore=not stuck)
            self._inbox.close()
            log.info("shm transport %r closed", self.agent_name)
