"""The simulator's D alone (``local``) and planner (``plan``) modes: local's TTFT has no hand-off
term, the proxy's real planner chooses local for short prompts at a low rate and hands long
prompts off under load, its goodput keeps up with the best fixed mode, runs are deterministic,
the proxy's TPOT guard keeps long prefills off a D whose decodes are slow, sizing may answer D
alone, and bad modes are refused naming the flag. Pure; a few seconds."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from kvbridge.proxy.planner import Path as PlanPath
from kvbridge.proxy.planner import Plan, PlannerSettings
from kvbridge.tools import cli
from kvbridge.tools.simulate.events import SimulationError
from kvbridge.tools.simulate.fleet import Fleet, simulate
from kvbridge.tools.simulate.metrics import check_invariants, summarize, ttft_s
from kvbridge.tools.simulate.profile import Profile, load_profile, profile_to_dict
from kvbridge.tools.simulate.sizing import Fleetspec, Slo, size_fleet
from kvbridge.tools.simulate.workload import Lengths, RequestSpec, Workload, generate

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def host() -> Profile:
    """This host's costs on dedicated cores (the shared-core model is not under test)."""
    return load_profile("host").replace(cpu=None)


OUTPUT = Lengths(16, 64)


def _specs(rate: float, prompt: Lengths, n: int = 300, output: Lengths = OUTPUT,
           seed: int = 0, arrival: str = "poisson") -> list[RequestSpec]:
    return generate(Workload(rate=rate, requests=n, prompt=prompt, output=output, seed=seed,
                             arrival=arrival))


def _run(profile: Profile, specs: list[RequestSpec], mode: str, prefills: int = 1,
         decodes: int = 1) -> Fleet:
    fleet = simulate(profile, specs, mode, prefills, decodes)
    check_invariants(fleet)
    return fleet


def _goodput(fleet: Fleet, slo_ms: float) -> float:
    """Requests whose TTFT met ``slo_ms`` per second, first arrival to last token."""
    ok = sum(1 for r in fleet.requests if ttft_s(fleet, r) * 1000.0 <= slo_ms)
    end = max(r.t_finish or 0.0 for r in fleet.requests)
    return ok / (end - min(r.spec.arrival for r in fleet.requests))


# -- local: D alone ---------------------------------------------------------------------------


def test_local_ttft_at_a_low_rate_is_d_prefill_plus_overheads(host: Profile) -> None:
    """Alone, a request's first token comes from D's one prefill step (the profile's prefill
    cost for the prompt) plus the proxy's legs: no transfer, no hand-off term."""
    prompt = 1000
    assert prompt <= host.prefill.max_batched_tokens  # one chunk
    specs = _specs(0.5, Lengths(prompt), n=20, output=Lengths(4), arrival="uniform")
    fleet = _run(host, specs, "local", prefills=0)
    px = host.proxy
    want = (px.client_s + px.request_s + px.per_prompt_token_s * prompt
            + host.prefill.step_time(prompt, prompt * prompt / 2) + px.stream_s)
    for r in fleet.requests:
        assert r.mode == "local" and r.p == -1 and r.t_kv_ready is None
        assert ttft_s(fleet, r) == pytest.approx(want, rel=1e-6)
    summary = summarize(fleet, 0.5)
    assert summary.handoff == {} and summary.prefills == 0
    push = summarize(_run(host, specs, "push"), 0.5)
    assert push.ttft["p50"] > summary.ttft["p50"]  # push pays the hand-off


def test_d_prefilling_slows_its_decodes(host: Profile) -> None:
    """Long prompts prefilled on D share D's steps with the requests decoding there."""
    specs = _specs(10, Lengths(4000), n=200)
    local = summarize(_run(host, specs, "local", prefills=0), 10)
    push = summarize(_run(host, specs, "push"), 10)
    assert local.tpot["p90"] > 2 * push.tpot["p90"]


def test_local_prefix_hit_is_not_computed(host: Profile) -> None:
    specs = _specs(0.5, Lengths(2000), n=10, output=Lengths(4), arrival="uniform")
    cold = summarize(simulate(host, specs, "local", 0, 1), 0.5)
    warm = simulate(host, specs, "local", 0, 1, prefix_hit=0.9)
    check_invariants(warm)
    assert summarize(warm, 0.5).ttft["p50"] < 0.5 * cold.ttft["p50"]


# -- plan: the proxy's planner -----------------------------------------------------------------


def test_plan_keeps_short_prompts_on_d_at_a_low_rate(host: Profile) -> None:
    """Mostly local; every settled decision with D idle is local. (With a request still
    decoding on D, local's estimate carries the planner's prior of 10 ms per queued request,
    which it learns only from local requests that met a queue: at this rate some of those go
    push, as on a real proxy.)"""
    fleet = _run(host, _specs(1, Lengths(200), n=200), "plan")
    paths = Counter(r.mode for r in fleet.requests)
    assert paths["local"] >= 0.7 * len(fleet.requests), paths
    idle = [r.mode for r in fleet.requests if r.reason in ("fastest", "tie", "slo")
            and isinstance(r.plan, Plan) and r.plan.features[PlanPath.LOCAL].queue == 0]
    assert len(idle) >= 100 and set(idle) == {"local"}
    # every request taught the planner once, on the path it took
    assert fleet.planner is not None
    snap = fleet.planner.snapshot()
    assert {p.value: snap[p.value]["observations"] for p in PlanPath} == dict(paths)


def test_plan_hands_long_prompts_off_under_load(host: Profile) -> None:
    specs = _specs(10, Lengths(4000), n=300)
    fleet = _run(host, specs, "plan")
    paths = Counter(r.mode for r in fleet.requests)
    handed = paths["push"] + paths["pull"]
    assert handed >= 0.25 * len(fleet.requests), paths
    settled = [r.mode for r in fleet.requests if r.reason == "fastest"]
    assert sum(1 for m in settled if m != "local") >= 0.25 * len(settled)
    local = summarize(_run(host, specs, "local", prefills=0), 10)
    assert summarize(fleet, 10).ttft["p90"] < local.ttft["p90"]


@pytest.mark.parametrize("rate, prompt, slo_ms", [
    (20.0, Lengths(100, 400), 100.0),   # short prompts: D alone is as good as a hand-off
    (8.0, Lengths(2000, 6000), 1000.0),  # long prompts under load: both engines must work
])
def test_plan_goodput_is_at_least_the_best_fixed_mode(host: Profile, rate: float,
                                                       prompt: Lengths, slo_ms: float) -> None:
    specs = _specs(rate, prompt, n=300, seed=1)
    fixed = {m: _goodput(_run(host, specs, m, prefills=0 if m == "local" else 1), slo_ms)
             for m in ("push", "pull", "local")}
    plan = _goodput(_run(host, specs, "plan"), slo_ms)
    assert plan >= 0.95 * max(fixed.values()), (plan, fixed)


def test_plan_applies_the_proxys_tpot_guard(host: Profile) -> None:
    """Long prompts at 10 req/s: D alone's prefills would push the streams decoding on D past
    an 8 ms TPOT SLO, and the proxy's guard (the same :meth:`Planner.choose`, given the streams
    placed on D) hands those prompts off; the TPOT on D drops. Without the SLO: no guard."""
    specs = _specs(10, Lengths(500, 4000), n=200, output=Lengths(32, 96))
    plain = _run(host, specs, "plan")
    assert summarize(plain, 10).guarded == 0
    assert not any(isinstance(r.plan, Plan) and r.plan.guard for r in plain.requests)

    fleet = Fleet(host, 1, 1, "plan", planner=PlannerSettings(tpot_slo_ms=8.0))
    assert fleet.planner is not None
    choose, seen = fleet.planner.choose, []

    def recording(*args: object, **kw: object) -> Plan:
        plan = choose(*args, **kw)  # type: ignore[arg-type]
        seen.append((kw["streams"], plan))
        return plan

    fleet.planner.choose = recording  # type: ignore[method-assign]
    fleet.run(specs)
    check_invariants(fleet)
    guarded = [(tpot, plan) for tpot, plan in seen if plan.guard]
    assert summarize(fleet, 10).guarded == len(guarded) >= 20
    for streams, plan in guarded:
        assert plan.guard == "tpot" and plan.path is not PlanPath.LOCAL
        assert all(s.tokens >= 32 for s in streams)
    assert any(plan.guard for streams, plan in seen if streams)
    local_with, local_without = (Counter(r.mode for r in f.requests)["local"]
                                 for f in (fleet, plain))
    assert local_with < local_without
    assert summarize(fleet, 10).tpot["p90"] < summarize(plain, 10).tpot["p90"]


def test_plan_is_deterministic_for_a_seed(host: Profile) -> None:
    def trace(seed: int) -> list[tuple[str, str, float | None]]:
        fleet = _run(host, _specs(12, Lengths(100, 5000), n=200, seed=seed), "plan")
        return [(r.mode, r.reason, r.t_first) for r in fleet.requests]

    assert trace(4) == trace(4)
    assert trace(4) != trace(5)


def test_plan_without_p_goes_local_and_shares_cores() -> None:
    """0P2D with the host's shared-core model: every request D alone, invariants hold."""
    profile = load_profile("host")
    assert profile.cpu is not None
    fleet = _run(profile, _specs(5, Lengths(100, 1000), n=60), "plan", prefills=0,
                 decodes=2)
    assert {r.mode for r in fleet.requests} == {"local"}
    assert {r.d for r in fleet.requests} == {0, 1}


def test_sizing_may_answer_d_alone(host: Profile) -> None:
    work = Workload(rate=2, requests=150, prompt=Lengths(100, 400), output=Lengths(32))
    slo = Slo(ttft_ms=200)
    for mode in ("plan", "local"):
        answer = size_fleet(host, work, Fleetspec(mode=mode), slo, max_engines=4)
        assert answer.chosen is not None
        assert (answer.chosen.prefills, answer.chosen.decodes) == (0, 1)
    pull = size_fleet(host, work, Fleetspec(mode="pull"), slo, max_engines=4)
    assert pull.chosen is not None and pull.chosen.prefills >= 1


# -- refusals ---------------------------------------------------------------------------------


def test_bad_mode_names_the_flag(host: Profile) -> None:
    specs = _specs(1, Lengths(100), n=3)
    with pytest.raises(SimulationError, match="--mode"):
        simulate(host, specs, "bogus")
    with pytest.raises(SimulationError, match="at least one D"):
        simulate(host, specs, "pull", 0, 1)
    with pytest.raises(SimulationError, match="at least one D"):
        simulate(host, specs, "plan", 1, 0)


def _dedicated(tmp: Path) -> str:
    doc = profile_to_dict(load_profile("host"))
    doc.pop("cpu", None)
    path = tmp / "host-dedicated.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["run", "--mode", "bogus"], "--mode: unknown mode 'bogus'"),
    (["run", "--mode", "pull,local", "--prefills", "0"], "--prefills 0"),
    (["run", "--mode", "plan", "--plan-tie", "-1"], "--plan-tie"),
    (["run", "--mode", "plan", "--plan-half-life", "0"], "--plan-half-life"),
    (["run", "--mode", "plan", "--plan-tpot-slo-ms", "-1"], "--plan-tpot-slo-ms"),
    (["sweep", "--rates", "1", "--mode", "push", "--prefills", "0"], "--prefills 0"),
])
def test_cli_refuses_bad_plan_options(capsys: pytest.CaptureFixture[str], args: list[str],
                                      message: str) -> None:
    profile = _dedicated(Path(tempfile.mkdtemp(prefix="kvbridge-sim-plan-")))
    code = cli.main(["simulate", *args, "--profile", profile, "--requests", "5"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("kvbridge: error: ") and message in err, err


def test_cli_run_and_size_local_and_plan(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    profile = _dedicated(tmp_path)
    code = cli.main(["simulate", "run", "--profile", profile, "--mode", "local,plan",
                     "--prefills", "1", "--requests", "60", "--rate", "10", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["mode"], r["prefills"], r["completed"]) for r in rows] == [
        ("local", 0, 60), ("auto", 1, 60)]  # plan is auto's other name
    assert sum(rows[1]["chosen"].values()) == 60 and rows[1]["guarded"] == 0
    code = cli.main(["simulate", "run", "--profile", profile, "--mode", "plan", "--requests",
                     "200", "--rate", "10", "--prompt-len", "500-4000", "--output-len", "32-96",
                     "--plan-tpot-slo-ms", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "; guard " in out, out
    code = cli.main(["simulate", "size", "--profile", profile, "--mode", "plan", "--rate", "2",
                     "--requests", "100", "--prompt-len", "100-400", "--ttft-slo", "200",
                     "--max-engines", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "0P1D" in out and "D engines alone meet the SLO" in out
