"""The scripts under ``benchmarks/`` print their tables through kvbridge.tools.report's printer:
the columns and values they printed by hand before, aligned."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _columns(line: str) -> list[str]:
    """The cells of a table line (columns are two blanks or more apart; a cell holds at most
    single blanks)."""
    return re.split(r"\s{2,}", line.strip())


def test_hetero_plan_prints_one_row_per_shape(capsys: pytest.CaptureFixture[str]) -> None:
    hetero = _load("hetero_plan")
    hetero.main(["--tokens", "256", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("256 tokens, 64 layers x 8 KV heads")
    assert lines[1].split("  ")[0] == "P tp/block -> D tp/block"
    assert set(lines[2]) <= {"-", " "} and len(lines) == 3 + 8
    rows = [_columns(line) for line in lines[3:]]
    assert rows[0][0] == "1/32 -> 1/32" and rows[0][1] == "8" and rows[0][5] == "1.00"
    assert rows[1][:2] == ["1/32 -> 2/32", "4"] and rows[1][3] == "32.0"
    assert rows[0][3] == "64.0"  # 256 tokens x 64 layers x 8 heads x 2 x 128 x 2 bytes
    assert all(float(r[4]) >= 0 for r in rows)


def _serve_run(**kw: Any) -> dict[str, Any]:
    return {"backend": "nixl", "spin": 2, "mode": "push", "run": 1, "completed": 40,
            "failed": 0, "ttft_p50": 12.25, "ttft_p99": 30.0, "ttft_max": 31.0,
            "tpot_p50": 4.0, "tpot_p99": 5.0, "e2e_p99": 100.0, "ratio": 2.449,
            "slow_requests": 0, "verdict": "ok", **kw}


def test_serve_load_table(capsys: pytest.CaptureFixture[str]) -> None:
    serve_load = _load("serve_load")
    rows = [{"idle_cpu": {"idle_P": 0.01}}, _serve_run(),
            _serve_run(mode="pull", run=2, completed=None, failed=None, ttft_p50=None,
                       verdict="bench failed (rc 1, log x.bench.log)")]
    serve_load.print_runs(rows, 5.0)
    lines = capsys.readouterr().out.splitlines()
    head = serve_load.table_head(5.0)
    assert head[-2] == ">5s" and lines[0].split() == " ".join(head).split()
    assert len(lines) == 4  # header, rule, two runs: the idle CPU entry is not a run
    assert _columns(lines[2]) == [
        "nixl", "2", "push", "1", "40/0", "12.2", "30.0", "31.0", "4.0", "5.0", "100.0", "2.45",
        "0", "ok"]
    failed = _columns(lines[3])
    assert failed[4:6] == ["-/-", "-"] and failed[-1] == "bench failed (rc 1, log x.bench.log)"


def test_fleet_faults_table(capsys: pytest.CaptureFixture[str]) -> None:
    faults = _load("fleet_faults")
    row = {"mode": "auto", "killed": "decode (D0)", "held_at_kill": 3, "completed": 47,
           "failed": 1, "truncated": 2, "ttft_p50": 20.4, "ttft_p99": 80.6, "e2e_p99": 300.0,
           "e2e_max": 410.2, "loadavg": 1.25, "retries": {"decode_failed": 2}}
    assert faults.table_row(row) == ["auto", "decode (D0)", "3", "47/1", "2", "20/81",
                                     "300/410", "1.2", "{'decode_failed': 2}"]
    from kvbridge.tools.report import print_table

    print_table(faults.HEAD, [faults.table_row(row)])
    lines = capsys.readouterr().out.splitlines()
    assert _columns(lines[2])[1] == "decode (D0)"
