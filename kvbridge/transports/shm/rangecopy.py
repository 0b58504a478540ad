"""Copy many byte ranges in one native call, without holding the GIL.

Why native: a Python loop of ``ctypes.memmove`` releases and re-takes the GIL for every range.
When another thread of the process runs Python (an engine's model runner does, all the time),
taking the GIL back waits out the switch interval (5 ms): measured here, a 64 MiB READ in 256
KiB ranges took 470 ms that way against 14 ms for a memcpy. One call that loops in C releases
the GIL once per transfer part.

The loop is twelve lines of C (:data:`SOURCE`), compiled on first use with the system C compiler
(``$CC``, else ``cc``) into a private cache directory (``$KVBRIDGE_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvbridge`` or ``~/.cache/kvbridge``, subdirectory ``native``), named by a hash
of the source, so later processes load it at once. Since this is code the engine runs, nothing
on the way may be changed by anyone else:

* the whole directory chain is checked (:func:`kvbridge.host.files.private_dir`): ``native``
  is created 0700 (parents too) and must be this user's and private, and every directory above
  it, links included, must belong to root or this user and be closed to writes by others
  unless sticky;
* the compiler runs *in* that directory (through its fd, not its path) and writes a temporary
  name there, which is opened with ``O_NOFOLLOW``, made 0700 and renamed into place;
* the ``.so`` is opened with ``O_NOFOLLOW`` relative to the directory fd and ``fstat``-checked
  (a regular file of this user's, not writable by group or others), and the library is loaded
  *through that fd* (``/proc/self/fd/N``): what is loaded is the inode that was checked, not
  whatever the path names a moment later.

:func:`load` returns None where any of that fails, or where no compiler works, and logs why
once; the shm transport then keeps moving bytes by cross-memory attach. Thread-safe.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvbridge.host import files
from kvbridge.host.files import UnsafePath

log = logging.getLogger("kvbridge.transport.shm")

__all__ = ["SOURCE", "load", "RangeCopy"]

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* rows: n rows of (dst, src, length). Copies them in order; checks *stop every 64 rows.
   Returns how many rows were copied (n unless stopped). */
uint64_t kvbridge_copy_ranges(const uint64_t *rows, uint64_t n, const volatile int32_t *stop) {
    uint64_t i;
    for (i = 0; i < n; i++) {
        if ((i & 63) == 0 && *stop) break;
        memmove((void *)(uintptr_t)rows[3 * i], (const void *)(uintptr_t)rows[3 * i + 1],
                (size_t)rows[3 * i + 2]);
    }
    return i;
}
"""

RangeCopy = Callable[[npt.NDArray[np.uint64], "ctypes.c_int32"], int]

_lock = threading.Lock()
_loaded: list[RangeCopy | None] = []


def _cache_dir() -> Path:
    root = os.environ.get("KVBRIDGE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvbridge"


def _native_name() -> str:
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    return f"rangecopy-{digest}-{os.uname().machine}.so"


def _build(dir_fd: int, name: str) -> None:
    """Compile :data:`SOURCE` into ``name`` in the directory ``dir_fd`` (atomic rename)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC)")
    tmp = f".build-{os.urandom(8).hex()}.so"
    try:
        # the compiler's cwd is the checked directory itself (its fd, inherited), not its path
        proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-x", "c", "-o", tmp, "-"],
                              input=SOURCE, capture_output=True, text=True, timeout=120,
                              pass_fds=(dir_fd,), cwd=f"/proc/self/fd/{dir_fd}")
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[:400]}")
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        # atomic: a concurrent builder wrote the same bytes
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        tmp = ""
    finally:
        if tmp:
            files.remove(dir_fd, tmp)


def _open_checked(dir_fd: int, name: str) -> int:
    """An fd of the ``.so`` ``name`` in ``dir_fd``: not a link, a regular file of this user's
    that neither group nor others may write. FileNotFoundError when absent."""
    fd, st = files.open_regular(dir_fd, name)  # O_NOFOLLOW; regular; this user's
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise UnsafePath(f"{name} may be written by group or others (mode "
                         f"0o{stat.S_IMODE(st.st_mode):o}); refused")
    return fd


def _load() -> RangeCopy:
    if not sys.platform.startswith("linux"):
        raise OSError("Linux only")
    folder = _cache_dir() / "native"
    name = _native_name()
    dir_fd = files.private_dir(folder)  # UnsafePath names the component that is not safe
    try:
        try:
            fd = _open_checked(dir_fd, name)
        except FileNotFoundError:
            _build(dir_fd, name)
            fd = _open_checked(dir_fd, name)
    finally:
        os.close(dir_fd)
    try:
        # through the checked fd: the path cannot be swapped between the check and the load
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")  # CDLL: the call releases the GIL
    finally:
        os.close(fd)
    fn = lib.kvbridge_copy_ranges
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]
    fn.restype = ctypes.c_uint64

    def copy(rows: npt.NDArray[np.uint64], stop: ctypes.c_int32) -> int:
        """Copy ``rows`` (C-contiguous ``(n, 3)`` uint64: dst, src, length); the rows done."""
        return int(fn(rows.ctypes.data, rows.shape[0], ctypes.addressof(stop)))

    return copy


def load() -> RangeCopy | None:
    """The native range copy, built on first use; None (logged once) where it cannot be."""
    with _lock:
        if not _loaded:
            try:
                _loaded.append(_load())
            except Exception as exc:  # noqa: BLE001 - any failure means: no mapped copies
                log.warning("shm: no native range copy (%s); peers' memory is not mapped and "
                            "moves by cross-memory attach", exc)
                _loaded.append(None)
        return _loaded[0]
