"""The hand-off planner's cost models and choice (kvbridge.proxy.planner), and its knobs."""

from __future__ import annotations

import math
import random
from typing import cast

import pytest

from kvbridge.errors import ConfigError
from kvbridge.proxy.members import Engine, Role
from kvbridge.proxy.planner import (
    COMPUTE,
    TPOT_GUARD,
    CostModel,
    Features,
    Path,
    Plan,
    Planner,
    PlannerSettings,
    Stream,
    smoothed_tpot,
    stalled_streams,
)
from kvbridge.proxy.planning import SLO_HEADER, Planning, requested_slo
from kvbridge.proxy.pool import Fleet
from kvbridge.proxy.relay import Call
from kvbridge.proxy.routing import (
    MODE_HEADER,
    RECORD_HEADER,
    ProxyMode,
    requested_mode,
    requested_record,
)
from kvbridge.proxy.settings import ProxySettings


def feats(tokens: float, held: float = 0.0, queue: float = 0.0) -> dict[Path, Features]:
    local = Features(tokens - held, 0.0, held, queue)
    hand = Features(tokens, tokens - held, held, 0.0)
    return {Path.LOCAL: local, Path.PUSH: hand, Path.PULL: hand}


def host(path: Path, f: Features, tier_ms_per_1k: float = 2.0) -> float:
    """A host where D alone costs 0.2 ms per token to prefill (plus its queue), a hand-off a
    30 ms fixed cost plus 0.02 ms per token on an idle P, and pull 10 ms more than push."""
    if path is Path.LOCAL:
        return 3.0 + 0.2 * f.compute + tier_ms_per_1k * f.held / 1000 + 15.0 * f.queue
    return 30.0 + 0.02 * f.compute + (10.0 if path is Path.PULL else 0.0)


def run(planner: Planner, tokens: float, held: float = 0.0, tier: float = 2.0,
        rng: random.Random | None = None) -> Plan:
    f = feats(tokens, held)
    plan = planner.choose(f)
    noise = 1.0 + (rng.uniform(-0.05, 0.05) if rng else 0.0)
    planner.observe(plan, plan.path, host(plan.path, f[plan.path], tier) * noise)
    return plan


def test_every_path_is_tried_before_its_estimate_is_trusted() -> None:
    planner = Planner(PlannerSettings(warmup=2, explore_every=0))
    seen = [run(planner, 100).path for _ in range(6)]
    assert sorted(seen) == sorted([Path.LOCAL, Path.PUSH, Path.PULL] * 2)
    assert all(planner.models[p].count == 2 for p in Path)


def test_short_prompts_stay_on_d_and_long_ones_are_handed_off() -> None:
    rng = random.Random(1)
    planner = Planner(PlannerSettings(explore_every=0))
    for _ in range(60):
        run(planner, rng.choice([20, 60, 400, 1000, 2000]), rng=rng)
    assert planner.choose(feats(30)).path is Path.LOCAL
    long = planner.choose(feats(2000))
    assert long.path is Path.PUSH and long.why == "fastest"
    assert long.estimates[Path.PUSH] == pytest.approx(70, rel=0.25)
    assert long.estimates[Path.LOCAL] == pytest.approx(403, rel=0.25)
    # what D holds costs little to load: a long prompt D holds stays on D
    assert planner.choose(feats(2000, held=1990)).path is Path.LOCAL


def _slow_tier_run(seed: int) -> tuple[int | None, int | None]:
    """Requests until a prompt D holds is handed off once D's tier slows (300 ms per 1000 held
    tokens), and until it stays on D again once the tier recovers (``None``: not within 80)."""
    rng = random.Random(seed)
    planner = Planner(PlannerSettings(explore_every=8))
    kinds = [(100.0, 0.0), (1000.0, 0.0), (1000.0, 900.0), (300.0, 250.0)]
    for _ in range(80):  # warm: mixed prompts, some held by D
        run(planner, *rng.choice(kinds), rng=rng)
    held_prompt = (300.0, 250.0)
    assert planner.choose(feats(*held_prompt), dry_run=True).path is Path.LOCAL
    flipped = back = None
    for i in range(40):
        run(planner, *rng.choice(kinds), tier=300.0, rng=rng)
        if flipped is None and planner.choose(feats(*held_prompt), dry_run=True).path \
                is not Path.LOCAL:
            flipped = i + 1
    for i in range(80):
        run(planner, *rng.choice(kinds), tier=2.0, rng=rng)
        if back is None and planner.choose(feats(*held_prompt), dry_run=True).path \
                is Path.LOCAL:
            back = i + 1
    return flipped, back


def test_a_slow_tier_flips_its_requests_within_20_and_back_when_it_recovers() -> None:
    runs = [_slow_tier_run(seed) for seed in range(20)]
    flips = [f for f, _ in runs]
    backs = [b for _, b in runs]
    assert all(f is not None and f <= 30 for f in flips), flips
    assert sum(f <= 20 for f in flips if f is not None) >= 18, flips
    assert all(b is not None and b <= 60 for b in backs), backs
    assert sum(b <= 40 for b in backs if b is not None) >= 18, backs


def test_a_slow_disk_tier_moves_only_what_it_holds_off_d() -> None:
    """With the medium of what D holds known (KV events), a disk tier that slows down sends
    the prompts D holds on disk to a hand-off with D's tiers left out (P sends it all), while
    those in its prefix cache stay on D."""
    rng = random.Random(5)
    planner = Planner(PlannerSettings(explore_every=8))
    disk_ms = 2.0

    def go(tokens: float, held: float, on_disk: bool) -> Plan:
        local = Features(tokens - held, 0.0, 0.0 if on_disk else held, 0.0,
                         storage=held if on_disk else 0.0)
        hand = Features(tokens, tokens - held, local.held, 0.0, storage=local.storage)
        f = {Path.LOCAL: local, Path.PUSH: hand, Path.PULL: hand}
        plan = planner.choose(f)
        x = plan.features[plan.path]  # with D's tiers off, the disk is not read
        cost = host(plan.path, x, 2.0) + disk_ms * x.storage / 1000
        planner.observe(plan, plan.path, cost * (1 + rng.uniform(-0.05, 0.05)))
        return plan

    kinds = [(100.0, 0.0, False), (1000.0, 0.0, False), (1000.0, 900.0, False),
             (1000.0, 900.0, True)]
    for _ in range(80):
        go(*rng.choice(kinds))
    disk_ms = 400.0  # the disk tier slows: 400 ms per 1000 tokens read
    for _ in range(40):
        go(*rng.choice(kinds))
    local = Features(100, 0, 0, 0, storage=900)
    hand = Features(1000, 100, 0, 0, storage=900)
    on_disk = planner.choose({Path.LOCAL: local, Path.PUSH: hand, Path.PULL: hand},
                             dry_run=True)
    assert on_disk.path is not Path.LOCAL and not on_disk.d_tiers, on_disk
    assert "tiers=off" in on_disk.header()
    local = Features(100, 0, 900, 0)
    hand = Features(1000, 100, 900, 0)
    cached = planner.choose({Path.LOCAL: local, Path.PUSH: hand, Path.PULL: hand},
                            dry_run=True)
    assert cached.path is Path.LOCAL, cached


def test_one_decision_in_explore_every_goes_to_another_path_in_turn() -> None:
    planner = Planner(PlannerSettings(warmup=1, explore_every=4))
    for _ in range(3):
        run(planner, 20)
    plans = [run(planner, 20) for _ in range(8)]
    explored = [p for p in plans if p.why == "explore"]
    assert len(explored) == 2
    ranks = [sorted(p.estimates, key=lambda q: p.estimates[q]).index(p.path) for p in explored]
    assert sorted(ranks) == [1, 2]
    assert all(p.path is Path.LOCAL for p in plans if p.why != "explore")


def test_an_exploration_waits_while_its_path_has_prefill_work_queued() -> None:
    """The exploration due every ``explore_every`` decisions of a kind waits while the engine
    that would prefill on the path to explore has a queue (it would measure the queue and cost
    the request the whole wait), and goes to the next request of the kind whose engine is
    free; the count to the next one starts there."""
    planner = Planner(PlannerSettings(warmup=1, explore_every=4))
    for _ in range(3):
        run(planner, 20)

    def request(p_queue: float) -> dict[Path, Features]:
        hand = Features(20, 20, 0, p_queue)
        return {Path.LOCAL: Features(20, 0, 0, 0), Path.PUSH: hand, Path.PULL: hand}

    whys = [planner.choose(request(5000)).why for _ in range(6)]  # P busy: the 4th waits
    assert "explore" not in whys, whys
    explored = planner.choose(request(0))
    assert explored.why == "explore" and explored.path is not Path.LOCAL, explored
    whys = [planner.choose(request(0)).why for _ in range(4)]
    assert [w == "explore" for w in whys] == [False, False, False, True], whys


def test_a_recheck_is_taken_only_where_it_could_win_and_one_at_a_time() -> None:
    """An exploration of pull that came back at 40 % of its estimate makes pull worth
    rechecking for requests of its kind where 40 % of its estimate would be the fastest — not
    where P's queue puts it at many times D alone's — and one recheck at a time: the next
    request of the kind is not rechecked until the last recheck came back (again well under
    its estimate: rechecked again; near it: caught up, no more)."""
    planner = Planner(PlannerSettings(explore_every=0))
    for _ in range(12):
        run(planner, 100)

    def request(p_queue: float) -> dict[Path, Features]:
        hand = Features(100, 100, 0, p_queue)
        return {Path.LOCAL: Features(100, 0, 0, 0), Path.PUSH: hand, Path.PULL: hand}

    idle = planner.choose(request(0), dry_run=True)
    assert idle.path is Path.LOCAL
    explored = Plan(Path.PULL, "explore", idle.estimates, request(0))
    planner.observe(explored, Path.PULL, 0.4 * idle.estimates[Path.PULL])
    busy = planner.choose(request(5000))  # pull's estimate is many times D alone's
    assert busy.estimates[Path.PULL] * 0.4 > busy.estimates[Path.LOCAL]
    assert busy.path is Path.LOCAL and busy.why == "fastest", busy
    assert planner.choose(request(0), dry_run=True).why != "recheck"  # a dry run takes none
    again = planner.choose(request(0))
    assert again.path is Path.PULL and again.why == "recheck", again
    assert planner.choose(request(0)).path is Path.LOCAL  # the recheck is still out
    planner.observe(again, Path.PULL, 0.4 * again.estimates[Path.PULL])  # still well under
    third = planner.choose(request(0))
    assert third.path is Path.PULL and third.why == "recheck", third
    planner.observe(third, Path.PULL, third.estimates[Path.PULL])  # the estimate caught up
    assert planner.choose(request(0)).why != "recheck"


def test_a_plan_expected_to_miss_its_slo_says_so() -> None:
    planner = Planner(PlannerSettings(explore_every=0))
    for _ in range(12):
        run(planner, 500)
    f = feats(500)
    est = planner.choose(f, dry_run=True).estimates
    assert est[Path.PUSH] < est[Path.LOCAL]
    met = planner.choose(f, slo_ms=est[Path.PUSH] + 5)
    assert met.path is Path.PUSH and met.why == "fastest"
    missed = planner.choose(f, slo_ms=1.0)
    assert missed.path is Path.PUSH and missed.why == "slo_missed"
    # the proxy's default SLO applies without the request's own
    slo = Planner(PlannerSettings(explore_every=0, ttft_slo_ms=1.0))
    slo.models = planner.models
    assert slo.choose(f).why == "slo_missed"
    assert slo.choose(f, slo_ms=0).why == "fastest"  # the request's 0: none


def test_d_alone_wins_a_near_tie() -> None:
    planner = Planner(PlannerSettings(explore_every=0, tie=0.5))
    for _ in range(12):
        run(planner, 200)
    plan = planner.choose(feats(200))
    assert plan.estimates[Path.LOCAL] > plan.estimates[Path.PUSH]
    assert plan.path is Path.LOCAL and plan.why == "tie"


def test_the_tpot_guard_keeps_long_prefills_off_a_slow_d() -> None:
    """With a TPOT SLO of 40 ms, while D's TPOT is past 30 ms (75 %), a prompt D alone would
    take more than 20 ms to prefill (here 0.2 ms per token: over 100 tokens) is handed off,
    ``guard=tpot`` in its plan; a short one stays; under the guard, or without an SLO or a
    measure, D alone is weighed as usual."""
    planner = Planner(PlannerSettings(explore_every=0, tpot_slo_ms=40.0))
    for _ in range(12):
        run(planner, 80)
        run(planner, 400)
    slow = TPOT_GUARD * 40.0
    assert planner.choose(feats(80), dry_run=True).path is Path.LOCAL
    assert planner.stalls(feats(150)[Path.LOCAL], slow)
    assert not planner.stalls(feats(80)[Path.LOCAL], slow)
    guarded = planner.choose(feats(150), d_tpot_ms=slow)
    assert guarded.path is not Path.LOCAL and guarded.guard == "tpot"
    assert Path.LOCAL not in guarded.estimates and "guard=tpot" in guarded.header()
    short = planner.choose(feats(80), d_tpot_ms=100.0)
    assert short.path is Path.LOCAL and short.guard == ""
    for tpot in (None, slow - 0.1):
        assert planner.choose(feats(150), d_tpot_ms=tpot).guard == ""
    # no SLO, or nothing but D alone to choose: no guard
    plain = Planner(PlannerSettings(explore_every=0))
    plain.models = planner.models
    assert plain.choose(feats(150), d_tpot_ms=1e6).guard == ""
    only = planner.choose({Path.LOCAL: feats(150)[Path.LOCAL]}, d_tpot_ms=1e6)
    assert only.path is Path.LOCAL and only.guard == ""


def test_a_d_tpot_is_smoothed_over_its_last_streams() -> None:
    assert smoothed_tpot(None, 20.0) == 20.0
    assert smoothed_tpot(20.0, 30.0) == pytest.approx(23.0)


def test_the_plan_header_names_every_estimate() -> None:
    plan = Plan(Path.PUSH, "fastest", {Path.LOCAL: 80.24, Path.PUSH: 41.0, Path.PULL: 55.31})
    assert plan.header() == ("path=push; est_ms=41.0; local=80.2; push=41.0; pull=55.3; "
                             "why=fastest")
    only = Plan(Path.LOCAL, "warmup", {Path.LOCAL: 3.0})
    assert only.header() == "path=local; est_ms=3.0; local=3.0; why=warmup"
    with pytest.raises(ValueError):
        Planner().choose({})


def test_a_cost_model_ignores_what_is_not_a_duration() -> None:
    m = CostModel((10.0, 100.0, 0.0, 5.0, 10.0, 10.0, 50.0, 5.0))
    f = Features(500, 0, 0, 0)
    for bad in (math.nan, math.inf, -1.0):
        m.observe(f, bad)
    assert m.count == 0 and m.predict(f) == pytest.approx(60.0)
    with pytest.raises(ValueError):
        CostModel((1.0, 2.0))
    for _ in range(40):
        m.observe(f, 1e12)  # absurd but finite: the estimate follows, and stays finite
    assert math.isfinite(m.predict(f)) and m.predict(Features(0, 0, 0, 0)) >= 0


@pytest.mark.parametrize("kw, flag", [
    ({"ttft_slo_ms": -1.0}, "--plan-ttft-slo-ms"), ({"ttft_slo_ms": math.inf}, "--plan-ttft"),
    ({"ttft_slo_ms": math.nan}, "--plan-ttft"), ({"tie": -0.1}, "--plan-tie"),
    ({"tie": 11.0}, "--plan-tie"), ({"explore_every": -1}, "--plan-explore-every"),
    ({"tpot_slo_ms": -1.0}, "--plan-tpot-slo-ms"), ({"tpot_slo_ms": math.inf}, "--plan-tpot"),
])
def test_bad_planner_settings_name_their_flag(kw: dict[str, float], flag: str) -> None:
    s = ProxySettings(["http://p:1"], ["http://d:2"], plan=PlannerSettings(**kw))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=flag):
        s.check()


def test_the_mode_and_slo_headers() -> None:
    assert requested_mode({}) is None
    assert requested_mode({MODE_HEADER: " Local "}) is ProxyMode.LOCAL
    assert requested_mode({MODE_HEADER: "plan"}) is ProxyMode.AUTO  # plan: auto's other name
    assert requested_mode({MODE_HEADER: "AUTO"}) is ProxyMode.AUTO
    assert requested_mode({MODE_HEADER: "Headroom"}) is ProxyMode.HEADROOM
    for bad in ("", "nixl", "push;pull", "x" * 10_000, "PUSH\x00"):
        with pytest.raises(ValueError, match=MODE_HEADER):
            requested_mode({MODE_HEADER: bad})
    assert requested_slo({}) is None
    assert requested_slo({SLO_HEADER: "250"}) == 250.0
    assert requested_slo({SLO_HEADER: "0"}) == 0.0
    for bad in ("-1", "nan", "inf", "1e9", "fast", "", "9" * 400):
        with pytest.raises(ValueError, match=SLO_HEADER):
            requested_slo({SLO_HEADER: bad})


def test_a_stall_is_spread_over_a_streams_tokens() -> None:
    """A 200 ms prefill on D adds 200 / 32 = 6.25 ms to the TPOT of a 33-token stream: one at
    35 ms goes past a 40 ms SLO, one at 30 ms does not, one past it already is not counted,
    nor one of a single token; an unmeasured one is taken at D's TPOT; the work queued ahead
    is not this prefill's doing."""
    assert stalled_streams([Stream(33, 35.0)], 0.0, 200.0, 40.0, None) == 1
    assert stalled_streams([Stream(33, 30.0)], 0.0, 200.0, 40.0, None) == 0
    assert stalled_streams([Stream(33, 45.0), Stream(1, 39.0)], 0.0, 200.0, 40.0, None) == 0
    assert stalled_streams([Stream(33), Stream(33)], 0.0, 200.0, 40.0, 35.0) == 2
    assert stalled_streams([Stream(33)], 0.0, 200.0, 40.0, None) == 0
    # 160 ms queued ahead bring it to exactly 40 ms: 30 ms more push it over
    assert stalled_streams([Stream(33, 35.0)], 160.0, 30.0, 40.0, None) == 1
    assert stalled_streams([Stream(33, 35.0)], 0.0, 30.0, 40.0, None) == 0
    # already over because of the queue: not this prefill's doing
    assert stalled_streams([Stream(33, 35.0)], 200.0, 30.0, 40.0, None) == 0
    # a stream not started yet: the queue runs before its first token, this prefill after
    assert stalled_streams([Stream(33, 35.0, started=False)], 200.0, 200.0, 40.0, None) == 1


def test_the_tpot_guard_weighs_the_streams_decoding_on_d() -> None:
    """With the streams on D known, D alone is left out when its prefill (0.2 ms per token
    here) would push one past the SLO — even while D's average TPOT is low — and not when no
    stream would go over; the average rule still holds on its own."""
    planner = Planner(PlannerSettings(explore_every=0, tpot_slo_ms=40.0))
    for _ in range(12):
        run(planner, 80)
        run(planner, 400)
    near = [Stream(33, 35.0)]
    assert planner.stalls(feats(1000)[Path.LOCAL], 20.0, near)  # 200 ms: +6.25 ms
    assert not planner.stalls(feats(150)[Path.LOCAL], 20.0, near)  # 30 ms: +0.94 ms
    assert planner.stalls(feats(150, queue=800)[Path.LOCAL], 20.0, near)  # 160 ms ahead
    assert not planner.stalls(feats(1000)[Path.LOCAL], 20.0, [])
    assert not planner.stalls(feats(1000)[Path.LOCAL], 20.0, [Stream(400, 35.0)])
    plan = planner.choose(feats(1000), d_tpot_ms=20.0, streams=near)
    assert plan.path is not Path.LOCAL and plan.guard == "tpot"
    # the average rule: D's TPOT past 75 % of the SLO and a prefill over half an SLO
    assert planner.stalls(feats(150)[Path.LOCAL], TPOT_GUARD * 40.0, [])
    assert not Planner(PlannerSettings(explore_every=0)).stalls(feats(1000)[Path.LOCAL],
                                                                   1e6, near)


def test_the_proxy_knows_the_streams_placed_on_each_d() -> None:
    """:class:`Planning` keeps each request on the D it was placed on (a retry moves it) with
    its ``max_tokens`` and TPOT so far, until the request ends, whatever its outcome."""
    planning = Planning(cast(Fleet, None), PlannerSettings(tpot_slo_ms=40.0))
    d1, d2 = Engine("http://d1", Role.DECODE), Engine("http://d2", Role.DECODE)
    a = Call(t0=0.0, rid="same", stream=True, headers={})
    b = Call(t0=0.0, rid="same", stream=True, headers={})  # a client may reuse an id
    planning.prompt(a, {"prompt": [1, 2, 3], "max_tokens": 64}, chat=False)
    planning.prompt(b, {"prompt": [1, 2], "max_completion_tokens": 8, "max_tokens": 99},
                    chat=False)
    assert (a.max_tokens, b.max_tokens) == (64, 8)
    for body in ({"prompt": [1]}, {"prompt": [1], "max_tokens": True},
                 {"prompt": [1], "max_tokens": -3}, {"prompt": [1], "max_tokens": "64"}):
        c = Call(t0=0.0, rid="c", stream=True, headers={})
        planning.prompt(c, body, chat=False)
        assert c.max_tokens is None
        planning.decoding(c, d1)
    planning.decoding(a, d1)
    planning.decoding(b, d1)
    a.events, a.first_at, a.last_at = 5, 10.0, 10.12  # 30 ms per token after the first
    streams = planning.streams(d1.url)
    assert sorted(s.tokens for s in streams) == [8, 64]
    assert next(s for s in streams if s.tokens == 64).tpot_ms == pytest.approx(30.0)
    assert next(s for s in streams if s.tokens == 8).tpot_ms is None
    assert {s.tokens: s.started for s in streams} == {64: True, 8: False}
    planning.decoding(b, d2)  # a retry on another D
    assert [s.tokens for s in planning.streams(d1.url)] == [64]
    assert [s.tokens for s in planning.streams(d2.url)] == [8]
    a.outcome = "upstream_error"
    planning.learn(a)
    planning.learn(b)
    assert planning.streams(d1.url) == planning.streams(d2.url) == []
    assert set(planning.placed) <= {d1.url}  # only the calls without max_tokens are left


def test_the_record_header_is_a_boolean_or_refused_by_name() -> None:
    assert requested_record({}) is True
    for value in ("0", "false", " OFF ", "No"):
        assert requested_record({RECORD_HEADER: value}) is False
    for value in ("1", "True", "on", "yes"):
        assert requested_record({RECORD_HEADER: value}) is True
    for bad in ("", "2", "maybe", "x" * 5000, "0 1"):
        with pytest.raises(ValueError, match=RECORD_HEADER) as info:
            requested_record({RECORD_HEADER: bad})
        assert len(str(info.value)) < 200  # an oversized value is not echoed whole


def test_the_engines_hold_a_prompt_from_its_first_token_on() -> None:
    """A request's D and P are recorded as holding its prompt in the prefix index once its
    first token is out, while it still decodes: a prompt that repeats it (a shared system
    prompt, the next turn) is then counted as held. One that ended without a token records
    nothing until :meth:`Planning.learn`, which records only what answered."""
    planning = Planning(cast(Fleet, None), PlannerSettings())
    p, d = "http://p", "http://d"
    call = Call(t0=0.0, rid="a", stream=True, headers={})
    prompt = planning.prompt(call, {"prompt": list(range(64)), "max_tokens": 8}, chat=False)
    call.flight.attempt("push", "t1", p, d)
    assert planning.index.held(d, prompt) == planning.index.held(p, prompt) == 0
    call.first_token()
    assert planning.index.held(d, prompt) == planning.index.held(p, prompt) == 63
    failed = Call(t0=0.0, rid="b", stream=True, headers={})
    other = planning.prompt(failed, {"prompt": list(range(100, 164)), "max_tokens": 8},
                            chat=False)
    failed.flight.attempt("local", "", "", d)
    failed.release_held()  # ended without a first token
    assert planning.index.held(d, other) == 0


def test_a_stream_within_the_margin_counts_for_any_stall() -> None:
    """With a margin, a stall that takes a stream past ``margin * slo`` counts, and a stream
    already between the margin and the SLO counts for any stall; one past the SLO is lost
    already and does not count. A margin of 1 is the plain rule."""
    assert stalled_streams([Stream(33, 35.0)], 0.0, 64.0, 40.0, None, 0.9) == 1  # 35 -> 37
    assert stalled_streams([Stream(33, 35.0)], 0.0, 64.0, 40.0, None) == 0
    assert stalled_streams([Stream(33, 37.0)], 0.0, 1.0, 40.0, None, 0.9) == 1
    assert stalled_streams([Stream(33, 30.0)], 0.0, 64.0, 40.0, None, 0.9) == 0  # 30 -> 32
    assert stalled_streams([Stream(33, 41.0)], 0.0, 64.0, 40.0, None, 0.9) == 0


def test_the_planner_guards_with_the_margin() -> None:
    from kvbridge.proxy.planner import TPOT_MARGIN

    assert 0.5 < TPOT_MARGIN < 1.0
    planner = Planner(PlannerSettings(tpot_slo_ms=40.0, explore_every=0, warmup=0))
    per_token = float(planner.models[Path.LOCAL].coef[COMPUTE]) / 1000.0
    assert per_token > 0
    f = feats(1000)[Path.LOCAL]
    stall = f.compute * per_token / 32  # spread over a 33-token stream
    near = 40.0 * TPOT_MARGIN - stall / 2  # the stall takes it past the margin, not the SLO
    assert planner.stalls(f, None, [Stream(33, near)])
    assert not planner.stalls(f, None, [Stream(33, near - stall)])


def _guard_case(planner: Planner, local_ms: float, hand_ms: float) -> dict[Path, Features]:
    """Features whose estimates are ``local_ms`` for D alone and ``hand_ms`` for both
    hand-offs (the models' coefficients set directly)."""
    for path, ms in ((Path.LOCAL, local_ms), (Path.PUSH, hand_ms), (Path.PULL, hand_ms)):
        m = planner.models[path]
        m.coef = m.coef * 0.0
        m.coef[0] = ms  # the intercept
        m.count = 10
    local = planner.models[Path.LOCAL]
    local.coef[COMPUTE] = 200.0  # per 1000 tokens: 1000 tokens stall D's streams 200 ms
    local.coef[0] -= 200.0
    return feats(1000)


def test_the_tpot_guard_yields_to_one_stream_against_a_sure_ttft_miss() -> None:
    """One stream at risk, and every hand-off expected past the TTFT SLO that D alone meets:
    D alone stays a candidate (``guard=tpot_yield``) and wins. Two streams at risk, or a
    hand-off within the SLO: the guard holds."""
    planner = Planner(PlannerSettings(ttft_slo_ms=800.0, tpot_slo_ms=40.0, explore_every=0))
    one = [Stream(33, 35.0)]  # 200 ms of prefill adds 6.25 ms: past 36
    plan = planner.choose(_guard_case(planner, 300.0, 1200.0), streams=one)
    assert (plan.path, plan.guard) == (Path.LOCAL, "tpot_yield")
    plan = planner.choose(_guard_case(planner, 300.0, 1200.0), streams=one * 2)
    assert plan.path is not Path.LOCAL and plan.guard == "tpot"
    plan = planner.choose(_guard_case(planner, 300.0, 700.0), streams=one)
    assert plan.path is not Path.LOCAL and plan.guard == "tpot"
    plan = planner.choose(_guard_case(planner, 900.0, 1200.0), streams=one)  # both miss
    assert plan.path is not Path.LOCAL and plan.guard == "tpot"
    no_slo = Planner(PlannerSettings(tpot_slo_ms=40.0, explore_every=0))
    plan = no_slo.choose(_guard_case(no_slo, 300.0, 1200.0), streams=one)
    assert plan.path is not Path.LOCAL and plan.guard == "tpot"


def test_work_queued_ahead_costs_what_computing_it_costs_before_any_queue_was_seen() -> None:
    """A burst's first request behind a queue: the cost models have seen no queue yet, and
    still estimate the wait at the learnt cost per computed token (a queued token is computed
    by the same engine), not at a prior."""
    rng = random.Random(2)
    planner = Planner(PlannerSettings(explore_every=0))
    for _ in range(40):  # P's prefix hits (a shared system prompt) make compute < move
        tokens = rng.choice([100.0, 500.0, 1000.0, 2000.0])
        f = Features(tokens * rng.choice([0.3, 1.0]), tokens, 0.0, 0.0)
        planner.observe(planner.choose({Path.PUSH: f}), Path.PUSH,
                        30.0 + 1.5 * f.compute + 0.05 * f.move)
    idle = planner.estimate(Path.PUSH, Features(1000.0, 1000.0, 0.0, 0.0))
    queued = planner.estimate(Path.PUSH, Features(1000.0, 1000.0, 0.0, 2000.0))
    assert idle == pytest.approx(1580.0, rel=0.05)
    assert queued - idle == pytest.approx(3000.0, rel=0.25)  # a queue prior: 200 ms
