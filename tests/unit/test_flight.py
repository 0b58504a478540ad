"""The proxy's flight log and the join of a request's records (kvbridge.proxy.flight)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.proxy.flight import Flight, FlightLog, critical_path, safe_request_id

PROXY = {"receive": 100.000, "prefill_sent": 100.001, "prefill_answer": 100.060,
         "decode_sent": 100.061, "first_token": 100.120}
P_PUSH = {"arrived": 100.003, "scheduled": 100.005, "kv_ready": 100.050,
          "write_posted": 100.051, "write_done": 100.070}
D_PUSH = {"recv_done": 100.071, "recv_seen": 100.072, "first_step": 100.075}


def test_the_log_keeps_the_newest_flights_and_a_reused_id_replaces_the_older() -> None:
    log = FlightLog(capacity=3)
    for i in range(5):
        log.add(Flight(f"r{i}"))
    assert len(log) == 3 and log.get("r0") is None and log.get("r4") is not None
    again = Flight("r2")
    log.add(again)
    assert log.get("r2") is again and len(log) == 3


@pytest.mark.parametrize("rid", ["", "x" * 129, "-leading-dash", "a b", "a/b", "a\nb", "é",
                                 None, "a%2Fb", "a\x00"])
def test_unsafe_request_ids_are_refused(rid: str | None) -> None:
    assert safe_request_id(rid) is None


@pytest.mark.parametrize("rid", ["kvb-0123abcd", "x" * 128, "client.req:7@eu-1", "A_b-1"])
def test_safe_request_ids_are_kept(rid: str) -> None:
    assert safe_request_id(rid) == rid


def test_a_retry_starts_the_attempt_steps_again() -> None:
    f = Flight("r")
    f.attempt("push", "xfer-1", "http://p:1", "http://d:1")
    f.mark("prefill_sent")
    f.attempt("pull", "xfer-2", "http://p:2")
    assert set(f.steps) == {"receive"} and f.retries == 1 and f.tid == "xfer-2"
    f.mark("first_token")
    row = f.row()
    assert row["proxy"]["first_token"] >= row["proxy"]["receive"]


def test_push_phases_sum_to_the_proxy_ttft_and_name_each_step() -> None:
    path = critical_path("push", PROXY, P_PUSH, D_PUSH)
    assert sum(p["seconds"] for p in path) == pytest.approx(0.120)
    named = {p["phase"]: p["seconds"] for p in path}
    assert named["wire (WRITE)"] == pytest.approx(0.019)
    assert named["P prefill"] == pytest.approx(0.045)
    assert named["D first step → first token out"] == pytest.approx(0.045)
    assert [p["hop"] for p in path].count(True) == 3  # proxy→P, P→D, D→proxy


def test_skewed_engine_clocks_move_only_the_hops_never_the_sum() -> None:
    skewed_p = {k: v + 7.5 for k, v in P_PUSH.items()}  # P's clock 7.5 s ahead
    skewed_d = {k: v - 3.0 for k, v in D_PUSH.items()}
    base = {p["phase"]: p["seconds"] for p in critical_path("push", PROXY, P_PUSH, D_PUSH)}
    path = critical_path("push", PROXY, skewed_p, skewed_d)
    assert sum(p["seconds"] for p in path) == pytest.approx(0.120)
    for p in path:
        if not p["hop"]:
            assert p["seconds"] == pytest.approx(base[p["phase"]])


def test_pull_path_and_missing_steps_span_to_the_next_recorded_one() -> None:
    p = {"arrived": 100.003, "scheduled": 100.005, "kv_ready": 100.050}
    d = {"arrived": 100.062, "scheduled": 100.063, "recv_start": 100.064,
         "read_posted": 100.066, "recv_done": 100.080, "first_step": 100.090}  # no recv_seen
    path = critical_path("pull", PROXY, p, d)
    assert sum(x["seconds"] for x in path) == pytest.approx(0.120)
    names = [x["phase"] for x in path]
    assert "wire (READ)" in names and "D admission wait (queue, KV allocation)" in names
    assert "D.recv_done → D.first_step" in names  # the step in between is missing
    # an engine that answered nothing: its part is one span, the sum still holds
    only_proxy = critical_path("pull", PROXY, None, None)
    assert sum(x["seconds"] for x in only_proxy) == pytest.approx(0.120)


def test_no_path_before_the_first_token() -> None:
    assert critical_path("push", {"receive": 1.0}, P_PUSH, D_PUSH) == []


def test_kvbridge_why_prints_every_phase_and_marks_the_hops() -> None:
    from kvbridge.tools.why import format_why, render_why

    row = {"request_id": "r1", "mode": "push", "transfer_id": "xfer-1", "retries": 0,
           "outcome": "ok", "prefill": "http://p", "decode": "http://d",
           "engines": {"P": "http://p: recorded", "D": "http://d: no record (evicted)"},
           "phases": critical_path("push", PROXY, P_PUSH, D_PUSH)}
    head, rows = format_why(row)
    assert any("D: http://d: no record" in h for h in head)
    assert any("120.0 ms" in h for h in head)
    assert [r[0] for r in rows].count("wire (WRITE)") == 1
    assert sum(1 for r in rows if str(r[0]).endswith(" *")) == 3
    assert format_why({**row, "phases": []})[1] == []
    lines = render_why(row, 100)
    assert lines[:len(head)] == head and len(lines) == len(head) + 2 + len(rows)
    assert lines[len(head)].split() == ["phase", "ms", "%", "from", "→", "to"]


def test_kvbridge_why_plots_a_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvbridge.tools.why import plot_why

    plot_why({"request_id": "r1", "mode": "push",
              "phases": critical_path("push", PROXY, P_PUSH, D_PUSH)}, str(tmp_path / "w.png"))
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"


def test_a_wait_in_the_proxys_socket_starts_the_path_earlier_and_survives_a_retry() -> None:
    f = Flight("r")
    f.waited(None)
    f.waited(0)
    assert "arrived" not in f.steps
    f.waited(7_000_000)
    assert f.steps["receive"] - f.steps["arrived"] == 7_000_000
    f.attempt("push", "xfer-1", "http://p:1", "http://d:1")
    f.attempt("push", "xfer-2", "http://p:2", "http://d:2")
    assert set(f.steps) == {"arrived", "receive"}
    proxy = {"arrived": 99.993, **PROXY}
    path = critical_path("push", proxy, P_PUSH, D_PUSH)
    assert path[0]["phase"] == "in the proxy's socket (before its handler ran)"
    assert path[0]["seconds"] == pytest.approx(0.007) and not path[0]["hop"]
    assert sum(p["seconds"] for p in path) == pytest.approx(0.127)
    pulled = critical_path("pull", proxy, None, None)
    assert pulled[0]["from"] == "proxy.arrived" and sum(
        p["seconds"] for p in pulled) == pytest.approx(0.127)
