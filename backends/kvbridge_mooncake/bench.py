"""The Transfer Engine on its own, for ``kvbridge bench transfer``'s "raw" column.

:func:`raw_bench` moves the same pattern of scattered blocks as kvbridge's bench (the initiator's
blocks in order, the target's at a random permutation, one engine entry per block, never
merged) between this process and a spawned target process, calling only the Transfer Engine
API: batches of at most ``MAX_BATCH`` entries, ``WINDOW`` of them in flight
(``batch_transfer_async_*`` + ``get_batch_transfer_status``), which is the fastest way the Python
API offers. No kvbridge code is on the data path. :class:`RawSession` runs one transfer per call,
for the paired bench. Blocking; the target is always stopped.
"""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError, TransferFailed
from kvbridge.testing.rawbench import RawTarget, scattered_blocks, serve_buffer
from kvbridge_mooncake._engine import create_engine, is_bad_batch_id

__all__ = ["RawSession", "raw_bench", "raw_session", "MAX_BATCH", "WINDOW"]

MAX_BATCH = 256
WINDOW = 2


def _target_main(conn: Connection, total: int, seed: int) -> None:
    engine = create_engine("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, total) != 0:
        conn.send({"error": "register_memory failed"})
        return
    conn.send({"session": f"127.0.0.1:{engine.get_rpc_port()}", "address": buf.ctypes.data})
    serve_buffer(conn, buf)


def _run(
    engine: Any, op: str, session: str, laddr: list[int], raddr: list[int], block: int
) -> None:
    submit = engine.batch_transfer_async_read if op == "read" else engine.batch_transfer_async_write
    in_flight: deque[int] = deque()
    failed = False
    for first in range(0, len(laddr), MAX_BATCH):
        bid = int(
            submit(
                session,
                laddr[first : first + MAX_BATCH],
                raddr[first : first + MAX_BATCH],
                [block] * len(laddr[first : first + MAX_BATCH]),
            )
        )
        if is_bad_batch_id(bid):
            failed = True
            break
        in_flight.append(bid)
        if len(in_flight) >= WINDOW and engine.get_batch_transfer_status([in_flight.popleft()]):
            failed = True
            break
    while in_flight:
        failed = bool(engine.get_batch_transfer_status([in_flight.popleft()])) or failed
    if failed:
        raise TransferFailed(f"raw mooncake {op} of {block}-byte blocks failed")


class RawSession:
    """The Transfer Engine alone between this process and a spawned target, for the paired
    ``kvbridge bench transfer``: :meth:`run` times one transfer of ``total_bytes`` in blocks of
    a size (target blocks at a random permutation; address lists built once per size, the
    first use also warms up the connection, untimed). Blocking; :meth:`close` always stops
    the target. Not thread-safe."""

    def __init__(self, total_bytes: int, seed: int = 0, timeout: float = 60.0) -> None:
        self.total = int(total_bytes)
        self._seed = seed
        self._lists: dict[int, tuple[list[int], list[int], Any]] = {}
        self._engine: Any = None
        self._target = RawTarget("mooncake", _target_main, (self.total, seed + 11), timeout)
        try:
            self._session = str(self._target.hello["session"])
            self._address = int(self._target.hello["address"])
            self._engine = create_engine("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            self._local = np.random.default_rng(seed + 12).integers(0, 256, self.total,
                                                                    dtype=np.uint8)
            if self._engine.register_memory(self._local.ctypes.data, self.total) != 0:
                raise TransferFailed("raw mooncake bench: register_memory failed")
        except BaseException:
            self.close()
            raise

    def _prepare(self, block: int) -> tuple[list[int], list[int], Any]:
        hit = self._lists.get(block)
        if hit is None:
            perm = scattered_blocks(self.total, block, self._seed + 13)
            laddr = self._local.ctypes.data + np.arange(perm.size, dtype=np.int64) * block
            hit = self._lists[block] = (laddr.tolist(), (self._address + perm * block).tolist(),
                                        perm)
            _run(self._engine, "read", self._session, hit[0], hit[1], block)  # warm-up
        return hit

    def run(self, op: str, block_bytes: int) -> float:
        """Seconds of one transfer."""
        op = op.lower()
        if op not in ("read", "write"):
            raise ConfigError(f"raw mooncake op must be 'read' or 'write', got {op!r}")
        laddr, raddr, _ = self._prepare(block_bytes)
        t0 = time.perf_counter()
        _run(self._engine, op, self._session, laddr, raddr, block_bytes)
        return time.perf_counter() - t0

    def reset(self, op: str, block_bytes: int) -> None:
        """Zero the destination of the next ``op`` (untimed; see :meth:`RawTarget.reset`)."""
        self._target.reset(op, self._local)

    def verify(self, op: str, block_bytes: int) -> None:
        """Raise :class:`TransferFailed` unless the buffers agree block by block."""
        self._target.check(op, self._local, self._prepare(block_bytes)[2], block_bytes)

    def close(self) -> None:
        """Unregister, stop the target. Idempotent."""
        if self._engine is not None:
            self._engine.unregister_memory(self._local.ctypes.data)
            self._engine = None
        self._target.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_bench(block_bytes: int, total_bytes: int, op: str, reps: int) -> float:
    """Best-of-``reps`` GB/s (1e9 bytes/s) of ``total_bytes`` in ``block_bytes`` blocks."""
    if op.lower() not in ("read", "write"):
        raise ConfigError(f"raw_bench op must be 'read' or 'write', got {op!r}")
    if block_bytes <= 0 or total_bytes < block_bytes or reps < 1:
        raise ConfigError("raw_bench needs 0 < block_bytes <= total_bytes and reps >= 1")
    n = total_bytes // block_bytes * block_bytes
    with RawSession(n) as session:
        best = min(session.run(op, block_bytes) for _ in range(reps))
        session.verify(op, block_bytes)
    return n / best / 1e9


# -- the bench hook (entry point ``mooncake`` of group ``kvbridge.bench_hooks``: this module) ----


def raw_session(total_bytes: int, seed: int = 0) -> RawSession:
    """:class:`RawSession`: the engine alone, one transfer per ``run(op, block_bytes)`` call
    (seconds), for the paired ``kvbridge bench transfer``."""
    return RawSession(total_bytes, seed)
