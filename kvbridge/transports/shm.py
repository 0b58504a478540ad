"""The built-in same-host transport: one-sided READ/WRITE with ``process_vm_readv/writev``.

``shm`` moves bytes between two processes on one Linux host with cross-memory attach (CMA): the
kernel copies straight from one address space into the other, zero intermediate copies. The
descriptor arrays become ``struct iovec`` arrays with one vectorised numpy copy (an ``(N, 2)``
``uint64`` array is exactly ``N`` iovecs) and are handed to the kernel 1024 (``IOV_MAX``) at a
time; nothing loops over descriptors in Python.

Trust: a peer's metadata arrives over the network and is never believed. It only says where to
ask: each transport listens on an abstract Unix socket with a random name. ``add_peer(metadata,
proof)`` connects there, lets the kernel say who listens (``SO_PEERCRED``: pid and uid, which the
listener cannot choose), refuses another user, a pid other than the one the metadata claims, or
an agent name other than the one the process itself answers with, and then asks that process,
over the same connection, for its *current* registration (agent, regions, notification address),
showing the ``proof`` of this handshake (:mod:`kvbridge.identity`). The listener answers only a
query whose proof its own engine attested (:meth:`ShmTransport.attest`, when its control plane
answered the dialler's authenticated Hello) for the very process that connects (the pid the
Hello's metadata names, checked against ``SO_PEERCRED``), once; anyone else — a process of the
same user in another container or PID namespace, a relayed or replayed handshake — gets a
refusal and nothing else: no regions, no memfd. Every CMA call uses the kernel-proven pid, and
every remote descriptor is checked against the regions the proven process answered (local ones
against ours) before any byte moves. The listener also watches each peer's pidfd: the moment a
peer's process exits it is forgotten, its mapped memory unmapped, and the core told
(:meth:`~kvbridge.transport.Transport.on_peer_lost`). See ``docs/backends/shm.md`` and
``docs/security.md``.

Contract (on top of :mod:`kvbridge.transport`):

* ``register_memory`` records host-DRAM regions and calls ``prctl(PR_SET_PTRACER,
  PR_SET_PTRACER_ANY)``, so a sibling process may attach to us under Yama ``ptrace_scope=1``
  (this widens who may ptrace this process to every process of the same user; ``ptrace_scope``
  2 or 3 forbids CMA altogether and transfers fail with a message saying so). It returns msgpack
  metadata (:class:`ShmMetadata`): agent name, claimed pid, hostname, boot id, PID namespace, the
  listener's socket name and a registration version. Call it again to add regions (the version
  goes up), then resend the metadata: re-adding the peer fetches the registration again.
* ``add_peer`` decodes the metadata strictly (:class:`MessageError` for anything malformed,
  oversized or of another version), refuses another host (boot id) or PID namespace, then runs
  the socket handshake above (:class:`PeerUnreachable` naming the mismatch, bounded by
  ``handshake_timeout``) and probes one byte of the peer's memory, so a permission problem is
  reported at handshake time rather than on the first transfer. It blocks for one local round
  trip (well under a millisecond when the peer is healthy).
* ``submit`` validates local descriptors against our regions and remote ones against the peer's
  proven ones (:class:`DescriptorError`) and queues the transfer; one background worker thread
  executes transfers in submission order and finishes their handles. A transfer to a peer whose
  process has exited since the handshake fails without a system call (a pidfd says so, so a
  recycled pid is never written to). A transfer's notification is sent after all its bytes
  landed, and only if it succeeded. ``poll`` never blocks.
* Transfers by block id (:class:`~kvbridge.blocks.BlockTransport`, the core's path): preparing
  checks both layouts against the registered and the proven regions once; ``submit_blocks``
  validates the ids (O(blocks)) and queues; the worker builds the iovecs from the plane tables.
  A request prepared ahead (``prepare_request``, as the connector builds a push's WRITE during
  the forward) has its iovecs built then, so posting it only queues.
  With the ``threads`` option, a transfer of at least ``split_bytes`` is copied in that many
  parts at once; it finishes (and notifies) when every part stopped.
* The listener is one daemon thread answering each connection once: at most
  ``listener_max_connections`` at a time, requests of at most 4 KiB, each connection closed after
  ``listener_timeout`` seconds, clients of another user refused; garbage closes the connection
  and is counted, never raised.
* Notifications travel over ZeroMQ on the control network (:mod:`._notify`), ordered per peer.
  The inbox authenticates frames with the ``secret`` option (the core must pass its shared
  secret there) and holds at most ``max_notifications`` messages / ``max_notification_bytes``;
  refused and overflowing frames are dropped and counted
  (:attr:`ShmTransport.dropped_notifications`).
* ``close`` waits up to ``timeout`` for queued transfers, then fails the rest (a transfer cut
  between two batches is FAILED; nothing lands after ``close`` returns), closes the sockets and
  joins every thread. Idempotent.

Options: ``notify_host`` (bind address of the inbox, default ``127.0.0.1``), ``notify_port``
(default 0: any free port), ``secret`` (HMAC key of notification and handshake frames; both sides
must agree), ``iov_max`` (iovecs per system call, default 1024), ``handshake_timeout`` (seconds,
default 5), ``listener_timeout`` (seconds per inbound connection, default 2),
``listener_max_connections`` (default 16), ``max_notifications`` (default 4096),
``max_notification_bytes`` (default 4 MiB), ``threads`` (default 2, or 1 on a one-CPU host),
``split_bytes`` (default 16 MiB), ``map_memory`` (default false: see below), ``map_peers``
(default true).

Mapped copies (:mod:`._memfd`): with ``map_memory``, ``register_memory`` moves the whole pages
of the regions onto one sealed memfd (same addresses, same bytes; the connector turns it on for
a CPU engine's KV cache, which nothing writes yet and nothing pins) and the listener hands that
memfd to a peer that asks, over the same Unix socket (``SCM_RIGHTS``). With ``map_peers``, the
handshake asks for it, validates it (a sealed tmpfs memfd that the proven process maps at the
claimed addresses, inside its regions; anything else is :class:`PeerUnreachable`) and maps it;
a transfer then copies the ranges the mapping holds with ``memmove`` in this process, and the
rest by CMA. Same bytes, same ordering and notification rules; a peer that exited fails the
transfer as CMA would. :attr:`ShmTransport.mapped_bytes` / :attr:`ShmTransport.cma_bytes` count
how each byte moved. Registered memory must stay allocated until ``close``, which gives the
shared pages back private ones (same bytes), so that heap memory reused after it is freed is
never shared with a forked child.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import errno
import logging
import os
import platform
import queue
import select
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge.blocks import (
    BlockPair,
    BlockRequest,
    BlockTransport,
    PreparedRequest,
    check_in_regions,
)
from kvbridge.errors import (
    BackendUnavailable,
    ConfigError,
    DescriptorError,
    MessageError,
    MessageTooLarge,
    PeerForged,
    PeerUnreachable,
    TransferFailed,
    TransportClosed,
    UnknownPeer,
)
from kvbridge.identity import PROOF_BYTES
from kvbridge.messages import Codec, PipeFrame
from kvbridge.offload.config import parse_bool
from kvbridge.transport import (
    Capabilities,
    DescriptorArray,
    HandleState,
    MemoryRegion,
    Op,
    TransferHandle,
    check_within,
)
from kvbridge.transports import _rangecopy as rangecopy
from kvbridge.transports._memfd import (
    MAX_FDS,
    FdRefused,
    FdUnverifiable,
    PeerMapping,
    Piece,
    SharedArea,
    close_all,
    share,
)
from kvbridge.transports._notify import (
    DEFAULT_MAX_NOTIFICATION_BYTES,
    DEFAULT_MAX_NOTIFICATIONS,
    NotificationInbox,
    NotificationSender,
)
from kvbridge.transports.proofs import Attestations, check_proof

__all__ = [
    "ShmTransport",
    "ShmMetadata",
    "IOV_MAX",
    "DEFAULT_THREADS",
    "MAX_METADATA_BYTES",
    "MAX_REGIONS",
    "decode_metadata",
    "split_iovecs",
]

log = logging.getLogger("kvbridge.transport.shm")

IOV_MAX = 1024
#: Default ``threads``: two copy threads where there are two CPUs. Measured on a quiet 2-vCPU
#: host, 64 MiB per transfer (docs/benchmarks.md): kvbridge/memcpy 0.65 -> 0.84 at 256 KiB
#: blocks and 0.80 -> 1.01 at 1 MiB; only transfers of at least ``split_bytes`` are split.
DEFAULT_THREADS = min(2, os.cpu_count() or 1)
MAX_METADATA_BYTES = 1 << 20
MAX_REGIONS = 16384
#: addresses and lengths are kept below this so that ``address + length`` never overflows int64
_MAX_ADDR = 1 << 62
_MAX_REQUEST_BYTES = 4096
_MAX_REPLY_BYTES = MAX_METADATA_BYTES
_SOCKET_PREFIX = "\0kvbridge-shm-"
#: Linux >= 6.5 (the generic socket option number: only trusted on architectures that use it);
#: elsewhere, and on older kernels, pidfd_open (>= 5.3), then no pidfd at all
_SO_PEERPIDFD = 77 if platform.machine() in ("x86_64", "aarch64", "arm64", "riscv64") else None
_WARN_EVERY_S = 1.0
_UCRED = struct.Struct("3i")
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

IovArray = npt.NDArray[np.uint64]

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Pos = Annotated[int, msgspec.Meta(ge=1, le=_MAX_ADDR)]
_Version = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
_Pid = Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
_Proof = Annotated[bytes, msgspec.Meta(min_length=PROOF_BYTES, max_length=PROOF_BYTES)]
_FdIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_FDS)]
_Offset = Annotated[int, msgspec.Meta(ge=0, le=_MAX_ADDR)]


class ShmMetadata(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.v2"):
    """Where to find a transport (nothing here is trusted; see the module docstring).

    ``pid`` and ``agent`` are *claims*, compared with what the socket proves; the regions and
    the notification address are fetched from the proven process, never read from here.
    """

    agent: _Name
    pid: _Pid
    hostname: Annotated[str, msgspec.Meta(max_length=256)]
    boot_id: Annotated[str, msgspec.Meta(max_length=512)]
    pid_ns: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    socket: Annotated[str, msgspec.Meta(pattern="^\x00kvbridge-shm-[0-9a-f]{32}$")]
    version: _Version


class _Query(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.query.v2"):
    """Handshake request: here is the proof your engine attested for this handshake; send me
    your current registration (and, with ``fds``, the memfds behind your shared memory)."""

    proof: _Proof
    fds: bool = False


class _Registration(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.reg.v2"):
    """Handshake answer: what the process behind the socket registered, as it says itself."""

    agent: _Name
    pid: _Pid
    version: _Version
    regions: Annotated[list[tuple[_Pos, _Pos]], msgspec.Meta(max_length=MAX_REGIONS)]
    notify_address: Annotated[str, msgspec.Meta(max_length=256, pattern="^tcp://")]
    proof: _Proof
    #: ``(address, length, fd index, offset)``: ranges backed by the memfds sent with the answer
    shared: Annotated[list[tuple[_Pos, _Pos, _FdIndex, _Offset]],
                      msgspec.Meta(max_length=MAX_REGIONS)] = []


class _Refused(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.refused.v1"):
    """Handshake answer to a query the listener does not let in (nothing else is sent)."""

    reason: Annotated[str, msgspec.Meta(max_length=512)]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ShmMetadata)
_query_decoder = msgspec.msgpack.Decoder(_Query)
_reg_decoder = msgspec.msgpack.Decoder(_Registration | _Refused)


def decode_metadata(data: object) -> ShmMetadata:
    """Parse a peer's metadata blob; raises :class:`MessageError` (never anything else)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageError(f"shm peer metadata must be bytes, not {type(data).__name__}")
    if len(data) > MAX_METADATA_BYTES:
        raise MessageTooLarge(
            f"shm peer metadata of {len(data)} bytes exceeds the limit of {MAX_METADATA_BYTES}"
        )
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed shm peer metadata: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - hostile bytes must never raise anything else
        raise MessageError(f"unreadable shm peer metadata: {type(exc).__name__}") from None


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


def split_iovecs(local: IovArray, remote: IovArray, parts: int) -> list[tuple[IovArray, IovArray]]:
    """Cut ``local[i] <-> remote[i]`` into at most ``parts`` pieces of about equal bytes (a
    range that crosses a cut is split), each a private C-contiguous pair for
    :func:`copy_iovecs`. O(ranges), vectorised but for the cuts."""
    lengths = local[:, 1].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    out: list[tuple[IovArray, IovArray]] = []
    start = 0
    for k in range(1, parts + 1):
        end = total * k // parts
        if end <= start:
            continue
        r0 = int(np.searchsorted(ends, start, side="right"))
        r1 = int(np.searchsorted(ends, end, side="left"))
        loc, rem = local[r0:r1 + 1].copy(), remote[r0:r1 + 1].copy()
        skip = np.uint64(start - (int(ends[r0]) - int(lengths[r0])))
        cut = np.uint64(int(ends[r1]) - end)
        for arr in (loc, rem):
            arr[0, 0] += skip
            arr[0, 1] -= skip
            arr[-1, 1] -= cut
        out.append((loc, rem))
        start = end
    return out


def _iov(descs: DescriptorArray) -> IovArray:
    return np.ascontiguousarray(descs[:, :2]).view(np.uint64)


# -- proving who is behind a socket ---------------------------------------------------------------


def _peercred(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the socket's other end, as the kernel recorded them."""
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return pid, uid, gid


def _peer_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd of the socket's other end (-1 where the kernel has none); raises
    :class:`ProcessLookupError` when that process is already gone."""
    fd = -1
    if _SO_PEERPIDFD is not None:
        try:
            fd = int(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD))
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise ProcessLookupError(pid) from exc
    if fd < 0:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise
        except OSError as exc:  # ENOSYS (kernel < 5.3), EPERM (seccomp): no liveness checks
            log.debug("no pidfd for process %d (%s); transfers rely on ESRCH alone", pid, exc)
            return -1
    os.set_inheritable(fd, False)
    return fd


def _poller(pidfd: int) -> select.poll | None:
    """A poll object that reports ``pidfd`` readable once its process exited."""
    if pidfd < 0:
        return None
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return poller


def _alive(pidfd: int) -> bool:
    """False once the process behind ``pidfd`` exited (True when there is no pidfd)."""
    poller = _poller(pidfd)
    return poller is None or not poller.poll(0)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        view = view[sock.send(view):]


def _recv_exact(sock: socket.socket, n: int, deadline: float,
                fds: list[int] | None = None) -> bytes:
    """``n`` bytes; with ``fds``, also the fds that come with them, appended there (closed
    on exec; more than :data:`MAX_FDS` in all raises :class:`MessageError`: the caller closes
    ``fds`` in any case)."""
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        if fds is None:
            chunk = sock.recv(min(n - len(buf), 1 << 16))
        else:
            chunk, anc, flags, _ = sock.recvmsg(min(n - len(buf), 1 << 16),
                                                socket.CMSG_SPACE(4 * MAX_FDS),
                                                socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(data[:len(data) - len(data) % got.itemsize])
                    fds.extend(got)
            # the kernel closes what did not fit and says so with MSG_CTRUNC
            if len(fds) > MAX_FDS or flags & socket.MSG_CTRUNC:
                raise MessageError(f"more than {MAX_FDS} fds sent with the answer")
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class _NotLetIn(Exception):
    """A query the listener answers with a refusal (its message says why)."""


@dataclass
class _Conn:
    """One inbound connection of the listener."""

    sock: socket.socket
    deadline: float
    pid: int
    size: int = -1
    buf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None
    fds: list[int] = field(default_factory=list)  # sent with the answer's first bytes


class _Listener:
    """Answers registration queries on an abstract Unix socket, from one daemon thread.

    Each connection gets one answer and is closed; at most ``max_conns`` are open at a time (more
    are closed at once), each for at most ``timeout`` seconds; a request is one 4-byte big-endian
    length and at most 4 KiB of :class:`Codec` frame. Clients of another user, garbage, oversized
    or unauthenticated requests close the connection and count in :attr:`refused`; nothing a
    client sends can raise out of the thread or block it. ``answer(proof, fds, pid)`` gets the
    query's proof, whether it asks for memfds and the kernel-proven pid of the client; it returns
    the payload and the fds to send, or raises :class:`_NotLetIn` to answer a refusal.

    The same thread watches peers' pidfds (:meth:`watch`): the moment a watched process exits,
    its callback runs (on this thread).
    """

    def __init__(
        self,
        codec: Codec,
        answer: Callable[[bytes, bool, int], tuple[bytes, list[int]]],
        timeout: float,
        max_conns: int,
        thread_name: str,
    ) -> None:
        self.name = _SOCKET_PREFIX + os.urandom(16).hex()
        self._codec, self._answer = codec, answer
        self._timeout, self._max_conns = timeout, max_conns
        self.served = 0
        self.refused = 0
        self._last_warning = float("-inf")
        self._uid = os.geteuid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.name)
            self._sock.listen(max_conns)
            self._sock.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
        except OSError:
            self._sock.close()
            raise
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self._watch_lock = threading.Lock()
        #: watch (key, dup fd, callback) and unwatch (key, -1, None) requests, in order
        self._watch_changes: list[tuple[int, int, Callable[[], None] | None]] = []
        self._watched: dict[int, tuple[int, Callable[[], None]]] = {}  # key -> (dup fd, cb)
        self._watch_keys = iter(range(1, 1 << 62))
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop:
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - the listener must outlive any surprise
                    log.exception("shm listener %r: unexpected error (continuing)", self.name[1:])
                    time.sleep(0.05)
        finally:
            for c in list(self._conns.values()):
                self._drop(c)
            for key in list(self._watched):
                self._unwatch_now(key)

    def watch(self, pidfd: int, on_exit: Callable[[], None]) -> int:
        """Run ``on_exit()`` on the listener thread once the process of ``pidfd`` exited (the
        listener watches a duplicate: the caller may close ``pidfd`` at any time). Returns a key
        for :meth:`unwatch`. Thread-safe."""
        dup = os.dup(pidfd)
        os.set_inheritable(dup, False)
        with self._watch_lock:
            key = next(self._watch_keys)
            self._watch_changes.append((key, dup, on_exit))
        self._wake()
        return key

    def unwatch(self, key: int) -> None:
        """Stop watching (no-op if the callback already ran). Thread-safe."""
        with self._watch_lock:
            self._watch_changes.append((key, -1, None))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass

    def _apply_watch_changes(self) -> None:
        with self._watch_lock:
            changes, self._watch_changes = self._watch_changes, []
        for key, dup, cb in changes:
            if cb is None:
                self._unwatch_now(key)
            else:
                self._watched[key] = (dup, cb)
                self._sel.register(dup, selectors.EVENT_READ, ("pidfd", key))

    def _unwatch_now(self, key: int) -> None:
        entry = self._watched.pop(key, None)
        if entry is not None:
            self._sel.unregister(entry[0])
            os.close(entry[0])

    def _exited(self, key: int) -> None:
        entry = self._watched.get(key)
        self._unwatch_now(key)
        if entry is not None:
            entry[1]()

    def _step(self) -> None:
        timeout = 1.0
        if self._conns:
            first = min(c.deadline for c in self._conns.values())
            timeout = min(max(first - time.monotonic(), 0.0), 1.0)
        self._apply_watch_changes()
        for key, _ in self._sel.select(timeout):
            if key.fileobj is self._sock:
                self._accept()
            elif key.fileobj is self._wake_r:
                try:
                    self._wake_r.recv(64)
                except OSError:
                    pass
            elif isinstance(key.data, tuple):
                self._exited(key.data[1])
            else:
                self._service(key.data)
        now = time.monotonic()
        for c in [c for c in self._conns.values() if c.deadline <= now]:
            self._refuse(c, f"no complete request within {self._timeout} s")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                self._warn(f"cannot accept: {exc}")
                time.sleep(0.05)
                return
            if len(self._conns) >= self._max_conns:
                self.refused += 1
                log.debug("shm listener: %d connections open; refusing one", len(self._conns))
                conn.close()
                continue
            try:
                conn.setblocking(False)
                pid, uid, _ = _peercred(conn)
            except OSError:
                conn.close()
                continue
            if uid != self._uid:
                self.refused += 1
                self._warn(f"refused a client of uid {uid} (this transport runs as {self._uid})")
                conn.close()
                continue
            c = _Conn(conn, time.monotonic() + self._timeout, pid)
            self._conns[conn.fileno()] = c
            self._sel.register(conn, selectors.EVENT_READ, c)

    def _service(self, c: _Conn) -> None:
        try:
            if c.out is None:
                self._read(c)
            else:
                self._write(c)
        except (BlockingIOError, InterruptedError):
            return
        except Exception as exc:  # noqa: BLE001 - whatever a client sends ends its connection
            self._refuse(c, f"{type(exc).__name__}: {exc}")

    def _read(self, c: _Conn) -> None:
        want = 4 if c.size < 0 else c.size
        chunk = c.sock.recv(want - len(c.buf))
        if not chunk:
            raise ConnectionError("closed before sending a whole request")
        c.buf += chunk
        if len(c.buf) < want:
            return
        if c.size < 0:
            c.size = int.from_bytes(c.buf, "big")
            c.buf.clear()
            if not 0 < c.size <= _MAX_REQUEST_BYTES:
                raise MessageError(f"request of {c.size} bytes announced")
            return
        reply, c.fds = self._reply(bytes(c.buf), c.pid)
        c.out = memoryview(len(reply).to_bytes(4, "big") + reply)
        self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        assert c.out is not None
        if c.fds:  # the fds travel with the first bytes that go out (and stay ours)
            sent = socket.send_fds(c.sock, [c.out], c.fds)
            c.fds = []
        else:
            sent = c.sock.send(c.out)
        c.out = c.out[sent:]
        if not c.out:
            self.served += 1
            self._drop(c)

    def _reply(self, data: bytes, pid: int) -> tuple[bytes, list[int]]:
        frame = self._codec.decode(data)
        if not isinstance(frame, PipeFrame):
            raise MessageError(f"expected a query frame, got {type(frame).__name__}")
        try:
            query = _query_decoder.decode(frame.payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MessageError(f"malformed query: {exc}") from None
        try:
            payload, fds = self._answer(query.proof, query.fds, pid)
        except _NotLetIn as exc:
            self.refused += 1
            self._warn(f"did not let in process {pid}: {exc}")
            payload, fds = _encoder.encode(_Refused(reason=str(exc)[:512])), []
        return self._codec.encode(PipeFrame(seq=0, payload=payload)), fds

    def _warn(self, what: str) -> None:
        """WARNING at most once a second (the rest at DEBUG): a flood must not flood the log."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning("shm listener %r %s (%d refused so far)", self.name[1:], what,
                        self.refused)
        else:
            log.debug("shm listener %r %s", self.name[1:], what)

    def _refuse(self, c: _Conn, why: str) -> None:
        self.refused += 1
        log.debug("shm listener %r dropped a connection: %s", self.name[1:], why)
        self._drop(c)

    def _drop(self, c: _Conn) -> None:
        self._conns.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close every socket. Idempotent."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("shm listener %r did not stop in %.1f s", self.name[1:], timeout)
            return
        with self._watch_lock:  # watches the thread never took
            for _, dup, _ in self._watch_changes:
                if dup >= 0:
                    os.close(dup)
            self._watch_changes.clear()
        self._sel.close()
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()


@dataclass(eq=False)
class _Peer:
    """A peer as proven by the handshake: the pid and regions every transfer uses."""

    agent: str
    pid: int
    pidfd: int
    version: int
    regions: list[tuple[int, int]]
    sender: NotificationSender
    mapping: PeerMapping | None = None
    retired: bool = False
    #: the listener's watch of the pidfd (None: not watched)
    watch: tuple[_Listener, int] | None = None

    def __post_init__(self) -> None:
        self._poller = _poller(self.pidfd)

    def alive(self) -> bool:
        """False once the proven process exited (its pid may then belong to another one)."""
        return self._poller is None or not self._poller.poll(0)

    def retire(self, unmap: bool = True) -> None:
        """Close the sender, the pidfd and (with ``unmap``) the mapping of its shared memory
        (on the worker, after every job queued before: no copy uses the mapping then)."""
        self.retired = True
        if self.watch is not None:
            listener, key = self.watch
            self.watch = None
            listener.unwatch(key)
        if unmap and self.mapping is not None:
            self.mapping.close()
        self.sender.close()
        if self.pidfd >= 0:
            self._poller = None
            os.close(self.pidfd)
            self.pidfd = -1


@dataclass
class _Part:
    """One copy thread's share of a transfer: ``moves`` (rows of dst, src, length) to copy
    through the peer's mapped memory, then the ``local <-> remote`` iovecs by CMA."""

    moves: IovArray
    local: IovArray
    remote: IovArray
    mapped_bytes: int = 0


Parts = list[_Part]


@dataclass
class _Job:
    """A transfer whose iovecs are built: at submit (by descriptors) or ahead (prepared)."""

    handle: TransferHandle
    peer: _Peer
    parts: Parts
    notification: bytes | None


@dataclass
class _BlockJob:
    """A transfer by block ids: its iovecs are built on the worker, from the plane tables."""

    handle: TransferHandle
    peer: _Peer
    pair: BlockPair
    req: BlockRequest
    notification: bytes | None


@dataclass
class _Prepared:
    """A request built ahead (:meth:`ShmTransport.prepare_request`): its parts, ready to copy."""

    peer: _Peer
    parts: Parts


def _check_bounds(local: DescriptorArray, remote: DescriptorArray) -> None:
    """Refuse addresses/lengths whose sum could overflow the int64 range check (one reduction
    per list: this runs on every submit)."""
    if local.shape[0] and (local.max() > _MAX_ADDR or remote.max() > _MAX_ADDR):
        raise DescriptorError("descriptors hold an address or length above 2**62")


def _option(options: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    try:
        value = float(options.get(key, default))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"shm option {key} must be a number: {exc}") from None
    if not lo <= value <= hi:
        raise ConfigError(f"shm option {key} must be in [{lo}, {hi}], got {value}")
    return value


class ShmTransport(BlockTransport):
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
        opts = self.options
        self._threads = int(_option(opts, "threads", DEFAULT_THREADS, 1, 64))
        self._split_bytes = int(_option(opts, "split_bytes", 16 << 20, 1, 1 << 40))
        self._map_memory = parse_bool(opts.get("map_memory", False), "shm option map_memory")
        self._map_peers = parse_bool(opts.get("map_peers", True), "shm option map_peers")
        self._rangecopy: rangecopy.RangeCopy | None = None  # loaded with the first mapping
        self._stop = ctypes.c_int32(0)  # set with _abort: the native copy checks it
        self._areas: list[SharedArea] = []
        #: bytes copied through peers' mapped memory / by cross-memory attach (successful
        #: transfers; updated on the worker)
        self.mapped_bytes = 0
        self.cma_bytes = 0
        self._helpers: ThreadPoolExecutor | None = None
        self._hs_timeout = _option(opts, "handshake_timeout", 5.0, 0.01, 600.0)
        listener_timeout = _option(opts, "listener_timeout", 2.0, 0.01, 600.0)
        max_conns = int(_option(opts, "listener_max_connections", 16, 1, 4096))
        max_msgs = int(_option(opts, "max_notifications", DEFAULT_MAX_NOTIFICATIONS, 1, 1 << 24))
        max_bytes = int(_option(
            opts, "max_notification_bytes", DEFAULT_MAX_NOTIFICATION_BYTES, 1, 1 << 34
        ))
        secret = opts.get("secret")
        self._codec = Codec(secret)
        self._hs_codec = Codec(secret, _MAX_REPLY_BYTES)
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []
        self._version = 0
        self._peers: dict[str, _Peer] = {}
        self._attested = Attestations()
        self._jobs: queue.SimpleQueue[_Job | _BlockJob | Callable[[], None] | None] = (
            queue.SimpleQueue())
        self._abort = threading.Event()
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
        self._worker = threading.Thread(
            target=self._work, name=f"kvbridge-shm-{agent_name}", daemon=True
        )
        self._worker.start()
        log.info("shm transport %r ready (pid %d, notifications at %s, socket @%s)",
                 agent_name, os.getpid(), self._inbox.address, self._listener.name[1:])

    @property
    def dropped_notifications(self) -> int:
        """Inbound notification frames dropped: refused by the codec, or over the inbox bound."""
        return self._inbox.dropped

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
        """Load a peer after proving who it is (see the module docstring).

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
        peer = self._handshake(meta, proof)
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

    def _handshake(self, meta: ShmMetadata, proof: bytes) -> _Peer:
        """Connect to the peer's socket, prove its pid and uid, fetch its registration."""
        who = f"peer {meta.agent!r}"
        deadline = time.monotonic() + self._hs_timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            return self._prove(meta, proof, who, sock, deadline, fds)
        finally:
            sock.close()
            close_all(fds)  # mapped or refused: the mappings keep what they need

    def _prove(self, meta: ShmMetadata, proof: bytes, who: str, sock: socket.socket,
               deadline: float, fds: list[int]) -> _Peer:
        pidfd = -1
        try:
            sock.settimeout(self._hs_timeout)
            try:
                sock.connect(meta.socket)
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                raise PeerUnreachable(
                    f"{who} (pid {meta.pid}) is gone: nothing listens on its shm socket "
                    "(or it runs in another network namespace)"
                ) from exc
            pid, uid, _ = _peercred(sock)
            if uid != os.geteuid():
                raise PeerUnreachable(
                    f"{who}'s shm socket belongs to uid {uid}, not to this process's uid "
                    f"{os.geteuid()}: the shm transport only connects processes of one user"
                )
            if pid <= 0:
                raise PeerUnreachable(
                    f"the process behind {who}'s shm socket is not visible in this PID namespace"
                )
            if pid != meta.pid:
                raise PeerUnreachable(
                    f"{who}'s metadata claims pid {meta.pid}, but the process listening on its "
                    f"shm socket is pid {pid}: refusing forged or stale metadata"
                )
            try:
                pidfd = _peer_pidfd(sock, pid)
            except ProcessLookupError:
                raise PeerUnreachable(f"{who}: process {pid} is gone") from None
            request = self._hs_codec.encode(
                PipeFrame(seq=0, payload=_encoder.encode(
                    _Query(proof=proof, fds=self._map_peers)))
            )
            _send_all(sock, len(request).to_bytes(4, "big") + request, deadline)
            size = int.from_bytes(_recv_exact(sock, 4, deadline, fds), "big")
            if not 0 < size <= _MAX_REPLY_BYTES:
                raise PeerUnreachable(
                    f"{who} announced a registration of {size} bytes (limit {_MAX_REPLY_BYTES})"
                )
            frame = self._hs_codec.decode(_recv_exact(sock, size, deadline, fds))
            if not isinstance(frame, PipeFrame):
                raise MessageError(f"a {type(frame).__name__} instead of a registration")
            reg = _reg_decoder.decode(frame.payload)
        except PeerUnreachable:
            _close_fd(pidfd)
            raise
        except TimeoutError as exc:
            _close_fd(pidfd)
            raise PeerUnreachable(
                f"{who} did not answer on its shm socket within {self._hs_timeout} s"
            ) from exc
        except (MessageError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            _close_fd(pidfd)
            raise PeerUnreachable(f"{who} answered a malformed registration: {exc}") from None
        except ConnectionError as exc:
            _close_fd(pidfd)
            raise PeerUnreachable(
                f"{who} closed its shm socket without answering ({exc}): does it use another "
                "shared secret, or is its listener busy?"
            ) from exc
        except OSError as exc:
            _close_fd(pidfd)
            raise PeerUnreachable(f"{who}'s shm socket failed during the handshake: {exc}") from exc
        if isinstance(reg, _Refused):
            _close_fd(pidfd)
            raise PeerForged(f"the process behind {who}'s shm socket (pid {pid}) did not let "
                             f"this handshake in: {reg.reason}")
        problem = None
        if reg.proof != proof:
            problem = "did not echo the proof"
        elif reg.pid != pid:
            problem = f"answers as pid {reg.pid}, but the kernel says its socket is pid {pid}"
        elif reg.agent != meta.agent:
            problem = f"is agent {reg.agent!r}, but the metadata names agent {meta.agent!r}"
        elif reg.version < meta.version:
            problem = (f"answers registration version {reg.version}, older than the "
                       f"metadata's {meta.version}")
        elif not _alive(pidfd):
            problem = f"(process {pid}) exited during the handshake"
        if problem is not None:
            _close_fd(pidfd)
            raise PeerUnreachable(f"the process behind {who}'s shm socket {problem}: refusing")
        try:
            mapping = self._map(reg, fds, pid, who)
        except PeerUnreachable:
            _close_fd(pidfd)
            raise
        try:
            sender = NotificationSender(reg.notify_address, self.agent_name, self._codec)
        except Exception as exc:  # noqa: BLE001 - zmq refuses an unusable address
            _close_fd(pidfd)
            if mapping is not None:
                mapping.close()
            raise PeerUnreachable(
                f"{who} answered an unusable notification address "
                f"{reg.notify_address!r}: {exc}"
            ) from None
        return _Peer(reg.agent, pid, pidfd, reg.version, list(reg.regions), sender, mapping)

    def _map(self, reg: _Registration, fds: list[int], pid: int, who: str) -> PeerMapping | None:
        """Map the peer's shared memory, validated (:class:`PeerMapping`); None where it
        shares none, where we do not map peers, or where ``/proc`` hides its mappings."""
        if not self._map_peers or not (fds or reg.shared):
            return None
        self._rangecopy = self._rangecopy or rangecopy.load()
        if self._rangecopy is None:
            return None  # no native copy here: CMA it is (load() logged why, once)
        pieces = [Piece(*s) for s in reg.shared]
        try:
            mapping = PeerMapping(fds, pieces, pid, reg.regions)
        except FdUnverifiable as exc:
            log.warning("shm %r: %s's shared memory is not mapped (%s); it moves by "
                        "cross-memory attach", self.agent_name, who, exc)
            return None
        except FdRefused as exc:
            raise PeerUnreachable(f"{who} sent shared memory that is refused: {exc}") from None
        except OSError as exc:
            raise PeerUnreachable(f"{who}'s shared memory cannot be checked: {exc}") from None
        log.info("shm %r maps %d bytes of %s's memory (memcpy instead of cross-memory attach)",
                 self.agent_name, mapping.nbytes, who)
        return mapping

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
                self._jobs.put(peer.retire)
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
        job = _Job(handle, p, self._parts(p, op, _iov(local), _iov(remote), handle.nbytes),
                   notification)
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
        return _Prepared(peer, self._block_parts(peer, op, pair, req))

    def _post_prepared(self, prep: PreparedRequest, native: _Prepared) -> TransferHandle:
        """Queue the prepared parts: nothing is built or validated on this path."""
        handle = TransferHandle(prep.op, prep.pair.peer, prep.req.nbytes, prep.req.count)
        self._queue(_Job(handle, native.peer, native.parts, prep.notification))
        return handle

    def _pair_peer(self, pair: BlockPair) -> _Peer:
        p: _Peer = pair.native
        if self._peer(pair.peer) is not p:
            raise UnknownPeer(f"shm {self.agent_name!r}: peer {pair.peer!r} was re-added")
        return p

    def _queue(self, job: _Job | _BlockJob) -> None:
        with self._lock:
            self._check_open()
            self._jobs.put(job)

    def _block_parts(self, peer: _Peer, op: Op, pair: BlockPair, req: BlockRequest) -> Parts:
        """``req``'s iovecs, from the plane tables, cut into the copy threads' parts."""
        loc, rem = req.descriptors(pair, columns=2)
        return self._parts(peer, op, loc.view(np.uint64), rem.view(np.uint64), req.nbytes)

    def _parts(self, peer: _Peer, op: Op, local: IovArray, remote: IovArray,
               nbytes: int) -> Parts:
        """The pieces the copy threads take: the whole transfer below ``split_bytes`` (or with
        one thread), else ``threads`` pieces of about equal bytes; in each, the ranges the
        peer's mapped memory holds are moves, the others stay iovecs."""
        if self._threads <= 1 or nbytes < self._split_bytes or local.shape[0] == 0:
            pairs = [(local, remote)]
        else:
            pairs = split_iovecs(local, remote, self._threads)
        return [_part(peer.mapping, op, loc, rem) for loc, rem in pairs]

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not isinstance(job, (_Job, _BlockJob)):
                job()
                continue
            self._run(job)

    def _run(self, job: _Job | _BlockJob) -> None:
        h, peer = job.handle, job.peer
        if self._abort.is_set():
            h._finish(HandleState.FAILED, "transport closed before the transfer started")
            return
        if peer.retired:
            h._finish(HandleState.FAILED, f"peer {h.peer!r} was removed before the transfer ran")
            return
        if not peer.alive():  # its pid may already belong to another process
            h._finish(HandleState.FAILED, f"{h.op.value} with {h.peer!r} failed: "
                      f"{_explain(errno.ESRCH, peer.pid)}")
            return
        fn = self._libc.readv if h.op is Op.READ else self._libc.writev
        try:
            parts = (job.parts if isinstance(job, _Job)
                     else self._block_parts(peer, h.op, job.pair, job.req))
            self._copy(fn, peer.pid, parts)
            mapped = sum(p.mapped_bytes for p in parts)
            if mapped and not peer.alive():  # CMA would have failed with ESRCH
                raise TransferFailed(_explain(errno.ESRCH, peer.pid))
            self.mapped_bytes += mapped
            self.cma_bytes += h.nbytes - mapped
            if job.notification is not None:
                peer.sender.send(job.notification)
        except Exception as exc:  # noqa: BLE001 - every failure ends the handle, never the thread
            log.debug("shm %r %s #%d failed: %s", self.agent_name, h.op.value, h.id, exc)
            h._finish(HandleState.FAILED, f"{h.op.value} with {h.peer!r} failed: {exc}")
            return
        h._finish(HandleState.DONE)

    def _copy(self, fn: Callable[..., int], pid: int, parts: Parts) -> None:
        """Copy the first part on the worker and the others on the helper threads; return once
        every part stopped, also when one failed (its bytes may be landing), then raise the
        first failure."""
        if len(parts) == 1:
            self._copy_part(fn, pid, parts[0])
            return
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(self._threads - 1,
                                               thread_name_prefix=f"kvbridge-shm-{self.agent_name}")
        first, *rest = parts
        futures = [self._helpers.submit(self._copy_part, fn, pid, p) for p in rest]
        errors: list[BaseException] = []
        try:
            self._copy_part(fn, pid, first)
        except Exception as exc:  # noqa: BLE001 - reported once every part stopped
            errors.append(exc)
        for f in futures:
            failure = f.exception()
            if failure is not None:
                errors.append(failure)
        if errors:
            raise errors[0]

    def _copy_part(self, fn: Callable[..., int], pid: int, part: _Part) -> None:
        """Copy the part's mapped ranges in one native call (without the GIL), then the rest by
        CMA; ``close`` stops either within 64 ranges."""
        if part.moves.shape[0]:
            assert self._rangecopy is not None  # there are moves only with a mapping
            if self._rangecopy(part.moves, self._stop) < part.moves.shape[0]:
                raise TransferFailed("transport closed during the transfer; abandoned")
        if part.local.shape[0]:
            copy_iovecs(fn, pid, part.local, part.remote, self._iov_max, self._abort)

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
            self._forget_blocks(None)
            self._listener.close()
            self._worker.join(timeout)
            if self._worker.is_alive():
                log.warning("shm %r: transfers still queued after %.1f s; failing them",
                            self.agent_name, timeout)
                self._abort.set()
                self._stop.value = 1
                self._worker.join(5.0)
            self._abort.set()
            self._stop.value = 1
            self._fail_leftovers()
            if self._helpers is not None:
                self._helpers.shutdown(wait=True)
            stuck = self._worker.is_alive()  # a copy may still read a mapping: keep them
            for p in peers:
                p.retire(unmap=not stuck)
            for area in self._areas:  # private pages again, unless a copy may still run
                area.close(restore=not stuck)
            self._inbox.close()
            log.info("shm transport %r closed", self.agent_name)

    def _fail_leftovers(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, (_Job, _BlockJob)):
                job.handle._finish(HandleState.FAILED, "transport closed before the transfer ran")
            elif job is not None:
                job()


def _part(mapping: PeerMapping | None, op: Op, local: IovArray, remote: IovArray) -> _Part:
    """Split one thread's iovecs into moves through ``mapping`` and the rest (vectorised)."""
    if mapping is None or local.shape[0] == 0:
        return _Part(_NO_MOVES, local, remote)
    length = remote[:, 1].astype(np.int64)
    inside, here = mapping.translate(remote[:, 0].astype(np.int64), length)
    if not inside.any():
        return _Part(_NO_MOVES, local, remote)
    mine = local[inside, 0].astype(np.int64)
    dst, src = (mine, here[inside]) if op is Op.READ else (here[inside], mine)
    sizes = length[inside]
    moves = np.ascontiguousarray(np.stack([dst, src, sizes], axis=1)).view(np.uint64)
    outside = ~inside
    return _Part(moves, np.ascontiguousarray(local[outside]),
                 np.ascontiguousarray(remote[outside]), int(sizes.sum()))


_NO_MOVES: IovArray = np.zeros((0, 3), dtype=np.uint64)


def _close_fd(fd: int) -> None:
    if fd >= 0:
        os.close(fd)
