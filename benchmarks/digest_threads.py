"""What the native hand-off digests' second thread gives, on a host whose cores are busy or not,
and what keeping the GIL through the hash gives beside a thread that runs Python.

    .venv/bin/python benchmarks/digest_threads.py
    PYTHONPATH=$OLD .venv/bin/python benchmarks/digest_threads.py   # another build of kvbridge

A 22.5 MiB part (the bench model's hand-off) in 720 ranges of 32 KiB, digested by
:func:`kvbridge.scheduling.digests.native` (XXH3-128 per 256 KiB of stream) on the calling
thread alone and with its helper (``threads`` 2), CALLS times each: back to back, and with a
3 ms pause between calls (the cores go idle between hand-offs, as they do on an engine host);
each beside 0, 1 and 2 other processes spinning in Python (an engine's busy threads). Then,
3 ms apart, with the GIL let go for the hash or kept (``keep_gil``), beside no other thread of
the process, one spinning in Python, and one running torch forward passes (digest_gil.py's).
Prints p50, p90 and the maximum per cell, in ms.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
from digest_gil import _forward, _spin  # this directory: the two threads beside the hash

from kvbridge.scheduling import digests
from kvbridge.tools.report import percentile, print_table

PART = 22 * (1 << 20) + (1 << 19)
RANGE = 32 << 10
CALLS = 40


def _times(rows: np.ndarray, threads: int, pause_s: float, keep_gil: bool = False) -> list[float]:
    fn = digests.native()
    assert fn is not None, "kvbridge was built without its native digests"
    out = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        fn(rows, digests.CHUNK_BYTES, threads, keep_gil)
        out.append((time.perf_counter() - t0) * 1e3)
        if pause_s:
            time.sleep(pause_s)
    return out


def main() -> None:
    buf = np.random.default_rng(0).integers(0, 256, PART, dtype=np.uint8)
    rows = np.array([(buf.ctypes.data + i, RANGE) for i in range(0, PART, RANGE)],
                    dtype=np.uint64)
    table = []
    for busy in (0, 1, 2):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(busy)]
        try:
            time.sleep(0.3)
            for pause_s in (0.0, 0.003):
                for threads in (1, 2):
                    ts = _times(rows, threads, pause_s)
                    table.append([busy, f"{pause_s * 1e3:g}", threads,
                                  *(f"{percentile(ts, q) or 0:.2f}" for q in (50, 90)),
                                  f"{max(ts):.2f}"])
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    print(f"native digests of a {PART / (1 << 20):.1f} MiB part in {RANGE >> 10} KiB ranges, "
          f"{CALLS} calls per row ({digests.__file__})")
    print_table(["spinning processes", "pause ms", "threads", "p50 ms", "p90 ms", "max ms"],
                table)
    table = []
    beside: list[tuple[str, Callable[[threading.Event], None] | None]] = [
        ("none", None), ("spinning in Python", _spin), ("torch forward passes", _forward)]
    for name, body in beside:
        stop = threading.Event()
        thread = threading.Thread(target=body, args=(stop,)) if body is not None else None
        if thread is not None:
            thread.start()
            time.sleep(0.5)
        try:
            for keep_gil in (False, True):
                for threads in (1, 2):
                    ts = _times(rows, threads, 0.003, keep_gil)
                    table.append([name, "kept" if keep_gil else "let go", threads,
                                  *(f"{percentile(ts, q) or 0:.2f}" for q in (50, 90)),
                                  f"{max(ts):.2f}"])
        finally:
            stop.set()
            if thread is not None:
                thread.join()
    print()
    print_table(["thread beside it", "GIL", "threads", "p50 ms", "p90 ms", "max ms"], table)


if __name__ == "__main__":
    main()
