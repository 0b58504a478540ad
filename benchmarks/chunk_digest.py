"""What sealing tier chunks costs (kvbridge.offload.seal), next to copying them.

    .venv/bin/python benchmarks/chunk_digest.py

For chunk payloads of 32 KiB (the test model's block) to 4 MiB, prints the median time of one
``bytes`` copy of the payload (what a DRAM tier's store or load costs at least), of ``seal``
(store: digest + append) and of ``unseal`` (load: digest + compare + slice), and their ratios.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from kvbridge.offload.seal import seal, unseal
from kvbridge.tools.report import print_table

SIZES = (32 << 10, 256 << 10, 1 << 20, 4 << 20)


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


if __name__ == "__main__":
    main()
