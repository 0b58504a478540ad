"""NIXL on its own, for ``kvbridge bench transfer``'s "raw" column, and what the block path costs
per transfer, for ``kvbridge bench descriptors``.

:class:`RawSession` moves scattered blocks between this process and a spawned target process
with nothing but the ``nixl_agent`` API, the fastest way it offers (prepared lists once, then per
transfer ``make_prepped_xfer`` + ``transfer`` + a ``check_xfer_state`` loop; after
:meth:`RawSession.prepare`, the request is made before the timer), so the paired bench can
alternate it with kvbridge's transfers; :func:`raw_bench` is its best-of-reps GB/s.
The agents are configured exactly as :class:`~kvbridge_nixl.NixlTransport` would be for the
same options, so the ratio kvbridge/raw isolates kvbridge's own overhead. :func:`block_cost`
times the transport's per-transfer work on the block path with real agents. All blocking; a
target process is always stopped.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.blocks import BlockRequest
from kvbridge.errors import ConfigError, TransferFailed
from kvbridge.layout import KVLayout, KVPlane
from kvbridge.testing.rawbench import RawTarget, scattered_blocks, serve_buffer
from kvbridge.transport import MemoryRegion, Op
from kvbridge_nixl._agent import NixlOptions, create_agent
from kvbridge_nixl.transport import NixlTransport

__all__ = ["RawSession", "RawResponder", "raw_bench", "block_cost", "raw_session", "raw_responder"]


def _target_main(
    conn: Connection, name: str, total: int, seed: int, options: dict[str, Any]
) -> None:
    agent, _ = create_agent(name, NixlOptions.parse(options))
    buf = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, total, 0, "")], "DRAM")
    conn.send({"metadata": agent.get_agent_metadata(), "address": buf.ctypes.data})
    serve_buffer(conn, buf)


class RawResponder:
    """The far side of a shared :class:`RawSession`, in a process that owns the memory: one
    NIXL agent (configured as :class:`~kvbridge_nixl.NixlTransport` would be) over ``nbytes``
    at ``address``, which the kvbridge transport of ``kvbridge bench transfer``'s target has
    registered too, so that the raw column moves the very bytes kvbridge's does. NIXL's own
    progress thread serves the transfers; :attr:`metadata` goes to the initiator. Not
    thread-safe; :meth:`close` is idempotent."""

    def __init__(self, address: int, nbytes: int, **options: Any) -> None:
        self._agent, _ = create_agent(f"raw-responder-{time.monotonic_ns():x}",
                                      NixlOptions.parse(options))
        self._agent.register_memory([(int(address), int(nbytes), 0, "")], "DRAM")
        self.metadata: bytes = self._agent.get_agent_metadata()

    def drain(self) -> int:
        """Drop the notifications the raw WRITEs left; how many."""
        got = self._agent.get_new_notifs() if self._agent is not None else {}
        return sum(len(v) for v in got.values())

    def close(self) -> None:
        self._agent = None


class RawSession:
    """NIXL alone, for ``kvbridge bench transfer``'s raw column (paired with kvbridge's runs).

    Own mode (the default): between this process and a spawned target process, ``total_bytes``
    registered on each side once; per block size, the initiator's blocks in order map to the
    target's at a random permutation (nothing merges). Shared mode (``peer=(metadata,
    address)``, ``local={"read": address, "write": address}``): against a
    :class:`RawResponder` over the bench target's own buffer, from the bench's own local
    buffers (the READ destination, the WRITE source), at the permutation :meth:`run` is given
    — the bytes kvbridge's column moves, so that the ratio holds nothing but the code path; the
    bench then zeroes and checks the buffers itself (:meth:`reset` and :meth:`verify` refuse).

    Either way both sides' lists are prepared once with ``prep_xfer_dlist`` (untimed, on first
    use). :meth:`run` times one ``make_prepped_xfer`` (unless :meth:`prepare` made it before) +
    ``transfer`` + ``check_xfer_state`` loop (the fastest the Python API offers; WRITEs carry a
    notification, as kvbridge's do); the request is released after the timer. The agents are
    configured exactly as :class:`~kvbridge_nixl.NixlTransport` would be for the same options.
    Blocking; :meth:`close` always stops an own target. Not thread-safe.
    """

    def __init__(self, total_bytes: int, seed: int = 0, timeout: float = 60.0, *,
                 peer: tuple[bytes, int] | None = None, local: Mapping[str, int] | None = None,
                 **options: Any) -> None:
        if (peer is None) != (local is None):
            raise ConfigError("a shared raw session needs both peer and local")
        self.total = int(total_bytes)
        self.timeout = timeout
        self.shared = peer is not None
        self._seed = seed
        self._opts = NixlOptions.parse(options)
        #: (local address, block bytes, permutation bytes) -> (local list, remote list,
        #: indices, permutation); b"" for an own session's fixed permutation
        self._prepared: dict[tuple[int, int, bytes], tuple[Any, Any, Any, Any]] = {}
        self._reps = 0
        self._pending: tuple[str, int, Any] | None = None  # (op, block bytes, request)
        self._agent: Any = None
        self._target: RawTarget | None = None
        tag = f"{time.monotonic_ns():x}"
        try:
            if peer is None:
                self._target = RawTarget("nixl", _target_main, (f"raw-target-{tag}", self.total,
                                                                seed + 1, dict(options)), timeout)
                metadata, self._address = self._target.hello["metadata"], int(
                    self._target.hello["address"])
                self._mine = np.random.default_rng(seed).integers(0, 256, self.total,
                                                                  dtype=np.uint8)
                self._local = {"READ": int(self._mine.ctypes.data),
                               "WRITE": int(self._mine.ctypes.data)}
            else:
                metadata, self._address = peer[0], int(peer[1])
                assert local is not None
                self._local = {op.upper(): int(address) for op, address in local.items()}
                if set(self._local) != {"READ", "WRITE"}:
                    raise ConfigError("local must name the read and the write buffer")
            self._agent, _ = create_agent(f"raw-init-{tag}", self._opts)
            for address in set(self._local.values()):
                self._agent.register_memory([(address, self.total, 0, "")], "DRAM")
            name = self._agent.add_remote_agent(metadata)
            self._peer = name.decode() if isinstance(name, bytes) else str(name)
        except BaseException:
            self.close()
            raise

    def _prepare(self, kind: str, block: int,
                 perm: npt.NDArray[np.int64] | None) -> tuple[Any, Any, Any, Any]:
        if perm is None and self.shared:
            raise ConfigError("a shared raw session moves the permutation it is given")
        key = (self._local[kind], block, b"" if perm is None else perm.tobytes())
        hit = self._prepared.get(key)
        if hit is not None:
            return hit
        if perm is None:
            perm = scattered_blocks(self.total, block, self._seed + 7)
        nblocks = perm.size
        ids = np.arange(nblocks, dtype=np.int64)
        zeros = np.zeros(nblocks, np.int64)
        local = np.stack([key[0] + ids * block, np.full(nblocks, block), zeros], axis=1)
        remote = np.stack([self._address + perm * block, np.full(nblocks, block), zeros], axis=1)
        lh = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        rh = self._agent.prep_xfer_dlist(self._peer, remote, "DRAM")
        hit = self._prepared[key] = (lh, rh, np.arange(nblocks, dtype=np.int32), perm.copy())
        return hit

    @staticmethod
    def _kind(op: str) -> str:
        kind = op.upper()
        if kind not in ("READ", "WRITE"):
            raise ConfigError(f"op must be read or write, got {op!r}")
        return kind

    def prepare(self, op: str, block_bytes: int, notify: bool | None = None,
                perm: npt.NDArray[np.int64] | None = None) -> None:
        """Make the next :meth:`run`'s request now (``make_prepped_xfer``), so that it times
        only ``transfer`` + completion (``kvbridge bench transfer --ahead``)."""
        kind = self._kind(op)
        lists = self._prepare(kind, block_bytes, perm)
        self._discard()
        self._pending = (kind, block_bytes, self._make(kind, block_bytes, lists, notify))

    def _make(self, kind: str, block_bytes: int, lists: tuple[Any, Any, Any, Any],
              notify: bool | None) -> Any:
        lh, rh, idx, _ = lists
        with_note = (kind == "WRITE") if notify is None else notify
        self._reps += 1
        note = f"raw:{block_bytes}:{self._reps}".encode() if with_note else b""
        return self._agent.make_prepped_xfer(kind, lh, idx, rh, idx, note)

    def _discard(self) -> None:
        if self._pending is not None:
            self._agent.release_xfer_handle(self._pending[2])
            self._pending = None

    def run(self, op: str, block_bytes: int, notify: bool | None = None,
            perm: npt.NDArray[np.int64] | None = None) -> float:
        """Seconds of one transfer of ``total_bytes`` in ``block_bytes`` blocks (at ``perm``,
        which a shared session needs): request creation included, unless :meth:`prepare` made
        it for this op and block size."""
        kind = self._kind(op)
        lists = self._prepare(kind, block_bytes, perm)
        pending, self._pending = self._pending, None
        if pending is not None and pending[:2] != (kind, block_bytes):
            self._agent.release_xfer_handle(pending[2])
            pending = None
        t0 = time.perf_counter()
        h = pending[2] if pending is not None else self._make(kind, block_bytes, lists, notify)
        state = self._agent.transfer(h)
        while state == "PROC":
            state = self._agent.check_xfer_state(h)
            if time.perf_counter() - t0 > self.timeout:
                break
        elapsed = time.perf_counter() - t0
        self._agent.release_xfer_handle(h)
        if state != "DONE":
            raise TransferFailed(f"raw nixl {kind} of {block_bytes}-byte blocks: {state}")
        return elapsed

    def _own(self) -> RawTarget:
        if self._target is None:
            raise ConfigError("a shared raw session: the bench zeroes and checks the buffers")
        return self._target

    def reset(self, op: str, block_bytes: int) -> None:
        """Zero the destination of the next ``op`` (untimed; see :meth:`RawTarget.reset`)."""
        self._own().reset(op, self._mine)

    def verify(self, op: str, block_bytes: int) -> None:
        """Raise :class:`TransferFailed` unless the last ``op`` left both buffers consistent."""
        target = self._own()
        target.check(op, self._mine, self._prepare(self._kind(op), block_bytes, None)[3],
                     block_bytes)

    def close(self) -> None:
        """Release the lists, stop an own target. Idempotent."""
        if self._agent is not None:
            self._discard()
        for lh, rh, _, _ in self._prepared.values():
            lh.release()
            rh.release()
        self._prepared.clear()
        if self._target is not None:
            self._target.close()
        self._agent = None

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_bench(
    block_bytes: int, total_bytes: int, op: str, reps: int, seed: int = 0,
    timeout: float = 60.0, notify: bool | None = None, **options: Any,
) -> float:
    """Best-of-``reps`` GB/s of a :class:`RawSession`; every byte checked after the last rep.

    ``op`` is ``read`` or ``write`` (any case); ``notify`` attaches a NIXL notification to
    every transfer (by default only to WRITEs, as ``kvbridge bench transfer`` does).
    """
    if op.upper() not in ("READ", "WRITE"):
        raise ConfigError(f"op must be read or write, got {op!r}")
    if block_bytes <= 0 or total_bytes < block_bytes or reps < 1:
        raise ConfigError("need block_bytes > 0, total_bytes >= block_bytes and reps >= 1")
    n = total_bytes // block_bytes * block_bytes
    with RawSession(n, seed, timeout, **options) as session:
        best = min(session.run(op, block_bytes, notify) for _ in range(reps))
        session.verify(op, block_bytes)
    return n / best / 1e9


def block_cost(
    planes: int, num_blocks: int, cases: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    reps: int, block_bytes: int = 64, **options: Any,
) -> dict[str, list[tuple[float, float, float]]]:
    """What :class:`~kvbridge_nixl.NixlTransport` does per transfer by block ids, up to and
    including the NIXL request (``make_prepped_xfer`` or ``initialize_xfer``), not posted.

    Two transports in this process (agents on UCX), each with ``planes × num_blocks`` blocks of
    ``block_bytes`` registered (NIXL's cost depends on how many ranges, not on their size), one
    prepared pair; per case (``name -> (local ids, remote ids)``) and repetition: ``(wall s,
    CPU s of this thread, native s)``, where the first two cover kvbridge's own work (the
    boundary validation and the index arrays or ranges) and the third NIXL's request creation.
    Blocking; both transports are closed before returning.
    """
    tag = f"{time.monotonic_ns():x}"
    made: list[NixlTransport] = []
    out: dict[str, list[tuple[float, float, float]]] = {}
    try:
        bufs, layouts = [], []
        for side in ("a", "b"):
            t = NixlTransport(f"cost-{side}-{tag}", options)
            made.append(t)
            buf = np.zeros(planes * num_blocks * block_bytes, dtype=np.uint8)
            base = int(buf.ctypes.data)
            bufs.append((buf, t.register_memory([MemoryRegion(base, buf.nbytes)])))
            span = num_blocks * block_bytes
            layouts.append(KVLayout(tuple(KVPlane(f"p{i}", base + i * span, block_bytes,
                                                  block_bytes) for i in range(planes)),
                                    num_blocks, 16, "uint8"))
        a, b = made
        a.add_peer(bufs[1][1], b.invite(bufs[0][1]))
        pair = a.prepare_blocks(b.agent_name, layouts[0], layouts[1])
        for case, (lids, rids) in cases.items():
            rows = out[case] = []
            for _ in range(reps):
                with a._lock:
                    c0, t0 = time.thread_time(), time.perf_counter()
                    req = BlockRequest.build(pair.local, pair.remote, lids, rids)
                    args = a._block_args(pair, req)
                    c1, t1 = time.thread_time(), time.perf_counter()
                    native = a._make_blocks(Op.READ, pair, args, b"")
                    t2 = time.perf_counter()
                a._release(native)
                rows.append((t1 - t0, c1 - c0, t2 - t1))
    finally:
        for t in made:
            t.close()
    return out


# -- the bench hook (entry point ``nixl`` of group ``kvbridge.bench_hooks``: this module) --------


def raw_session(total_bytes: int, seed: int = 0, **options: Any) -> RawSession:
    """:class:`RawSession`: NIXL alone, one transfer per ``run(op, block_bytes)`` call (seconds),
    for the paired ``kvbridge bench transfer``; with ``peer`` and ``local``, over the bench's
    own buffers and a :func:`raw_responder`."""
    return RawSession(total_bytes, seed, **options)


def raw_responder(address: int, nbytes: int, **options: Any) -> RawResponder:
    """:class:`RawResponder`: a NIXL agent alone over memory the caller owns, the far side of a
    shared :func:`raw_session` (``kvbridge bench transfer`` starts one in its target process)."""
    return RawResponder(address, nbytes, **options)
