"""Copy many byte ranges in one native call, without holding the GIL.

Why native: a Python loop of ``ctypes.memmove`` releases and re-takes the GIL for every range.
When another thread of the process runs Python (an engine's model runner does, all the time),
taking the GIL back waits out the switch interval (5 ms): measured here, a 64 MiB READ in 256
KiB ranges took 470 ms that way against 14 ms for a memcpy. One call that loops in C releases
the GIL once per transfer part.

The loop is twelve lines of C (:data:`SOURCE`), compiled on first use with the system C compiler
(``$CC``, else ``cc``) into a private cache directory (``$KVBRIDGE_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvbridge`` or ``~/.cache/kvbridge``; created 0700 and refused if another
user owns it or can write it), named by a hash of the source, so later processes load it at
once. :func:`load` returns None where no compiler works; the shm transport then keeps moving
bytes by cross-memory attach and says so once in its log. Thread-safe.
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
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

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


def _private(path: Path) -> None:
    """Refuse a directory or file another user owns or may write (we load code from it)."""
    st = path.stat()
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is not private to this user (uid {st.st_uid}, mode "
                              f"0o{stat.S_IMODE(st.st_mode):o})")


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "rangecopy.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[:400]}")
        os.replace(out, target)  # atomic: a concurrent builder wrote the same bytes


def _load() -> RangeCopy:
    if not sys.platform.startswith("linux"):
        raise OSError("Linux only")
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    folder = _cache_dir() / "native"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private(folder)
    target = folder / f"rangecopy-{digest}-{os.uname().machine}.so"
    if not target.exists():
        _build(target)
    _private(target)
    fn = ctypes.CDLL(str(target)).kvbridge_copy_ranges  # CDLL: the call releases the GIL
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
