"""XXH3-128 over large buffers without handing the GIL away in the middle of a hash.

python-xxhash releases the GIL for every input over 64 KiB (``XXHASH_GIL_MINSIZE``) and takes
it back when the hash of that input is done. In an engine another thread — vLLM's engine loop,
the model runner — runs Python almost all the time, and a thread that gave the GIL up gets it
back only when that thread's switch interval (``sys.getswitchinterval()``, 5 ms) runs out. A
hand-off's digest fed to xxhash in 256 KiB pieces then waits out one switch interval per piece:
measured here (``benchmarks/digest_gil.py``), 22 MiB in 24 ranges took 240–274 ms beside a
thread spinning in Python and 6 ms (18 ms at worst) beside one running torch forward passes,
against 1.0–1.5 ms fed in 64 KiB pieces; with nothing beside it, 0.8 ms either way.
Every XXH3 digest of kvbridge (the hand-off digests, :mod:`kvbridge.scheduling.digests`; the
tier seals, :mod:`kvbridge.offload.seal`) therefore feeds the hash in pieces of at most
:data:`PIECE` bytes, which xxhash hashes holding the GIL. Between two pieces the interpreter
still hands the GIL to a thread that asked for it once its switch interval ran out, so a hash
delays another thread's Python by at most one switch interval, like any Python code.

Pure functions; thread-safe (each call uses its own hash state).
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

__all__ = ["PIECE", "feed", "xxh3_128"]

#: the largest piece handed to xxhash in one call: python-xxhash keeps the GIL up to 64 KiB
PIECE = 64 << 10


def feed(update: Callable[[memoryview], object], data: memoryview) -> None:
    """Hand ``data`` to ``update`` (an xxhash object's ``update``) in pieces of at most
    :data:`PIECE` bytes: the same digest as one call, without giving the GIL up."""
    size = len(data)
    if size <= PIECE:
        update(data)
        return
    for pos in range(0, size, PIECE):
        update(data[pos:pos + PIECE])


def xxh3_128(data: bytes | memoryview) -> bytes:
    """The XXH3-128 digest of ``data`` (16 bytes; a view must be C-contiguous), fed in pieces
    (:func:`feed`)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    h = xxhash.xxh3_128()
    feed(h.update, view)
    return h.digest()
