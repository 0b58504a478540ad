"""``kvbridge bench transfer``: kvbridge against the raw library and memcpy, paired.

The initiator (this process) and a target (a process started with the ``spawn`` context) each
create the backend through :func:`kvbridge.registry.create`, register their buffers and exchange
metadata over a local pipe. Per block size, the initiator's blocks in order map to the target's
at a random permutation (nothing coalesces), and kvbridge moves them the way the connector does:
one prepared block pair (:func:`kvbridge.blocks.prepare_blocks`, untimed), then per transfer
``submit_blocks`` + ``wait``, timed; every transfer's bytes are checked (READ: here; WRITE: in
the target, after the WRITE's notification arrived where the backend has notifications) and a
wrong byte raises :class:`TransferFailed`. Next to it, per repetition:

* ``memcpy``: an in-process numpy copy of the same scattered blocks (gather for READ, scatter for
  WRITE);
* ``raw``: the backend library alone, where the backend package offers
  ``raw_session(total_bytes, seed, **options)`` (an object with ``reset(op, block_bytes)``,
  ``run(op, block_bytes) -> seconds``, ``verify(op, block_bytes)`` and ``close()``;
  kvbridge_nixl, kvbridge_mooncake and the shm transport's module do), given the same backend
  options when it takes them. Where the package also offers ``raw_responder(address, nbytes,
  **options)`` (nixl), the raw library moves the very buffers kvbridge's column moves: the
  target process starts a responder over its buffer next to its transport, the session
  (``peer=(metadata, address)``, ``local={"read": ..., "write": ...}``) uses this process's
  buffers and the same permutation, and each raw transfer is zeroed before and checked after
  exactly as kvbridge's (``raw_shared`` in the report). Otherwise the raw session runs between
  its own pair of processes and buffers and checks the bytes once after the repetitions; the
  copy speed of different buffers can differ by a few percent, which then shows in the ratio.

With ``ahead`` (``--ahead``) every request is built before its timer starts, as the connector
builds a push's WRITE while the forward runs and a pull's READ while its claim is in flight:
kvbridge validates the ids and builds the transport's request
(:meth:`~kvbridge.blocks.BlockTransport.prepare_request`) untimed and times
:meth:`~kvbridge.blocks.PreparedRequest.post` + ``wait``; the raw column, where its session has
``prepare(op, block_bytes)`` (nixl: ``make_prepped_xfer``), likewise times only the post and
completion. Without it (the default) both columns time building too.

``pages`` (``--pages``) picks the page size of the bench's buffers, in both processes and for
the memcpy column: ``numpy`` (the default) as numpy allocates them — numpy asks for transparent
huge pages for large arrays; ``small`` on 4 KiB pages, as torch's CPU allocator gives vLLM's KV
cache where the kernel's THP mode is ``madvise``; ``kvbridge`` allocated as ``small``, then
released and faulted in again as huge pages, the way the connector treats a fresh CPU KV cache
(:mod:`kvbridge.host.hugepages`). A raw session with its own buffers (no responder) keeps numpy's.

Every column zeroes its destination before each timed transfer (untimed), as kvbridge's must
to check its bytes: writing into freshly dirtied cache lines costs more than into clean ones
(seen: up to 10 % on a 64 MiB READ), so skipping it for one column would bias the ratio.

Mode ``paired`` (the default) runs the columns inside every repetition, cycling through every
order of them (each column follows each other equally often: what ran just before, and the
untimed byte check after a kvbridge transfer, stir the caches), after one untimed warm-up each,
so that whatever else the host does hits all columns alike; it reports each column's median
GB/s and, for kvbridge/raw and kvbridge/memcpy, the median of the per-repetition ratios with a
distribution-free confidence interval (:func:`kvbridge.tools.report.median_ci`). Mode
``sequential`` runs each column's repetitions back to back and reports best-of (the bench
before pairing).

Blocking: the bench blocks the calling thread until done; the target process
(:mod:`kvbridge.tools.bench.transfer_target`) and the raw session are always stopped before
returning, also on failure.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge import registry
from kvbridge.blocks import BlockPair, prepare_blocks, prepare_parts, submit_blocks
from kvbridge.errors import ConfigError, KVBridgeError, TransferFailed
from kvbridge.layout import KVLayout, KVPlane
from kvbridge.testing.rawbench import scattered
from kvbridge.tools.bench.transfer_target import Bytes, TargetProcess, host_buffer, pattern
from kvbridge.tools.report import MedianCI, median_ci, paired_ratios, size_label, table
from kvbridge.transport import (
    HandleState,
    MemoryRegion,
    Notifying,
    Op,
    Transport,
)

__all__ = [
    "MODES",
    "TransferRow",
    "TransferReport",
    "parse_ops",
    "run_transfer_bench",
    "memcpy_once",
    "format_transfer_report",
]

log = logging.getLogger("kvbridge.tools.bench.transfer")

I64 = npt.NDArray[np.int64]
MODES = ("paired", "sequential")
PAGES = ("numpy", "small", "kvbridge")


def parse_ops(op: str) -> list[Op]:
    """``"read"``, ``"write"`` or ``"both"`` → the ops to run, READ first."""
    table_ = {"read": [Op.READ], "write": [Op.WRITE], "both": [Op.READ, Op.WRITE]}
    try:
        return table_[op.lower()]
    except KeyError:
        raise ConfigError(f"unknown op {op!r}; expected read, write or both") from None


# -- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferRow:
    """One block size and op. GB/s are medians (paired) or best (sequential); ``vs_raw`` and
    ``vs_memcpy`` are the paired per-repetition ratios' median and interval."""

    block_bytes: int
    op: str
    descriptors: int  # byte ranges per transfer (one per block: nothing coalesces)
    kvbridge_gbps: float
    memcpy_gbps: float
    raw_gbps: float | None
    raw_error: str | None = None
    vs_memcpy: MedianCI | None = None
    vs_raw: MedianCI | None = None

    @property
    def ratio_memcpy(self) -> float:
        if self.vs_memcpy is not None:
            return self.vs_memcpy.median
        return self.kvbridge_gbps / self.memcpy_gbps if self.memcpy_gbps else float("nan")

    @property
    def ratio_raw(self) -> float | None:
        if self.vs_raw is not None:
            return self.vs_raw.median
        return self.kvbridge_gbps / self.raw_gbps if self.raw_gbps else None


@dataclass(frozen=True)
class TransferReport:
    backend: str
    total_bytes: int
    reps: int
    mode: str = "paired"
    confidence: float = 0.95
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before, after
    rows: list[TransferRow] = field(default_factory=list)
    ahead: bool = False  # requests built before the timer (kvbridge; raw where it can)
    raw_ahead: bool = False  # the raw session built its requests ahead too
    raw_shared: bool = False  # the raw column moved kvbridge's own buffers (raw_responder)
    pages: str = "numpy"  # page size of the bench's buffers (PAGES)
    #: share of kvbridge's bytes copied through the peer's mapped memory (shm ``map_memory``;
    #: the rest moved by cross-memory attach); None for transports that do not map
    mapped: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "total_bytes": self.total_bytes,
            "reps": self.reps,
            "mode": self.mode,
            "statistic": ("median; ratios: median of per-rep ratios with an order-statistics "
                          "interval" if self.mode == "paired" else "best of reps"),
            "confidence": self.confidence,
            "load_average": list(self.load),
            "ahead": self.ahead,
            "raw_ahead": self.raw_ahead,
            "raw_shared": self.raw_shared,
            "pages": self.pages,
            "mapped": self.mapped,
            "verified": True,
            "rows": [
                {**asdict(r), "ratio_memcpy": r.ratio_memcpy, "ratio_raw": r.ratio_raw}
                for r in self.rows
            ],
        }


# -- the transfer bench --------------------------------------------------------------------------


def memcpy_once(src: Bytes, dst: Bytes, block: int, perm: I64, op: Op) -> float:
    """Seconds of an in-process copy of the scattered blocks: READ gathers
    (``dst[i] = src[perm[i]]``), WRITE scatters (``dst[perm[i]] = src[i]``)."""
    n = perm.size * block
    s2, d2 = src[:n].reshape(-1, block), dst[:n].reshape(-1, block)
    t0 = time.perf_counter()
    if op is Op.READ:
        np.take(s2, perm, axis=0, out=d2, mode="clip")  # "raise" would buffer `out`
    else:
        d2[perm] = s2
    return time.perf_counter() - t0


def _raw_session(backend: str, options: Mapping[str, Any], total: int, seed: int,
                 **shared: Any) -> Any:
    """The backend package's raw session, or None when it has none; ``shared`` (``peer``,
    ``local``) only goes to a session that takes keyword arguments."""
    hook = registry.bench_hook(backend)
    if hook is None:
        return None
    fn = hook.raw_session
    params = inspect.signature(fn).parameters.values()
    takes_options = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if not takes_options:
        return fn(total, seed)
    return fn(total, seed, **shared, **dict(options))


def run_transfer_bench(
    backend: str,
    total_bytes: int = 64 << 20,
    block_sizes: Sequence[int] = (16 << 10, 64 << 10, 256 << 10, 1 << 20),
    ops: Sequence[Op] = (Op.READ, Op.WRITE),
    reps: int = 30,
    options: Mapping[str, Any] | None = None,
    raw: bool = True,
    timeout: float = 120.0,
    seed: int = 0,
    mode: str = "paired",
    confidence: float = 0.95,
    ahead: bool = False,
    pages: str = "numpy",
) -> TransferReport:
    """Run the transfer bench (see the module docstring). Raises a :class:`KVBridgeError`."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if pages not in PAGES:
        raise ConfigError(f"pages must be one of {', '.join(PAGES)}, got {pages!r}")
    if reps < 1:
        raise ConfigError(f"reps must be >= 1, got {reps}")
    if not 0.5 <= confidence < 1.0:
        raise ConfigError(f"confidence must be in [0.5, 1), got {confidence}")
    if not block_sizes:
        raise ConfigError("at least one block size is needed")
    for block in block_sizes:
        if block <= 0 or block > total_bytes:
            raise ConfigError(
                f"block size {block} bytes must be > 0 and at most the total {total_bytes} bytes"
            )
    if total_bytes <= 0 or total_bytes > 16 << 30:
        raise ConfigError(f"total bytes must be in (0, 16 GiB], got {total_bytes}")
    opts = dict(options or {})
    load_before = os.getloadavg()[0]
    transport: Transport = registry.create(backend, "kvbridge-bench-initiator", opts)
    rows: list[TransferRow] = []
    target: TargetProcess | None = None
    session: Any = None
    raw_error: str | None = None
    try:
        src = host_buffer(total_bytes, pages, pattern(seed, total_bytes))
        dst = host_buffer(total_bytes, pages)
        meta = transport.register_memory(
            [MemoryRegion(int(src.ctypes.data), total_bytes),
             MemoryRegion(int(dst.ctypes.data), total_bytes)]
        )
        target = TargetProcess(backend, opts, total_bytes, seed, raw, pages)
        hello = target.reply()
        peer = transport.add_peer(hello["metadata"], hello["proof"])
        target.call("peer", metadata=meta, proof=transport.invite(hello["metadata"]))
        if raw:
            shared: dict[str, Any] = {}
            if "raw_error" in hello:
                log.warning("bench transfer: the raw column moves its own buffers (the "
                            "responder over kvbridge's failed: %s)", hello["raw_error"])
            if "raw" in hello:
                shared = {"peer": (hello["raw"], int(hello["address"])),
                          "local": {"read": int(dst.ctypes.data), "write": int(src.ctypes.data)}}
            try:
                session = _raw_session(backend, opts, total_bytes, seed, **shared)
            except Exception as exc:  # a failing raw column must not hide kvbridge's figures
                raw_error = f"{type(exc).__name__}: {exc}"
        side = _Side(transport, target, peer, src, dst, int(hello["address"]),
                     host_buffer(total_bytes, pages, pattern(seed + 1, total_bytes)), timeout,
                     ahead, pages=pages)
        rng = np.random.default_rng(seed + 2)
        for block in block_sizes:
            perm = scattered(rng, total_bytes // block)
            for op in ops:
                rows.append(_bench_one(side, session, raw_error, op, block, perm, reps, mode,
                                       confidence, ahead))
    finally:
        if session is not None:
            session.close()
        if target is not None:
            target.stop()
        transport.close()
    return TransferReport(backend, total_bytes, reps, mode, confidence,
                          (load_before, os.getloadavg()[0]), rows, ahead,
                          ahead and session is not None and hasattr(session, "prepare"),
                          _shared(session), pages, _mapped(transport))


def _mapped(transport: Transport) -> float | None:
    """The share of the transport's bytes it copied through a peer's mapping (shm)."""
    mapped, cma = getattr(transport, "mapped_bytes", None), getattr(transport, "cma_bytes", 0)
    if mapped is None or not mapped + cma:
        return None
    return float(mapped / (mapped + cma))


def _shared(session: Any) -> bool:
    """Whether ``session`` moves the bench's own buffers (see the module docstring)."""
    return bool(getattr(session, "shared", False))


@dataclass
class _Side:
    """kvbridge's half of the bench: the initiator transport, its buffers and the target."""

    transport: Transport
    target: TargetProcess
    peer: str
    src: Bytes
    dst: Bytes
    remote_base: int
    remote_data: Bytes
    timeout: float
    ahead: bool = False
    transfers: int = 0
    pages: str = "numpy"

    def pair(self, op: Op, block: int, nblocks: int) -> BlockPair:
        local = self.dst if op is Op.READ else self.src
        return prepare_blocks(self.transport, self.peer, _plane(int(local.ctypes.data), block,
                                                                nblocks),
                              _plane(self.remote_base, block, nblocks))

    def reset(self, op: Op, n: int) -> None:
        """Zero the destination of the next ``op`` (the first ``n`` bytes for a READ)."""
        if op is Op.READ:
            self.dst[:n].fill(0)
        else:
            self.target.call("zero")

    def check(self, op: Op, block: int, perm: I64, expected: Bytes | None,
              note: bytes | None) -> None:
        """Raise :class:`TransferFailed` unless the last ``op`` of ``perm`` moved every byte
        (a WRITE with ``note``: once the target got that notification)."""
        n = block * perm.size
        if op is Op.READ:
            assert expected is not None
            if not np.array_equal(self.dst[:n], expected):
                bad = int(np.flatnonzero(self.dst[:n] != expected)[0])
                raise TransferFailed(f"READ of {block}-byte blocks: byte {bad} differs")
        else:
            self.target.call("check_write", block=block, perm=perm.tobytes(), notification=note)

    def run(self, op: Op, pair: BlockPair, perm: I64, expected: Bytes | None) -> tuple[float, int]:
        """One timed transfer (the reset before and the byte check after are not timed)."""
        block, nblocks = pair.local.planes[0].block_bytes, perm.size
        self.reset(op, block * nblocks)
        self.transfers += 1
        notify = (self.transport.capabilities.notifications and op is Op.WRITE
                  and isinstance(self.transport, Notifying))
        note = f"kvbridge-bench:{block}:{self.transfers}".encode() if notify else None
        ids = np.arange(nblocks, dtype=np.int64)
        prep = (prepare_parts(self.transport, op, self.peer,
                              [(pair.local, ids, pair.remote, perm)], note)
                if self.ahead else None)  # None: this transport builds nothing ahead
        t0 = time.perf_counter()
        handle = (prep.post() if prep is not None
                  else submit_blocks(self.transport, op, pair, ids, perm, note))
        state = self.transport.wait(handle, self.timeout)
        elapsed = time.perf_counter() - t0
        if state is HandleState.FAILED:
            raise TransferFailed(f"{op.value} of {block}-byte blocks failed: {handle.error}")
        self.check(op, block, perm, expected, note)
        return elapsed, handle.count


def _plane(base: int, block: int, nblocks: int) -> KVLayout:
    return KVLayout((KVPlane("bench", base, block, block),), nblocks, 16, "uint8")


def _bench_one(
    side: _Side, session: Any, raw_error: str | None, op: Op, block: int, perm: I64, reps: int,
    mode: str, confidence: float, ahead: bool = False,
) -> TransferRow:
    nblocks = perm.size
    n = nblocks * block
    if op is Op.READ:
        side.target.call("fill")
    expected = (side.remote_data[:n].reshape(-1, block)[perm].reshape(-1) if op is Op.READ
                else None)
    pair = side.pair(op, block, nblocks)
    scratch = host_buffer(n, side.pages)
    mem_src = side.remote_data if op is Op.READ else side.src
    ranges = 0

    def kvbridge() -> float:
        nonlocal ranges
        elapsed, ranges = side.run(op, pair, perm, expected)
        return elapsed

    def memcpy() -> float:
        scratch.fill(0)  # every column zeroes its destination first, as kvbridge's does
        return memcpy_once(mem_src, scratch, block, perm, op)

    shared = _shared(session)
    how = {"perm": perm} if shared else {}

    def raw() -> float:
        if shared:
            side.reset(op, n)
        else:
            session.reset(op.value.lower(), block)
        if ahead and hasattr(session, "prepare"):
            session.prepare(op.value.lower(), block, **how)
        elapsed = float(session.run(op.value.lower(), block, **how))
        if shared:  # every raw transfer checked, as kvbridge's
            try:
                side.check(op, block, perm, expected, None)
            except TransferFailed as exc:
                raise TransferFailed(f"raw {exc}") from None
        return elapsed

    columns: dict[str, Callable[[], float]] = {"kvbridge": kvbridge, "memcpy": memcpy}
    if session is not None and raw_error is None:
        columns["raw"] = raw
    times: dict[str, list[float]] = {name: [] for name in columns}
    for name, fn in list(columns.items()):  # warm-up: first-touch faults, connections
        try:
            fn()
        except Exception as exc:
            if name != "raw":
                raise
            raw_error = f"{type(exc).__name__}: {exc}"
            del columns[name], times[name]
    names = list(columns)
    orders = list(itertools.permutations(names))  # every order in turn: each column follows
    plan = ([list(orders[rep % len(orders)]) for rep in range(reps)]  # each other equally often
            if mode == "paired" else [[name] * reps for name in names])
    try:
        for batch in plan:
            for name in batch:
                times[name].append(columns[name]())
        if "raw" in times and not shared:
            session.verify(op.value.lower(), block)
    except Exception as exc:
        if "raw" not in times or isinstance(exc, KVBridgeError) and "raw" not in str(exc):
            raise
        raw_error = f"{type(exc).__name__}: {exc}"
        del times["raw"]
    return _row(block, op, ranges, n, times, raw_error, mode, confidence)


def _row(block: int, op: Op, ranges: int, n: int, times: dict[str, list[float]],
         raw_error: str | None, mode: str, confidence: float) -> TransferRow:
    def gbps(name: str) -> float:
        seconds = statistics.median(times[name]) if mode == "paired" else min(times[name])
        return n / seconds / 1e9

    raw_t = times.get("raw")
    if mode != "paired":
        return TransferRow(block, op.value.lower(), ranges, gbps("kvbridge"), gbps("memcpy"),
                           gbps("raw") if raw_t else None, raw_error)
    kvb = times["kvbridge"]
    return TransferRow(
        block, op.value.lower(), ranges, gbps("kvbridge"), gbps("memcpy"),
        gbps("raw") if raw_t else None, raw_error,
        vs_memcpy=median_ci(paired_ratios(times["memcpy"], kvb), confidence),
        vs_raw=median_ci(paired_ratios(raw_t, kvb), confidence) if raw_t else None,
    )


def format_transfer_report(report: TransferReport) -> str:
    before, after = report.load
    if report.mode == "paired":
        how = (f"{report.reps} paired reps (columns interleaved, every order in turn); GB/s: "
               "median; "
               f"kvb/x: median of per-rep ratios [{report.confidence:.0%} CI, order statistics, "
               "distribution-free]")
    else:
        how = f"best of {report.reps} reps per column, columns run one after the other"
    if report.ahead:
        how += ("; requests built ahead, untimed: post + completion timed (kvbridge" +
                (" and raw)" if report.raw_ahead else "; raw builds in its timed run)"))
    if report.raw_shared:
        how += "; raw moves kvbridge's own buffers, every transfer checked"
    if report.pages != "numpy":
        how += f"; buffers on {report.pages} pages"
    if report.mapped is not None:
        how += (f"; {report.mapped:.0%} of kvbridge's bytes copied through the peer's mapped "
                "memory, the rest by cross-memory attach")
    lines = [
        f"kvbridge bench transfer: backend={report.backend}, "
        f"{report.total_bytes / (1 << 20):g} MiB per transfer, {how}, GB/s = 1e9 bytes/s, "
        f"every byte checked; load average {before:.2f} -> {after:.2f}",
    ]
    head = ["block", "op", "descs", "kvbridge", "memcpy", "raw", "kvb/memcpy", "kvb/raw"]
    rows = []
    for r in report.rows:
        raw = f"{r.raw_gbps:.2f}" if r.raw_gbps is not None else ("error" if r.raw_error else "-")
        if r.vs_memcpy is not None:
            ratio_mem = r.vs_memcpy.format()
            ratio_raw = r.vs_raw.format() if r.vs_raw is not None else "-"
        else:
            ratio_mem = f"{r.ratio_memcpy:.2f}"
            ratio_raw = f"{r.ratio_raw:.2f}" if r.ratio_raw is not None else "-"
        rows.append([size_label(r.block_bytes), r.op, str(r.descriptors),
                     f"{r.kvbridge_gbps:.2f}", f"{r.memcpy_gbps:.2f}", raw, ratio_mem, ratio_raw])
    lines += table(head, rows, "r")
    lines += [f"raw {size_label(r.block_bytes)} {r.op}: {r.raw_error}" for r in report.rows
              if r.raw_error]
    return "\n".join(lines)
