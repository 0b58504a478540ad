"""``kvbridge simulate``: the subcommands in process (fast), their argument errors, the plots
they write, and validation against the committed bench serve results. No engines."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from kvbridge.tools import cli
from kvbridge.tools.simulate.profile import load_profile, profile_to_dict
from kvbridge.tools.simulate.validate import load_results, setup_mode, validate, within

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "bench_serve-2026-12-03.json"
PNG = b"\x89PNG\r\n\x1a\n"
DEDICATED = Path(tempfile.mkdtemp(prefix="kvbridge-sim-cli-")) / "host-dedicated.json"
SMALL = ["--profile", str(DEDICATED), "--requests", "60"]


@pytest.fixture(autouse=True, scope="module")
def _dedicated_host() -> None:
    """The host profile's costs on dedicated cores (no cpu section): fast, and the sizing
    questions below ask about fleets, not about this 2-core box."""
    doc = profile_to_dict(load_profile("host"))
    doc.pop("cpu", None)
    DEDICATED.write_text(json.dumps(doc))


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["simulate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_run_prints_percentiles_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "run", *SMALL, "--rate", "20")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("profile host: 1P1D, 60 requests at 20 req/s")
    assert lines[1].split()[:8] == ["mode", "fleet", "rate", "done", "TTFT", "p50", "p90", "p99"]
    # every mode once: plan is auto's other name, not another run
    assert [line.split()[0] for line in lines[3:]] == ["pull", "push", "auto", "headroom",
                                                       "local"]


def test_run_json_and_fleet_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "run", *SMALL, "--rate", "20", "--mode", "push",
                       "--prefills", "2", "--decodes", "3", "--json")
    assert code == 0
    [row] = json.loads(out)
    assert (row["mode"], row["prefills"], row["decodes"], row["completed"]) == ("push", 2, 3, 60)
    assert set(row["ttft_ms"]) == {"p50", "p90", "p99", "mean"}


def test_run_from_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([{"arrival_s": i * 0.05, "prompt_len": 100 + i,
                                  "output_len": 8} for i in range(40)]))
    code, out, _ = run(capsys, "run", "--profile", str(DEDICATED), "--trace", str(trace),
                       "--json")
    assert code == 0 and [r["completed"] for r in json.loads(out)] == [40] * 5


def test_sweep_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "sweep.png"
    code, out, _ = run(capsys, "sweep", *SMALL, "--rates", "5,10,20", "--plot", str(plot))
    assert code == 0 and plot.read_bytes().startswith(PNG)
    assert f"plot: {plot}" in out
    assert sum(1 for line in out.splitlines() if line.split()[:1] in (["pull"], ["push"])) == 6


def test_sweep_prints_the_table_and_plots_only_when_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "sweep", *SMALL, "--rates", "5,10", "--mode", "push")
    assert code == 0 and not err
    assert [line.split()[0] for line in out.splitlines()[3:]] == ["push", "push"]
    assert "plot" not in out and list(tmp_path.iterdir()) == []  # no PNG by default


def test_sweep_without_matplotlib_prints_the_table_then_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As on a host without matplotlib: its import fails (issue 31 item 1)."""
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)
    plot = tmp_path / "sweep.png"
    code, out, err = run(capsys, "sweep", *SMALL, "--rates", "5,10", "--mode", "push",
                         "--plot", str(plot))
    assert code == 1 and not plot.exists()
    assert [line.split()[0] for line in out.splitlines()[3:]] == ["push", "push"]
    assert err == (f"kvbridge: error: --plot {plot}: not drawn, matplotlib is not installed "
                   "(pip install matplotlib)\n")


@pytest.mark.parametrize("args, why", [
    (["--rate", "20", "--ttft-slo", "0.001"], "the lowest TTFT p90 of a fleet that keeps up is"),
    (["--rate", "20", "--ttft-slo", "100000", "--tpot-slo", "0.0001"],
     "the lowest TPOT p90 of a fleet within the TTFT SLO is"),
    (["--rate", "100000", "--ttft-slo", "100000"], "no fleet keeps up: the best, 1P1D, completes"),
])
def test_size_with_an_impossible_slo_fails_and_says_why(
        capsys: pytest.CaptureFixture[str], args: list[str], why: str) -> None:
    code, out, err = run(capsys, "size", *SMALL, "--mode", "push", "--max-engines", "2", *args)
    assert code == 1
    assert out.splitlines()[-1].split()[:2] == ["push", "none"]
    assert err.startswith("kvbridge: error: push: no fleet of up to 2 engines meets the SLO: "
                          + why), err
    assert len(err.splitlines()) == 1
    code, out, err = run(capsys, "size", *SMALL, "--mode", "push", "--max-engines", "2",
                         *args, "--json")
    assert code == 1 and json.loads(out)[0]["chosen"] is None and why in err


def test_size_answers_a_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "size", "--profile", str(DEDICATED), "--requests", "200",
                       "--mode",
                       "push", "--rate", "150", "--prompt-len", "400", "--ttft-slo", "80",
                       "--tpot-slo", "15", "--max-engines", "6")
    assert code == 0
    row = out.splitlines()[-1].split()
    assert row[0] == "push" and row[1].endswith("D") and row[1] != "none"


def test_profiles_lists_and_shows_sources(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "profiles")
    assert code == 0 and {"host", "seeds"} <= {line.split()[0] for line in out.splitlines()[2:]}
    code, out, _ = run(capsys, "profiles", "seeds")
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("pull.per_desc_s"))
    assert "PR #35264" in line


@pytest.mark.parametrize("args, message", [
    (["run", "--mode", "sideways"], "--mode: unknown mode 'sideways'"),
    (["run", "--rate", "-1"], "--rate: must be > 0"),
    (["run", "--prefix-hit", "1.5"], "--prefix-hit: must be in [0, 1)"),
    (["run", "--fragmentation", "2"], "--fragmentation: must be in [0, 1]"),
    (["run", "--requests", "0"], "--requests: must be > 0"),
    (["run", "--decodes", "100000"], "--decodes: must be in 0..256"),
    (["run", "--push-headroom", "-1"], "--push-headroom: must be in 0..1048576"),
    (["run", "--prompt-len", "10-5"], "--prompt-len"),
    (["run", "--profile", "nope"], "--profile: 'nope' is neither a shipped profile"),
    (["run", "--set", "link=1"], "--set: expected SECTION.KEY=VALUE"),
    (["run", "--set", "decode.step_base_s=-2"], "decode.step_base_s: must be >= 0"),
    (["sweep", "--rates", ""], "--rates"),
    (["size", "--rate", "5", "--ttft-slo", "0"], "--ttft-slo / --tpot-slo: must be > 0"),
    (["size", "--rate", "5", "--ttft-slo", "9", "--percentile", "75"], "--percentile"),
    (["size", "--rate", "5", "--ttft-slo", "9", "--max-engines", "1"], "--max-engines"),
    (["size", "--rate", "5", "--ttft-slo", "9", "--max-engines", "500"], "--max-engines"),
    (["validate", "--results", "/nonexistent.json"], "--results: cannot read"),
    (["validate", "--results", str(RESULTS), "--tolerance", "0"], "--tolerance"),
    (["validate", "--results", str(RESULTS), "--repeats", "0"], "--repeats"),
    (["validate", "--results", str(RESULTS), "--setup-prefix", "x-"], "no row of"),
])
def test_bad_options_are_one_line_errors(capsys: pytest.CaptureFixture[str], args: list[str],
                                         message: str) -> None:
    code, _, err = run(capsys, *args)
    assert code == 1
    assert err.startswith("kvbridge: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["run", "--rate", "x"], ["sweep"], ["size", "--rate", "1"],
                                  ["validate"], ["bogus"], ["run", "--arrival", "gamma"]])
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", *args])
    assert info.value.code == 2


@pytest.mark.parametrize("body, message", [
    ("[]", "not a kvbridge bench serve results file"),
    ('{"kind": "kvbridge-bench-serve", "settings": {}, "rows": []}', "settings.input_len"),
    ('{"kind": "kvbridge-bench-serve", "settings": {"input_len": 5, "output_len": 2, '
     '"num_prompts": 4}, "rows": {}}', "'rows' (list)"),
    ("nope", "is not JSON"),
])
def test_bad_results_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str,
                           message: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(body)
    code, _, err = run(capsys, "validate", "--results", str(path))
    assert code == 1 and message in err, err


def test_validate_against_the_committed_results(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "v.png"
    code, out, _ = run(capsys, "validate", "--results", str(RESULTS), "--repeats", "3",
                       "--plot", str(plot))
    assert code == 0 and plot.read_bytes().startswith(PNG)
    rows = [line.split() for line in out.splitlines() if line.startswith("kvbridge-")]
    assert {(r[0], r[2]) for r in rows} == {(f"kvbridge-{m}", str(rate)) for m in
                                            ("pull", "push", "auto") for rate in (2, 4, 8, 16)}
    assert "ttft_p50:" in out and "tpot_p50:" in out


def test_validate_reads_the_fleet_shape(tmp_path: Path) -> None:
    data = load_results(RESULTS)
    data["settings"] = {**data["settings"], "prefill_engines": 2, "decode_engines": 2}
    data["rows"] = [r for r in data["rows"] if r["setup"] == "kvbridge-push"][:1]
    rows = validate(load_profile("host"), data, repeats=2)
    assert [(r.fleet, r.mode) for r in rows] == [("2P2D", "push")]
    assert rows[0].measured["ttft_p50"] == data["rows"][0]["ttft_p50"]
    assert within(rows[0], "ttft_p50", 10.0) is True


def test_validate_simulates_a_version_1_auto_row_as_headroom() -> None:
    """A results file of version 1 was written while auto was the headroom rule: its
    kvbridge-auto rows are simulated as headroom; from version 2 on, kvbridge-auto is the
    planner and kvbridge-headroom the rule."""
    data = load_results(RESULTS)
    assert data["version"] == 1
    data["rows"] = [r for r in data["rows"] if r["setup"] == "kvbridge-auto"][:1]
    assert [r.mode for r in validate(load_profile("host"), data, repeats=1)] == ["headroom"]
    assert setup_mode("kvbridge-auto") == "auto" and setup_mode("kvbridge-auto", 1) == "headroom"
    assert setup_mode("kvbridge-headroom") == "headroom" and setup_mode("vllm-nixl") is None
    data["version"] = 2
    assert [r.mode for r in validate(load_profile("host"), data, repeats=1)] == ["auto"]


def test_published_compares_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "published", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["num_prompts"] == 100 and doc["limits"] == {"pull": 9, "push": 12}
    roles = [r["role"] for r in doc["rows"]]
    assert roles.count("held out") == 4 and roles.count("fitted (req/s)") == 2
    for r in doc["rows"]:
        assert r["simulated_req_s"] > 0 and r["published_req_s"] > 0
    code, out, _ = run(capsys, "published")
    assert code == 0 and "pull 512/128 @ 8" in out and "PR #35264" in out


@pytest.mark.parametrize("seeds", ["x", "", "-1", ",".join(["1"] * 101)])
def test_published_refuses_bad_seeds(capsys: pytest.CaptureFixture[str], seeds: str) -> None:
    code, _, err = run(capsys, "published", "--seeds", seeds)
    assert code == 1 and "--seeds" in err


def test_published_names_the_pr_by_its_url(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The source line is printed as is: the PR's own address, no mangled mirror (issue 31)."""
    from kvbridge.tools.simulate import cli as sim_cli

    keys = ("mean_ttft", "median_ttft", "p99_ttft", "mean_tpot", "req_s")
    monkeypatch.setattr(sim_cli, "simulate_row", lambda *_a: dict.fromkeys(keys, 1.0))
    code, out, _ = run(capsys, "published")
    assert code == 0
    assert out.splitlines()[0] == (
        "vLLM PR #35264 (snadampal, 2026-02-25), 'Benchmarking results': vllm bench serve, "
        "sonnet dataset, AWS P5en, P/D TP 4; https://github.com/vllm-project/vllm/pull/35264; "
        "the rows after 512/128/8 are cut off")
