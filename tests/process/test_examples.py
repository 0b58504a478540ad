"""The examples run (the fast one here; pd_on_one_host.sh is what `kvbridge demo` automates)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend", ["shm", "compose"])
def test_transfer_example_moves_every_byte(backend: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples/transfer_two_processes.py"),
                          "--backend", backend], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "every byte arrived" in out.stdout
    if backend == "compose":  # memory cannot reach another process: shm carried it
        assert "through member shm" in out.stdout


@pytest.mark.parametrize("script", ["pd_on_one_host.sh", "fleet_on_one_host.sh"])
def test_engine_example_scripts_are_valid_bash(script: str) -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "examples" / script)]).returncode == 0
