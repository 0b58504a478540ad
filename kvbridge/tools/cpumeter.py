"""CPU seconds: per process group, this process, the whole host (through ``psutil``, which reads
``/proc/<pid>/stat`` and ``/proc/stat`` as the hand parsers it replaces did); the load average.

Contract: Linux only; every reader is a plain read with no subprocess and no monitor thread,
cheap enough to call around each bench phase. :class:`CpuMeter` snapshots at construction and
:meth:`CpuMeter.read` returns seconds since then; a process that exits between two snapshots is
simply missing from the second (its last seconds are lost), a new one counts fully. Used by
``kvbridge bench e2e``/``handoff``, the simulator's calibration and ``benchmarks/``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: ``kvbridge --help`` imports this module, lightly
    import psutil

__all__ = ["CpuMeter", "cpu_seconds", "group_cpu", "host_busy_seconds", "loadavg",
           "process_seconds", "self_seconds"]


def process_seconds(proc: psutil.Process) -> float:
    """utime + stime of ``proc`` (a process or, by its thread id, a thread) so far, in seconds;
    raises :class:`psutil.Error` when it is gone."""
    times = proc.cpu_times()
    return float(times.user + times.system)


def group_cpu(pgid: int) -> dict[int, float]:
    """CPU seconds used so far by every live process in process group *pgid*, by pid."""
    import psutil

    out: dict[int, float] = {}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out[proc.pid] = process_seconds(proc)
        except (OSError, psutil.Error):
            continue  # exited meanwhile
    return out


def cpu_seconds(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU seconds used between two :func:`group_cpu` snapshots (new pids count fully)."""
    return sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items())


def host_busy_seconds() -> float:
    """Busy CPU seconds of the whole host so far (``/proc/stat``: all but idle and iowait)."""
    import psutil

    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + t.irq + t.softirq + t.steal)


def self_seconds() -> float:
    """CPU seconds used so far by this process (the benchmark's client and proxies)."""
    import psutil

    return process_seconds(psutil.Process())


class CpuMeter:
    """CPU seconds of P's and D's process groups, this process, and everything else."""

    def __init__(self, p_pgid: int, d_pgid: int) -> None:
        self.p_pgid, self.d_pgid = p_pgid, d_pgid
        self.p0, self.d0 = group_cpu(p_pgid), group_cpu(d_pgid)
        self.host0, self.self0 = host_busy_seconds(), self_seconds()

    def read(self) -> tuple[float, float, float, float]:
        """(P, D, this process, others) CPU seconds since construction."""
        p = cpu_seconds(self.p0, group_cpu(self.p_pgid))
        d = cpu_seconds(self.d0, group_cpu(self.d_pgid))
        me = self_seconds() - self.self0
        host = host_busy_seconds() - self.host0
        return p, d, me, max(0.0, host - p - d - me)


def loadavg() -> str:
    """The host's 1, 5 and 15 minute load averages, as text."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"
