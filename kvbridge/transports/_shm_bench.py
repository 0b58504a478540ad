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

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.errors import ConfigError, PeerUnreachable, TransferFailed
from kvbridge.transports.shm import IOV_MAX, _Libc, copy_iovecs

__all__ = ["RawSession"]


def _target_main(conn: Connection, total: int, seed: int) -> None:
    _Libc.get().allow_ptracer_any()
    buf = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    conn.send({"pid": os.getpid(), "address": int(buf.ctypes.data)})
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg != "data":
            break
        conn.send(buf.tobytes())
    conn.close()


class RawSession:
    """See the module docstring; :meth:`run` returns the seconds of one transfer."""

    def __init__(self, total_bytes: int, seed: int = 0, timeout: float = 60.0) -> None:
        self.total = int(total_bytes)
        self._seed = seed
        self._libc = _Libc.get()
        self._iovecs: dict[int, tuple[Any, Any, npt.NDArray[np.int64]]] = {}
        self._mine = np.random.default_rng(seed + 21).integers(0, 256, self.total,
                                                               dtype=np.uint8)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_target_main, args=(child, self.total, seed + 22),
                                 daemon=True)
        self._proc.start()
        child.close()
        try:
            if not self._conn.poll(timeout):
                raise PeerUnreachable("raw shm bench target did not start")
            hello = self._conn.recv()
        except BaseException:
            self.close()
            raise
        self._pid, self._address = int(hello["pid"]), int(hello["address"])

    def _prepare(self, block: int) -> tuple[Any, Any, npt.NDArray[np.int64]]:
        hit = self._iovecs.get(block)
        if hit is None:
            if block <= 0 or block > self.total:
                raise ConfigError(f"block size {block} must be in (0, {self.total}]")
            from kvbridge.bench import scattered

            nblocks = self.total // block
            perm = scattered(np.random.default_rng(self._seed + 23 + block), nblocks)
            local = np.empty((nblocks, 2), dtype=np.uint64)
            local[:, 0] = self._mine.ctypes.data + np.arange(nblocks, dtype=np.uint64) * block
            local[:, 1] = block
            remote = np.empty((nblocks, 2), dtype=np.uint64)
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

    def verify(self, op: str, block_bytes: int) -> None:
        """Raise :class:`TransferFailed` unless both buffers agree block by block."""
        *_, perm = self._prepare(block_bytes)
        self._conn.send("data")
        n = perm.size * block_bytes
        theirs = np.frombuffer(self._conn.recv(), dtype=np.uint8)[:n].reshape(-1, block_bytes)
        if not np.array_equal(theirs[perm], self._mine[:n].reshape(-1, block_bytes)):
            raise TransferFailed(f"raw shm {op} of {block_bytes}-byte blocks: bytes differ")

    def close(self) -> None:
        """Stop the target. Idempotent."""
        try:
            self._conn.send("stop")
        except (OSError, ValueError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
