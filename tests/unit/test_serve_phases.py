"""kvbridge.tools.bench.serve_results.phase_gaps: a ``vllm bench serve`` run's client TTFTs
against the proxy's joined flight records (``/admin/why``), request by request."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.tools.bench.serve_results import format_phases, phase_gaps


def _why(*ms: float) -> dict[str, Any]:
    return {"phases": [{"phase": f"p{i}", "seconds": v / 1000.0} for i, v in enumerate(ms)]}


def test_gaps_are_per_request_and_skip_failures_and_unknown_ids() -> None:
    result = {"ttfts": [0.030, 0.050, 0.020, 0.040, float("nan")],
              "errors": ["", None, "boom", "", ""]}
    whys = {0: _why(10, 19), 1: _why(45), 2: _why(20), 4: _why(1)}  # 3: the proxy forgot it
    out = phase_gaps(result, whys)
    assert out["phases_n"] == 2  # 2 failed, 3 unknown, 4 has no finite TTFT
    assert abs(out["phases_gap_max"] - 5.0) < 1e-9
    assert abs(out["phases_gap_p50"] - 3.0) < 1e-9  # gaps 1 and 5 ms
    assert 0.9 < out["phases_proxy_p50"] < 1.0


def test_a_request_without_a_critical_path_is_left_out() -> None:
    out = phase_gaps({"ttfts": [0.01], "errors": [""]}, {0: {"phases": []}})
    assert out["phases_n"] == 0 and out["phases_gap_p99"] is None
    assert phase_gaps({}, {})["phases_n"] == 0


def test_the_report_line_names_each_kvbridge_run() -> None:
    rows = [{"setup": "kvbridge-push", "rate": 4.0, "phases_n": 32, "phases_gap_p50": 0.91,
             "phases_gap_p99": 2.5, "phases_gap_max": 3.0},
            {"setup": "vllm-nixl", "rate": 4.0}]
    text = format_phases(rows)
    assert "kvbridge-push @ 4: 32 requests, p50 0.91, p99 2.50, max 3.00" in text
    assert "vllm-nixl" not in text
    assert format_phases([{"setup": "vllm-nixl", "rate": 1.0}]) == ""


def test_the_gap_is_split_between_the_client_and_the_proxy_when_clocks_join() -> None:
    """bench serve's start times are perf_counter values; on one host, with the offset to the
    wall clock, the gap splits into the way in (send -> the proxy's handler) and the way out."""
    offset = 1000.0
    result = {"ttfts": [0.040], "errors": [""], "start_times": [5.0]}
    why = {**_why(30), "proxy": {"receive": 1005.004, "first_token": 1005.034}}
    out = phase_gaps(result, {0: why}, offset)
    assert abs(out["phases_gap_p50"] - 10.0) < 1e-6
    assert abs(out["phases_before_p50"] - 4.0) < 1e-6 and abs(out["phases_after_p50"] - 6.0) < 1e-6
    assert "client send -> proxy p50/p99 4.00/4.00" in format_phases(
        [{"setup": "kvbridge-pull", "rate": 1.0, **out}])
    assert "phases_before_p50" not in phase_gaps(result, {0: why})  # no offset: no split


def test_client_nice_is_a_setting_and_zero_leaves_the_thread_alone() -> None:
    import argparse
    import os

    from kvbridge.tools.bench import serve as bs
    from kvbridge.tools.bench.serve_run import _boost

    p = argparse.ArgumentParser()
    bs.add_arguments(p)
    assert bs.settings_from_args(p.parse_args(["--client-nice", "-10"])).client_nice == -10
    assert bs.settings_from_args(p.parse_args([])).client_nice == 0
    said: list[str] = []
    rec = type("R", (), {"say": lambda self, m: said.append(m)})()
    now = os.getpriority(os.PRIO_PROCESS, 0)
    assert _boost(0, rec) == now and said == []  # type: ignore[arg-type]


def test_each_request_of_the_split_is_listed_with_its_send_time() -> None:
    offset = 1000.0
    result = {"ttfts": [0.040, 0.030], "errors": ["", ""], "start_times": [5.0, 5.5]}
    whys = {0: {**_why(30), "proxy": {"receive": 1005.004, "first_token": 1005.034}},
            1: {**_why(29), "proxy": {"receive": 1005.501, "first_token": 1005.530}}}
    out = phase_gaps(result, whys, offset)
    assert [r[:2] for r in out["phases_requests"]] == [[0, 0.0], [1, 0.5]]
    assert out["phases_requests"][0][2:] == [10.0, 4.0, 6.0, 0.0]


def test_time_in_the_proxys_socket_is_in_the_record_not_before_it() -> None:
    """A request whose bytes waited 12 ms in the proxy's socket: the record starts at
    ``arrived``, so the way in is the client's 2 ms and the socket's 12 ms is reported apart."""
    offset = 1000.0
    result = {"ttfts": [0.050], "errors": [""], "start_times": [5.0]}
    why = {**_why(48), "proxy": {"arrived": 1005.002, "receive": 1005.014,
                                 "first_token": 1005.050}}
    out = phase_gaps(result, {0: why}, offset)
    assert abs(out["phases_before_p50"] - 2.0) < 1e-6
    assert abs(out["phases_socket_max"] - 12.0) < 1e-6
    assert out["phases_requests"][0][5] == pytest.approx(12.0)
    assert "in the proxy's socket (recorded) p99/max 12.00/12.00" in format_phases(
        [{"setup": "kvbridge-pull", "rate": 1.0, **out}])


def test_the_run_window_spans_first_send_to_last_end() -> None:
    from kvbridge.tools.bench.serve_results import run_window

    result = {"start_times": [5.0, 4.0, float("nan")], "latencies": [0.5, 2.0, 1.0]}
    assert run_window(result, 100.0) == (104.0, 106.0)
    start, end = run_window({}, 100.0)
    assert start > end  # empty: nothing falls in it


def test_the_report_line_gives_the_host_stall_probe_when_it_ran() -> None:
    row = {"setup": "kvbridge-pull", "rate": 16.0, "phases_n": 64, "phases_gap_p50": 1.5,
           "phases_gap_p99": 30.0, "phases_gap_max": 40.0, "probe_n": 800, "probe_p99": 0.4,
           "probe_max": 25.0, "probe_over_5ms": 3}
    assert "host stall probe p99/max 0.40/25.00 (3 of 800 round trips over 5 ms)" in \
        format_phases([row])
    assert "stall probe" not in format_phases([{**row, "probe_n": None}])
