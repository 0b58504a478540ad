"""What a READ's digest check costs after the copy, and fused into it: the copy a decode rank
makes over shm (P's staged KV into its own blocks), then its check of what landed.

    .venv/bin/python benchmarks/copy_digest.py

A 22.5 MiB part (the bench model's hand-off) in 720 ranges of 32 KiB and in 12 of 1.9 MiB,
copied from one buffer into another at scattered places, ROUNDS rounds with the three ways
interleaved, each call on buffers the others did not touch for a while (out of the cache, as a
hand-off's are), 3 ms apart:

- ``copy``: shm's native range copy alone (two threads, as shm copies), no check;
- ``copy, then digest``: the copy, then :func:`kvbridge.scheduling.digests.compute` of the
  destination (what D's check does today);
- ``fused``: :func:`kvbridge.scheduling.digests.copy_compute`, each piece hashed right after it
  is copied, while it is in the cache.

Prints p50 and p90 per way, in ms, and what the check adds to the copy (p50 against p50).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from kvbridge.scheduling import digests
from kvbridge.tools.report import percentile, print_table
from kvbridge.transports.shm import rangecopy

PART = 22 * (1 << 20) + (1 << 19)
ROUNDS = 40
SETS = 6  # buffer pairs taken in turn: 6 x 45 MiB, far past any cache here


def _moves(src: np.ndarray, dst: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """``src`` in ranges of ``size`` into ``dst`` at shuffled places (dst, src, length)."""
    starts = list(range(0, PART, size))
    places = rng.permutation(len(starts))
    return np.array([(dst.ctypes.data + int(places[i]) * size, src.ctypes.data + a,
                      min(size, PART - a)) for i, a in enumerate(starts)], dtype=np.uint64)


def main() -> None:
    copy = rangecopy.load()
    assert copy is not None and digests.native_copy() is not None, \
        "kvbridge was built without its native copy and digests"
    rng = np.random.default_rng(0)
    stop = ctypes.c_int32(0)
    table = []
    for size in (32 << 10, PART // 12):
        pairs = []
        for _ in range(SETS):
            src = rng.integers(0, 256, PART, dtype=np.uint8)
            dst = np.zeros(PART + size, dtype=np.uint8)
            pairs.append((src, dst, _moves(src, dst, size, rng)))

        def plain(m: np.ndarray) -> None:
            copy(m, stop, 2)

        def then(m: np.ndarray) -> None:
            copy(m, stop, 2)
            digests.compute(np.ascontiguousarray(m[:, [0, 2]]).astype(np.int64))

        def fused(m: np.ndarray) -> None:
            digests.copy_compute(m, ctypes.addressof(stop))

        ways = {"copy": plain, "copy, then digest": then, "fused": fused}
        times: dict[str, list[float]] = {w: [] for w in ways}
        turn = 0
        for _ in range(ROUNDS):
            for name, way in ways.items():
                m = pairs[turn % SETS][2]
                turn += 1
                t0 = time.perf_counter()
                way(m)
                times[name].append((time.perf_counter() - t0) * 1e3)
                time.sleep(0.003)
        base = percentile(times["copy"], 50) or 0.0
        for name, ts in times.items():
            p50 = percentile(ts, 50) or 0.0
            table.append([f"{PART // size} x {size / (1 << 10):.0f} KiB", name, f"{p50:.2f}",
                          f"{percentile(ts, 90) or 0:.2f}",
                          "" if name == "copy" else f"+{p50 - base:.2f}"])
    print(f"a {PART / (1 << 20):.1f} MiB part copied and checked, {ROUNDS} rounds interleaved, "
          f"out of the cache ({digests.__file__})")
    print_table(["ranges", "way", "p50 ms", "p90 ms", "check adds (p50) ms"], table)


if __name__ == "__main__":
    main()
