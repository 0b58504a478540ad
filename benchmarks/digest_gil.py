"""What a thread running Python beside it does to a hand-off digest: xxhash fed in large pieces
(it gives the GIL up for each) against kvbridge.hashing's pieces (it keeps it).

    .venv/bin/python benchmarks/digest_gil.py

For a 22 MiB part (the bench model's hand-off) in 24 ranges of about 1 MiB and in 720 ranges of
about 32 KiB, the median and worst time of its XXH3-128 digests per 256 KiB of stream, fed to
xxhash two ways: the way kvbridge did before 2026-12-06 (a range or 256 KiB chunk per call,
which python-xxhash hashes with the GIL released when it is over 64 KiB) and through
:func:`kvbridge.hashing.feed` (at most 64 KiB per call: hashed holding the GIL). Each three
times: alone; with one more thread spinning in Python; and with one more thread running a small
model's forward passes with torch on CPU, in a loop (Python between operators, the GIL let go
inside each), as an engine's model runner does beside the transfer loop's thread.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import xxhash

from kvbridge.hashing import feed
from kvbridge.tools.report import print_table

PART = 22 << 20
CHUNK = 256 << 10
REPS = 15


def _digests(memory: memoryview, ranges: list[tuple[int, int]],
             put: Callable[[Callable[[memoryview], object], memoryview], None]) -> bytes:
    """The part's digests, one per CHUNK of the stream, each piece handed over by ``put``."""
    out, h, left = bytearray(), xxhash.xxh3_128(), CHUNK
    for pos, end in ranges:
        while pos < end:
            take = min(left, end - pos)
            put(h.update, memory[pos:pos + take])
            pos, left = pos + take, left - take
            if left == 0:
                out += h.digest()
                h.reset()
                left = CHUNK
    return bytes(out + (h.digest() if left != CHUNK else b""))


def _whole(update: Callable[[memoryview], object], view: memoryview) -> None:
    update(view)


def _spin(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def _forward(stop: threading.Event) -> None:
    import torch  # only this row needs it

    torch.set_num_threads(1)
    layers = [torch.nn.Linear(256, 256) for _ in range(12)]
    x = torch.randn(64, 256)
    with torch.no_grad():
        while not stop.is_set():
            h = x
            for layer in layers:
                h = torch.nn.functional.silu(layer(h)) + h


def main() -> None:
    buf = np.random.default_rng(1).integers(0, 256, PART, dtype=np.uint8)
    memory = memoryview(buf.data).cast("B")
    rows = []
    for other, target in (("alone", None), ("spinning", _spin), ("torch forward", _forward)):
        stop = threading.Event()
        spinner = threading.Thread(target=target, args=(stop,), daemon=True)
        if target is not None:
            spinner.start()
            time.sleep(0.5)
        try:
            for n in (24, 720):
                per = PART // n
                ranges = [(i * per, (i + 1) * per) for i in range(n)]
                cells = []
                for put in (_whole, feed):
                    assert _digests(memory, ranges, put) == _digests(memory, ranges, _whole)
                    times = []
                    for _ in range(REPS):
                        t0 = time.perf_counter()
                        _digests(memory, ranges, put)
                        times.append((time.perf_counter() - t0) * 1e3)
                    cells.append((statistics.median(times), max(times)))
                (old, old_max), (new, new_max) = cells
                rows.append([other, str(n), f"{per >> 10} KiB",
                             f"{old:.2f}", f"{old_max:.2f}", f"{new:.2f}", f"{new_max:.2f}",
                             f"{old / new:.1f}x"])
        finally:
            stop.set()
            if target is not None:
                spinner.join()
    print(f"XXH3-128 digests of a {PART >> 20} MiB part, median and worst of {REPS} (ms)")
    print_table(["other thread", "ranges", "range", "whole p50", "whole max", "pieces p50",
                 "pieces max", "whole / pieces"], rows, list("lrrrrrrr"))


if __name__ == "__main__":
    main()
