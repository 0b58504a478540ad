"""Niceness that holds across sessions, for the benchmark harnesses.

Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled`` = 1, the default of
many kernels) makes every session (``setsid``; every process started with
``start_new_session=True``) a scheduling group of its own, and shares the CPU between the groups
first. A process's niceness then weighs only against the processes of its own session: a
proxy and a load generator started at niceness −10 in sessions of their own still get the
same share as each engine's session. To favour them over the engines, the niceness of their
group must be set too (``/proc/PID/autogroup``, which a negative value needs
``CAP_SYS_NICE`` for). :func:`follow_niceness` does both for a process just started.

Not for the library: engines never change their own or another process's priority.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["autogroup_enabled", "set_group_nice", "follow_niceness"]

_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")


def autogroup_enabled() -> bool:
    """Whether the kernel schedules sessions as groups (False where it cannot be read)."""
    try:
        return _ENABLED.read_text().strip() == "1"
    except OSError:
        return False


def set_group_nice(pid: int, nice: int) -> str | None:
    """Set the niceness of ``pid``'s autogroup (its session) to ``nice`` (−20 … 19). None when
    done; else why not (autogroups off, no such process, not allowed), for the caller to
    report. Affects every process of that session."""
    if not -20 <= nice <= 19:
        raise ValueError(f"nice must be in -20..19, not {nice}")
    if not autogroup_enabled():
        return "the kernel does not group sessions (sched_autogroup_enabled is not 1)"
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError as exc:
        return f"cannot set the niceness of process {pid}'s session: {exc}"
    return None


def follow_niceness(pid: int) -> str | None:
    """Give process ``pid`` (just started in a session of its own) the calling thread's
    niceness for its session too, so that it weighs against other sessions as it would
    against this process's peers; nothing when the caller runs at niceness 0. None when done
    or nothing to do, else why not (see :func:`set_group_nice`)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice == 0:
        return None
    return set_group_nice(pid, nice)
