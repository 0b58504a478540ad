"""Back a fresh host-memory KV cache with transparent huge pages.

Why: ``process_vm_readv/writev`` (the ``shm`` transport, and UCX's CMA under NIXL on one host)
pins and copies the far side's memory page by page. On 4 KiB pages this host moves 4.6–7.5
GB/s with it; on 2 MiB pages 7.7–12.8 GB/s, 1.5–1.7× more (docs/benchmarks.md). torch's
CPU allocator asks for no huge pages, so on hosts whose THP mode is ``madvise`` (the Debian and
Ubuntu default) vLLM's CPU KV cache sits on 4 KiB pages.

What :func:`back_with_huge_pages` does, per region: it takes the whole huge pages inside the
region (the partial ones at its ends are left alone: they may hold other data), marks them
``MADV_HUGEPAGE`` so that later faults get huge pages, releases (``MADV_DONTNEED``) those whose
bytes are all zero, and faults them in again at once (``MADV_POPULATE_WRITE``, or one write of
a zero byte per huge page on kernels before 5.14) as zeroed huge pages: the same bytes, so no
reader can tell. A huge page holding any non-zero byte keeps its pages (``kept_bytes``):
nothing is ever lost, it only stays slower.

Faulting in at once matters: a huge page's first fault allocates and clears 2 MiB, and on a VM
whose free memory goes back to the host (free page reporting) it costs milliseconds. Left to
the first transfer, that lands on the hand-off: measured here, a 22 MiB push WRITE into
released pages took 81 ms against 13.5 ms into 4 KiB pages. Paid at registration, it is engine
start-up time (0.1–4 s per GiB here, depending on whether the host still backs the memory).

Contract: call it only while no other thread writes the regions — a write between the zero
check and the release would be lost. The connector calls it from ``register_kv_caches``, right
after vLLM allocated the KV cache (``torch.zeros``) and before the engine's first forward. Host
memory only, never page-locked (pinned) memory. Blocking: reads every byte once (~0.1 s per GiB)
and faults the released pages in again (see above). Never raises: what happened is in the
returned :class:`HugePageReport`. Thread-safe (no shared state).
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["HugePageReport", "back_with_huge_pages", "thp_disabled_here", "thp_mode"]

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14
PR_GET_THP_DISABLE = 42
PR_THP_DISABLE_EXCEPT_ADVISED = 1 << 1  # Linux 6.18: madvised ranges still get huge pages
_SYSFS = "/sys/kernel/mm/transparent_hugepage"
_CHECK_CHUNK = 64 << 20  # bytes of the zero check per numpy call (bounded temporaries)


@dataclass(frozen=True)
class HugePageReport:
    """What :func:`back_with_huge_pages` did.

    ``huge_bytes``: bytes released and faulted in again as huge pages; ``kept_bytes``: whole
    huge pages left as they were because they held data; ``edge_bytes``: the partial huge
    pages at the regions' ends, not touched; ``skipped``: why nothing was done (empty when it
    ran);
    ``error``: the first ``madvise`` failure, if any (the rest of that region is left alone).
    """

    huge_bytes: int = 0
    kept_bytes: int = 0
    edge_bytes: int = 0
    page_bytes: int = 0
    skipped: str = ""
    error: str = ""

    def describe(self) -> str:
        """One line for the engine log."""
        if self.skipped:
            return f"huge pages: not used ({self.skipped})"
        text = (f"huge pages: {self.huge_bytes / 2**20:.0f} MiB of the KV cache now on "
                f"{self.page_bytes >> 10} KiB pages")
        if self.kept_bytes:
            text += f"; {self.kept_bytes / 2**20:.0f} MiB held data and kept their pages"
        if self.error:
            text += f"; {self.error}"
        return text


def thp_mode() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or ``""``
    where it cannot be read (not Linux, no THP)."""
    try:
        with open(f"{_SYSFS}/enabled", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def _page_bytes() -> int:
    try:
        with open(f"{_SYSFS}/hpage_pmd_size", encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2 << 20


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def thp_disabled_here() -> bool:
    """Whether ``prctl(PR_SET_THP_DISABLE)`` (set by some container runtimes and inherited)
    keeps this process's madvised ranges off huge pages."""
    try:
        flags = int(ctypes.CDLL(None, use_errno=True).prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0))
    except (OSError, AttributeError):
        return False
    return flags > 0 and bool(flags & 1) and not flags & PR_THP_DISABLE_EXCEPT_ADVISED


def _zero_pages(start: int, count: int, page: int) -> np.ndarray:
    """One bool per huge page of ``[start, start + count * page)``: all bytes zero."""
    words = page // 8
    per_call = max(1, _CHECK_CHUNK // page)
    out = np.empty(count, dtype=bool)
    for first in range(0, count, per_call):
        n = min(per_call, count - first)
        view = np.ctypeslib.as_array(
            (ctypes.c_uint64 * (n * words)).from_address(start + first * page))
        out[first:first + n] = ~view.reshape(n, words).any(axis=1)
    return out


def back_with_huge_pages(regions: Iterable[tuple[int, int]]) -> HugePageReport:
    """See the module docstring. ``regions``: ``(address, bytes)`` of host memory this
    process owns and nobody else writes during the call."""
    if not sys.platform.startswith("linux"):
        return HugePageReport(skipped="not Linux")
    mode = thp_mode()
    if mode in ("", "never"):
        return HugePageReport(skipped=f"transparent huge pages are {mode or 'unavailable'}")
    if mode == "always":
        return HugePageReport(skipped="transparent huge pages are 'always': already in use")
    madvise = _madvise()
    if madvise is None:
        return HugePageReport(skipped="libc has no madvise")
    if thp_disabled_here():
        return HugePageReport(skipped="this process runs with transparent huge pages disabled "
                                      "(prctl PR_SET_THP_DISABLE)")
    page = _page_bytes()
    huge = kept = edge = 0
    error = ""
    for address, nbytes in regions:
        address, nbytes = int(address), int(nbytes)
        if address <= 0 or nbytes <= 0:
            continue
        lo = -(-address // page) * page
        hi = (address + nbytes) // page * page
        if hi <= lo:
            edge += nbytes
            continue
        edge += (lo - address) + (address + nbytes - hi)
        if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            error = error or _error("MADV_HUGEPAGE", lo, hi - lo)
            continue
        zero = _zero_pages(lo, (hi - lo) // page, page)
        kept += int((~zero).sum()) * page
        # runs of zero pages: one MADV_DONTNEED each
        padded = np.concatenate(([False], zero, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        for first, stop in zip(edges[::2], edges[1::2], strict=True):
            at, length = lo + int(first) * page, int(stop - first) * page
            if madvise(at, length, MADV_DONTNEED) != 0:
                error = error or _error("MADV_DONTNEED", at, length)
                kept += length
                continue
            _populate(madvise, at, length, page)
            huge += length
    return HugePageReport(huge, kept, edge, page, "", error)


def _populate(madvise: Callable[[int, int, int], int], at: int, length: int, page: int) -> None:
    """Fault ``[at, at + length)`` in now (released, so all zero: writing a zero changes
    nothing)."""
    if madvise(at, length, MADV_POPULATE_WRITE) == 0:
        return
    words = length // 8
    view = np.ctypeslib.as_array((ctypes.c_uint64 * words).from_address(at))
    view[:: page // 8] = 0


def _error(what: str, address: int, length: int) -> str:
    code = ctypes.get_errno()
    name = errno_mod.errorcode.get(code, str(code))
    return (f"madvise({what}) of {length} bytes at 0x{address:x} failed: {name} "
            f"({os.strerror(code)})")
