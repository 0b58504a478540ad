"""``kvbridge bench handoff``'s flags and arithmetic (no engines; the bench is run by hand,
docs/benchmarks.md)."""

from __future__ import annotations

import argparse

import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools import cli
from kvbridge.tools.bench import handoff as bh
from kvbridge.tools.bench.e2e_report import RequestRecord

pytestmark = pytest.mark.timeout(60)


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["bench", "handoff", *argv]).parse_args(["bench", "handoff", *argv])


def test_flags() -> None:
    s = bh.settings_from_args(_args())
    assert (s.backend, s.requests, s.modes) == ("shm", 20, ("push", "pull", "push-behind"))
    s = bh.settings_from_args(_args("--backend", "nixl", "--modes", "push", "--requests", "4"))
    assert (s.backend, s.requests, s.modes) == ("nixl", 4, ("push",))
    with pytest.raises(ConfigError, match="--modes"):
        bh.settings_from_args(_args("--modes", "push,bogus"))
    with pytest.raises(ConfigError, match="--requests"):
        bh.settings_from_args(_args("--requests", "1"))


def test_the_pairs_differ_only_by_one_switch() -> None:
    assert bh.pairs_of(bh.settings_from_args(_args())) == {
        "wake": {}, "nowake": {"KVBRIDGE_WAKE_ON_ARRIVAL": "0"}}
    assert bh.pairs_of(bh.settings_from_args(_args("--against", "nodirect"))) == {
        "wake": {}, "nodirect": {"KVBRIDGE_DIRECT_ARRIVAL": "0"}}
    assert bh.pairs_of(bh.settings_from_args(_args("--against", "nomap"))) == {
        "wake": {}, "nomap": {"KVBRIDGE_MAP_KV_CACHE": "0"}}
    # the per-request baseline runs on the wake pair itself: one pair, no second environment
    assert bh.pairs_of(bh.settings_from_args(_args("--against", "unrecorded"))) == {"wake": {}}
    assert bh.SAME_PAIR["unrecorded"] == {"kvbridge_record": False}
    assert bh.pairs_of(bh.settings_from_args(_args("--against", "same"))) == {"wake": {}}
    s = bh.settings_from_args(_args("--against", "nohuge", "--model", "bench"))
    assert bh.pairs_of(s) == {"wake": {}, "nohuge": {"KVBRIDGE_HUGE_PAGES": "0"}}
    assert s.model == "bench" and len(bh._prompts(s, 1, 0)[0]) == s.prompt_len
    assert max(bh._prompts(s, 1, 0)[0]) >= 1024  # the bench model's vocabulary, not the tiny one's


def _cell(pair: str, handoffs_ms: list[float], ttfts_ms: list[float]) -> bh._Cell:
    cell = bh._Cell(pair, "push")
    for i, (h, t) in enumerate(zip(handoffs_ms, ttfts_ms, strict=True)):
        tid = f"{pair}-{i}"
        cell.records.append(RequestRecord(index=i, mode="push", ok=True, ttft=t / 1000,
                                          transfer_id=tid))
        cell.p_timings[tid] = {"kv_ready": 10.0, "write_posted": 10.0005, "write_done": 10.0015}
        cell.d_timings[tid] = {"recv_done": 10.002, "first_step": 10.0 + h / 1000}
    return cell


def test_summary_and_paired_differences() -> None:
    wake = _cell("wake", [2.0, 3.0, 4.0], [30.0, 31.0, 40.0])
    nowake = _cell("nowake", [5.0, 7.0, 6.0], [33.0, 36.0, 41.0])
    row = bh.summarize_pair(wake)
    assert row["handoff_p50_ms"] == pytest.approx(3.0)
    assert row["wire_p50_ms"] == pytest.approx(1.0)
    assert row["beyond_wire_p50_ms"] == pytest.approx(2.0)
    assert row["ttft_p50_ms"] == pytest.approx(31.0)
    assert set(row["steps_ms"]) == {"kv_ready->write_posted", "write_posted->write_done",
                                    "write_done->recv_done", "recv_done->first_step"}
    delta = bh.paired_deltas(wake, nowake)
    assert delta["handoff_ms"] == pytest.approx(-3.0)  # median of -3, -4, -2
    assert delta["ttft_ms"] == pytest.approx(-3.0)  # median of -3, -5, -1
    assert delta["ttft_ci_ms"] == pytest.approx([-5.0, -1.0])  # 3 rounds: all of them
    assert delta["wire_ms"] == pytest.approx(0.0)  # every WRITE took 1 ms
    wake.p_timings["wake-0"]["write_done"] += 0.004
    wake.p_timings["wake-2"]["write_done"] += 0.002
    assert bh.paired_deltas(wake, nowake)["wire_ms"] == pytest.approx(2.0)  # of 4, 0, 2
    assert delta["prefill_ms"] is None and delta["beyond_prefill_ms"] is None  # not recorded
    nowake.records[1].ok = False  # an unpaired round is left out
    assert bh.paired_deltas(wake, nowake)["rounds"] == 2


def test_ttft_less_prefill_takes_out_the_engines_own_speed() -> None:
    """Pair A's P prefills 60 ms slower in every round (an engine process slower than its
    twin); its hand-off is 1 ms longer. TTFT shows 61 ms, TTFT less P's prefill the 1 ms."""
    a = _cell("a", [4.0, 4.0, 4.0, 4.0], [1061.0, 1071.0, 1081.0, 1066.0])
    b = _cell("b", [3.0, 3.0, 3.0, 3.0], [1000.0, 1010.0, 1020.0, 1005.0])
    for cell, prefill_ms in ((a, 1057.0), (b, 997.0)):
        for i, rec in enumerate(cell.records):
            t = cell.p_timings[rec.transfer_id or ""]
            t["scheduled"] = t["kv_ready"] - (prefill_ms + 10 * (i % 3)) / 1000
    delta = bh.paired_deltas(a, b)
    assert delta["ttft_ms"] == pytest.approx(61.0)
    assert delta["prefill_ms"] == pytest.approx(60.0)
    assert delta["beyond_prefill_ms"] == pytest.approx(1.0)
    assert delta["beyond_prefill_ci_ms"] == pytest.approx([1.0, 1.0])
    assert bh.summarize_pair(a)["prefill_p50_ms"] == pytest.approx(1062.0)
    report = {"date": "d", "settings": {"backend": "shm", "requests": 4}, "load_start": "1",
              "load_end": "2", "rows": [bh.summarize_pair(a), bh.summarize_pair(b)],
              "paired": {"push": delta}, "log_dir": "/tmp/x"}
    text = bh.format_handoff_report(report)
    assert ("push: TTFT 61.00 [61.00, 61.00] ms, hand-off 1.00 ms, wire 0.00 ms (4 rounds); "
            "P's prefill 60.00 ms, TTFT less P's prefill 1.00 [1.00, 1.00] ms") in text
    assert "read TTFT less P's prefill, not TTFT" in text


def test_report_text_names_the_bar() -> None:
    rows = [bh.summarize_pair(_cell("wake", [2.0], [30.0])),
            bh.summarize_pair(_cell("nowake", [5.0], [33.0]))]
    report = {"date": "d", "settings": {"backend": "shm", "requests": 1}, "load_start": "1",
              "load_end": "2", "rows": rows, "idle": {"wake": (0.01, 0.02)},
              "paired": {"push": {"ttft_ms": -3.0, "handoff_ms": -3.0, "wire_ms": -1.5,
                                  "rounds": 1.0},
                         "pull": {"ttft_ms": -1.0, "handoff_ms": -2.0, "wire_ms": None,
                                  "rounds": 1.0}},
              "log_dir": "/tmp/x"}
    text = bh.format_handoff_report(report)
    assert "push hand-off minus wire p50 (wake): 1.00 ms (bar <= 2 ms: met)" in text
    assert "push: TTFT -3.00 ms, hand-off -3.00 ms, wire -1.50 ms (1 rounds)" in text
    assert "pull: TTFT -1.00 ms, hand-off -2.00 ms (1 rounds)" in text
    report["paired"]["pull"]["ttft_ci_ms"] = [-1.5, -0.25]
    assert "pull: TTFT -1.00 [-1.50, -0.25] ms, hand-off -2.00 ms (1 rounds)" in (
        bh.format_handoff_report(report))
    assert "wake    idle" in text
