"""Cross-memory attach and the kernel's word on processes, for the shm transport.

``process_vm_readv/writev`` and ``prctl`` through ctypes (:class:`_Libc`); moving ``(N, 2)``
uint64 iovec arrays with them, ``IOV_MAX`` at a time (:func:`copy_iovecs`) and cutting a
transfer into parts of about equal bytes (:func:`split_iovecs`); who is behind a Unix socket
(``SO_PEERCRED``: :func:`_peercred`), a pidfd of that process (:func:`_peer_pidfd`) and
whether it is still alive (:func:`_alive`); this host's boot id and PID namespace (what the
metadata claims and a peer compares).

Thread-safe: :class:`_Libc` is loaded once per process under a lock; the functions share no
state (a pair of iovec arrays belongs to one caller). Blocking: :func:`copy_iovecs` blocks for
the system calls that copy its bytes (it checks ``cancelled`` between them); everything else
returns at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import platform
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvbridge.errors import BackendUnavailable, TransferFailed
from kvbridge.transport import DescriptorArray

__all__ = ["IOV_MAX", "IovArray", "copy_iovecs", "split_iovecs"]

log = logging.getLogger("kvbridge.transport.shm")

IOV_MAX = 1024
#: Linux >= 6.5 (the generic socket option number: only trusted on architectures that use it);
#: elsewhere, and on older kernels, pidfd_open (>= 5.3), then no pidfd at all
_SO_PEERPIDFD = 77 if platform.machine() in ("x86_64", "aarch64", "arm64", "riscv64") else None
_UCRED = struct.Struct("3i")
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

IovArray = npt.NDArray[np.uint64]


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


def _close_fd(fd: int) -> None:
    if fd >= 0:
        os.close(fd)
