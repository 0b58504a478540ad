"""``kvbridge bench descriptors``: what one transfer costs before any byte moves, old path
against the block path, on a Qwen3-32B-shaped request.

The layout is ``layers`` tensors shaped ``(2, num_blocks, block_size, kv_heads, head_dim)``
(a K and a V plane each; fake addresses, nothing allocated). Block ids come as tuples, the way
the scheduler hands them over. Per case — ``scattered`` (random ids on both sides: no runs) and
``contiguous`` (one run per side) — and per row, every repetition times the wall clock and the
calling thread's CPU (robust to other processes competing for the cores):

* ``descriptor_pair`` — the old path's descriptor arrays;
* ``+ submit checks`` — plus what ``Transport.submit`` then checked on every transfer (the
  arrays' shape and lengths, both sides against registered memory): the old path up to the
  native call;
* ``blocks: validate`` — the block path's boundary (:meth:`BlockRequest.build`: ids in range,
  no duplicates, equal counts, runs); all a ``memory``, ``mooncake`` or ``compose`` submit does
  on the caller's thread (they build ranges on their worker);
* ``shm: + iovecs`` — plus the ``struct iovec`` arrays, which the shm worker builds before its
  ``process_vm_readv/writev`` calls;
* ``nixl: + indices`` — plus the index arrays (or coalesced ranges), with real agents; its
  ``native`` column is NIXL's request creation (``make_prepped_xfer``/``initialize_xfer``),
  measured separately.

Blocking; the nixl row needs the nixl package (skipped with a note otherwise).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvbridge import registry
from kvbridge.blocks import BlockPair, BlockRequest
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.layout import KVLayout, KVPlane, descriptor_pair
from kvbridge.tools.report import percentile, table
from kvbridge.transport import BlockCostHook, as_descriptors, check_within

__all__ = ["DescriptorRow", "DescriptorReport", "kv_layout", "run_descriptor_bench",
           "format_descriptor_report", "ROWS"]

#: Rows in order; ``nixl`` is optional (``backends``).
ROWS = ("descriptor_pair", "+ submit checks", "blocks: validate", "shm: + iovecs",
        "nixl: + indices")


@dataclass(frozen=True)
class DescriptorRow:
    path: str
    case: str
    descriptors: int  # byte ranges per side (planes x runs)
    median_ms: float
    p90_ms: float
    cpu_median_ms: float
    native_median_ms: float | None = None  # NIXL's request creation (nixl row only)


@dataclass(frozen=True)
class DescriptorReport:
    layers: int
    planes: int
    block_bytes: int
    blocks: int
    tokens: int
    reps: int
    rows: list[DescriptorRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

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


Step = Callable[[], int]  # one repetition; returns the byte ranges per side


def _time(step: Step, reps: int) -> tuple[int, list[float], list[float]]:
    walls, cpus, count = [], [], 0
    for _ in range(reps):
        c0, t0 = time.thread_time(), time.perf_counter()
        count = step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return count, walls, cpus


def _row(path: str, case: str, count: int, walls: Sequence[float], cpus: Sequence[float],
         native: Sequence[float] | None = None) -> DescriptorRow:
    return DescriptorRow(path, case, count, statistics.median(walls) * 1e3,
                         (percentile(walls, 90) or 0.0) * 1e3, statistics.median(cpus) * 1e3,
                         None if native is None else statistics.median(native) * 1e3)


def run_descriptor_bench(
    tokens: int = 16384, layers: int = 64, kv_heads: int = 8, head_dim: int = 128,
    block_size: int = 16, dtype_bytes: int = 2, num_blocks: int = 0, reps: int = 50,
    seed: int = 0, backends: Sequence[str] = ("shm", "nixl"),
) -> DescriptorReport:
    """Time every row of the module docstring for one request. Raises :class:`ConfigError`."""
    for name, value in (("tokens", tokens), ("layers", layers), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("block_size", block_size),
                        ("dtype_bytes", dtype_bytes), ("reps", reps)):
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    unknown = sorted(set(backends) - {"shm", "nixl"})
    if unknown:
        raise ConfigError(f"--backends: unknown {', '.join(unknown)} (choose from shm, nixl)")
    blocks = -(-tokens // block_size)
    num_blocks = num_blocks or 8 * blocks
    if num_blocks < blocks:
        raise ConfigError(f"num_blocks {num_blocks} is below the {blocks} blocks of one request")
    block_bytes = block_size * kv_heads * head_dim * dtype_bytes
    local = kv_layout(1 << 40, layers, num_blocks, block_bytes, block_size)
    remote = kv_layout(1 << 41, layers, num_blocks, block_bytes, block_size)
    pair = BlockPair("peer", local, remote)
    rng = np.random.default_rng(seed)
    cases = {
        "scattered": (tuple(rng.choice(num_blocks, blocks, replace=False).tolist()),
                      tuple(rng.choice(num_blocks, blocks, replace=False).tolist())),
        "contiguous": (tuple(range(blocks)), tuple(range(num_blocks - blocks, num_blocks))),
    }
    report = DescriptorReport(layers, len(local.planes), block_bytes, blocks, tokens, reps)

    for case, (lids, rids) in cases.items():
        for path, step in _steps(pair, lids, rids, "shm" in backends):
            step()  # warm-up (first-call allocations, caches)
            report.rows.append(_row(path, case, *_time(step, reps)))

    if "nixl" in backends:
        _nixl_rows(report, layers * 2, num_blocks, cases, reps)
    report.rows.sort(key=lambda r: (r.case != "scattered", ROWS.index(r.path)))
    return report


def _steps(pair: BlockPair, lids: tuple[int, ...], rids: tuple[int, ...],
           shm: bool) -> list[tuple[str, Step]]:
    local, remote = pair.local, pair.remote
    lregions, rregions = local.regions(), remote.regions()

    def old() -> int:
        return int(descriptor_pair(local, lids, remote, rids)[0].shape[0])

    def old_checked() -> int:
        loc, rem = descriptor_pair(local, lids, remote, rids)
        loc, rem = as_descriptors(loc, "local"), as_descriptors(rem, "remote")
        if not np.array_equal(loc[:, 1], rem[:, 1]):
            raise AssertionError("unequal lengths")
        check_within(loc, lregions, "local")
        check_within(rem, rregions, "remote")
        return int(loc.shape[0])

    def validate() -> int:
        return BlockRequest.build(local, remote, lids, rids).count

    def iovecs() -> int:
        loc, _ = BlockRequest.build(local, remote, lids, rids).descriptors(pair, columns=2)
        return int(loc.view(np.uint64).shape[0])

    steps = [("descriptor_pair", old), ("+ submit checks", old_checked),
             ("blocks: validate", validate)]
    return steps + [("shm: + iovecs", iovecs)] if shm else steps


def _nixl_rows(report: DescriptorReport, planes: int, num_blocks: int,
               cases: dict[str, tuple[tuple[int, ...], tuple[int, ...]]], reps: int) -> None:
    try:
        hook = registry.bench_hook("nixl")
        if not isinstance(hook, BlockCostHook):
            raise ConfigError("the nixl bench hook has no block_cost() (kvbridge.transport."
                              "BlockCostHook)")
        measured = hook.block_cost(planes, num_blocks, cases, reps + 1)
    except KVBridgeError as exc:
        report.notes.append(f"nixl row skipped: {exc}")
        return
    for case, samples in measured.items():
        samples = samples[1:]  # the first request warms NIXL up
        lids, rids = cases[case]
        count = BlockRequest.build(*_fake(planes, num_blocks), lids, rids).count
        report.rows.append(_row("nixl: + indices", case, count, [s[0] for s in samples],
                                [s[1] for s in samples], [s[2] for s in samples]))


def _fake(planes: int, num_blocks: int) -> tuple[KVLayout, KVLayout]:
    one = kv_layout(1 << 40, planes // 2, num_blocks, 64, 16)
    return one, kv_layout(1 << 41, planes // 2, num_blocks, 64, 16)


def format_descriptor_report(report: DescriptorReport) -> str:
    lines = [
        f"kvbridge bench descriptors: {report.tokens} tokens = {report.blocks} blocks, "
        f"{report.layers} layers x K/V = {report.planes} planes, "
        f"{report.block_bytes} bytes per block per plane, {report.reps} reps; "
        "kvbridge's own work per transfer (native: NIXL's request creation)",
    ]
    rows = [[r.case, r.path, str(r.descriptors), f"{r.median_ms:.3f}", f"{r.p90_ms:.3f}",
             f"{r.cpu_median_ms:.3f}",
             "-" if r.native_median_ms is None else f"{r.native_median_ms:.3f}"]
            for r in report.rows]
    lines += table(["block ids", "path", "ranges", "median ms", "p90 ms", "cpu median ms",
                    "native ms"], rows, "r")
    lines += report.notes
    return "\n".join(lines)
