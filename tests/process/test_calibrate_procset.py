"""kvbridge.tools.simulate.calibrate_cpu.ProcSet: CPU seconds by role, read through psutil."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvbridge.tools.simulate.calibrate_cpu import ProcSet

# a leader (the "API server") that starts a helper in its group (the "engine core"); each
# spins for its own CPU time, then says it and waits
_HELPER = ("import sys, time\n"
           "while time.process_time() < 0.2: pass\n"
           "print(time.process_time(), flush=True); sys.stdin.read()\n")
_LEADER = ("import subprocess, sys, time\n"
           f"h = subprocess.Popen([sys.executable, '-c', {_HELPER!r}], stdout=subprocess.PIPE,"
           " stdin=subprocess.PIPE, text=True)\n"
           "helper = float(h.stdout.readline())\n"
           "while time.process_time() < 0.1: pass\n"
           "print(time.process_time(), helper, flush=True); sys.stdin.read()\n")


def _spin(go: threading.Event, spun: threading.Event, stop: threading.Event) -> None:
    go.wait()
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.1:
        pass
    spun.set()
    stop.wait()


def test_roles_read_the_leader_its_group_and_this_process_threads() -> None:
    leader = subprocess.Popen([sys.executable, "-c", _LEADER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    go, spun, stop = threading.Event(), threading.Event(), threading.Event()
    proxy = threading.Thread(target=_spin, args=(go, spun, stop))
    proxy.start()
    try:
        assert leader.stdout is not None
        own, helper = map(float, leader.stdout.readline().split())
        procs = ProcSet(leader.pid, leader.pid)
        before = procs.read(client=leader.pid)
        go.set()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:  # this (main) thread is not a proxy thread
            pass
        assert spun.wait(30)
        got = procs.read(client=leader.pid)
        assert list(got) == ["p_api", "d_api", "p_engine", "d_engine", "proxy", "client"]
        assert got["p_api"] == got["d_api"] == got["client"] == pytest.approx(own, abs=0.05)
        assert got["p_engine"] == got["d_engine"] == pytest.approx(helper, abs=0.05)
        assert got["proxy"] - before["proxy"] == pytest.approx(0.1, abs=0.05)
    finally:
        stop.set()
        proxy.join()
        os.killpg(leader.pid, signal.SIGKILL)  # the helper too
        leader.wait()
    assert procs.read()["p_api"] == 0.0  # gone: counted as nothing, no error
