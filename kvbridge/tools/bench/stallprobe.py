"""A control for latency tails: how long the host itself keeps a waiting process from running.

A tail that no process's record explains (the flight recorder's phases against the client's
TTFT, ``kvbridge bench serve``) may belong to the host: a process woken on a loaded machine
can wait for a CPU, a page, the hypervisor. :class:`StallProbe` measures that with nothing of
kvbridge, vLLM or asyncio in the way: two processes bounce one byte over a socket pair every
``interval_ms`` (each sleeps in between, as a proxy between requests does), and a round trip
that takes longer than a few tens of microseconds is time the host held one of them. Run it
next to a benchmark at the benchmark client's priority, and compare its p99 and maximum with
the tail to explain.

Contract: :meth:`StallProbe.start` spawns ``python -m kvbridge.tools.bench.stallprobe`` (the
process forks its partner) in a session of its own at the caller's niceness (its session too,
:mod:`kvbridge.tools.priority`), and blocks until the probe says it bounces (at most
``ready_s``; a probe stopped before then, still importing, would die of the SIGTERM with nothing
written); :meth:`StallProbe.stop` ends it and returns its samples,
``[wall-clock time the round trip ended, round trip ms]`` (empty when it failed);
:func:`summarize` gives ``probe_n``, ``probe_p50``/``probe_p99``/``probe_max`` (ms) and
``probe_over_5ms`` of those within a time window. At most :data:`MAX_SAMPLES` round trips
are kept; :meth:`StallProbe.stop` is idempotent; both processes exit when their socket closes.
CPU: one wake-up per interval on each side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvbridge.tools.priority import follow_niceness
from kvbridge.tools.procs import end_group
from kvbridge.tools.report import percentile

__all__ = ["StallProbe", "parse", "summarize", "MAX_SAMPLES", "MAX_BYTES"]

MAX_SAMPLES = 200_000
MAX_BYTES = MAX_SAMPLES * 40  # "[1796572529.6951, 16.0812]," is 28 bytes
READY = b"stallprobe ready"  # the probe's one line to stdout: its SIGTERM handler is set


def parse(data: bytes) -> list[list[float]]:
    """The samples in the probe's output ``data``; an empty list for anything else (not JSON,
    not a list of ``[time, ms]`` number pairs, over :data:`MAX_BYTES`): the file lies in a
    directory other processes of the user can write to."""
    if len(data) > MAX_BYTES:
        return []
    try:
        raw = json.loads(data)
        samples = [[float(t), float(r)] for t, r in raw]
    except (ValueError, TypeError, RecursionError):
        return []
    if len(samples) > MAX_SAMPLES or not all(math.isfinite(t) and math.isfinite(r) and r >= 0
                                             for t, r in samples):
        return []
    return samples


def summarize(samples: list[list[float]], start: float = float("-inf"),
              end: float = float("inf")) -> dict[str, Any]:
    """The summary of the probe's round trips that ended within ``[start, end]`` (wall-clock
    seconds): an empty dict for none."""
    rtts_ms = [r for t, r in samples if start <= t <= end]
    if not rtts_ms:
        return {}
    return {"probe_n": len(rtts_ms), "probe_p50": percentile(rtts_ms, 50),
            "probe_p99": percentile(rtts_ms, 99), "probe_max": max(rtts_ms),
            "probe_over_5ms": sum(1 for r in rtts_ms if r > 5.0)}


class StallProbe:
    """See the module docstring."""

    def __init__(self, out: Path, interval_ms: float = 5.0) -> None:
        if interval_ms <= 0:
            raise ValueError("interval_ms must be positive")
        self.out = out
        self.interval_ms = interval_ms
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_s: float = 30.0) -> bool:
        """Start the probe; True once it bounces, False if it did not say so within
        ``ready_s`` (it is left running: :meth:`stop` ends it and reports what it wrote)."""
        self.out.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.tools.bench.stallprobe", "--out", str(self.out),
             "--interval-ms", str(self.interval_ms)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # fmt: skip
        follow_niceness(self.proc.pid)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], ready_s)
        line = self.proc.stdout.readline() if ready else b""  # EOF too: it died
        self.proc.stdout.close()  # nothing more is written there
        return line.strip() == READY

    def stop(self) -> list[list[float]]:
        proc, self.proc = self.proc, None
        if proc is None:
            return []
        end_group(proc)
        try:
            with open(self.out, "rb") as f:
                return parse(f.read(MAX_BYTES + 1))
        except OSError:
            return []


def _run(out: Path, interval_s: float) -> None:
    """The probe process: fork the partner, bounce a byte until SIGTERM, write the RTTs (ms)."""
    a, b = socket.socketpair()
    if os.fork() == 0:  # the partner: echo until the socket closes
        a.close()
        with contextlib.suppress(OSError):
            while data := b.recv(16):
                b.sendall(data)
        os._exit(0)
    b.close()
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    rtts: list[tuple[float, float]] = []
    with contextlib.suppress(OSError):  # the caller waits for this (its end may be closed)
        os.write(1, READY + b"\n")
    try:
        while not stop and len(rtts) < MAX_SAMPLES:
            time.sleep(interval_s)
            t = time.perf_counter()
            a.sendall(b"x")
            if not a.recv(16):
                break
            rtts.append((time.time(), (time.perf_counter() - t) * 1000.0))
    except (OSError, InterruptedError):
        pass
    finally:
        a.close()
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps([[round(t, 4), round(r, 4)] for t, r in rtts]))
        tmp.replace(out)
        with contextlib.suppress(ChildProcessError):
            os.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvbridge.tools.bench.stallprobe",
                                description="bounce a byte between two processes until "
                                            "SIGTERM; write [time, round trip ms] pairs as "
                                            "JSON")
    p.add_argument("--out", type=Path, required=True, help="where to write the round trips")
    p.add_argument("--interval-ms", type=float, default=5.0,
                   help="sleep between round trips (default: 5)")
    args = p.parse_args(argv)
    if args.interval_ms <= 0:
        p.error("--interval-ms must be positive")
    _run(args.out, args.interval_ms / 1000.0)


if __name__ == "__main__":
    main()
