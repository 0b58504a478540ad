"""Benchmarks behind ``kvbridge bench``: transfer bandwidth and descriptor building.

Both compare side by side within one run, because absolute times on shared CI machines mean
little: the transfer bench prints kvbridge's GB/s next to an in-process numpy copy of the same
scattered blocks and next to the backend library's own figure (where the backend package exposes
``raw_bench(block_bytes, total_bytes, op, reps) -> float`` in GB/s), with the ratios.

Transfer bench, per block size and op: the initiator (this process) and a target (a process started
with the ``spawn`` context) each create the backend through :func:`kvbridge.registry.create`,
register their buffers and exchange metadata over a local pipe. Blocks are placed by a random
permutation so that no two neighbours coalesce. Each repetition resets the destination, times
``submit`` + ``wait`` only (descriptors are prepared beforehand, as the connector does), then
checks every byte (READ: here; WRITE: in the target, after the WRITE's notification arrived when
the backend supports notifications). A wrong byte raises :class:`TransferFailed`.

Blocking: both benches block the calling thread until done; the target process is always
stopped before returning, also on failure.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge import registry
from kvbridge.errors import ConfigError, KVBridgeError, PeerUnreachable, TransferFailed
from kvbridge.layout import KVLayout, KVPlane, descriptor_pair
from kvbridge.transport import HandleState, MemoryRegion, Op, Transport

__all__ = [
    "TransferRow",
    "TransferReport",
    "DescriptorRow",
    "DescriptorReport",
    "parse_ops",
    "run_transfer_bench",
    "run_descriptor_bench",
    "memcpy_gbps",
    "format_transfer_report",
    "format_descriptor_report",
]

Bytes = npt.NDArray[np.uint8]
RawBench = Callable[[int, int, str, int], float]
_REPLY_TIMEOUT_S = 120.0


def parse_ops(op: str) -> list[Op]:
    """``"read"``, ``"write"`` or ``"both"`` → the ops to run, READ first."""
    table = {"read": [Op.READ], "write": [Op.WRITE], "both": [Op.READ, Op.WRITE]}
    try:
        return table[op.lower()]
    except KeyError:
        raise ConfigError(f"unknown op {op!r}; expected read, write or both") from None


# -- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferRow:
    block_bytes: int
    op: str
    descriptors: int
    kvbridge_gbps: float
    memcpy_gbps: float
    raw_gbps: float | None
    raw_error: str | None = None

    @property
    def ratio_memcpy(self) -> float:
        return self.kvbridge_gbps / self.memcpy_gbps if self.memcpy_gbps else float("nan")

    @property
    def ratio_raw(self) -> float | None:
        return self.kvbridge_gbps / self.raw_gbps if self.raw_gbps else None


@dataclass(frozen=True)
class TransferReport:
    backend: str
    total_bytes: int
    reps: int
    rows: list[TransferRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "total_bytes": self.total_bytes,
            "reps": self.reps,
            "statistic": "best of reps",
            "verified": True,
            "rows": [
                {**asdict(r), "ratio_memcpy": r.ratio_memcpy, "ratio_raw": r.ratio_raw}
                for r in self.rows
            ],
        }


# -- the target process --------------------------------------------------------------------------


def _send(conn: Connection, msg: Mapping[str, Any]) -> None:
    conn.send_bytes(msgspec.msgpack.encode(msg))


def _pattern(seed: int, nbytes: int) -> Bytes:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def _target_main(
    conn: Connection, backend: str, options: dict[str, Any], total: int, seed: int
) -> None:
    """Body of the target process: serve commands from the initiator until ``quit`` or EOF."""
    try:
        transport = registry.create(backend, "kvbridge-bench-target", options)
    except KVBridgeError as exc:
        _send(conn, {"ok": False, "error": str(exc)})
        return
    try:
        buf = _pattern(seed + 1, total)
        meta = transport.register_memory([MemoryRegion(int(buf.ctypes.data), total)])
        _send(conn, {"ok": True, "metadata": meta, "address": int(buf.ctypes.data)})
        pending: list[bytes] = []
        src: Bytes | None = None
        while True:
            try:
                msg = msgspec.msgpack.decode(conn.recv_bytes())
            except (EOFError, OSError):
                return
            cmd = msg["cmd"]
            try:
                if cmd == "quit":
                    _send(conn, {"ok": True})
                    return
                if cmd == "peer":
                    _send(conn, {"ok": True, "peer": transport.add_peer(msg["metadata"])})
                elif cmd == "fill":
                    np.copyto(buf, _pattern(seed + 1, total))
                    _send(conn, {"ok": True})
                elif cmd == "zero":
                    buf.fill(0)
                    _send(conn, {"ok": True})
                elif cmd == "check_write":
                    if msg.get("notification"):
                        _await_notification(transport, msg["notification"], pending)
                    if src is None:
                        src = _pattern(seed, total)
                    block = int(msg["block"])
                    perm = np.frombuffer(msg["perm"], dtype=np.int64)
                    n = perm.size * block
                    got = buf[:n].reshape(-1, block)[perm]
                    ok = bool(np.array_equal(got, src[:n].reshape(-1, block)))
                    _send(conn, {"ok": ok, "error": None if ok else "WRITE bytes differ"})
                else:
                    _send(conn, {"ok": False, "error": f"unknown command {cmd!r}"})
            except KVBridgeError as exc:
                _send(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        transport.close()


def _await_notification(transport: Transport, want: bytes, pending: list[bytes]) -> None:
    deadline = time.monotonic() + _REPLY_TIMEOUT_S
    delay = 1e-4
    while want not in pending:
        got = transport.get_notifications()
        pending.extend(m for _, m in got)
        if want in pending:
            break
        if time.monotonic() > deadline:
            raise TransferFailed(f"notification {want!r} did not arrive")
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)
    pending.remove(want)


class _Target:
    """The initiator's handle on the target process."""

    def __init__(self, backend: str, options: dict[str, Any], total: int, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_target_main,
            args=(child, backend, options, total, seed),
            name="kvbridge-bench-target",
            daemon=True,
        )
        self.proc.start()
        child.close()

    def reply(self) -> dict[str, Any]:
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise PeerUnreachable(f"bench target exited with status {self.proc.exitcode}")
            if time.monotonic() > deadline:
                raise PeerUnreachable(f"bench target did not answer in {_REPLY_TIMEOUT_S} s")
        try:
            msg: dict[str, Any] = msgspec.msgpack.decode(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise PeerUnreachable(f"bench target went away: {exc}") from exc
        if not msg.get("ok"):
            raise TransferFailed(f"bench target: {msg.get('error')}")
        return msg

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        _send(self.conn, {"cmd": cmd, **kw})
        return self.reply()

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                _send(self.conn, {"cmd": "quit"})
                self.proc.join(10)
        except (OSError, ValueError):
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


# -- the transfer bench --------------------------------------------------------------------------


def memcpy_gbps(src: Bytes, dst: Bytes, block: int, perm: npt.NDArray[np.int64], op: Op,
                reps: int) -> float:
    """Best-of-``reps`` GB/s of an in-process copy of the same scattered blocks.

    READ gathers (``dst[i] = src[perm[i]]``), WRITE scatters (``dst[perm[i]] = src[i]``).
    """
    n = perm.size * block
    s2, d2 = src[:n].reshape(-1, block), dst[:n].reshape(-1, block)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        if op is Op.READ:
            np.take(s2, perm, axis=0, out=d2, mode="clip")  # "raise" would buffer `out`
        else:
            d2[perm] = s2
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def _find_raw_bench(backend: str, options: Mapping[str, Any]) -> RawBench | None:
    """The backend package's ``raw_bench`` (its module, then its top-level package), if any.

    When it takes ``**options``, the backend options are passed on, so both columns run the
    same configuration.
    """
    cls = registry.load_class(backend)
    for name in (cls.__module__, cls.__module__.split(".")[0]):
        fn = getattr(sys.modules.get(name) or importlib.import_module(name), "raw_bench", None)
        if not callable(fn):
            continue
        params = inspect.signature(fn).parameters.values()
        if options and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return functools.partial(fn, **options)
        return fn  # type: ignore[no-any-return]
    return None


def run_transfer_bench(
    backend: str,
    total_bytes: int = 64 << 20,
    block_sizes: Sequence[int] = (16 << 10, 64 << 10, 256 << 10, 1 << 20),
    ops: Sequence[Op] = (Op.READ, Op.WRITE),
    reps: int = 5,
    options: Mapping[str, Any] | None = None,
    raw: bool = True,
    timeout: float = 120.0,
    seed: int = 0,
) -> TransferReport:
    """Run the transfer bench (see the module docstring). Raises a :class:`KVBridgeError`."""
    if reps < 1:
        raise ConfigError(f"reps must be >= 1, got {reps}")
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
    raw_fn = _find_raw_bench(backend, opts) if raw else None
    transport: Transport = registry.create(backend, "kvbridge-bench-initiator", opts)
    report = TransferReport(backend, total_bytes, reps)
    target: _Target | None = None
    try:
        src = _pattern(seed, total_bytes)
        dst = np.zeros(total_bytes, dtype=np.uint8)
        meta = transport.register_memory(
            [MemoryRegion(int(src.ctypes.data), total_bytes),
             MemoryRegion(int(dst.ctypes.data), total_bytes)]
        )
        target = _Target(backend, opts, total_bytes, seed)
        hello = target.reply()
        remote_base = int(hello["address"])
        peer = transport.add_peer(hello["metadata"])
        target.call("peer", metadata=meta)
        remote_data = _pattern(seed + 1, total_bytes)
        rng = np.random.default_rng(seed + 2)
        for block in block_sizes:
            nblocks = total_bytes // block
            perm = rng.permutation(nblocks).astype(np.int64)
            for op in ops:
                report.rows.append(
                    _bench_one(transport, target, peer, op, block, nblocks, perm, src, dst,
                               remote_base, remote_data, reps, timeout, raw_fn)
                )
    finally:
        if target is not None:
            target.stop()
        transport.close()
    return report


def _descriptors(base: int, block: int, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """One descriptor per block, never merged (the bench measures scattered blocks)."""
    out = np.empty((ids.size, 3), dtype=np.int64)
    out[:, 0] = base + ids * block
    out[:, 1] = block
    out[:, 2] = 0
    return out


def _bench_one(
    transport: Transport, target: _Target, peer: str, op: Op, block: int, nblocks: int,
    perm: npt.NDArray[np.int64], src: Bytes, dst: Bytes, remote_base: int, remote_data: Bytes,
    reps: int, timeout: float, raw_fn: RawBench | None,
) -> TransferRow:
    n = nblocks * block
    local_buf = dst if op is Op.READ else src
    ldesc = _descriptors(int(local_buf.ctypes.data), block, np.arange(nblocks, dtype=np.int64))
    rdesc = _descriptors(remote_base, block, perm)
    if op is Op.READ:
        target.call("fill")
        expected = remote_data[:n].reshape(-1, block)[perm].reshape(-1)
    notify = transport.capabilities.notifications
    best = float("inf")
    for rep in range(reps):
        if op is Op.READ:
            dst.fill(0)
        else:
            target.call("zero")
        note = f"kvbridge-bench:{block}:{rep}".encode() if notify and op is Op.WRITE else None
        t0 = time.perf_counter()
        handle = transport.submit(op, peer, ldesc, rdesc, note)
        state = transport.wait(handle, timeout)
        elapsed = time.perf_counter() - t0
        if state is HandleState.FAILED:
            raise TransferFailed(f"{op.value} of {block}-byte blocks failed: {handle.error}")
        if op is Op.READ:
            if not np.array_equal(dst[:n], expected):
                bad = int(np.flatnonzero(dst[:n] != expected)[0])
                raise TransferFailed(f"READ of {block}-byte blocks: byte {bad} differs")
        else:
            target.call("check_write", block=block, perm=perm.tobytes(), notification=note)
        best = min(best, elapsed)
    scratch = np.empty(n, dtype=np.uint8)
    mem = memcpy_gbps(remote_data if op is Op.READ else src, scratch, block, perm, op, reps)
    raw_gbps: float | None = None
    raw_error: str | None = None
    if raw_fn is not None:
        try:
            raw_gbps = float(raw_fn(block, n, op.value.lower(), reps))
        except Exception as exc:  # a failing raw column must not hide kvbridge's figures
            raw_error = f"{type(exc).__name__}: {exc}"
    return TransferRow(block, op.value.lower(), int(ldesc.shape[0]), n / best / 1e9, mem,
                       raw_gbps, raw_error)


def format_transfer_report(report: TransferReport) -> str:
    lines = [
        f"kvbridge bench transfer: backend={report.backend}, "
        f"{report.total_bytes / (1 << 20):g} MiB per rep, best of {report.reps} reps, "
        "GB/s = 1e9 bytes/s, every byte checked",
    ]
    head = ["block", "op", "descs", "kvbridge", "memcpy", "raw", "kvb/memcpy", "kvb/raw"]
    rows = []
    for r in report.rows:
        raw = f"{r.raw_gbps:.2f}" if r.raw_gbps is not None else ("error" if r.raw_error else "-")
        ratio_raw = f"{r.ratio_raw:.2f}" if r.ratio_raw is not None else "-"
        rows.append([_size(r.block_bytes), r.op, str(r.descriptors), f"{r.kvbridge_gbps:.2f}",
                     f"{r.memcpy_gbps:.2f}", raw, f"{r.ratio_memcpy:.2f}", ratio_raw])
    lines += _table(head, rows)
    lines += [f"raw {_size(r.block_bytes)} {r.op}: {r.raw_error}" for r in report.rows
              if r.raw_error]
    return "\n".join(lines)


# -- the descriptor bench ------------------------------------------------------------------------


@dataclass(frozen=True)
class DescriptorRow:
    case: str
    descriptors: int
    median_ms: float
    p90_ms: float
    cpu_median_ms: float
    """CPU time of the calling thread: robust to other processes competing for the cores."""


@dataclass(frozen=True)
class DescriptorReport:
    layers: int
    planes: int
    block_bytes: int
    blocks: int
    tokens: int
    reps: int
    rows: list[DescriptorRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}


def kv_layout(base: int, layers: int, num_blocks: int, block_bytes: int,
              block_size: int) -> KVLayout:
    """A layout of ``layers`` tensors shaped ``(2, num_blocks, …)`` at fake address ``base``."""
    planes = []
    for layer in range(layers):
        lbase = base + layer * 2 * num_blocks * block_bytes
        planes.append(KVPlane(f"layers.{layer}.k", lbase, block_bytes, block_bytes))
        planes.append(KVPlane(f"layers.{layer}.v", lbase + num_blocks * block_bytes,
                              block_bytes, block_bytes))
    return KVLayout(tuple(planes), num_blocks, block_size, "bfloat16")


def run_descriptor_bench(
    tokens: int = 16384, layers: int = 64, kv_heads: int = 8, head_dim: int = 128,
    block_size: int = 16, dtype_bytes: int = 2, num_blocks: int = 0, reps: int = 50,
    seed: int = 0,
) -> DescriptorReport:
    """Time :func:`descriptor_pair` for one request, scattered and contiguous block ids."""
    for name, value in (("tokens", tokens), ("layers", layers), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("block_size", block_size),
                        ("dtype_bytes", dtype_bytes), ("reps", reps)):
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    blocks = -(-tokens // block_size)
    num_blocks = num_blocks or 8 * blocks
    if num_blocks < blocks:
        raise ConfigError(f"num_blocks {num_blocks} is below the {blocks} blocks of one request")
    block_bytes = block_size * kv_heads * head_dim * dtype_bytes
    local = kv_layout(1 << 40, layers, num_blocks, block_bytes, block_size)
    remote = kv_layout(1 << 41, layers, num_blocks, block_bytes, block_size)
    rng = np.random.default_rng(seed)
    cases = {
        "scattered": (rng.choice(num_blocks, blocks, replace=False),
                      rng.choice(num_blocks, blocks, replace=False)),
        "contiguous": (np.arange(blocks), np.arange(num_blocks - blocks, num_blocks)),
    }
    report = DescriptorReport(layers, len(local.planes), block_bytes, blocks, tokens, reps)
    for case, (lids, rids) in cases.items():
        lids_list, rids_list = lids.tolist(), rids.tolist()  # as the scheduler hands them over
        times, cpu = [], []
        count = 0
        for _ in range(reps):
            c0, t0 = time.thread_time(), time.perf_counter()
            ldesc, _rdesc = descriptor_pair(local, lids_list, remote, rids_list)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            count = int(ldesc.shape[0])
        times.sort()
        p90 = times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))]
        report.rows.append(
            DescriptorRow(case, count, statistics.median(times) * 1e3, p90 * 1e3,
                          statistics.median(cpu) * 1e3)
        )
    return report


def format_descriptor_report(report: DescriptorReport) -> str:
    lines = [
        f"kvbridge bench descriptors: {report.tokens} tokens = {report.blocks} blocks, "
        f"{report.layers} layers x K/V = {report.planes} planes, "
        f"{report.block_bytes} bytes per block per plane, {report.reps} reps",
    ]
    rows = [[r.case, str(r.descriptors), f"{r.median_ms:.3f}", f"{r.p90_ms:.3f}",
             f"{r.cpu_median_ms:.3f}"] for r in report.rows]
    lines += _table(["block ids", "descriptors", "median ms", "p90 ms", "cpu median ms"], rows)
    return "\n".join(lines)


# -- formatting ----------------------------------------------------------------------------------


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    cells = [list(head)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out
