"""Ending a process started in a session (process group) of its own, for the tools.

:func:`end_group` signals the whole group, so whatever the process started goes too, and
escalates to SIGKILL when the group's leader does not exit in time. Blocking (at most about
``2 * grace_s``); safe to call on a process that already exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

__all__ = ["end_group"]


def end_group(proc: subprocess.Popen[bytes], first: int = signal.SIGTERM,
              grace_s: float = 10.0) -> None:
    """Send ``first`` to ``proc``'s process group (``proc`` was started with
    ``start_new_session=True``), then SIGKILL if ``proc`` has not exited within ``grace_s``;
    return once it has been reaped (a leader that survives SIGKILL for ``grace_s`` raises
    :class:`subprocess.TimeoutExpired`)."""
    if proc.poll() is not None:
        return
    for sig in dict.fromkeys((first, signal.SIGKILL)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            if sig == signal.SIGKILL:
                raise
