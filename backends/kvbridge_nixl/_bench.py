"""NIXL on its own, for ``kvbridge bench transfer``'s "raw" column.

:func:`raw_bench` moves ``total_bytes`` as ``block_bytes`` blocks between this process and a
spawned target process with nothing but the ``nixl_agent`` API: the initiator's blocks in order,
the target's at a random permutation (so nothing merges), both sides prepared once with
``prep_xfer_dlist``, then per repetition ``make_prepped_xfer`` + ``transfer`` + a
``check_xfer_state`` loop + ``release_xfer_handle`` — the fastest path the Python API offers.
WRITEs carry a notification, as in kvbridge's bench (the target learns of a WRITE through it).
Every byte is checked after the last repetition. The agent is configured exactly as
:class:`~kvbridge_nixl.NixlTransport` would be for the same options (backends, progress-thread
delay), so the ratio kvbridge/raw isolates kvbridge's own overhead. Blocking; the target process
is always stopped.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError, PeerUnreachable, TransferFailed
from kvbridge_nixl._agent import NixlOptions, create_agent

__all__ = ["raw_bench"]


def _target_main(
    conn: Connection, name: str, total: int, seed: int, options: dict[str, Any]
) -> None:
    agent, _ = create_agent(name, NixlOptions.parse(options))
    buf = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, total, 0, "")], "DRAM")
    conn.send({"metadata": agent.get_agent_metadata(), "address": buf.ctypes.data})
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if msg == "data":
            conn.send(buf.tobytes())
    conn.close()


def raw_bench(
    block_bytes: int, total_bytes: int, op: str, reps: int, seed: int = 0,
    timeout: float = 60.0, notify: bool | None = None, **options: Any,
) -> float:
    """See the module docstring. ``op`` is ``read`` or ``write`` (any case).

    ``notify`` attaches a NIXL notification to every transfer; by default only to WRITEs, as
    ``kvbridge bench transfer`` does (the target learns of a WRITE only through it).
    """
    kind = op.upper()
    if kind not in ("READ", "WRITE"):
        raise ConfigError(f"op must be read or write, got {op!r}")
    if block_bytes <= 0 or total_bytes < block_bytes or reps < 1:
        raise ConfigError("need block_bytes > 0, total_bytes >= block_bytes and reps >= 1")
    nblocks = total_bytes // block_bytes
    n = nblocks * block_bytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    tag = f"{time.monotonic_ns():x}"
    proc = ctx.Process(target=_target_main, args=(child, f"raw-target-{tag}", n, seed + 1,
                                                  dict(options)), daemon=True)
    proc.start()
    child.close()
    agent = None
    try:
        if not parent.poll(timeout):
            raise PeerUnreachable("raw nixl bench target did not start")
        hello = parent.recv()
        agent, _ = create_agent(f"raw-init-{tag}", NixlOptions.parse(options))
        mine = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        agent.register_memory([(mine.ctypes.data, n, 0, "")], "DRAM")
        peer = agent.add_remote_agent(hello["metadata"])
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        perm = np.random.default_rng(seed + 7).permutation(nblocks).astype(np.int64)
        ids = np.arange(nblocks, dtype=np.int64)
        local = np.stack([mine.ctypes.data + ids * block_bytes,
                          np.full(nblocks, block_bytes), np.zeros(nblocks, np.int64)], axis=1)
        remote = np.stack([hello["address"] + perm * block_bytes,
                           np.full(nblocks, block_bytes), np.zeros(nblocks, np.int64)], axis=1)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        rh = agent.prep_xfer_dlist(peer, remote, "DRAM")
        idx = np.arange(nblocks, dtype=np.int32)
        best = float("inf")
        with_note = (kind == "WRITE") if notify is None else notify
        for rep in range(reps):
            note = f"raw:{block_bytes}:{rep}".encode() if with_note else b""
            t0 = time.perf_counter()
            h = agent.make_prepped_xfer(kind, lh, idx, rh, idx, note)
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
                if time.perf_counter() - t0 > timeout:
                    break
            elapsed = time.perf_counter() - t0
            agent.release_xfer_handle(h)
            if state != "DONE":
                raise TransferFailed(f"raw nixl {kind} of {block_bytes}-byte blocks: {state}")
            best = min(best, elapsed)
        parent.send("data")
        theirs = np.frombuffer(parent.recv(), dtype=np.uint8).reshape(-1, block_bytes)
        ours = mine.reshape(-1, block_bytes)
        if kind == "WRITE":
            ok = np.array_equal(theirs[perm], ours)
        else:
            ok = np.array_equal(ours, theirs[perm])
        if not ok:
            raise TransferFailed(f"raw nixl {kind} of {block_bytes}-byte blocks: bytes differ")
        lh.release()
        rh.release()
        return n / best / 1e9
    finally:
        try:
            parent.send("stop")
        except (OSError, ValueError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()
        del agent
