"""What every backend's raw session (the raw column of ``kvbridge bench transfer``) shares:
the target process that holds the far buffer, and checking the bytes afterwards.

A raw session moves scattered blocks between this process and a :class:`RawTarget` with nothing
but the backend's native library. The target runs ``target(conn, *args)`` in a process started
with the ``spawn`` context; that function sends one hello dict (what the session needs to reach
it: an address, a pid, metadata…) and then calls :func:`serve_buffer`. Everything here blocks;
:meth:`RawTarget.close` always stops the process. Not thread-safe.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.errors import ConfigError, PeerUnreachable, TransferFailed

__all__ = ["RawTarget", "serve_buffer", "scattered", "scattered_blocks"]


def serve_buffer(conn: Connection, buf: npt.NDArray[np.uint8]) -> None:
    """In the target: answer ``"data"`` with the buffer's bytes and ``"zero"`` by zeroing it,
    until anything else or EOF."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg == "data":
            conn.send(buf.tobytes())
        elif msg == "zero":
            buf.fill(0)
            conn.send(True)
        else:
            break
    conn.close()


def scattered(rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
    """A random permutation of ``range(n)`` in which no element is followed by its successor,
    so that no two blocks coalesce (for n >= 4)."""
    perm = rng.permutation(n).astype(np.int64)
    for _ in range(100):
        bad = np.flatnonzero(np.diff(perm) == 1)
        if bad.size == 0 or n < 4:
            break
        for i in bad.tolist():  # swap the successor away with a random element
            j = int(rng.integers(n))
            perm[i + 1], perm[j] = perm[j], perm[i + 1]
    return perm


def scattered_blocks(total: int, block: int, seed: int) -> npt.NDArray[np.int64]:
    """The permutation placing ``total // block`` blocks on the far side (nothing coalesces);
    :class:`ConfigError` for a block size outside ``(0, total]``."""
    if block <= 0 or block > total:
        raise ConfigError(f"block size {block} must be in (0, {total}]")
    return scattered(np.random.default_rng(seed + block), total // block)


class RawTarget:
    """The far side of a raw session (see the module docstring); ``hello`` is what it sent."""

    def __init__(self, what: str, target: Callable[..., None], args: tuple[Any, ...],
                 timeout: float = 60.0) -> None:
        self.what = what
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self._proc.start()
        child.close()
        try:
            if not self._conn.poll(timeout):
                raise PeerUnreachable(f"raw {what} bench: the target process did not start")
            self.hello: dict[str, Any] = self._conn.recv()
            if "error" in self.hello:
                raise TransferFailed(f"raw {what} bench target: {self.hello['error']}")
        except BaseException:
            self.close()
            raise

    def check(self, op: str, mine: npt.NDArray[np.uint8], perm: npt.NDArray[np.int64],
              block: int) -> None:
        """Raise :class:`TransferFailed` unless far block ``perm[i]`` equals ``mine``'s block
        ``i`` for every ``i`` (what READs and WRITEs of that permutation leave)."""
        self._conn.send("data")
        n = perm.size * block
        theirs = np.frombuffer(self._conn.recv(), dtype=np.uint8)[:n].reshape(-1, block)
        if not np.array_equal(theirs[perm], mine[:n].reshape(-1, block)):
            raise TransferFailed(f"raw {self.what} {op} of {block}-byte blocks: bytes differ")

    def reset(self, op: str, mine: npt.NDArray[np.uint8]) -> None:
        """Zero the destination of the next ``op``: ``mine`` for a READ, the far buffer for a
        WRITE (as kvbridge's side of the bench does before each of its transfers, so both pay
        the same for dirty cache lines)."""
        if op.lower() == "read":
            mine.fill(0)
        else:
            self._conn.send("zero")
            self._conn.recv()

    def close(self) -> None:
        """Stop the process (asked, then killed). Idempotent."""
        try:
            self._conn.send("stop")
        except (OSError, ValueError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
