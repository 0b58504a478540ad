"""The pure parts of ``kvbridge bench mix``'s replay (kvbridge.tools.bench.mix, mix_cli)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.mix import (
    Outcome,
    cache_salt,
    format_goodput,
    format_rate,
    mark_mismatches,
    parse_plan_header,
    parse_policies,
    plot_rows,
    request_body,
    summarize,
)
from kvbridge.tools.bench.mix_cli import parse_max_tokens
from kvbridge.tools.bench.mix_workload import generate_trace


def test_plan_header_is_read_leniently() -> None:
    h = "path=local; est_ms=12.3; local=12.3; push=40.1; pull=55.0; why=fastest"
    assert parse_plan_header(h) == {"path": "local", "est_ms": "12.3", "local": "12.3",
                                    "push": "40.1", "pull": "55.0", "why": "fastest"}
    assert parse_plan_header(" Path = push ;;junk; =x;why=a=b") == {"path": "push", "why": "a=b"}
    assert parse_plan_header(None) == {} and parse_plan_header("") == {}


def test_policies_put_the_reference_first_and_refuse_unknown_ones() -> None:
    assert parse_policies("push,pull,local,auto") == ("local", "push", "pull", "auto")
    assert parse_policies(" auto , auto,push") == ("auto", "push")
    # plan is auto's other name (the planner): one policy, one run; headroom is the old auto
    assert parse_policies("plan,headroom,auto") == ("auto", "headroom")
    for bad in ("", "push,teleport"):
        with pytest.raises(ConfigError, match="--policies"):
            parse_policies(bad)


def test_salts_differ_per_policy_seed_and_rate() -> None:
    salts = {cache_salt(p, s, r) for p in ("push", "local") for s in (0, 1) for r in (2.0, 4.0)}
    assert len(salts) == 8
    req = generate_trace(3, 2.0, 0).requests[1]
    body = request_body(req, "mix-x")
    assert body["prompt"] == list(req.prompt) and body["max_tokens"] == req.max_tokens
    assert body["cache_salt"] == "mix-x" and body["stream"] is True
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True


def test_max_tokens_flag() -> None:
    assert parse_max_tokens("8,16") == (8, 16) and parse_max_tokens("4") == (4, 4)
    for bad in ("a,b", "1,2,3"):
        with pytest.raises(ConfigError, match="--max-tokens"):
            parse_max_tokens(bad)


def _ok(i: int, klass: str, ttft: float, e2e: float, ids: list[int],
        path: str | None = None) -> Outcome:
    return Outcome(i, klass, ok=True, ttft_s=ttft, e2e_s=e2e, tokens=len(ids), token_ids=ids,
                   path=path)


def test_summary_counts_slo_mismatches_failures_and_paths() -> None:
    ref = {0: _ok(0, "short", 0.1, 0.2, [5, 6, 7]), 1: _ok(1, "long", 0.1, 0.2, [8, 9]),
           2: _ok(2, "long", 0.1, 0.2, [1, 2])}
    runs = [_ok(0, "short", 0.05, 0.15, [5, 6, 7], "local"),   # TPOT 50 ms: meets 60
            _ok(1, "long", 0.9, 1.0, [8, 10], "push"),        # TTFT misses; mismatch
            Outcome(2, "long", ok=False, error="HTTP 503")]
    mark_mismatches(runs, ref)
    assert [o.mismatch for o in runs] == [False, True, None]
    rows = summarize(runs, wall_s=2.0, ttft_slo_ms=500, tpot_slo_ms=60)
    assert [r["class"] for r in rows] == ["short", "long", "all"]
    whole = rows[-1]
    assert whole["count"] == 3 and whole["failures"] == 1 and whole["mismatches"] == 1
    assert whole["slo_met"] == 1 and whole["goodput_rps"] == 0.5
    assert whole["paths"] == {"local": 1, "push": 1}
    assert whole["ttft_p50_ms"] == pytest.approx(475.0)
    assert rows[0]["tpot_p50_ms"] == pytest.approx(50.0)
    assert summarize(runs, 2.0, 500, 40)[-1]["slo_met"] == 0  # TPOT 50 ms > 40
    assert summarize([_ok(0, "short", 0.1, 0.2, [1])], 1.0, 500, 50)[-1]["mismatches"] is None


def test_tables_use_the_shared_printer() -> None:
    rows = summarize([_ok(0, "short", 0.1, 0.2, [1, 2], "local")], 1.0, 500, 500)
    entry = {"rate": 2.0, "policies": [{"policy": "local", "rows": rows, "p_requests": 0.0},
                                       {"policy": "auto", "rows": rows},
                                       {"policy": "push", "error": "boom"}]}
    text = format_rate(entry)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["policy", "class", "n"] and set(lines[1]) <= {"-", " "}
    assert "local 100%" in text and "ref" in text and "error: boom" in text
    g = format_goodput({"rates": [entry, {**entry, "rate": 4.0}]})
    assert "2 req/s" in g and "4 req/s" in g and "1.00" in g


@pytest.mark.parametrize(("extra", "message"), [
    (["--disk-tier", "--proxy", "http://127.0.0.1:9"], "--disk-tier"),
    (["--slow-tier-at", "5"], "--slow-tier-at needs --disk-tier"),
    (["--shares", "short=1,disk=1"], "the disk class needs --disk-tier"),
    (["--disk-tier", "--slow-tier-at", "5", "--slow-tier-ms", "0"], "--slow-tier-ms"),
    (["--disk-tier", "--slow-tier-at", "5", "--slow-tier-for", "0"], "--slow-tier-for"),
])
def test_disk_tier_flags_are_checked_before_anything_starts(
        capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    from kvbridge.tools import cli

    code = cli.main(["bench", "mix", "--num-requests", "4", *extra])
    err = capsys.readouterr().err
    assert code != 0 and message in err, err


def _report(tmp_path: Path) -> Path:
    rows = summarize([_ok(0, "short", 0.1, 0.2, [1, 2], "local")], 1.0, 500, 500)
    report = {"kind": "kvbridge-bench-mix", "date": "2026-12-06", "url": "u",
              "settings": {"fleet": "1P1D", "backend": "shm", "policies": ["local", "auto"],
                           "num_requests": 1, "seed": 0, "ttft_slo_ms": 500.0,
                           "tpot_slo_ms": 40.0},
              "rates": [{"rate": r, "counts": {"short": 1},
                         "policies": [{"policy": "local", "rows": rows},
                                      {"policy": "auto", "rows": rows},
                                      {"policy": "push", "error": "boom"}]}
                        for r in (2.0, 4.0)]}
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(report))
    return path


def test_the_figure_draws_the_whole_mix_per_policy_against_the_rate(tmp_path: Path) -> None:
    """One point per policy and rate from the ``all`` row (a policy that failed has none);
    ``--plot-only`` draws an earlier report without starting anything."""
    report = json.loads(_report(tmp_path).read_text())
    points = plot_rows(report)
    assert [(p["policy"], p["rate"]) for p in points] == [
        ("local", 2.0), ("auto", 2.0), ("local", 4.0), ("auto", 4.0)]
    assert all(p["class"] == "all" and p["goodput_rps"] == 1.0 for p in points)
    pytest.importorskip("matplotlib")
    from kvbridge.tools import cli

    png = tmp_path / "fig" / "mix.png"
    assert cli.main(["bench", "mix", "--plot-only", str(tmp_path / "mix.json"),
                     "--plot", str(png)]) == 1  # push's error makes the report unclean
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content", ["{not json", '{"kind": "something else"}', "[]"])
def test_plot_only_refuses_what_is_not_a_mix_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str) -> None:
    from kvbridge.tools import cli

    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert cli.main(["bench", "mix", "--plot-only", str(bad)]) != 0
    assert "--plot-only: cannot read" in capsys.readouterr().err
    assert cli.main(["bench", "mix", "--plot-only", str(tmp_path / "missing.json")]) != 0
