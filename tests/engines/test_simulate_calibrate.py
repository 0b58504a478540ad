"""``kvbridge simulate calibrate`` on real engines: one short run (marked ``vllm``).

The derivation from measurements is unit-tested in tests/unit/test_simulate.py; this checks that the
measurements are taken from real engines through the real proxy, that the profile written loads
and simulates, and that no engine is left running.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvbridge.tools import cli
from kvbridge.tools.simulate.profile import load_profile
from kvbridge.tools.simulate.sizing import Fleetspec, run_one
from kvbridge.tools.simulate.workload import Lengths, Workload


@pytest.mark.vllm
@pytest.mark.timeout(720)
def test_calibrate_writes_a_profile_that_simulates(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """shm backend, 2 repetitions, the front ends' CPU measured in push mode only (three real
    ``vllm bench serve`` runs): about 3 minutes on an idle 2-core host (engines ~45 s, each
    load generator ~10 s of start-up)."""
    from kvbridge.tools import engines

    out = tmp_path / "host.json"
    argv = ["simulate", "calibrate", "--backend", "shm", "--reps", "2", "--out", str(out),
            "--log-dir", str(tmp_path / "logs"), "--cpu-modes", "push"]
    assert cli.main(argv) == 0, capsys.readouterr().err[-3000:]
    assert not engines._LIVE, "an engine was left running"
    doc = json.loads(out.read_text())
    cal = doc["calibration"]
    assert set(cal["prefill_ms"]) == {"32", "128", "256", "512", "896"}
    assert all(v > 0 for v in cal["prefill_ms"].values())
    assert {b for b, _, _ in cal["decode"]} == {1, 2, 4, 8}
    for mode, gaps in (("pull", ("send->recv_start", "recv_start->recv_done",
                                 "recv_done->first_step")),
                       ("push", ("send->kv_ready", "kv_ready->write_posted",
                                 "write_posted->write_done", "recv_done->first_step"))):
        assert set(gaps) <= set(cal["gaps_ms"][mode]), (mode, cal["gaps_ms"][mode])
        assert cal["ttft_ms"][mode] > 0
    # the front ends' CPU: three load runs through the real proxy, every process measured
    runs = cal["cpu"]["runs"]
    assert [(r["prompts"], r["output_len"]) for r in runs] == [(8, 8), (40, 8), (40, 48)]
    assert all(r["completed"] == r["prompts"] and r["wall_s"] > 0 for r in runs)
    for role in ("client", "proxy", "p_api", "d_api", "d_engine"):
        assert runs[2]["cpu_s"][role] > 0, (role, runs[2])
    assert cal["decode_cpu"] and all(t > 0 for _, _, t in cal["decode_cpu"])
    profile = load_profile(str(out))
    assert profile.cpu is not None and profile.cpu.cores == (os.cpu_count() or 1)
    assert profile.cpu.d_api_token_s > 0 or profile.cpu.client_token_s > 0
    assert "engine-core CPU seconds" in profile.sources["prefill.per_token_s"]
    assert profile.prefill.step_base_s + profile.prefill.per_token_s * 200 > 0
    w = Workload(rate=10, requests=40, prompt=Lengths(200), output=Lengths(16), arrival="vllm")
    for mode in ("pull", "push"):
        s = run_one(profile, w, Fleetspec(mode=mode))
        assert s.completed == 40 and s.ttft["p50"] > 0
        assert any(k.startswith("CPU ") for k in s.utilisation)  # the shared cores are modelled
