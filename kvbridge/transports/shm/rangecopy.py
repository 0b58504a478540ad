"""Copy many byte ranges in one native call, without holding the GIL.

Why native: a Python loop of ``ctypes.memmove`` releases and re-takes the GIL for every range.
When another thread of the process runs Python (an engine's model runner does, all the time),
taking the GIL back waits out the switch interval (5 ms): measured here, a 64 MiB READ in 256
KiB ranges took 470 ms that way against 14 ms for a memcpy. One call that loops in C releases
the GIL once per transfer part. With two copy threads both run inside one call (a helper thread
copies rows from the back), so the GIL is let go and taken back once per transfer: taking it
back waits, while an engine thread runs Python, up to a switch interval (5 ms), and two copy
threads of Python's each waited for it (benchmarks/copy_gil.py).

The loop is a small C extension module, ``kvbridge.transports.shm._rangecopy``
(``_rangecopy.c`` next to this file), compiled by setuptools when kvbridge is built or
installed (``pip install``, ``pip wheel``, and editable installs, which put it into the source
tree: ``setup.py``). Nothing is compiled at run time: the module is imported from kvbridge's own
package directory like every other module of kvbridge, so it is exactly as trustworthy as the
Python code the engine already runs (whoever may write there may change kvbridge itself). This
replaces an earlier design that compiled the loop on first use into a private per-user cache
directory; that needed a compiler on every engine host and a careful check of every directory
on the way, and gave nothing a build at install time does not.

:func:`load` returns None where the extension is absent (kvbridge was installed without a
working C compiler, or a source tree is used without being installed: ``pip install --no-deps
-e .`` builds it), and logs why once; the shm transport then keeps moving bytes by
cross-memory attach. Thread-safe.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
from typing import Protocol

import numpy as np
import numpy.typing as npt

log = logging.getLogger("kvbridge.transport.shm")

__all__ = ["MODULE", "load", "RangeCopy"]

#: The extension module built from ``_rangecopy.c``.
MODULE = "kvbridge.transports.shm._rangecopy"

class RangeCopy(Protocol):
    """``(rows, stop, threads=1) -> rows copied``: see :func:`load`."""

    def __call__(self, rows: npt.NDArray[np.uint64], stop: ctypes.c_int32,
                 threads: int = 1) -> int: ...


_lock = threading.Lock()
_loaded: list[RangeCopy | None] = []


def _load() -> RangeCopy:
    """The built extension's copy, wrapped; ImportError where it was not built."""
    fn = importlib.import_module(MODULE).copy_ranges

    def copy(rows: npt.NDArray[np.uint64], stop: ctypes.c_int32, threads: int = 1) -> int:
        """Copy ``rows`` (C-contiguous ``(n, 3)`` uint64: dst, src, length), the GIL let go once
        for the call: in order, checking ``stop`` every 64 rows, or (``threads`` 2) with a
        helper thread copying rows from the back while this one copies them from the front,
        ``stop`` checked before every row; the number of rows copied (all unless stopped)."""
        return int(fn(rows.ctypes.data, rows.shape[0], ctypes.addressof(stop), threads))

    return copy


def load() -> RangeCopy | None:
    """The native range copy; None (logged once) where kvbridge was installed without it."""
    with _lock:
        if not _loaded:
            try:
                _loaded.append(_load())
            except ImportError as exc:
                log.warning("shm: no native range copy (%s: kvbridge was installed without a C "
                            "compiler; reinstall it with one, or `pip install --no-deps -e .` "
                            "in a source tree); peers' memory is not mapped and moves by "
                            "cross-memory attach", exc)
                _loaded.append(None)
        return _loaded[0]
