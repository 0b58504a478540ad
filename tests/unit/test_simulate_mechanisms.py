"""The simulator's load mechanisms: shared cores (kvbridge.tools.simulate.cpu), the proxy's
in-flight limits, ``vllm bench serve``'s finite runs and arrivals, the fit to vLLM PR #35264's
rows, and the front-end CPU fit of calibrate. No engines; about ten seconds."""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools.simulate.calibrate_cpu import CpuMeasurements, CpuRun, derive_cpu, fit_cpu
from kvbridge.tools.simulate.cpu import max_min_shares
from kvbridge.tools.simulate.events import SimulationError
from kvbridge.tools.simulate.fleet import simulate
from kvbridge.tools.simulate.metrics import check_invariants, summarize, ttft_s
from kvbridge.tools.simulate.profile import (
    CpuCost,
    Profile,
    load_profile,
    parse_profile,
    profile_to_dict,
)
from kvbridge.tools.simulate.published import (
    PR35264_ROWS,
    fit_in_flight,
    num_prompts_from,
    simulate_row,
)
from kvbridge.tools.simulate.sizing import Fleetspec, run_one
from kvbridge.tools.simulate.workload import Lengths, Workload, generate, vllm_arrivals

pytestmark = pytest.mark.timeout(300)

HOST_CPU = CpuCost(cores=2, client_request_s=0.004, client_token_s=0.0008,
                   proxy_request_s=0.004, proxy_token_s=0.0004, p_api_request_s=0.005,
                   d_api_request_s=0.005, d_api_token_s=0.0006, engine_spin_s=0.002)


@pytest.fixture(scope="module")
def host() -> Profile:
    return load_profile("host").replace(cpu=HOST_CPU)


def _bench(rate: float, n: int = 32, prompt: int = 200, output: int = 16,
           seed: int = 0) -> Workload:
    return Workload(rate=rate, requests=n, prompt=Lengths(prompt), output=Lengths(output),
                    arrival="vllm", seed=seed)


# -- max-min fair shares ----------------------------------------------------------------------


@pytest.mark.parametrize("tasks, cores, want", [
    ([(1, 0), (1, 1)], 2, [1, 1]),                      # one engine per core
    ([(1, 0), (1, 1), (1, None)], 2, [2 / 3] * 3),       # a front end takes a third of each
    ([(1, 0), (1, None), (1, None)], 2, [2 / 3] * 3),
    ([(1, None)], 2, [1]),                              # one thread uses one core at most
    ([(1, 0), (1, 0), (1, None)], 2, [0.5, 0.5, 1]),    # two on core 0, the floater gets core 1
    ([(1, 0), (1, 0), (1, 1), (1, None)], 2, [0.5, 0.5, 0.5, 0.5]),
    ([(1, 0), (0.5, None)], 1, [2 / 3, 1 / 3]),          # weights
])
def test_shares_are_max_min_fair(tasks: list[tuple[float, int | None]], cores: int,
                                 want: list[float]) -> None:
    assert max_min_shares(tasks, cores) == pytest.approx(want)


def test_shares_never_overcommit() -> None:
    pins = [None, 0, 1, 2]
    for n in range(1, 7):
        for combo in itertools.product(pins, repeat=n):
            shares = max_min_shares([(1.0, c) for c in combo], 3)
            assert all(0 < s <= 1 + 1e-9 for s in shares)
            assert sum(shares) <= 3 + 1e-9
            for core in range(3):
                assert sum(s for s, c in zip(shares, combo, strict=True) if c == core) <= 1 + 1e-9
            if n <= 3 and len({c for c in combo if c is not None}) == sum(
                    1 for c in combo if c is not None):
                assert shares == pytest.approx([1.0] * n)  # nobody contends: everyone runs


def test_bad_pinning_is_refused() -> None:
    with pytest.raises(SimulationError, match="pinned to core 2"):
        max_min_shares([(1.0, 2)], 2)


# -- shared cores in the fleet ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push", "headroom"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 2)])
def test_shared_cores_keep_every_invariant(host: Profile, mode: str,
                                           shape: tuple[int, int]) -> None:
    specs = generate(Workload(rate=40, requests=120, prompt=Lengths(50, 600),
                              output=Lengths(2, 24), seed=5))
    fleet = simulate(host, specs, mode, *shape)
    check_invariants(fleet)  # every token seen by the client once, no CPU work left
    assert fleet.cpu is not None
    assert all(r.seen == r.spec.output_len for r in fleet.requests)
    # the client parses a token after D produced it; CPU time adds up to the work submitted
    assert all(r.t_seen_first is not None and r.t_first is not None
               and r.t_seen_first >= r.t_first for r in fleet.requests)
    end = fleet.loop.now
    assert sum(t.cpu_s for t in fleet.cpu.tasks) <= host.cpu.cores * end + 1e-6  # type: ignore[union-attr]


def test_more_front_end_cpu_means_higher_ttft_and_tpot(host: Profile) -> None:
    ttft, tpot = [], []
    for scale in (0.0, 1.0, 3.0):
        cpu = replace(HOST_CPU, client_token_s=HOST_CPU.client_token_s * scale,
                      proxy_request_s=HOST_CPU.proxy_request_s * scale,
                      proxy_token_s=HOST_CPU.proxy_token_s * scale,
                      d_api_token_s=HOST_CPU.d_api_token_s * scale,
                      p_api_request_s=HOST_CPU.p_api_request_s * scale)
        s = run_one(host.replace(cpu=cpu), _bench(16), Fleetspec(mode="pull"))
        ttft.append(s.ttft["p50"])
        tpot.append(s.tpot["p50"])
    assert ttft[0] < ttft[1] < ttft[2], ttft
    assert tpot[0] < tpot[2], tpot


def test_front_ends_cost_more_as_the_rate_rises(host: Profile) -> None:
    """The mechanism the dedicated-host model lacks: the same per-request CPU slows the engines
    more when more requests share the cores (host validation, docs/simulator.md)."""
    dedicated = load_profile("host").replace(cpu=None)
    low = run_one(host, _bench(2), Fleetspec(mode="push"))
    high = run_one(host, _bench(16), Fleetspec(mode="push"))
    d_low = run_one(dedicated, _bench(2), Fleetspec(mode="push"))
    d_high = run_one(dedicated, _bench(16), Fleetspec(mode="push"))
    assert high.tpot["p50"] / low.tpot["p50"] > d_high.tpot["p50"] / d_low.tpot["p50"]
    assert high.ttft["p50"] > low.ttft["p50"]


def test_background_load_slows_everything(host: Profile) -> None:
    quiet = run_one(host, _bench(8), Fleetspec(mode="pull"))
    busy = run_one(host.replace(cpu=replace(HOST_CPU, background=2.0)), _bench(8),
                   Fleetspec(mode="pull"))
    assert busy.ttft["p50"] > quiet.ttft["p50"] and busy.tpot["p50"] > quiet.tpot["p50"]


# -- the proxy's in-flight limit ----------------------------------------------------------------


def _max_in_flight(fleet: Any) -> int:
    events = sorted([(r.t_admitted, 1) for r in fleet.requests] +
                    [(r.t_finish + fleet.profile.proxy.stream_s, -1) for r in fleet.requests])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_in_flight_limit_holds_and_queues(mode: str) -> None:
    seeds = load_profile("seeds")
    specs = generate(_bench(8, n=60, prompt=16384, output=64))
    ttft = {}
    for limit in (3, 6, 0):
        p = seeds.replace(proxy=replace(seeds.proxy, pull_max_in_flight=limit,
                                        push_max_in_flight=limit))
        fleet = simulate(p, specs, mode, prefix_hit=0.935)
        check_invariants(fleet)
        if limit:
            assert _max_in_flight(fleet) <= limit
        assert all(r.t_admitted is not None and r.t_admitted >= r.spec.arrival
                   for r in fleet.requests)
        ttft[limit] = np.mean([ttft_s(fleet, r) for r in fleet.requests])
        at_proxy = p.proxy.client_s + 1e-9
        waited = sum(1 for r in fleet.requests if r.t_admitted > r.spec.arrival + at_proxy)
        assert waited > 30 if limit == 3 else waited < 60, waited  # 3 cannot carry 8 req/s
        assert waited == 0 or limit
    # a limit below capacity queues requests at the proxy (a looser one can even lower the mean,
    # by sparing the engines' queues: admission control)
    assert ttft[3] > 2 * max(ttft[6], ttft[0])


# -- vllm bench serve's finite runs ---------------------------------------------------------------


def test_vllm_arrivals_are_vllm_bench_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The send times equal those of vLLM's own ``get_request`` for the same seed (its clock
    and sleeps replaced, so the test takes no time)."""
    from vllm.benchmarks import serve

    clock = [1000.0]
    start = [0.0]
    sent: list[float] = []

    async def fake_sleep(s: float) -> None:
        clock[0] += s

    monkeypatch.setattr(serve.time, "time", lambda: clock[0])
    monkeypatch.setattr(serve.asyncio, "sleep", fake_sleep)

    async def collect(n: int, rate: float) -> None:
        async for _ in serve.get_request(list(range(n)), rate):  # type: ignore[arg-type]
            sent.append(clock[0] - start[0])

    for n, rate, seed in ((50, 8.0, 0), (32, 2.0, 1001), (7, 16.0, 3)):
        sent.clear()
        start[0] = clock[0]
        np.random.seed(seed)
        asyncio.run(collect(n, rate))
        assert sent == pytest.approx(list(vllm_arrivals(n, rate, seed)), abs=1e-9)
        assert sent[-1] == pytest.approx(n / rate) and sent[0] > 0


def test_an_overloaded_finite_run_reports_its_backlog() -> None:
    """Past capacity, mean TTFT is the backlog of a finite run: it grows with num_prompts, and
    vllm bench serve's req/s falls below the offered rate."""
    pr = load_profile("pr35264")
    means, rps = [], []
    for n in (50, 100, 200):
        s = run_one(pr, _bench(8, n=n, prompt=512, output=128), Fleetspec(mode="pull",
                                                                           prefix_hit=0.39))
        means.append(s.ttft["mean"])
        rps.append(s.bench_throughput)
    assert means[0] < means[1] < means[2] and means[2] > 2.5 * means[0], means
    assert all(r < 6.0 for r in rps), rps
    keeps_up = run_one(pr, _bench(2, n=100, prompt=512, output=128),
                       Fleetspec(mode="pull", prefix_hit=0.39))
    # req/s = N / (N / rate + the last request's latency), as vllm bench serve computes it
    assert keeps_up.bench_throughput == pytest.approx(2.0, rel=0.05)


# -- vLLM PR #35264 -----------------------------------------------------------------------------


def test_num_prompts_from_the_rows_that_keep_up() -> None:
    keep_up = [r for r in PR35264_ROWS if r.qps == 4 and r.p99_ttft < 10 * r.median_ttft]
    assert len(keep_up) == 3
    assert all(95 <= num_prompts_from(r) <= 105 for r in keep_up)
    assert all(num_prompts_from(r) < 70 for r in PR35264_ROWS if r.qps == 8)  # they do not


def test_the_shipped_in_flight_limits_are_the_fit() -> None:
    pr = load_profile("pr35264")
    assert pr.scenario is not None
    base = pr.replace(proxy=replace(pr.proxy, pull_max_in_flight=0, push_max_in_flight=0))
    fitted = fit_in_flight(base, [r for r in PR35264_ROWS if r.qps == 8], pr.scenario.requests)
    assert fitted == {"pull": pr.proxy.pull_max_in_flight, "push": pr.proxy.push_max_in_flight}
    seeds = load_profile("seeds")
    assert (seeds.proxy.pull_max_in_flight, seeds.proxy.push_max_in_flight) == (
        fitted["pull"], fitted["push"])
    for row in PR35264_ROWS:
        if row.qps == 8:
            assert simulate_row(pr, row, pr.scenario.requests)["req_s"] == pytest.approx(
                row.req_s, rel=0.05)


# -- profiles: the cpu section is user input ----------------------------------------------------


@pytest.mark.parametrize("edit, message", [
    ({"cores": 0}, "cpu.cores: must be > 0"),
    ({"cores": 5000}, "cpu.cores: at most 1024"),
    ({"client_token_s": -1}, "cpu.client_token_s: must be >= 0"),
    ({"proxy_token_s": float("inf")}, "cpu.proxy_token_s"),
    ({"bogus": 1}, "cpu.bogus: unknown key"),
])
def test_bad_cpu_sections_name_the_key(host: Profile, edit: dict[str, Any], message: str) -> None:
    doc = profile_to_dict(host)
    doc["cpu"].update(edit)
    with pytest.raises(ConfigError, match=message):
        parse_profile(doc)


def test_bad_scenario_arrival() -> None:
    doc = profile_to_dict(load_profile("seeds"))
    doc["scenario"]["arrival"] = "bursty"
    with pytest.raises(ConfigError, match="scenario.arrival: one of poisson, uniform, vllm"):
        parse_profile(doc)


# -- calibrate: the front-end CPU fit -------------------------------------------------------------


def test_fit_cpu_recovers_known_costs() -> None:
    truth = {"client": (0.004, 0.0009), "proxy": (0.003, 0.0004), "p_api": (0.006, 0.0),
             "d_api": (0.005, 0.0007), "p_engine": (0.02, 0.0), "d_engine": (0.001, 0.004)}
    idle = {k: 0.02 for k in truth} | {"client": 0.0}
    m = CpuMeasurements(idle_rate=idle)
    for mode, (n, out) in itertools.product(("pull", "push"), ((8, 8), (40, 8), (40, 48))):
        wall = n / 4 + 3.0
        cpu = {k: a * n + b * n * out + idle[k] * wall for k, (a, b) in truth.items()}
        m.runs.append(CpuRun(mode, n, out, wall, cpu, completed=n))
    fit = fit_cpu(m)
    for proc, (a, b) in truth.items():
        assert fit[proc]["request_s"] == pytest.approx(a, abs=1e-9)
        assert fit[proc]["token_s"] == pytest.approx(b, abs=1e-9)
    doc = profile_to_dict(load_profile("host"))
    before = dict(doc["proxy"])
    derive_cpu(m, doc, "test", cores=2, spin_s=0.002,
               engines={"d_engine_stream_s": (0.01, "measured elsewhere")})
    p = parse_profile(doc)
    assert p.cpu is not None and p.cpu.cores == 2 and p.cpu.engine_spin_s == 0.002
    assert p.cpu.d_api_token_s == pytest.approx(0.0007)
    assert p.cpu.client_request_s == pytest.approx(0.004)
    assert p.cpu.d_engine_stream_s == 0.01
    assert p.sources["cpu.d_engine_stream_s"] == "measured elsewhere"
    # every hop's cost is CPU on the shared cores now: no wall-clock delay left on them, but
    # the first token's own way out, less the per-token CPU already counted
    assert p.proxy.request_s == p.proxy.answer_s == p.proxy.client_s == 0.0
    assert p.proxy.stream_s == pytest.approx(
        max(0.0, before["stream_s"] - 0.0007 - 0.0004 - 0.0009))
    assert "vllm bench serve" in p.sources["cpu.client_token_s"]


def test_fit_cpu_needs_two_runs() -> None:
    assert fit_cpu(CpuMeasurements()) == {}
    assert math.isfinite(sum(v["request_s"] for v in fit_cpu(CpuMeasurements(runs=[
        CpuRun("pull", 8, 8, 5.0, dict.fromkeys(("client", "proxy", "p_api", "d_api",
                                                 "p_engine", "d_engine"), 1.0), 8),
        CpuRun("pull", 16, 8, 7.0, dict.fromkeys(("client", "proxy", "p_api", "d_api",
                                                  "p_engine", "d_engine"), 2.0), 16)])).values()))


def test_summary_reports_bench_throughput(host: Profile) -> None:
    fleet = simulate(host, generate(_bench(4)), "push")
    s = summarize(fleet, 4)
    last = max(r.t_seen_last for r in fleet.requests if r.t_seen_last is not None)
    assert s.bench_throughput == pytest.approx(32 / last)
    assert any(k.startswith("CPU ") for k in s.utilisation)
