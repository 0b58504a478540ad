"""CPU seconds from ``/proc``: per process group, this process, the whole host; the load average.

Contract: Linux only; every reader is a plain file read with no subprocess and no monitor
thread, cheap enough to call around each bench phase. :class:`CpuMeter` snapshots at
construction and :meth:`CpuMeter.read` returns seconds since then; a process that exits between
two snapshots is simply missing from the second (its last ticks are lost), a new one counts
fully. Used by ``kvbridge bench e2e``/``handoff``, the simulator's calibration and
``benchmarks/``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["CpuMeter", "cpu_seconds", "group_cpu_ticks", "host_busy_ticks", "loadavg",
           "parse_stat_line", "self_ticks"]


def parse_stat_line(line: str) -> tuple[int, int]:
    """``/proc/<pid>/stat`` → (process group, utime + stime in clock ticks)."""
    rest = line[line.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
    return int(rest[2]), int(rest[11]) + int(rest[12])


def group_cpu_ticks(pgid: int) -> dict[int, int]:
    """CPU ticks used so far by every live process in process group *pgid*, by pid."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                group, ticks = parse_stat_line(f.read())
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if group == pgid:
            out[int(entry)] = ticks
    return out


def cpu_seconds(before: Mapping[int, int], after: Mapping[int, int]) -> float:
    """CPU seconds used between two :func:`group_cpu_ticks` snapshots (new pids count fully)."""
    ticks = sum(max(0, t - before.get(pid, 0)) for pid, t in after.items())
    return ticks / os.sysconf("SC_CLK_TCK")


def host_busy_ticks() -> int:
    """Busy CPU ticks of the whole host so far (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal


def self_ticks() -> int:
    """CPU ticks used so far by this process (the benchmark's client and proxies)."""
    with open("/proc/self/stat") as f:
        return parse_stat_line(f.read())[1]


class CpuMeter:
    """CPU seconds of P's and D's process groups, this process, and everything else."""

    def __init__(self, p_pgid: int, d_pgid: int) -> None:
        self.p_pgid, self.d_pgid = p_pgid, d_pgid
        self.p0, self.d0 = group_cpu_ticks(p_pgid), group_cpu_ticks(d_pgid)
        self.host0, self.self0 = host_busy_ticks(), self_ticks()

    def read(self) -> tuple[float, float, float, float]:
        """(P, D, this process, others) CPU seconds since construction."""
        p = cpu_seconds(self.p0, group_cpu_ticks(self.p_pgid))
        d = cpu_seconds(self.d0, group_cpu_ticks(self.d_pgid))
        tck = os.sysconf("SC_CLK_TCK")
        me = (self_ticks() - self.self0) / tck
        host = (host_busy_ticks() - self.host0) / tck
        return p, d, me, max(0.0, host - p - d - me)



def loadavg() -> str:
    """The host's 1, 5 and 15 minute load averages, as text."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"
