"""What the KV digests cost: tier chunk seals (kvbridge.offload.seal) and hand-off digests
(kvbridge.scheduling.digests), next to copying the same bytes.

    .venv/bin/python benchmarks/chunk_digest.py

Tier seals: for chunk payloads of 32 KiB (the test model's block) to 4 MiB, the median time of
one ``bytes`` copy of the payload (what a DRAM tier's store or load costs at least), of ``seal``
(store: digest + append) and of ``unseal`` (load: digest + compare + slice), and their ratios.

Hand-off digests: for a part of 0.5 to 64 MiB scattered in ranges of 16 KiB to 1 MiB (as a KV
cache's layers and blocks scatter it), the median time of one copy of every range into another
buffer (what the transport does at least, in memory) and of the digests one side computes
(XXH3-128 per 256 KiB of the stream, read in place), and their ratio.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvbridge.offload.seal import seal, unseal
from kvbridge.scheduling import digests
from kvbridge.tools.report import print_table

SIZES = (32 << 10, 256 << 10, 1 << 20, 4 << 20)
#: (part bytes, range bytes) of the hand-off digests
PARTS = ((512 << 10, 16 << 10), (4 << 20, 32 << 10), (24 << 20, 64 << 10), (24 << 20, 1 << 20),
         (64 << 20, 256 << 10))


def _median_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    rows = []
    for size in SIZES:
        payload = os.urandom(size)
        sealed = seal(payload)
        reps = max(50, (64 << 20) // size)
        copy = _median_us(lambda p=payload: bytearray(p), reps)
        s = _median_us(lambda p=payload: seal(p), reps)
        u = _median_us(lambda c=sealed, n=size: unseal(c, n), reps)
        rows.append([f"{size >> 10} KiB", f"{copy:.1f}", f"{s:.1f}", f"{u:.1f}",
                     f"{s / copy:.1f}x", f"{size / (u * 1e-6) / 1e9:.2f}"])
    print_table(["payload", "copy us", "seal us", "unseal us", "seal / copy", "unseal GB/s"],
                rows, list("lrrrrr"))
    print()
    rows = []
    for total, rng in PARTS:
        src = np.random.default_rng(1).integers(0, 256, 2 * total, dtype=np.uint8)
        dst = np.empty_like(src)
        # every other range of a buffer twice the part's size: scattered, in stream order
        starts = np.arange(0, 2 * total, 2 * rng, dtype=np.int64)
        descs = np.stack([src.ctypes.data + starts, np.full_like(starts, rng),
                          np.zeros_like(starts)], axis=1)
        pairs = [(src[a:a + rng], dst[a:a + rng]) for a in starts.tolist()]
        reps = max(10, (256 << 20) // total)

        def copy(pairs: list[tuple[np.ndarray, np.ndarray]] = pairs) -> None:
            for a, b in pairs:
                np.copyto(b, a)

        c = _median_us(copy, reps)
        d = _median_us(lambda ds=descs: digests.compute(ds), reps)
        rows.append([f"{total >> 10} KiB", f"{rng >> 10} KiB", f"{c:.1f}", f"{d:.1f}",
                     f"{d / c:.2f}x", f"{total / (d * 1e-6) / 1e9:.1f}"])
    print_table(["hand-off part", "ranges of", "copy us", "digests us", "digests / copy",
                 "digests GB/s"], rows, list("llrrrr"))


if __name__ == "__main__":
    main()
