"""The fleet model (kvbridge.tools.simulate): invariants, monotonic behaviour, the seeds' numbers,
sizing against sweeps, and hostile profile / trace input. No engines; a few seconds in all."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools.simulate.events import SimulationError
from kvbridge.tools.simulate.fleet import simulate
from kvbridge.tools.simulate.metrics import check_invariants, summarize
from kvbridge.tools.simulate.profile import (
    PROFILE_KIND,
    Profile,
    load_profile,
    override,
    parse_profile,
    profile_to_dict,
)
from kvbridge.tools.simulate.sizing import Fleetspec, Slo, meets, run_one, size_fleet, sweep
from kvbridge.tools.simulate.workload import Lengths, RequestSpec, Workload, generate, load_trace

pytestmark = pytest.mark.timeout(120)

SEEDS = {"pull": {"ttft": 1744.0, "tpot": 10.4}, "push": {"ttft": 540.0, "tpot": 7.0}}


@pytest.fixture(scope="module")
def host() -> Profile:
    """This host's costs on dedicated cores: the fleet mechanics under test do not depend on
    the shared-core model (tests/unit/test_simulate_mechanisms.py tests that)."""
    return load_profile("host").replace(cpu=None)


@pytest.fixture(scope="module")
def seeds() -> Profile:
    return load_profile("seeds")


def _work(rate: float, n: int = 300, prompt: int = 200, output: int = 16,
          seed: int = 0) -> Workload:
    return Workload(rate=rate, requests=n, prompt=Lengths(prompt), output=Lengths(output),
                    seed=seed)


# -- invariants -----------------------------------------------------------------------------------


# headroom, not auto (the planner, which may leave a P idle: test_simulate_plan.py)
@pytest.mark.parametrize("mode", ["pull", "push", "headroom"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 1)])
def test_every_request_finishes_once_and_kv_is_conserved(host: Profile, mode: str,
                                                        shape: tuple[int, int]) -> None:
    specs = generate(Workload(rate=60, requests=400, prompt=Lengths(50, 900),
                              output=Lengths(1, 40), seed=3))
    fleet = simulate(host, specs, mode, *shape)
    check_invariants(fleet)  # once each, causal order, blocks back, proxy counts at zero
    assert [r.finishes for r in fleet.requests] == [1] * len(specs)
    assert all(r.t_first is not None and r.t_first >= r.spec.arrival >= 0
               for r in fleet.requests)
    assert {r.mode for r in fleet.requests} <= {"pull", "push"}
    # xPyD: the proxy's least-loaded picks spread the work over every engine
    assert {r.p for r in fleet.requests} == set(range(shape[0]))
    assert {r.d for r in fleet.requests} == set(range(shape[1]))


def test_a_small_kv_pool_queues_requests_and_never_overcommits(host: Profile) -> None:
    per_request = host.model.blocks(200 + 16) * host.model.block_size
    small = host.replace(decode=replace(host.decode, kv_capacity_tokens=2 * per_request))
    specs = generate(_work(80, n=200))
    roomy = summarize(simulate(host, specs, "push"), 80)
    fleet = simulate(small, specs, "push")
    check_invariants(fleet)  # _Pool raises the moment free or held goes negative
    cramped = summarize(fleet, 80)
    assert all(d.kv.total == 2 * small.model.blocks(216) for d in fleet.decodes)
    assert cramped.ttft["p90"] > 2 * roomy.ttft["p90"]


def test_push_commits_d_early_and_pull_late(host: Profile) -> None:
    specs = generate(_work(20, n=50))
    push, pull = simulate(host, specs, "push"), simulate(host, specs, "pull")
    for r in push.requests:
        assert r.t_d_admit is not None and r.t_kv_ready is not None
        assert r.t_d_admit < r.t_kv_ready  # D allocates while P prefills
    for r in pull.requests:
        assert r.t_d_recv is not None and r.t_kv_ready is not None
        assert r.t_d_recv >= r.t_kv_ready  # D is chosen once P answered, not before


def test_a_prompt_larger_than_the_pool_is_refused(host: Profile) -> None:
    tiny = host.replace(prefill=replace(host.prefill, kv_capacity_tokens=64))
    with pytest.raises(SimulationError, match="more blocks than P's KV pool"):
        simulate(tiny, [RequestSpec(0.0, 200, 4)], "pull")


def test_runs_are_deterministic(seeds: Profile) -> None:
    w = replace(_work(8, n=150, prompt=16384, output=32), seed=11)
    a = run_one(seeds, w, Fleetspec(mode="pull", prefix_hit=0.935))
    b = run_one(seeds, w, Fleetspec(mode="pull", prefix_hit=0.935))
    assert a.to_dict() == b.to_dict()


# -- monotonic behaviour --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_more_load_means_higher_ttft(host: Profile, mode: str) -> None:
    rows = sweep(host, _work(1, n=400), Fleetspec(), [10, 40, 90, 150], [mode])
    p90 = [s.ttft["p90"] for s in rows]
    assert p90 == sorted(p90) and p90[-1] > 1.5 * p90[0], p90


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_more_bandwidth_means_a_shorter_handoff(seeds: Profile, mode: str) -> None:
    w = _work(2, n=60, prompt=16384, output=16)
    handoff = []
    for scale in (0.25, 1.0, 4.0):
        link = replace(seeds.link, read_bandwidth=seeds.link.read_bandwidth * scale,
                       write_bandwidth=seeds.link.write_bandwidth * scale,
                       read_per_desc_s=seeds.link.read_per_desc_s / scale,
                       write_per_desc_s=seeds.link.write_per_desc_s / scale)
        s = run_one(seeds.replace(link=link), w, Fleetspec(mode=mode, prefix_hit=0.9))
        handoff.append(s.handoff["p50"])
    assert handoff[0] > handoff[1] > handoff[2], handoff


def test_pull_setup_on_d_loop_slows_decoding_and_off_loop_does_not(seeds: Profile) -> None:
    w = _work(8, n=300, prompt=16384, output=128)
    spec = Fleetspec(mode="pull", prefix_hit=0.935)
    on = run_one(seeds, w, spec)
    off = run_one(seeds.replace(pull=replace(seeds.pull, on_d_loop=False)), w, spec)
    push = run_one(seeds, w, replace(spec, mode="push"))
    assert on.tpot["mean"] > 1.3 * off.tpot["mean"]
    assert abs(off.tpot["mean"] - push.tpot["mean"]) < 0.15 * push.tpot["mean"]


def test_headroom_follows_the_proxys_headroom_rule(host: Profile) -> None:
    specs = generate(_work(60, n=200))
    all_pull = simulate(host, specs, "headroom", push_headroom=0)
    all_push = simulate(host, specs, "headroom", push_headroom=10_000)
    assert {(r.mode, r.reason) for r in all_pull.requests} == {("pull", "busy")}
    assert {(r.mode, r.reason) for r in all_push.requests} == {("push", "headroom")}


def test_auto_is_the_planner_and_plan_its_other_name(host: Profile) -> None:
    """As in the proxy: auto runs the planner (every decision is one of its whys), plan is
    auto, and the load rule is headroom's."""
    specs = generate(_work(60, n=100))
    for mode in ("auto", "plan"):
        fleet = simulate(host, specs, mode)
        assert fleet.planner is not None and fleet.mode.value == "auto"
        assert {r.reason for r in fleet.requests} <= {"warmup", "explore", "recheck", "fastest",
                                                      "tie", "slo_missed"}
    assert simulate(host, specs, "headroom").planner is None


# -- the seeds' numbers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeds_run(seeds: Profile) -> dict[str, dict[str, float]]:
    sc = seeds.scenario
    assert sc is not None
    w = Workload(rate=sc.rate, requests=sc.requests, prompt=Lengths(sc.prompt_len),
                 output=Lengths(sc.output_len), arrival=sc.arrival, seed=sc.seed)
    out = {}
    for mode in ("pull", "push"):
        s = run_one(seeds, w, Fleetspec(sc.prefills, sc.decodes, mode, sc.prefix_hit))
        out[mode] = {"ttft": s.ttft["mean"], "tpot": s.tpot["mean"]}
    return out


@pytest.mark.parametrize("mode, metric", [("push", "ttft"), ("push", "tpot"), ("pull", "tpot"),
                                          ("pull", "ttft")])
def test_seeds_reproduced_within_25_percent(seeds_run: dict[str, dict[str, float]], mode: str,
                                            metric: str) -> None:
    """Push TTFT is the one scenario number calibrated (prefix_hit); both TPOTs come from the
    READ posts on D's loop vs P's writer thread; pull TTFT from the finite, overloaded
    ``vllm bench serve`` run: 100 prompts and per-mode in-flight limits, both taken from vLLM
    PR #35264's own rows (same author, hardware and harness), not from the seeds' numbers
    (profile sources; docs/simulator.md says what that assumes)."""
    got, want = seeds_run[mode][metric], SEEDS[mode][metric]
    assert abs(got / want - 1) <= 0.25, (mode, metric, got, want)


def test_seeds_pull_is_slower_than_push(seeds_run: dict[str, dict[str, float]]) -> None:
    assert seeds_run["pull"]["ttft"] > 2 * seeds_run["push"]["ttft"]
    assert seeds_run["pull"]["tpot"] > 1.15 * seeds_run["push"]["tpot"]


def test_seeds_pull_ttft_needs_the_finite_overloaded_run(seeds: Profile) -> None:
    """Without the in-flight limits pull keeps up and its TTFT is far below the published
    1744 ms; with them, it falls behind and its mean TTFT is the backlog of the run, which grows
    with the number of prompts."""
    sc = seeds.scenario
    assert sc is not None
    free = seeds.replace(proxy=replace(seeds.proxy, pull_max_in_flight=0, push_max_in_flight=0))
    means = {}
    for name, profile, n in (("free", free, 100), ("100", seeds, 100), ("200", seeds, 200)):
        w = Workload(rate=sc.rate, requests=n, prompt=Lengths(sc.prompt_len),
                     output=Lengths(sc.output_len), arrival="vllm", seed=sc.seed)
        s = run_one(profile, w, Fleetspec(mode="pull", prefix_hit=sc.prefix_hit))
        means[name] = s.ttft["mean"]
        if name != "free":
            assert s.bench_throughput < 0.85 * sc.rate  # it does not keep up
    assert means["free"] < 0.5 * SEEDS["pull"]["ttft"] < means["100"] < means["200"]


# -- sizing ---------------------------------------------------------------------------------------


def test_sizing_agrees_with_the_sweep(host: Profile) -> None:
    w = _work(150, n=400, prompt=400, output=16)
    slo = Slo(ttft_ms=80, tpot_ms=15, percentile=90)
    answer = size_fleet(host, w, Fleetspec(mode="push"), slo, max_engines=8)
    assert answer.chosen is not None
    p, d = answer.chosen.prefills, answer.chosen.decodes
    assert p + d > 2  # one pair does not keep up at 150 req/s
    again = sweep(host, w, Fleetspec(p, d), [w.rate], ["push"])[0]
    assert again.to_dict() == answer.chosen.to_dict() and meets(again, slo)
    for fewer in ((p - 1, d), (p, d - 1)):
        if min(fewer) >= 1:
            assert not meets(run_one(host, w, Fleetspec(*fewer, mode="push")), slo), fewer
    assert all(s.prefills + s.decodes <= p + d for s in answer.tried)


def test_sizing_says_none_when_the_bound_is_too_small(host: Profile) -> None:
    answer = size_fleet(host, _work(400, n=200), Fleetspec(mode="pull"), Slo(ttft_ms=1),
                        max_engines=3)
    assert answer.chosen is None and len(answer.tried) == 1 + 2


# -- profiles: hostile input ----------------------------------------------------------------------


def _doc(profile: Profile) -> dict[str, object]:
    return json.loads(json.dumps(profile_to_dict(profile)))


def test_profile_round_trips(host: Profile, seeds: Profile) -> None:
    for p in (host, seeds):
        assert parse_profile(_doc(p)) == replace(p, sources=p.sources)
        assert set(p.sources) and all(isinstance(v, str) and v for v in p.sources.values())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(kind="other"), "not a kvbridge simulate profile"),
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(extra=1), "extra: unknown key"),
    (lambda d: d["link"].update(read_bandwidth=0), "link.read_bandwidth: must be > 0"),
    (lambda d: d["prefill"].update(per_token_s=-1e-3), "prefill.per_token_s: must be >= 0"),
    (lambda d: d["decode"].update(step_base_s=float("nan")), "decode.step_base_s"),
    (lambda d: d["decode"].update(max_num_seqs=True), "decode.max_num_seqs: must be a number"),
    (lambda d: d["model"].update(layers=2.5), "model.layers: must be an integer"),
    (lambda d: d["pull"].update(on_d_loop="yes"), "pull.on_d_loop: must be true or false"),
    (lambda d: d["proxy"].pop("stream_s"), "proxy.stream_s: missing"),
    (lambda d: d["push"].update(bogus=1), "push.bogus: unknown key"),
    (lambda d: d.update(fragmentation=1.5), "fragmentation"),
    (lambda d: d.update(model=[]), "model: must be a JSON object"),
    (lambda d: d["model"].update(name="x" * 500), "model.name"),
    (lambda d: d.update(sources={"a": 1}), "sources"),
])
def test_bad_profiles_name_the_key(host: Profile, edit: object, message: str) -> None:
    doc = _doc(host)
    edit(doc)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_profile(doc)


def test_profile_files(tmp_path: Path, host: Profile) -> None:
    good = tmp_path / "p.json"
    good.write_text(json.dumps(_doc(host)))
    assert load_profile(str(good)).decode == host.decode
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_profile(str(tmp_path / "bad.json"))
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"kind": PROFILE_KIND, "pad": "x" * (2 << 20)}))
    with pytest.raises(ConfigError, match="larger than"):
        load_profile(str(big))
    with pytest.raises(ConfigError, match="neither a shipped profile"):
        load_profile(str(tmp_path / "missing.json"))


def test_override(host: Profile) -> None:
    p = override(host, ["link.latency_s=0.5", "pull.on_d_loop=true", "scenario.rate=3"])
    assert p.link.latency_s == 0.5 and p.pull.on_d_loop and p.scenario and p.scenario.rate == 3
    assert "--set" in p.sources["link.latency_s"]
    for bad, message in (("link", "SECTION.KEY=VALUE"), ("nope.x=1", "SECTION.KEY=VALUE"),
                         ("link.nope=1", "link.nope: unknown key"),
                         ("link.latency_s=-1", "link.latency_s: must be >= 0")):
        with pytest.raises(ConfigError, match=message):
            override(host, [bad])


# -- workloads and traces -------------------------------------------------------------------------


def test_generated_arrivals_scale_with_the_rate() -> None:
    slow = generate(_work(2, n=500, seed=5))
    fast = generate(_work(4, n=500, seed=5))
    assert all(math.isclose(a.arrival, 2 * b.arrival) for a, b in zip(slow, fast, strict=True))
    assert 2 * 0.85 < (slow[-1].arrival / 500) * 4 < 2 * 1.15  # mean gap ~ 1 / rate


@pytest.mark.parametrize("text, message", [
    ("[{\"arrival_s\": 0, \"prompt_len\": 5}]", "missing output_len"),
    ("[{\"arrival_s\": -1, \"prompt_len\": 5, \"output_len\": 1}]", "arrival_s"),
    ("[{\"arrival_s\": \"x\", \"prompt_len\": 5, \"output_len\": 1}]", "trace row 0"),
    ("[{\"arrival_s\": 0, \"prompt_len\": 0, \"output_len\": 1}]", "must be > 0"),
    ("{\"a\": 1}", "JSON list"),
    ("[]", "1..1000000"),
    ("[1]", "must be an object"),
])
def test_bad_traces_name_the_row(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_trace(path)


def test_csv_trace(tmp_path: Path, host: Profile) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_len,output_len\n5.0,100,4\n5.5,300,8\n5.1,50,2\n")
    specs = load_trace(path)
    assert [s.arrival for s in specs] == pytest.approx([0.0, 0.1, 0.5])
    fleet = simulate(host, specs, "push")
    check_invariants(fleet)


def test_length_ranges() -> None:
    assert Lengths.parse("100-300", "--x") == Lengths(100, 300)
    for bad in ("0", "5-2", "a", "1-2-3"):
        with pytest.raises(ConfigError, match="--x"):
            Lengths.parse(bad, "--x")


# -- calibration: deriving a profile from measurements (the engine runs are not tested here) ------


def test_derive_recovers_known_costs(host: Profile) -> None:
    from kvbridge.tools.simulate.calibrate import Measurements, derive

    m = Measurements(loadavg=["0.5 0.5 0.5", "1.0 0.8 0.6"], max_batched_tokens=2048)
    m.prefill = {n: [0.004 + 2e-5 * n] * 3 for n in (32, 128, 256, 512, 896)}
    m.decode = [(b, b * 224, 0.003 + 0.0005 * b) for b in (1, 2, 4, 8) for _ in range(3)]
    m.decode += [(4, 4 * 824, 0.003 + 0.0005 * 4)] * 3
    m.gaps = {
        "pull": {"send->recv_start": [0.023],
                 "recv_start->recv_done": [0.009], "recv_done->first_step": [0.002],
                 "first_step->first_token": [0.0095]},
        "push": {"send->kv_ready": [0.012], "kv_ready->write_posted": [0.003],
                 "write_posted->write_done": [0.002], "write_done->recv_done": [-0.0004],
                 "recv_done->first_step": [0.002], "first_step->first_token": [0.0095]},
    }
    doc = derive(m, profile_to_dict(host), "shm", "testhost")
    doc.pop("calibration")
    p = parse_profile(doc)
    assert p.prefill.step_base_s == pytest.approx(0.004, rel=1e-6)
    assert p.prefill.per_token_s == pytest.approx(2e-5, rel=1e-6)
    assert p.prefill.per_token_ctx_s == pytest.approx(0.0, abs=1e-12)
    assert p.prefill.max_batched_tokens == 2048
    assert p.decode.per_seq_s == pytest.approx(0.0005, rel=1e-6)
    assert p.decode.per_ctx_token_s == pytest.approx(0.0, abs=1e-9)
    assert p.proxy.request_s == pytest.approx(0.012 - 0.008, rel=1e-6)
    assert p.proxy.answer_s == pytest.approx(0.023 - 0.008 - 2 * 0.004, rel=1e-6)
    assert p.pull.setup_s == pytest.approx(0.009 - 0.002, rel=1e-6)
    assert p.push.setup_s == pytest.approx(0.003) and p.push.notify_s == 0.0
    assert p.decode.idle_wake_s == pytest.approx(0.002)
    assert p.link.write_bandwidth == pytest.approx(host.model.kv_bytes_per_token * 200 / 0.002)
    assert not p.pull.on_d_loop and p.push.post_on_p_thread
    assert "testhost" in p.sources["prefill.per_token_s"]
