"""Registered memory on a sealed memfd, so that a same-host peer copies it with ``memmove``.

Why: cross-memory attach (``process_vm_readv/writev``) pins every remote range in the kernel on
its own, about 2 µs per range here, and a WRITE dirties each destination page through the
kernel; at 256 KiB per range that keeps the shm transport at 0.8-0.95 x a memcpy
(docs/benchmarks.md). A peer that maps the same pages copies them in user space at memcpy speed.

The owner side, :func:`share` (called by ``ShmTransport.register_memory`` with the
``map_memory`` option): for the whole pages inside each region it writes their bytes into one
memfd and maps the memfd over the same addresses (``MAP_SHARED | MAP_FIXED``), a chunk at a time
so the extra memory is one chunk. The bytes stay where they were, under the same addresses: only
what backs them changes, from private anonymous pages to the memfd's. The memfd is sealed
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before anything is mapped, so no one can ever
truncate it under a mapping (a mapping past the end of its file raises ``SIGBUS``); the ranges
are marked ``MADV_DONTFORK`` (a forked child must not share the KV cache's pages: it gets no
mapping there, as with RDMA-registered memory) and collapsed onto huge pages (``MADV_COLLAPSE``,
Linux 6.1; skipped quietly where refused). The partial pages at a region's ends are left alone
(they may hold other data) and keep moving by CMA.

Contract of :func:`share`: call it only while no thread writes the regions (a write between the
copy and the remap would be lost) — the connector calls it from ``register_kv_caches``, before
the engine's first forward — and only on ordinary host memory, never on page-locked (pinned,
``cudaHostRegister``) memory: the remap gives the range new pages. Blocking (copies every byte
once, ~0.1-0.3 s per GiB). Never raises for what the kernel refuses: the pieces that were
remapped are in the returned :class:`SharedArea` (the rest stays as it was), the reason in
``error``. Not thread-safe against itself on overlapping regions. The memory must stay
allocated until :meth:`SharedArea.close` (the transport's ``close``), which gives it private
pages again: heap memory the allocator reuses must not stay shared (see
:meth:`SharedArea.restore`).

The peer side, :class:`PeerMapping`: a peer's fds are hostile input. Each must be a memfd on
tmpfs (not hugetlbfs, whose faults can raise ``SIGBUS`` when its pool is empty), sealed against
shrinking, writable, and large enough for every piece; each piece must be page-aligned, inside
the regions the proven process registered, and — read from ``/proc/<pid>/maps`` — mapped by
that very process at that address from that file and offset, so a mapped copy lands exactly
where a CMA one would. Anything else raises :class:`FdRefused` naming the piece and the reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvbridge.host.hugepages import MADV_HUGEPAGE, MADV_POPULATE_WRITE

log = logging.getLogger("kvbridge.transport.shm")

__all__ = ["FdRefused", "FdUnverifiable", "Piece", "SharedArea", "PeerMapping", "share",
           "close_all", "MAX_FDS"]

#: fds one registration answer may carry (one memfd per ``register_memory`` call)
MAX_FDS = 16
F_ADD_SEALS, F_GET_SEALS = 1033, 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE, F_SEAL_FUTURE_WRITE = 1, 2, 4, 8, 16
MADV_DONTFORK, MADV_COLLAPSE = 10, 25
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_HUGE = 2 << 20
_CHUNK = 64 << 20
_TMPFS_MAGIC = 0x01021994
_PAGE = mmap.PAGESIZE

I64 = npt.NDArray[np.int64]


class FdRefused(Exception):
    """A peer's shared-memory fd or piece failed validation (the message says which, why)."""


class FdUnverifiable(FdRefused):
    """The pieces could not be checked against ``/proc/<pid>/maps`` (unreadable here)."""


@dataclass(frozen=True)
class Piece:
    """``length`` bytes at ``address`` are backed by memfd number ``fd`` from ``offset``."""

    address: int
    length: int
    fd: int
    offset: int


@dataclass
class SharedArea:
    """What :func:`share` remapped: the memfd (owned: :meth:`close` it) and its pieces."""

    fd: int = -1
    pieces: list[Piece] = field(default_factory=list)
    huge_bytes: int = 0
    error: str = ""

    @property
    def nbytes(self) -> int:
        return sum(p.length for p in self.pieces)

    def close(self, restore: bool = True) -> None:
        """Give the pieces private pages again (:meth:`restore`, unless told not to: a copy
        may still be running), then close the fd."""
        if self.fd >= 0:
            try:
                if restore:
                    self.restore()
            finally:
                os.close(self.fd)
                self.fd = -1

    def restore(self) -> int:
        """Back the pieces with private anonymous pages again (same bytes, same addresses),
        where this process still maps the memfd there; the bytes restored.

        Why: the allocator may reuse the memory once its owner frees it, and a shared,
        ``MADV_DONTFORK`` mapping under ordinary heap memory breaks ``fork`` (a child crashes
        touching it, as Python's ``preexec_fn`` does) or, without ``MADV_DONTFORK``, lets a
        child write into the parent. Call it only when no transfer and no other thread uses the
        pieces (the transport's ``close``). Ranges the process unmapped or remapped since are
        left alone (read from ``/proc/self/maps``).
        """
        if self.fd < 0 or not self.pieces:
            return 0
        try:
            maps = _maps_of(os.getpid(), {os.fstat(self.fd).st_ino})
        except OSError as exc:
            log.warning("cannot read /proc/self/maps to restore shared memory: %s", exc)
            return 0
        done = 0
        for start, stop, off, _, _ in maps:
            for p in self.pieces:
                lo, hi = max(start, p.address), min(stop, p.address + p.length)
                if lo < hi and off + (lo - start) == p.offset + (lo - p.address):
                    done += _privatize(lo, hi)
        self.pieces = []
        return done


class _Sys:
    """``mmap``/``munmap``/``madvise``/``fstatfs`` with addresses, through ctypes."""

    _lib: ctypes.CDLL | None = None

    @classmethod
    def lib(cls) -> ctypes.CDLL:
        if cls._lib is None:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
            lib.mremap.restype = ctypes.c_void_p
            lib.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                   ctypes.c_int, ctypes.c_void_p]
            cls._lib = lib
        return cls._lib


def _err(what: str) -> str:
    e = ctypes.get_errno()
    return f"{what}: {os.strerror(e)} (errno {e})"


def _privatize(lo: int, hi: int) -> int:
    """Replace the mapping of ``[lo, hi)`` by private anonymous pages holding the same bytes,
    a chunk at a time (copy into a fresh mapping, then ``mremap`` it over the range: the
    range is never unmapped in between); the bytes done."""
    lib = _Sys.lib()
    at = lo
    while at < hi:
        n = min(_CHUNK, hi - at)
        tmp = lib.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE,
                       mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if tmp in (None, _MAP_FAILED):
            log.warning("%s", _err(f"restoring 0x{at:x}: mmap"))
            break
        lib.madvise(tmp, n, MADV_HUGEPAGE)
        ctypes.memmove(tmp, at, n)
        if lib.mremap(tmp, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, at) != at:
            log.warning("%s", _err(f"restoring 0x{at:x}: mremap"))
            lib.munmap(tmp, n)
            break
        at += n
    return at - lo


def _map_aligned(lib: ctypes.CDLL, fd: int, size: int) -> int | None:
    """Map ``size`` bytes of ``fd`` shared, at a 2 MiB-aligned address, so that the file's
    huge pages can be mapped whole (a misaligned mapping falls back to 4 KiB entries: a page
    fault on each first touch and a TLB entry per 4 KiB); None on failure (errno set)."""
    span = size + _HUGE
    got_area = lib.mmap(None, span, 0,  # PROT_NONE: a reservation
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if got_area in (None, _MAP_FAILED):
        return None
    area = int(got_area)
    base = (area + _HUGE - 1) & ~(_HUGE - 1)
    got = lib.mmap(base, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                   fd, 0)
    if got != base:
        lib.munmap(area, span)
        return None
    if base > area:
        lib.munmap(area, base - area)
    if area + span > base + size:
        lib.munmap(base + size, area + span - base - size)
    return base


def _collapse(lib: ctypes.CDLL, lo: int, hi: int) -> int:
    """``MADV_COLLAPSE`` the whole huge pages of ``[lo, hi)``; the bytes it collapsed."""
    a, b = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
    if b <= a or lib.madvise(a, b - a, MADV_COLLAPSE) != 0:
        return 0
    return b - a


def share(regions: Sequence[tuple[int, int]], name: str = "kvbridge-shm") -> SharedArea:
    """Back the whole pages of ``regions`` with one sealed memfd (see the module docstring)."""
    spans = []
    for addr, length in regions:
        lo, hi = -(-addr // _PAGE) * _PAGE, (addr + length) // _PAGE * _PAGE
        if hi > lo:
            spans.append((lo, hi))
    area = SharedArea()
    if not spans:
        area.error = "no whole page in the regions"
        return area
    # offsets congruent to the addresses modulo 2 MiB, so the pages can be huge on both sides
    offsets, end = [], 0
    for lo, hi in spans:
        off = end + ((lo - end) % _HUGE)
        offsets.append(off)
        end = off + (hi - lo)
    lib = _Sys.lib()
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        area.error = f"memfd_create: {exc}"
        return area
    area.fd = fd
    try:
        os.ftruncate(fd, end)
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
    except OSError as exc:
        area.close()
        area.error = f"sizing or sealing the memfd: {exc}"
        return area
    for (lo, hi), off in zip(spans, offsets, strict=True):
        done = lo
        while done < hi and not area.error:
            n = min(_CHUNK, hi - done)
            view = memoryview((ctypes.c_char * n).from_address(done)).cast("B")
            try:
                at = 0
                while at < n:
                    at += os.pwrite(fd, view[at:], off + done - lo + at)
            except OSError as exc:
                area.error = f"copying into the memfd: {exc}"
                break
            got = lib.mmap(done, n, mmap.PROT_READ | mmap.PROT_WRITE,
                           mmap.MAP_SHARED | _MAP_FIXED, fd, off + done - lo)
            if got != done:
                area.error = _err(f"mmap over 0x{done:x}")
                break
            done += n
        if done > lo:
            if lib.madvise(lo, done - lo, MADV_DONTFORK) != 0:
                log.debug("%s", _err("MADV_DONTFORK"))
            area.huge_bytes += _collapse(lib, lo, done)
            lib.madvise(lo, done - lo, MADV_POPULATE_WRITE)  # no first-touch faults later
            area.pieces.append(Piece(lo, done - lo, 0, off))
        if area.error:
            break
    if not area.pieces:
        area.close()
    return area


# -- the peer side ------------------------------------------------------------------------------


def _maps_of(pid: int, inodes: set[int]) -> list[tuple[int, int, int, int, str]]:
    """``(start, end, offset, inode, device)`` of ``pid``'s mappings of the given inodes."""
    out = []
    with open(f"/proc/{pid}/maps", "rb") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 5 or int(parts[4]) not in inodes:
                continue
            start, _, stop = parts[0].partition(b"-")
            out.append((int(start, 16), int(stop, 16), int(parts[2], 16), int(parts[4]),
                        parts[3].decode()))
    out.sort()
    return out


def _check_fd(fd: int, index: int) -> os.stat_result:
    """A memfd on tmpfs, sealed against shrinking, writable: else :class:`FdRefused`."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise FdRefused(f"fd #{index} is not a regular file (mode 0o{st.st_mode:o})")
    target = os.readlink(f"/proc/self/fd/{fd}")
    if not target.startswith("/memfd:"):
        raise FdRefused(f"fd #{index} is not a memfd ({target[:80]!r})")
    buf = ctypes.create_string_buffer(256)
    if _Sys.lib().fstatfs(fd, buf) != 0:
        raise FdRefused(_err(f"fd #{index}: fstatfs"))
    magic = ctypes.c_long.from_buffer(buf).value
    if magic != _TMPFS_MAGIC:
        raise FdRefused(f"fd #{index} is not on tmpfs (filesystem magic 0x{magic:x}; a "
                        "hugetlbfs memfd can fault with SIGBUS)")
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        raise FdRefused(f"fd #{index} has no seals: {exc}") from None
    if not seals & F_SEAL_SHRINK:
        raise FdRefused(f"fd #{index} is not sealed against shrinking (seals 0x{seals:x}): "
                        "a truncation would fault a mapping with SIGBUS")
    if seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
        raise FdRefused(f"fd #{index} is sealed against writing (seals 0x{seals:x})")
    return st


class PeerMapping:
    """A proven peer's shared pieces, mapped here; translates its addresses into ours.

    Built once per handshake (blocking: one read of ``/proc/<pid>/maps``); :meth:`translate`
    is vectorised and thread-safe; :meth:`close` unmaps, and must run only once no copy uses
    the mapping (the transport retires a peer on its worker, behind every queued transfer).
    """

    def __init__(self, fds: Sequence[int], pieces: Sequence[Piece], pid: int,
                 regions: Sequence[tuple[int, int]]) -> None:
        self._maps: list[tuple[int, int]] = []
        if len(fds) > MAX_FDS:
            raise FdRefused(f"{len(fds)} fds sent (at most {MAX_FDS})")
        try:
            self._build(fds, pieces, pid, regions)
        except BaseException:
            self.close()
            raise

    def _build(self, fds: Sequence[int], pieces: Sequence[Piece], pid: int,
               regions: Sequence[tuple[int, int]]) -> None:
        stats = [_check_fd(fd, i) for i, fd in enumerate(fds)]
        used = {p.fd for p in pieces}
        if used != set(range(len(fds))):
            raise FdRefused(f"{len(fds)} fds sent, but the pieces use fds {sorted(used)}")
        reg = sorted(regions)
        reg_lo = np.array([a for a, _ in reg], dtype=np.int64)
        reg_hi = np.array([a + n for a, n in reg], dtype=np.int64)
        order = sorted(range(len(pieces)), key=lambda i: pieces[i].address)
        last_end = 0
        for i in order:
            p = pieces[i]
            where = f"piece #{i} [0x{p.address:x}, +{p.length})"
            if p.address % _PAGE or p.length % _PAGE or p.offset % _PAGE or p.length <= 0:
                raise FdRefused(f"{where} is not page-aligned")
            if p.address < last_end:
                raise FdRefused(f"{where} overlaps the piece before it")
            last_end = p.address + p.length
            if p.offset + p.length > stats[p.fd].st_size:
                raise FdRefused(f"{where} ends at offset {p.offset + p.length}, past the end "
                                f"of its memfd ({stats[p.fd].st_size} bytes)")
            k = int(np.searchsorted(reg_lo, p.address, side="right")) - 1
            if k < 0 or p.address + p.length > int(reg_hi[k]):
                raise FdRefused(f"{where} is not inside one of the peer's registered regions")
        self._check_maps(fds, stats, pieces, pid)
        lib = _Sys.lib()
        bases = []
        for i, fd in enumerate(fds):
            size = max(p.offset + p.length for p in pieces if p.fd == i)
            size = -(-size // _PAGE) * _PAGE
            base = _map_aligned(lib, fd, size)
            if base is None:
                raise FdRefused(_err(f"mapping fd #{i} ({size} bytes)"))
            self._maps.append((base, size))
            lib.madvise(base, size, MADV_DONTFORK)
            _collapse(lib, base, base + size)
            mine = [p for p in pieces if p.fd == i]
            # map every page now (no fault on a transfer's first touch), where the file holds
            # as many bytes as the pieces (an honest owner wrote them all), so that populating
            # cannot make this process allocate a sparse file's holes
            if stats[i].st_blocks * 512 >= sum(p.length for p in mine):
                for p in mine:
                    lib.madvise(base + p.offset, p.length, MADV_POPULATE_WRITE)
            bases.append(base)
        ps = sorted(pieces, key=lambda p: p.address)
        self.starts: I64 = np.array([p.address for p in ps], dtype=np.int64)
        self.ends: I64 = np.array([p.address + p.length for p in ps], dtype=np.int64)
        self.delta: I64 = np.array([bases[p.fd] + p.offset - p.address for p in ps],
                                   dtype=np.int64)
        self.nbytes = sum(p.length for p in ps)

    @staticmethod
    def _check_maps(fds: Sequence[int], stats: Sequence[os.stat_result],
                    pieces: Sequence[Piece], pid: int) -> None:
        """Each piece is what ``pid`` maps at its address, from its fd's file and offset."""
        try:
            maps = _maps_of(pid, {st.st_ino for st in stats})
        except OSError as exc:
            raise FdUnverifiable(f"cannot read /proc/{pid}/maps to check the pieces: {exc}"
                                 ) from None
        for i, p in enumerate(pieces):
            st = stats[p.fd]
            dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
            at = p.address
            for start, stop, off, ino, mdev in maps:
                if ino != st.st_ino or mdev != dev or not start <= at < stop:
                    continue
                if off + (at - start) != p.offset + (at - p.address):
                    break
                at = stop
                if at >= p.address + p.length:
                    break
            if at < p.address + p.length:
                raise FdRefused(
                    f"piece #{i} [0x{p.address:x}, +{p.length}): process {pid} does not map "
                    f"fd #{p.fd}'s file there at offset {p.offset} (from 0x{at:x} on)")

    def translate(self, addr: I64, length: I64) -> tuple[npt.NDArray[np.bool_], I64]:
        """For each range ``[addr, addr + length)`` of the peer: whether one mapped piece holds
        it whole, and where it is here (meaningless where not)."""
        k = np.searchsorted(self.starts, addr, side="right") - 1
        kk = np.maximum(k, 0)
        inside = (k >= 0) & (addr + length <= self.ends[kk])
        return inside, addr + self.delta[kk]

    def close(self) -> None:
        """Unmap everything (idempotent)."""
        lib = _Sys.lib()
        for base, size in self._maps:
            if lib.munmap(base, size) != 0:
                log.warning("%s", _err(f"munmap of a peer's mapping at 0x{base:x}"))
        self._maps = []


def close_all(fds: Sequence[int]) -> None:
    """Close every fd of ``fds`` (received ones a handshake did not keep)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise
