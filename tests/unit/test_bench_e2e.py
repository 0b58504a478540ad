"""Fast unit tests of ``kvbridge bench e2e``'s helpers: flags, percentiles, the joins, the table.

No engines are started here; the benchmark itself is run by hand (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools import cli, prom
from kvbridge.tools.bench import e2e as b
from kvbridge.tools.bench.e2e_report import (
    BenchSettings,
    PhaseResult,
    RequestRecord,
    add_ratios,
    format_bars,
    format_table,
    parse_configs,
    summarize,
    workload_prompts,
)
from kvbridge.tools.bench.fleet import (
    BENCH_BACKENDS,
    CONFIG_NAMES,
    VLLM_PUSH_P_ENGINE,
    engine_specs,
    fleet_specs,
)
from kvbridge.tools.bench.timings import (
    beyond_wire,
    handoff_breakdown,
    handoff_times,
    request_steps,
)
from kvbridge.tools.cpumeter import CpuMeter, cpu_seconds, group_cpu, self_seconds
from kvbridge.tools.report import percentile

pytestmark = pytest.mark.timeout(60)


# -- flags ---------------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["bench", "e2e", *argv]).parse_args(["bench", "e2e", *argv])


def test_defaults_match_the_protocol() -> None:
    s = b.settings_from_args(_args())
    assert s.configs == CONFIG_NAMES
    assert (s.seq, s.concurrent, s.wave, s.prompt_len, s.max_tokens) == (12, 16, 8, 400, 32)
    assert s.push_headroom == 4
    assert s.conc_phase == "c8"


def test_configs_subset_keeps_order_and_drops_duplicates() -> None:
    s = b.settings_from_args(_args("--configs", "kvbridge-shm, vllm-nixl-pull,kvbridge-shm",
                                   "--seq", "3", "--wave", "4", "--log-dir", "/tmp/x"))
    assert s.configs == ("kvbridge-shm", "vllm-nixl-pull")
    assert s.seq == 3 and s.conc_phase == "c4" and s.log_dir == Path("/tmp/x")
    assert parse_configs("all") == CONFIG_NAMES


@pytest.mark.parametrize("text", ["vllm-nixl", "", " , ", "kvbridge-shm,nope"])
def test_bad_configs_are_named(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_configs(text)
    assert "configuration" in str(err.value)


@pytest.mark.parametrize("flag,value", [("--seq", "-1"), ("--wave", "0"), ("--max-tokens", "1")])
def test_bad_numbers_are_refused(flag: str, value: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        b.settings_from_args(_args(flag, value))


def test_cli_reports_bad_configs_without_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "e2e", "--configs", "bogus"]) == 1
    assert "unknown configuration 'bogus'" in capsys.readouterr().err


# -- percentiles and prompts ---------------------------------------------------------------------


def test_percentile_interpolates_linearly() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(map(float, range(11))), 90) == pytest.approx(9.0)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_prompts_are_fresh_per_phase_and_shared_across_configurations() -> None:
    s = BenchSettings(prompt_len=50)
    seq_pull = workload_prompts(s, "pull", "seq", 5)
    assert seq_pull == workload_prompts(s, "pull", "seq", 5)  # same for every configuration
    # headroom (auto before the planner) keeps auto's slot: its prompts are those of old runs
    assert workload_prompts(s, "headroom", "seq", 5) == workload_prompts(s, "auto", "seq", 5)
    others = [workload_prompts(s, m, ph, 5) for m in ("pull", "push", "headroom")
              for ph in ("warmup", "seq", "conc", "proxy-seq")]
    flat = [tuple(p) for group in others for p in group]
    assert len(set(flat)) == len(flat), "a prompt repeats: a prefix-cache hit would flatter"
    assert all(len(p) == 50 for p in flat)


# -- joins ---------------------------------------------------------------------------------------


P_TIMINGS = {
    "t-pull": {"kv_ready": 100.000},
    "t-push": {"kv_ready": 200.000, "write_posted": 200.001, "write_done": 200.004},
    "t-only-p": {"kv_ready": 300.0},
}
D_TIMINGS = {
    "t-pull": {"recv_done": 100.050, "first_step": 100.060},
    "t-push": {"recv_done": 200.006, "first_step": 200.010},
    "t-only-d": {"recv_done": 1.0, "first_step": 2.0},
}


def test_handoff_joins_p_and_d_by_transfer_id() -> None:
    got = handoff_times(P_TIMINGS, D_TIMINGS, ["t-pull", "t-push", "t-only-p", "t-only-d",
                                                 "missing"])
    assert got == pytest.approx([0.060, 0.010])


def test_breakdown_splits_consecutive_steps() -> None:
    pull = handoff_breakdown(P_TIMINGS, D_TIMINGS, ["t-pull"])
    assert pull == pytest.approx({"kv_ready->recv_done": 0.050, "recv_done->first_step": 0.010})
    push = handoff_breakdown(P_TIMINGS, D_TIMINGS, ["t-push"])
    assert push == pytest.approx({"kv_ready->write_posted": 0.001,
                                  "write_posted->write_done": 0.003,
                                  "write_done->recv_done": 0.002,
                                  "recv_done->first_step": 0.004})


def test_beyond_wire_subtracts_the_write_from_the_push_hand_off() -> None:
    got = beyond_wire(P_TIMINGS, D_TIMINGS, ["t-push", "t-pull", "missing"])
    assert got == pytest.approx([0.010 - 0.003])  # pull has no WRITE: not counted


def test_breakdown_places_the_loop_and_scheduler_marks_between_the_steps() -> None:
    p = {"t": {"kv_ready": 1.000, "ready_seen": 1.0002, "write_posted": 1.0005,
               "write_done": 1.0015}}
    d = {"t": {"recv_done": 1.002, "recv_seen": 1.003, "first_step": 1.0033}}
    steps = handoff_breakdown(p, d, ["t"])
    assert list(steps) == ["kv_ready->ready_seen", "ready_seen->write_posted",
                           "write_posted->write_done", "write_done->recv_done",
                           "recv_done->recv_seen", "recv_seen->first_step"]
    assert sum(steps.values()) == pytest.approx(0.0033)


def test_breakdown_with_client_events_adds_up_to_ttft() -> None:
    client = {"t-push": {"dispatch": 199.900, "first_token": 200.030}}
    steps = handoff_breakdown(P_TIMINGS, D_TIMINGS, ["t-push"], client)
    assert steps["dispatch->kv_ready"] == pytest.approx(0.100)
    assert steps["first_step->first_token"] == pytest.approx(0.020)
    assert sum(steps.values()) == pytest.approx(0.130)  # = first_token - dispatch


def test_request_steps_are_relative_to_dispatch_and_ordered() -> None:
    steps = request_steps(P_TIMINGS, D_TIMINGS, "t-push", 199.9)
    assert list(steps) == ["P.kv_ready", "P.write_posted", "P.write_done", "D.recv_done",
                           "D.first_step"]
    assert steps["P.kv_ready"] == pytest.approx(0.1)
    assert request_steps(P_TIMINGS, D_TIMINGS, "missing", 0.0) == {}
    rec = RequestRecord(index=0, mode="push", steps={"P.kv_ready": 0.1})
    assert rec.to_dict()["steps_ms"] == {"P.kv_ready": 100.0}


def test_prom_sum_adds_every_label_set_and_ignores_lookalikes() -> None:
    text = "\n".join([
        "# HELP vllm:nixl_xfer_time_seconds transfer time",
        'vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.25',
        'vllm:nixl_xfer_time_seconds_sum{engine="1",model_name="tiny"} 0.5',
        'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 3.0',
        'vllm:nixl_xfer_time_seconds_bucket{le="0.1"} 9',
        "vllm:nixl_xfer_time_seconds_sum_other 7",
    ])
    assert prom.total(text, "vllm:nixl_xfer_time_seconds_sum") == 0.75
    assert prom.total(text, "vllm:nixl_xfer_time_seconds_count") == 3.0
    assert prom.total(text, "absent") == 0.0


# -- CPU accounting ------------------------------------------------------------------------------


def test_cpu_seconds_of_own_process_group_grows_with_work() -> None:
    pgid = os.getpgrp()
    before = group_cpu(pgid)
    assert os.getpid() in before
    assert self_seconds() == pytest.approx(time.process_time(), abs=0.05)
    x = 0
    for i in range(3_000_000):
        x += i * i
    after = group_cpu(pgid)
    assert cpu_seconds(before, after) > 0.0
    # Pids that appeared later count from zero; pids that vanished do not subtract.
    assert cpu_seconds({}, {1: 1.5}) == 1.5
    assert cpu_seconds({1: 1.0, 2: 0.5}, {1: 0.9}) == 0.0


def test_cpu_meter_splits_engines_self_and_others() -> None:
    meter = CpuMeter(-1, -1)  # no such groups: engines count zero
    x = 0
    for i in range(2_000_000):
        x += i
    p, d, me, other = meter.read()
    assert (p, d) == (0.0, 0.0)
    assert me > 0.0 and other >= 0.0


# -- rows, ratios, table -------------------------------------------------------------------------


def _phase(config: str, mode: str, phase: str, ttfts: list[float], tpot: float,
           **kw: object) -> PhaseResult:
    recs = [RequestRecord(index=i, mode=mode, ok=True, ttft=t, tpot=tpot)
            for i, t in enumerate(ttfts)]
    return PhaseResult(config, mode, phase, records=recs, **kw)  # type: ignore[arg-type]


def test_summary_ratios_and_table() -> None:
    base = _phase("vllm-nixl-pull", "pull", "seq", [0.2, 0.4, 0.3], 0.010, cpu_p=1.5,
                  cpu_d=2.0, xfer_avg_ms=4.0, xfer_count=3, checked=2, matched=2)
    push = _phase("kvbridge-shm", "push", "seq", [0.1, 0.2, 0.15], 0.005,
                  handoffs=[0.002, 0.004, 0.003], checked=2, matched=1)
    auto = _phase("kvbridge-shm", "headroom", "c8", [1.0], 0.02)
    auto.records.append(RequestRecord(index=1, mode="pull", ok=False, error="boom"))
    auto.records[0].mode = "push"
    auto.error = "1 failed, first: boom"
    proxy = _phase("kvbridge-shm", "push", "proxy-seq", [0.6], 0.02)
    rows = [summarize(r) for r in (base, push, auto, proxy)]
    add_ratios(rows)
    assert rows[0]["ttft_p50_s"] == pytest.approx(0.3) and rows[0]["ttft_ratio"] == 1.0
    assert rows[1]["ttft_ratio"] == pytest.approx(0.5)
    assert rows[1]["tpot_ratio"] == pytest.approx(0.5)
    assert rows[1]["handoff_p50_ms"] == pytest.approx(3.0)
    assert rows[1]["match"] == "MISMATCH 1/2" and rows[0]["match"] == "MATCH 2/2"
    assert rows[2]["ttft_ratio"] is None  # no c8 baseline in this run
    assert (rows[2]["ok"], rows[2]["failed"]) == (1, 1)
    assert rows[2]["chosen"] == {"push": 1, "pull": 1}
    assert rows[3]["ttft_ratio"] == pytest.approx(2.0)  # proxy-seq against the baseline's seq
    json.dumps(rows)  # plain JSON values only

    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split("  ")[0] == "config"
    assert set(lines[1]) <= {"-", " "}
    base_line = next(ln for ln in lines if ln.startswith("vllm-nixl-pull"))
    assert " n/a " in base_line and "MATCH 2/2" in base_line and " 4.0 " in base_line
    push_line = next(ln for ln in lines if " push " in ln and " seq " in ln)
    assert "3.0/3.8" in push_line and "0.50" in push_line
    assert any("headroom(pull:1/push:1)" in ln for ln in lines)
    assert "errors:" in text and "boom" in text


def test_report_formats_with_breakdown_and_notes() -> None:
    res = _phase("kvbridge-nixl", "push", "seq", [0.1], 0.005, handoffs=[0.002],
                 breakdown={"kv_ready->write_posted": 0.001})
    rows = [summarize(res)]
    add_ratios(rows)
    report = {"date": "2026-01-01T00:00:00+00:00",
              "host": {"cpus": 2, "loadavg_start": "1 1 1", "loadavg_end": "2 2 2"},
              "rows": rows, "log_dir": "/tmp/logs",
              "configs": {"kvbridge-nixl": {"ready_s": 60.0, "elapsed_s": 200.0,
                                            "loadavg_start": "1 1 1", "loadavg_end": "2 2 2"}}}
    text = b.format_report(report)
    assert "kv_ready->write_posted 1.0" in text
    assert "hand-off minus wire" not in text  # no WRITE timings in this phase
    assert "kvbridge-nixl: waited 0 s for quiet, ready 60.0 s" in text
    assert "load 1 1 1 -> 2 2 2" in text


def test_engine_specs_follow_the_recipes(tmp_path: Path) -> None:
    model = tmp_path / "model"
    p, d = engine_specs("vllm-nixl-push", model, tmp_path)
    assert p.kv_transfer_config == {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer",
                                    "kv_buffer_device": "cpu", "engine_id": VLLM_PUSH_P_ENGINE}
    assert d.kv_transfer_config is not None and d.kv_transfer_config["kv_role"] == "kv_consumer"
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert (p.cpu_bind, d.cpu_bind) == ("0", "1")
    assert p.env["VLLM_TARGET_DEVICE"] == "cpu" and "--block-size" in p.extra_args
    p, d = engine_specs("kvbridge-nixl", model, tmp_path)
    assert p.kv_transfer_config is not None
    assert p.kv_transfer_config["kv_connector"] == "KVBridgeConnector"
    assert p.kv_transfer_config["kv_connector_extra_config"] == {"backend": "nixl"}
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in p.env
    assert p.proc is None and d.proc is None  # nothing started
    assert not p.pin_cpus
    p, d = engine_specs("kvbridge-shm", model, tmp_path, pin=True)
    assert p.pin_cpus and d.pin_cpus and (p.cpus(), d.cpus()) == ({0}, {1})
    assert b.settings_from_args(_args("--pin-engines")).pin_engines


def test_every_kvbridge_backend_is_a_configuration_and_nothing_else_is(tmp_path: Path) -> None:
    """``kvbridge-<backend>`` for each transport the benches know (mooncake too, though not in
    bench e2e's default set); any other name is refused, naming it."""
    assert "mooncake" in BENCH_BACKENDS and "kvbridge-mooncake" not in CONFIG_NAMES
    for backend in BENCH_BACKENDS:
        p, d = engine_specs(f"kvbridge-{backend}", tmp_path / "model", tmp_path)
        for server, role in ((p, "kv_producer"), (d, "kv_consumer")):
            assert server.kv_transfer_config is not None
            assert server.kv_transfer_config["kv_role"] == role
            assert server.kv_transfer_config["kv_connector_extra_config"] == {"backend": backend}
        ps, ds = fleet_specs(f"kvbridge-{backend}", tmp_path / "model", tmp_path, prefill=2,
                             decode=2)
        assert [s.kv_transfer_config["engine_id"] for s in ps + ds  # type: ignore[index]
                ] == [f"bench-{backend}-{t}" for t in ("P0", "P1", "D0", "D1")]
    for bad in ("kvbridge-tcp", "kvbridge", "mooncake", "kvbridge-"):
        with pytest.raises(ConfigError, match="unknown configuration"):
            engine_specs(bad, tmp_path / "model", tmp_path)
        with pytest.raises(ConfigError, match="needs a kvbridge configuration"):
            fleet_specs(bad, tmp_path / "model", tmp_path, prefill=2, decode=2)


def test_bars_line_judges_push_seq_hand_off_minus_wire() -> None:
    ok = summarize(_phase("kvbridge-nixl", "push", "seq", [0.1], 0.005, handoffs=[0.003],
                            beyond_wire=[0.0015]))
    slow = summarize(_phase("kvbridge-shm", "push", "seq", [0.1], 0.005, handoffs=[0.006],
                              beyond_wire=[0.0045]))
    conc = summarize(_phase("kvbridge-shm", "push", "c8", [0.1], 0.005, beyond_wire=[0.001]))
    text = format_bars([ok, slow, conc])
    assert "kvbridge-nixl: push seq hand-off p50 3.00 ms, minus wire 1.50 ms" in text
    assert "(bar <= 2 ms: met)" in text and "(bar <= 2 ms: NOT met)" in text
    assert "c8" not in text
    table = format_table([ok])
    assert " 1.50 " in table and "-wire p50 ms" in table
