"""The host stall probe (kvbridge.tools.bench.stallprobe) and kvbridge.tools.priority with real
processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.tools.bench.stallprobe import StallProbe, summarize
from kvbridge.tools.priority import autogroup_enabled


def test_the_probe_bounces_and_stops_cleanly(tmp_path: Path) -> None:
    probe = StallProbe(tmp_path / "probe.json", interval_ms=2.0)
    t0 = time.time()
    assert probe.start()  # returns once the probe bounces (it may take seconds to import)
    pid = probe.proc.pid if probe.proc is not None else -1
    time.sleep(0.5)
    samples = probe.stop()
    assert probe.stop() == []  # idempotent
    assert len(samples) >= 20  # ~0.5 s / (2 ms + a round trip), with room for a slow host
    assert all(t0 <= t <= time.time() and r > 0 for t, r in samples)
    summary = summarize(samples)
    assert summary["probe_n"] == len(samples) and summary["probe_p50"] < summary["probe_max"] + 1e-9
    # both processes are gone (the partner exits when its socket closes)
    out = subprocess.run(["pgrep", "-s", str(pid)], capture_output=True, text=True)
    assert out.stdout.strip() == ""


def test_a_probe_stopped_at_once_after_start_still_reports(tmp_path: Path) -> None:
    """start() waits for the probe's handler: stopped right away, it writes what it has (the
    CI once stopped a probe still importing after 0.5 s, which died with nothing written)."""
    probe = StallProbe(tmp_path / "probe.json", interval_ms=1.0)
    assert probe.start()
    assert probe.proc is not None and probe.proc.poll() is None
    probe.stop()
    assert (tmp_path / "probe.json").exists()  # written on SIGTERM, not killed


@pytest.mark.parametrize("program", ["exit", "hang"])
def test_a_probe_that_never_says_ready_is_reported_and_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, program: str) -> None:
    """A probe that dies before it is ready (EOF) or says nothing (the bound) makes start()
    say False, and stop() ends it and reports nothing."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + ("exit 1\n" if program == "exit" else "exec sleep 30\n"))
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    probe = StallProbe(tmp_path / "probe.json")
    t0 = time.monotonic()
    assert probe.start(ready_s=30.0 if program == "exit" else 1.0) is False
    took = time.monotonic() - t0
    assert took < 15.0 if program == "exit" else 1.0 <= took < 15.0  # EOF, else the bound
    assert probe.stop() == []
    assert probe.proc is None


def test_a_probe_killed_before_it_wrote_gives_no_samples(tmp_path: Path) -> None:
    probe = StallProbe(tmp_path / "probe.json")
    probe.start()
    assert probe.proc is not None
    probe.proc.kill()  # no output file: stop() reports nothing rather than raising
    probe.proc.wait(10)
    assert probe.stop() == []


_CHILD = """
import os, subprocess, sys
from kvbridge.tools.priority import follow_niceness
os.setpriority(os.PRIO_PROCESS, 0, 5)
p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                     stdin=subprocess.PIPE, start_new_session=True)
try:
    print(follow_niceness(p.pid))
    print(open(f"/proc/{p.pid}/autogroup").read().strip())
finally:
    p.stdin.close(); p.wait(10)
"""


@pytest.mark.skipif(not autogroup_enabled(), reason="the kernel does not group sessions")
def test_a_new_session_gets_the_callers_niceness() -> None:
    """A positive niceness needs no privilege: a child at niceness 5 starts a process in a
    session of its own, whose group then runs at 5 too (the default is 0)."""
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert out[0] == "None"
    assert out[1].endswith("nice 5"), out


_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
time.sleep(60)
"""


def test_end_group_escalates_and_takes_the_whole_group() -> None:
    """A leader that ignores SIGTERM is killed after the grace, and the child it started goes
    with the group."""
    from kvbridge.tools.procs import end_group

    proc = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    t0 = time.monotonic()
    end_group(proc, grace_s=1.0)
    assert proc.returncode == -9 and time.monotonic() - t0 < 5.0
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:  # the child: killed with the group, reaped by init
        if subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode:
            break
        time.sleep(0.05)
    else:
        pytest.fail("a process of the group outlived end_group")
    end_group(proc)  # already ended: nothing to do
