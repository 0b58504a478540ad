"""The CPU meter (kvbridge.tools.cpumeter) against real child processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kvbridge.tools.cpumeter import group_cpu

_SPIN = ("import sys, time\n"
         "while time.process_time() < 0.3: pass\n"
         "print(time.process_time(), flush=True)\n"
         "sys.stdin.read()\n")


def test_group_cpu_reads_a_process_group_with_an_odd_name(tmp_path: Path) -> None:
    """A process named like vLLM's ``VLLM::EngineCore`` with blanks and parentheses (which broke
    a split of ``/proc/<pid>/stat``) in a group of its own: its CPU seconds are what it measured
    itself, and nothing of this process's group is counted."""
    odd = tmp_path / "VLLM Eng (x))"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", _SPIN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        own = float(child.stdout.readline())
        assert psutil.Process(child.pid).name().startswith("VLLM Eng")
        got = group_cpu(child.pid)
        assert list(got) == [child.pid]
        assert got[child.pid] == pytest.approx(own, abs=0.05)  # clock ticks of 10 ms
        assert os.getpid() not in got
    finally:
        child.kill()
        child.wait()
