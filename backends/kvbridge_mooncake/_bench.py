"""The Transfer Engine on its own, for ``kvbridge bench transfer``'s "raw" column.

:func:`raw_bench` moves the same pattern of scattered blocks as kvbridge's bench (the initiator's
blocks in order, the target's at a random permutation, one engine entry per block, never
merged) between this process and a spawned target process, calling only the Transfer Engine
API: batches of at most ``MAX_BATCH`` entries, ``WINDOW`` of them in flight
(``batch_transfer_async_*`` + ``get_batch_transfer_status``), which is the fastest way the Python
API offers. No kvbridge code is on the data path. Blocking; the target is always stopped.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError, TransferFailed
from kvbridge_mooncake._engine import create_engine, is_bad_batch_id

__all__ = ["raw_bench", "MAX_BATCH", "WINDOW"]

MAX_BATCH = 256
WINDOW = 2


def _target_main(conn: Connection, total: int, seed: int) -> None:
    engine = create_engine("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, total) != 0:
        conn.send({"error": "register_memory failed"})
        return
    conn.send({"session": f"127.0.0.1:{engine.get_rpc_port()}", "address": buf.ctypes.data})
    conn.recv()  # stop
    conn.close()


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


def raw_bench(block_bytes: int, total_bytes: int, op: str, reps: int) -> float:
    """Best-of-``reps`` GB/s (1e9 bytes/s) of ``total_bytes`` in ``block_bytes`` blocks."""
    op = op.lower()
    if op not in ("read", "write"):
        raise ConfigError(f"raw_bench op must be 'read' or 'write', got {op!r}")
    if block_bytes <= 0 or total_bytes < block_bytes or reps < 1:
        raise ConfigError("raw_bench needs 0 < block_bytes <= total_bytes and reps >= 1")
    nblocks = total_bytes // block_bytes
    n = nblocks * block_bytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target_main, args=(child, n, 11), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise TransferFailed("raw mooncake bench: the target process did not start")
        hello = parent.recv()
        if "error" in hello:
            raise TransferFailed(f"raw mooncake bench target: {hello['error']}")
        engine = create_engine("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        local = np.random.default_rng(12).integers(0, 256, n, dtype=np.uint8)
        if engine.register_memory(local.ctypes.data, n) != 0:
            raise TransferFailed("raw mooncake bench: register_memory failed")
        perm = np.random.default_rng(13).permutation(nblocks).astype(np.int64)
        laddr = (local.ctypes.data + np.arange(nblocks, dtype=np.int64) * block_bytes).tolist()
        raddr = (int(hello["address"]) + perm * block_bytes).tolist()
        _run(engine, op, hello["session"], laddr, raddr, block_bytes)  # warm-up: handshake
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            _run(engine, op, hello["session"], laddr, raddr, block_bytes)
            best = min(best, time.perf_counter() - t0)
        if op == "read":
            expected = np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8)
            if not np.array_equal(
                local.reshape(-1, block_bytes), expected.reshape(-1, block_bytes)[perm]
            ):
                raise TransferFailed("raw mooncake bench: READ delivered wrong bytes")
        engine.unregister_memory(local.ctypes.data)
        return n / best / 1e9
    finally:
        try:
            parent.send("stop")
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()
