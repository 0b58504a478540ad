"""The built-in same-host transport: one-sided READ/WRITE with ``process_vm_readv/writev``.

``shm`` moves bytes between two processes on one Linux host with cross-memory attach (CMA): the
kernel copies straight from one address space into the other, zero intermediate copies. The
descriptor arrays become ``struct iovec`` arrays with one vectorised numpy copy (an ``(N, 2)``
``uint64`` array is exactly ``N`` iovecs) and are handed to the kernel 1024 (``IOV_MAX``) at a
time; nothing loops over descriptors in Python.

Contract (on top of :mod:`kvbridge.transport`):

* ``register_memory`` records host-DRAM regions and calls ``prctl(PR_SET_PTRACER,
  PR_SET_PTRACER_ANY)``, so a sibling process may attach to us under Yama ``ptrace_scope=1``
  (this widens who may ptrace this process to every process of the same user; ``ptrace_scope``
  2 or 3 forbids CMA altogether and transfers fail with a message saying so). It returns msgpack
  metadata: agent name, pid, hostname, boot id, PID namespace, registered regions and the address
  of this transport's notification inbox. Call it again to add regions, then resend the metadata.
* ``add_peer`` refuses metadata from another host (boot id) or another PID namespace with
  :class:`PeerUnreachable`, and probes one byte of the peer's memory so a permission problem is
  reported at handshake time rather than on the first transfer.
* ``submit`` validates local descriptors against our regions and remote ones against the peer's
  (:class:`DescriptorError`) and queues the transfer; one background worker thread executes
  transfers in submission order and finishes their handles. A transfer's notification is sent
  after all its bytes landed, and only if it succeeded. ``poll`` never blocks.
* Notifications travel over ZeroMQ on the control network (:mod:`._notify`), ordered per peer.
* ``close`` waits up to ``timeout`` for queued transfers, then fails the rest (a transfer cut
  between two batches is FAILED; nothing lands after ``close`` returns), closes the sockets and
  joins both threads. Idempotent.

Options: ``notify_host`` (bind address of the inbox, default ``127.0.0.1``), ``notify_port``
(default 0: any free port), ``secret`` (HMAC key of notification frames; both sides must agree),
``iov_max`` (iovecs per system call, default 1024).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import queue
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge.errors import (
    BackendUnavailable,
    DescriptorError,
    MessageError,
    PeerUnreachable,
    TransferFailed,
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
    Transport,
    check_within,
)
from kvbridge.transports._notify import NotificationInbox, NotificationSender

__all__ = ["ShmTransport", "ShmMetadata", "IOV_MAX"]

log = logging.getLogger("kvbridge.transport.shm")

IOV_MAX = 1024
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

IovArray = npt.NDArray[np.uint64]


class ShmMetadata(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.v1"):
    """What a peer needs to reach this transport's memory."""

    agent: str
    pid: int
    hostname: str
    boot_id: str
    pid_ns: int
    regions: list[tuple[int, int]]
    notify_address: str


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ShmMetadata)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class _Libc:
    """``process_vm_readv/writev`` and ``prctl`` through ctypes (loaded once per process)."""

    _instance: _Libc | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise BackendUnavailable("the shm transport needs Linux (process_vm_readv)")
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        try:
            readv, writev = lib.process_vm_readv, lib.process_vm_writev
        except AttributeError as exc:
            raise BackendUnavailable(f"libc has no process_vm_readv: {exc}") from exc
        for fn in (readv, writev):
            fn.argtypes = [
                ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong,
            ]
            fn.restype = ctypes.c_ssize_t
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong,
                              ctypes.c_ulong, ctypes.c_ulong]
        lib.prctl.restype = ctypes.c_int
        self.readv: Callable[..., int] = readv
        self.writev: Callable[..., int] = writev
        self._prctl = lib.prctl
        self.ptracer_set = False

    @classmethod
    def get(cls) -> _Libc:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def allow_ptracer_any(self) -> None:
        """Let any same-user process attach (Yama ``ptrace_scope=1``); harmless without Yama."""
        with self._lock:
            if self.ptracer_set:
                return
            if self._prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
                err = ctypes.get_errno()
                log.debug("prctl(PR_SET_PTRACER_ANY) failed (%s); Yama is probably off",
                          os.strerror(err))
            self.ptracer_set = True


def _explain(err: int, pid: int) -> str:
    text = f"{os.strerror(err)} (errno {err})"
    if err == errno.EPERM:
        text += (
            f": not allowed to access process {pid}; check /proc/sys/kernel/yama/ptrace_scope "
            "(must be 0 or 1, and the peer must have registered memory) and that both processes "
            "run as the same user"
        )
    elif err == errno.ESRCH:
        text += f": peer process {pid} is gone"
    elif err == errno.EFAULT:
        text += ": an address is not mapped (memory freed or never allocated?)"
    return text


def copy_iovecs(
    fn: Callable[..., int],
    pid: int,
    local: IovArray,
    remote: IovArray,
    iov_max: int = IOV_MAX,
    cancelled: threading.Event | None = None,
) -> int:
    """Move all bytes of ``local[i] <-> remote[i]`` with ``fn`` (process_vm_readv or _writev).

    ``local`` and ``remote`` are C-contiguous ``(N, 2)`` uint64 arrays (address, length) with equal
    lengths row by row; they are private copies and are advanced in place on a partial result.
    Raises :class:`TransferFailed` with the system error; returns the number of bytes moved.
    """
    n = local.shape[0]
    moved = 0
    i = 0
    lbase, rbase = local.ctypes.data, remote.ctypes.data
    while i < n:
        if cancelled is not None and cancelled.is_set():
            raise TransferFailed(f"transport closed after {moved} bytes; transfer abandoned")
        j = min(i + iov_max, n)
        want = int(local[i:j, 1].sum())
        got = fn(pid, lbase + 16 * i, j - i, rbase + 16 * i, j - i, 0)
        if got < 0:
            raise TransferFailed(_explain(ctypes.get_errno(), pid))
        moved += got
        if got == want:
            i = j
            continue
        if got == 0:
            raise TransferFailed(f"no progress copying to/from process {pid} at iovec #{i}")
        cum = np.cumsum(local[i:j, 1])
        k = int(np.searchsorted(cum, got, side="right"))
        part = got - (int(cum[k - 1]) if k else 0)
        i += k
        if part:
            for arr in (local, remote):
                arr[i, 0] += np.uint64(part)
                arr[i, 1] -= np.uint64(part)
    return moved


def _iov(descs: DescriptorArray) -> IovArray:
    return np.ascontiguousarray(descs[:, :2]).view(np.uint64)


@dataclass
class _Peer:
    meta: ShmMetadata
    sender: NotificationSender


@dataclass
class _Job:
    handle: TransferHandle
    pid: int
    local: IovArray
    remote: IovArray
    notification: bytes | None
    sender: NotificationSender


class ShmTransport(Transport):
    """Same-host transport over cross-memory attach; see the module docstring."""

    name = "shm"
    capabilities = Capabilities(
        read=True, write=True, notifications=True, device_memory=False, cross_host=False
    )

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(agent_name, options)
        self._libc = _Libc.get()
        self._iov_max = int(self.options.get("iov_max", IOV_MAX))
        if not 1 <= self._iov_max <= IOV_MAX:
            raise DescriptorError(f"iov_max must be in [1, {IOV_MAX}], got {self._iov_max}")
        self._codec = Codec(self.options.get("secret"))
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []
        self._peers: dict[str, _Peer] = {}
        self._jobs: queue.SimpleQueue[_Job | Callable[[], None] | None] = queue.SimpleQueue()
        self._abort = threading.Event()
        self._inbox = NotificationInbox(
            str(self.options.get("notify_host", "127.0.0.1")),
            int(self.options.get("notify_port", 0)),
            self._codec,
            thread_name=f"kvbridge-shm-notify-{agent_name}",
        )
        self._worker = threading.Thread(
            target=self._work, name=f"kvbridge-shm-{agent_name}", daemon=True
        )
        self._worker.start()
        self._boot_id, self._pid_ns = _boot_id(), _pid_ns()
        log.info("shm transport %r ready (pid %d, notifications at %s)",
                 agent_name, os.getpid(), self._inbox.address)

    # -- memory and peers -----------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Record host-DRAM ``regions``; return metadata listing every region registered so far."""
        new: list[tuple[int, int]] = []
        for r in regions:
            if r.kind.upper() != "DRAM":
                raise DescriptorError(
                    f"the shm transport moves host DRAM only, not {r.kind} (device {r.device})"
                )
            if r.address <= 0 or r.length <= 0:
                raise DescriptorError(f"bad region [0x{r.address:x}, +{r.length})")
            new.append((int(r.address), int(r.length)))
        self._libc.allow_ptracer_any()
        with self._lock:
            self._regions.extend(new)
            meta = self._metadata()
        log.info("shm %r registered %d region(s), %d bytes", self.agent_name, len(new),
                 sum(n for _, n in new))
        return meta

    def _metadata(self) -> bytes:
        return _encoder.encode(
            ShmMetadata(
                agent=self.agent_name,
                pid=os.getpid(),
                hostname=socket.gethostname(),
                boot_id=self._boot_id,
                pid_ns=self._pid_ns,
                regions=list(self._regions),
                notify_address=self._inbox.address,
            )
        )

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer; refuses other hosts and PID namespaces with :class:`PeerUnreachable`."""
        self._check_open()
        try:
            meta = _decoder.decode(metadata)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
            raise MessageError(f"malformed shm peer metadata: {exc}") from exc
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
        if meta.regions:
            self._probe(meta)
        peer = _Peer(meta, NotificationSender(meta.notify_address, self.agent_name, self._codec))
        with self._lock:
            old = self._peers.get(meta.agent)
            self._peers[meta.agent] = peer
        if old is not None:
            self._retire(old)
        log.info("shm %r added peer %r (pid %d, %d region(s))", self.agent_name, meta.agent,
                 meta.pid, len(meta.regions))
        return meta.agent

    def _probe(self, meta: ShmMetadata) -> None:
        """Read one byte of the peer: a missing permission or process fails the handshake."""
        buf = np.zeros(1, dtype=np.uint8)
        loc = np.array([[buf.ctypes.data, 1]], dtype=np.uint64)
        rem = np.array([[meta.regions[0][0], 1]], dtype=np.uint64)
        if self._libc.readv(meta.pid, loc.ctypes.data, 1, rem.ctypes.data, 1, 0) == 1:
            return
        err = ctypes.get_errno()
        if err in (errno.EPERM, errno.ESRCH):
            raise PeerUnreachable(
                f"cannot access peer {meta.agent!r}'s memory: {_explain(err, meta.pid)}"
            )
        log.warning("probe of peer %r's first region failed: %s", meta.agent,
                    _explain(err, meta.pid))

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
        if old is not None:
            self._retire(old)
            log.info("shm %r removed peer %r", self.agent_name, peer)

    def _retire(self, peer: _Peer) -> None:
        # Close the sender behind every transfer already queued for it (the worker is FIFO).
        with self._lock:
            if not self._closed:
                self._jobs.put(peer.sender.close)
                return
        peer.sender.close()

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
        check_within(local, regions, "local")
        check_within(remote, p.meta.regions, f"remote ({peer})")
        handle = TransferHandle(op, peer, int(local[:, 1].sum()), int(local.shape[0]))
        job = _Job(handle, p.meta.pid, _iov(local), _iov(remote), notification, p.sender)
        log.debug("shm %r posting %s #%d: %d bytes in %d descriptors to %r", self.agent_name,
                  op.value, handle.id, handle.nbytes, handle.count, peer)
        with self._lock:
            if self._closed:
                raise TransportClosed(f"shm transport {self.agent_name!r} is closed")
            self._jobs.put(job)
        return handle

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not isinstance(job, _Job):
                job()
                continue
            self._run(job)

    def _run(self, job: _Job) -> None:
        h = job.handle
        if self._abort.is_set():
            h._finish(HandleState.FAILED, "transport closed before the transfer started")
            return
        fn = self._libc.readv if h.op is Op.READ else self._libc.writev
        try:
            copy_iovecs(fn, job.pid, job.local, job.remote, self._iov_max, self._abort)
            if job.notification is not None:
                job.sender.send(job.notification)
        except Exception as exc:  # noqa: BLE001 - every failure ends the handle, never the thread
            log.debug("shm %r %s #%d failed: %s", self.agent_name, h.op.value, h.id, exc)
            h._finish(HandleState.FAILED, f"{h.op.value} with {h.peer!r} failed: {exc}")
            return
        h._finish(HandleState.DONE)

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
                self._jobs.put(None)
                peers = list(self._peers.values())
                self._peers.clear()
            self._worker.join(timeout)
            if self._worker.is_alive():
                log.warning("shm %r: transfers still queued after %.1f s; failing them",
                            self.agent_name, timeout)
                self._abort.set()
                self._worker.join(5.0)
            self._abort.set()
            self._fail_leftovers()
            for p in peers:
                p.sender.close()
            self._inbox.close()
            log.info("shm transport %r closed", self.agent_name)

    def _fail_leftovers(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Job):
                job.handle._finish(HandleState.FAILED, "transport closed before the transfer ran")
            elif job is not None:
                job()
