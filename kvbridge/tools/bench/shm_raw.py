"""Cross-memory attach on its own, for ``kvbridge bench transfer --backend shm``'s raw column.

:class:`RawSession` spawns a target process holding ``total_bytes`` (which lets same-user
processes attach: ``PR_SET_PTRACER_ANY``) and moves scattered blocks between it and this process
with nothing but ``process_vm_readv``/``process_vm_writev`` called from the calling thread, at
most ``IOV_MAX`` iovecs per call — what :class:`~kvbridge.transports.shm.ShmTransport` does on its
worker thread, without the transport: no handshake, no validation, no queue, no thread hand-off,
no notification. The ratio kvbridge/raw is therefore the shm transport's own overhead. Blocking;
:meth:`RawSession.close` always stops the target. Not thread-safe.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

import numpy as np
import numpy.typing as npt

from kvbridge.errors import ConfigError
from kvbridge.testing.rawbench import RawTarget, scattered_blocks, serve_buffer
from kvbridge.transports.shm import IOV_MAX, _Libc, copy_iovecs

__all__ = ["RawSession", "raw_session"]

Iov = npt.NDArray[np.uint64]


def _target_main(conn: Connection, total: int, seed: int) -> None:
    _Libc.get().allow_ptracer_any()
    buf = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    conn.send({"pid": os.getpid(), "address": int(buf.ctypes.data)})
    serve_buffer(conn, buf)


class RawSession:
    """See the module docstring; :meth:`run` returns the seconds of one transfer."""

    def __init__(self, total_bytes: int, seed: int = 0, timeout: float = 60.0) -> None:
        self.total = int(total_bytes)
        self._seed = seed
        self._libc = _Libc.get()
        self._iovecs: dict[int, tuple[Iov, Iov, npt.NDArray[np.int64]]] = {}
        self._mine = np.random.default_rng(seed + 21).integers(0, 256, self.total,
                                                               dtype=np.uint8)
        self._target = RawTarget("shm", _target_main, (self.total, seed + 22), timeout)
        self._pid = int(self._target.hello["pid"])
        self._address = int(self._target.hello["address"])

    def _prepare(self, block: int) -> tuple[Iov, Iov, npt.NDArray[np.int64]]:
        hit = self._iovecs.get(block)
        if hit is None:
            perm = scattered_blocks(self.total, block, self._seed + 23)
            local = np.empty((perm.size, 2), dtype=np.uint64)
            local[:, 0] = self._mine.ctypes.data + np.arange(perm.size, dtype=np.uint64) * block
            local[:, 1] = block
            remote = np.empty((perm.size, 2), dtype=np.uint64)
            remote[:, 0] = self._address + perm.astype(np.uint64) * block
            remote[:, 1] = block
            hit = self._iovecs[block] = (local, remote, perm)
        return hit

    def run(self, op: str, block_bytes: int) -> float:
        kind = op.lower()
        if kind not in ("read", "write"):
            raise ConfigError(f"raw shm op must be 'read' or 'write', got {op!r}")
        local, remote, _ = self._prepare(block_bytes)
        fn = self._libc.readv if kind == "read" else self._libc.writev
        loc, rem = local.copy(), remote.copy()  # copy_iovecs advances them on a short copy
        t0 = time.perf_counter()
        copy_iovecs(fn, self._pid, loc, rem, IOV_MAX)
        return time.perf_counter() - t0

    def reset(self, op: str, block_bytes: int) -> None:
        """Zero the destination of the next ``op`` (untimed; see :meth:`RawTarget.reset`)."""
        self._target.reset(op, self._mine)

    def verify(self, op: str, block_bytes: int) -> None:
        """Raise :class:`TransferFailed` unless both buffers agree block by block."""
        self._target.check(op, self._mine, self._prepare(block_bytes)[2], block_bytes)

    def close(self) -> None:
        """Stop the target. Idempotent."""
        self._target.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_session(total_bytes: int, seed: int = 0) -> RawSession:
    """Cross-memory attach alone, for the raw column of ``kvbridge bench transfer --backend
    shm`` (the ``kvbridge.bench_hooks`` entry point of ``shm``)."""
    return RawSession(total_bytes, seed)
