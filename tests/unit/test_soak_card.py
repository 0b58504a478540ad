"""The chaos soak's pure parts (``kvbridge.tools.bench.soak_card``): the seeded fault schedule,
the short failure reasons and the report card. Starts nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvbridge.tools.bench.soak_card import (
    CONNECTORS,
    DEFAULT_FAULTS,
    ENGINES,
    FAULTS,
    PROXY_MODES,
    ROLLING_ORDER,
    SCHEDULED,
    TIERS,
    Outcome,
    Window,
    applicable,
    card,
    card_rows,
    code_rows,
    code_version,
    proxy_mode,
    reason,
    repeat_of,
    rolling,
    rolling_order,
    schedule,
)


def test_a_seed_gives_one_schedule_within_the_run_and_its_quiet_ends() -> None:
    a = schedule(7, 600, SCHEDULED)
    assert a == schedule(7, 600, SCHEDULED)
    assert a != schedule(8, 600, SCHEDULED)
    assert a[0].at_s == 20.0 and all(f.at_s <= 570 for f in a)
    assert all(25 <= b.at_s - x.at_s <= 50.1 for x, b in zip(a, a[1:], strict=False))
    assert {f.kind for f in a} <= set(SCHEDULED)
    for f in a:
        assert (f.target == "proxy") == (f.kind == "proxy")
        assert (f.target == TIERS) == (f.kind == "slow_disk")
        assert f.target in (*ENGINES, "proxy", TIERS)
        if f.kind == "stop":
            assert 2 <= f.hold_s <= 12 and f.delay_ms == 0
        elif f.kind == "slow_disk":
            assert 10 <= f.hold_s <= 40 and 300 <= f.delay_ms <= 1500
        else:
            assert f.hold_s == 0 and f.delay_ms == 0


def test_adding_the_slow_disk_fault_left_the_other_kinds_schedules_as_they_were() -> None:
    """A soak without ``slow_disk`` draws what it drew before the fault existed (seed 5's
    30-minute card of 2026-12-05 began with these), so recorded runs can be re-run."""
    old = schedule(5, 1800, DEFAULT_FAULTS)
    assert [(f.at_s, f.kind, f.target) for f in old[:4]] == [
        (20.0, "drain", "D0"), (64.9, "kill", "D1"), (109.3, "stop", "P0"),
        (137.1, "proxy", "proxy")] and len(old) == 47
    assert all(f.kind != "slow_disk" for f in schedule(5, 1800, DEFAULT_FAULTS))
    assert "slow_disk" not in DEFAULT_FAULTS and set(DEFAULT_FAULTS) < set(FAULTS)
    slow = [f for f in schedule(2, 1800, ["slow_disk", "kill"]) if f.kind == "slow_disk"]
    assert slow and len({f.delay_ms for f in slow}) > 1  # a seeded delay per fault


def test_only_enabled_faults_are_scheduled_and_a_moment_less_fault_schedules_nothing() -> None:
    assert {f.kind for f in schedule(3, 1200, ["stop"])} == {"stop"}
    assert schedule(3, 1200, ["transfer_error"]) == []
    assert schedule(3, 40, SCHEDULED) == []  # shorter than warm-up plus the quiet tail
    with pytest.raises(ValueError, match="unknown faults"):
        schedule(3, 600, ["meteor"])


def test_vllm_nixl_takes_only_the_faults_that_apply_to_it() -> None:
    assert applicable("kvbridge", FAULTS) == list(FAULTS)
    assert applicable("vllm-nixl", ["kill", "stop", "drain", "proxy"]) == list(CONNECTORS[
        "vllm-nixl"])
    for bad in ("transfer_error", "slow_disk"):
        with pytest.raises(ValueError, match=f"{bad} do not apply to --connector vllm-nixl"):
            applicable("vllm-nixl", ["kill", bad])
    with pytest.raises(ValueError, match="unknown connector"):
        applicable("lmcache", ["kill"])
    with pytest.raises(ValueError, match="unknown faults"):
        applicable("kvbridge", ["meteor"])


def test_repeats_are_seeded_earlier_requests_and_none_without_a_share() -> None:
    assert [repeat_of(1, i, 0.0) for i in range(50)] == [None] * 50
    picks = [repeat_of(1, i, 0.3) for i in range(2000)]
    assert picks == [repeat_of(1, i, 0.3) for i in range(2000)]
    assert picks != [repeat_of(2, i, 0.3) for i in range(2000)]
    assert picks[0] is None and all(j is None or 0 <= j < i for i, j in enumerate(picks))
    assert 500 < sum(j is not None for j in picks) < 700  # about 30 %
    assert all(repeat_of(1, i, 1.0) is not None for i in range(1, 20))


def test_a_rolling_upgrade_drains_every_engine_once_prefill_first_no_other_fault() -> None:
    plan = rolling(60)
    assert [f.target for f in plan] == list(ROLLING_ORDER) and set(ROLLING_ORDER) == set(ENGINES)
    assert ROLLING_ORDER[:2] == ("P0", "P1")
    assert all(f.kind == "drain" and f.at_s == 60.0 and f.hold_s == 0 for f in plan)
    assert [f.target for f in rolling(0, ["D1", "P0"])] == ["D1", "P0"]
    for bad in ((-1.0, ROLLING_ORDER), (10.0, ["P0", "P0"]), (10.0, ["proxy"])):
        with pytest.raises(ValueError, match="bad rolling upgrade"):
            rolling(*bad)


def test_a_rolling_order_names_every_engine_exactly_once() -> None:
    assert rolling_order("D0,D1,P0,P1") == ("D0", "D1", "P0", "P1")
    assert rolling_order(" P1, D0 ,D1,P0 ") == ("P1", "D0", "D1", "P0")
    assert rolling_order(",".join(ROLLING_ORDER)) == ROLLING_ORDER
    for bad, why in (("D0,D1,P0", "missing P1"), ("D0,D1,P0,P1,P0", "twice P0"),
                     ("D0,D1,P0,P2", "unknown P2; missing P1"), ("", "missing P0, P1, D0, D1"),
                     ("d0,D1,P0,P1", "unknown d0; missing D0")):
        with pytest.raises(ValueError, match="exactly once") as info:
            rolling_order(bad)
        assert f"({why})" in str(info.value)
    assert [f.target for f in rolling(5, rolling_order("D0,D1,P0,P1"))] == ["D0", "D1", "P0", "P1"]


def test_the_proxy_mode_defaults_to_headroom_and_vllm_nixl_takes_pull_only() -> None:
    assert proxy_mode("kvbridge", None) == "headroom" and proxy_mode("vllm-nixl", None) == "pull"
    assert all(proxy_mode("kvbridge", m) == m for m in PROXY_MODES)
    assert set(PROXY_MODES) == {"pull", "push", "headroom", "auto"}  # local hands nothing off
    assert proxy_mode("vllm-nixl", "pull") == "pull"
    with pytest.raises(ValueError, match="pull mode only, not push"):
        proxy_mode("vllm-nixl", "push")
    with pytest.raises(ValueError, match="unknown mode 'local'"):
        proxy_mode("kvbridge", "local")


def test_the_card_says_the_proxy_mode_and_the_rolling_order() -> None:
    c = card([], [], {}, extra={"proxy_mode": "pull", "order": ["D0", "D1", "P0", "P1"]})
    rows = dict((r[0], r[1]) for r in card_rows(c))
    assert rows["proxy mode"] == "pull" and rows["rolling order"] == "D0, D1, P0, P1"
    assert "rolling order" not in dict((r[0], r[1]) for r in card_rows(card([], [], {})))


def test_reasons_fold_numbers_and_addresses_so_that_failures_count_together() -> None:
    a = reason(503, 'POST http://127.0.0.1:1234/v1/completions -> HTTP 503: {"error": '
                    '{"message": "no decode engine up after 3 tries (tid 0123abcdef99)"}}')
    b = reason(503, 'POST http://127.0.0.1:999/v1/completions -> HTTP 503: {"error": '
                    '{"message": "no decode engine up after 4 tries (tid ffffabcdef00)"}}')
    assert a == b and a.startswith("HTTP 503: no decode engine up")
    assert reason(0, "POST x failed: <urlopen error [Errno 111] Connection refused>") == \
        "connection refused (nothing listening)"
    assert reason(0, "stream from x reported an error: {'type': 'decode_error', 'x': 1}") == \
        "stream ended with an in-band error event (decode_error)"


def _o(i: int, start: float, end: float, status: int = 200, why: str = "",
       ttft: float | None = None, correct: bool | None = True) -> Outcome:
    return Outcome(i, ttft is not None, 64, 8, start, end, status, why, ttft, correct)


def test_the_card_counts_failures_wrong_outputs_leaks_and_splits_ttft_by_fault_windows() -> None:
    outcomes = [_o(0, 0, 1, ttft=0.1), _o(1, 2, 3, ttft=0.3),  # quiet
                _o(2, 10, 12, ttft=0.9),  # overlaps the kill window
                _o(3, 11, 14, 0, "connection reset", correct=None),
                _o(4, 21, 22, ttft=0.5),  # within settle_s after the window: a fault's
                _o(5, 40, 41, correct=False), _o(6, 42, 43, correct=None)]
    c = card(outcomes, [Window("kill", "P0", 10, 18)], {"P0": 0, "D1": 2}, settle_s=5,
             extra={"seed": 1})
    assert (c["sent"], c["ok"], c["failed"], c["failed_during_faults"]) == (7, 6, 1, 1)
    assert c["failed_by_reason"] == {"connection reset": 1}
    assert (c["wrong"], c["wrong_requests"], c["unchecked"]) == (1, [5], 1)
    assert (c["leaked_total"], c["longest_failure_s"]) == (2, 3.0)
    assert c["ttft_quiet_ms"] == {"n": 2, "p50": 200.0, "p99": 298.0}
    assert c["ttft_faults_ms"]["n"] == 2 and c["ttft_faults_ms"]["p50"] == 700.0
    assert c["ttft_p99_ratio"] == round(0.896 / 0.298, 2)  # p99s unrounded: 896 / 298 ms
    assert c["faults"] == {"kill": 1} and c["seed"] == 1
    rows = dict((r[0], r[1]) for r in card_rows(c))
    assert rows["wrong outputs (must be 0)"] == "1"
    assert rows["blocks leaked (must be 0)"] == "P0 0, D1 2"
    assert rows["  failed: connection reset"] == "1"
    assert rows["TTFT p99 faults / quiet"] == "3.01"


def test_an_engine_that_cannot_say_what_it_holds_is_not_measurable_not_zero() -> None:
    outcomes = [_o(0, 0, 1), Outcome(1, False, 64, 8, 2, 3, 200, correct=True, repeat_of=0)]
    c = card(outcomes, [], {"P0": None, "P1": None, "D0": 0, "D1": 1})
    assert (c["repeats"], c["leaked_total"], c["leaked_unmeasured"]) == (1, 1, ["P0", "P1"])
    rows = dict((r[0], r[1]) for r in card_rows(c))
    assert rows["blocks leaked (must be 0)"] == ("P0 not measurable, P1 not measurable, D0 0, "
                                                 "D1 1")
    assert rows["requests sent"] == "2 (1 re-sent an earlier prompt)"


def test_an_empty_run_has_a_card() -> None:
    c = card([], [], {})
    assert (c["sent"], c["wrong"], c["leaked_total"], c["longest_failure_s"]) == (0, 0, 0, 0.0)
    assert c["ttft_quiet_ms"]["p50"] is None and c["ttft_p99_ratio"] is None
    assert card_rows(c)[-1] == ["faults injected", "none"]


def _soak() -> ModuleType:
    """``benchmarks/soak.py`` as a module (its options only: nothing is started)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("benchmarks_soak_options", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_soak_takes_an_order_and_a_proxy_mode_and_names_the_flag_it_refuses(
        capsys: pytest.CaptureFixture[str]) -> None:
    soak = _soak()
    args = soak.parse_args(["--rolling", "--order", "D0,D1,P0,P1", "--proxy-mode", "pull"])
    assert (args.order, args.proxy_mode, args.faults) == (("D0", "D1", "P0", "P1"), "pull", [])
    args = soak.parse_args([])
    assert (args.order, args.proxy_mode) == (ROLLING_ORDER, "headroom")
    assert soak.parse_args(["--connector", "vllm-nixl"]).proxy_mode == "pull"
    for argv, flag in ((["--rolling", "--order", "D0,D1,P0"], "--order: 'D0,D1,P0'"),
                       (["--rolling", "--order", "D0,D0,P0,P1"], "--order:"),
                       (["--order", "D0,D1,P0,P1"], "--order: only with --rolling"),
                       (["--proxy-mode", "local"], "--proxy-mode"),
                       (["--connector", "vllm-nixl", "--proxy-mode", "push"],
                        "--proxy-mode: --connector vllm-nixl runs in pull mode only")):
        with pytest.raises(SystemExit) as info:
            soak.parse_args(argv)
        assert info.value.code == 2
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        soak.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--order NAMES" in text and "--proxy-mode {pull,push,headroom,auto}" in text


def test_an_upgrade_across_versions_runs_the_old_code_only_in_the_initial_fleet() -> None:
    assert [code_version(n, "from", "to") for n in (1, 2, 3)] == ["from", "to", "to"]
    assert [code_version(n, None, "to") for n in (1, 2)] == ["to", "to"]
    with pytest.raises(ValueError, match="count from 1"):
        code_version(0, "from", "to")


def test_the_card_names_both_commits_and_what_each_engine_ran() -> None:
    old = {"label": "from", "commit": "d9975cdf73fe0000", "subject": "2026-12-05 README",
           "path": "/tmp/old", "dirty": False}
    new = {"label": "to", "commit": "4f25fb71566c0000", "subject": "docs", "path": "/tmp/new",
           "dirty": True}
    code = {"from": old, "to": new, "engines": {"P0": ["from", "to"], "D1": ["from"]},
            "mapped": {"P0": [["/tmp/old"], ["/tmp/new"]], "D1": [[]]}}
    rows = dict(map(tuple, code_rows(code)))
    assert rows["code before (initial fleet)"].startswith("d9975cdf73 (2026-12-05 README)")
    assert "uncommitted" in rows["code after (successors, proxy)"]
    assert rows["  P0 ran"] == "d9975cdf73 -> 4f25fb7156 (mapped: /tmp/old -> /tmp/new)"
    assert rows["  D1 ran"] == "d9975cdf73 (mapped: ?)"
    assert code_rows({"from": None, "to": new, "engines": {"P0": ["to"]}}) == []
    c = card([], [], {}, extra={"code": code})
    assert ["code before (initial fleet)", rows["code before (initial fleet)"]] in card_rows(c)
