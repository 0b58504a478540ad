"""What taking the GIL back costs shm's range copy beside a thread that runs Python.

    .venv/bin/python benchmarks/copy_gil.py

The shm transport copies a part's mapped ranges in one native call per thread
(:mod:`kvbridge.transports.shm.rangecopy`), which lets the GIL go for the copy; with two copy
threads the worker copies one half and a pool thread the other, and each takes the GIL back
after its copy. While another thread of the engine runs Python (the model runner between its
operators, a prefill next to a push), taking it back waits until that thread lets go, at the
latest after its switch interval (5 ms). This copies a 22.5 MiB part in 720 ranges of 32 KiB
(memory to memory in this process), CALLS times 3 ms apart: on one thread; on two as the
worker did before 2026-12-06 (its own half, a pool thread's half, then wait for that thread);
and on two in one call (a helper thread inside the call, the GIL taken back once: what the
worker does now). Alone and beside a thread running torch forward passes (digest_gil.py's);
p50, p90 and maximum in ms.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from digest_gil import _forward  # this directory: the thread beside the copy

from kvbridge.tools.report import percentile, print_table
from kvbridge.transports.shm import rangecopy

PART = 22 * (1 << 20) + (1 << 19)
RANGE = 32 << 10
CALLS = 30


def _times(fn: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.003)
    return out


def main() -> None:
    copy = rangecopy.load()
    assert copy is not None, "kvbridge was built without shm's range copy"
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, PART, dtype=np.uint8)
    dst = np.zeros(PART, dtype=np.uint8)
    rows = np.array([(dst.ctypes.data + i, src.ctypes.data + i, RANGE)
                     for i in range(0, PART, RANGE)], dtype=np.uint64)
    halves = [np.ascontiguousarray(rows[: len(rows) // 2]),
              np.ascontiguousarray(rows[len(rows) // 2:])]
    stop = ctypes.c_int32(0)
    pool = ThreadPoolExecutor(1)

    def two() -> None:  # as the shm worker copied with two threads
        other = pool.submit(copy, halves[1], stop)
        copy(halves[0], stop)
        other.result()

    table = []
    for name, body in (("none", None), ("torch forward passes", _forward)):
        ev = threading.Event()
        thread = threading.Thread(target=body, args=(ev,)) if body is not None else None
        if thread is not None:
            thread.start()
            time.sleep(0.5)
        try:
            for threads, fn in (("1", lambda: copy(rows, stop)), ("2, a pool thread", two),
                                ("2, one call", lambda: copy(rows, stop, 2))):
                ts = _times(fn)
                table.append([name, threads, *(f"{percentile(ts, q) or 0:.2f}" for q in (50, 90)),
                              f"{max(ts):.2f}"])
        finally:
            ev.set()
            if thread is not None:
                thread.join()
    pool.shutdown()
    assert np.array_equal(src, dst)
    print(f"shm range copy of a {PART / (1 << 20):.1f} MiB part in {RANGE >> 10} KiB ranges, "
          f"{CALLS} calls per row")
    print_table(["thread beside it", "copy threads", "p50 ms", "p90 ms", "max ms"], table)


if __name__ == "__main__":
    main()
