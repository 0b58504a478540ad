"""``kvbridge simulate``: run, sweep, size and validate the fleet model from the command line.

Subcommands (every one takes ``--profile NAME|FILE``, default ``seeds``; workload options default
to the profile's ``scenario``)::

    kvbridge simulate run       [--mode all] [--rate R] [--prefills P --decodes D] ...
                                (--mode local: D alone; --mode auto: the proxy's planner)
    kvbridge simulate sweep     --rates 1,2,4,8 [--plot FILE] ...   (a PNG only with --plot)
    kvbridge simulate size      --rate R --ttft-slo MS [--tpot-slo MS] [--percentile 90] ...
    kvbridge simulate validate  --results RESULTS.json [--profile host] [--plot FILE]
    kvbridge simulate profiles  [NAME]
    kvbridge simulate calibrate --out PROFILE.json ...   (real engines on this host)

Tables go to stdout (``--json`` for JSON). Bad options are a usage error naming the option.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.proxy.planner import PlannerSettings
from kvbridge.tools.args import DefaultsFormatter, parse_names
from kvbridge.tools.bench.serve_settings import parse_rates
from kvbridge.tools.report import print_table
from kvbridge.tools.simulate import calibrate
from kvbridge.tools.simulate.fleet import ALIASES, MODES, NO_P_MODES, canonical_mode, simulate
from kvbridge.tools.simulate.metrics import Summary, check_invariants, summarize
from kvbridge.tools.simulate.plots import plot_sweep, plot_validation
from kvbridge.tools.simulate.profile import (
    Profile,
    builtin_profiles,
    load_profile,
    override,
    profile_to_dict,
)
from kvbridge.tools.simulate.published import (
    PR35264_ROWS,
    PR35264_SOURCE,
    fit_in_flight,
    num_prompts_from,
    simulate_row,
)
from kvbridge.tools.simulate.sizing import (
    Fleetspec,
    Sizing,
    Slo,
    run_one,
    size_fleet,
    sweep,
    why_none,
)
from kvbridge.tools.simulate.validate import load_results, table, validate, within
from kvbridge.tools.simulate.workload import Lengths, Workload, load_trace

__all__ = ["add_arguments", "cli_main"]

_MAX_ENGINES = 256


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    print_table(headers, rows)


def _common(p: argparse.ArgumentParser, workload: bool = True) -> None:
    p.add_argument("--profile", default="seeds",
                   help="shipped profile name (see `kvbridge simulate profiles`) or a JSON file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one profile parameter (repeatable), e.g. "
                        "link.read_bandwidth=4e10")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    if not workload:
        return
    g = p.add_argument_group("workload and fleet (defaults: the profile's scenario)")
    g.add_argument("--mode", default="all",
                   help="comma-separated: pull, push, auto (the proxy's planner chooses "
                        "local, push or pull per request by learnt cost; plan is another name "
                        "of it), headroom (push or pull by D's load: auto before the planner), "
                        "local (D alone: no P, D prefills itself), or all")
    g.add_argument("--prefills", type=int, default=None,
                   help="P engines (0 only with --mode local or auto; local always runs "
                        "without one)")
    g.add_argument("--decodes", type=int, default=None, help="D engines")
    g.add_argument("--requests", type=int, default=None, help="requests simulated")
    g.add_argument("--prompt-len", default=None, help="prompt tokens: N or LOW-HIGH (uniform)")
    g.add_argument("--output-len", default=None, help="output tokens: N or LOW-HIGH (uniform)")
    g.add_argument("--arrival", default=None, choices=["poisson", "uniform", "vllm"],
                   help="arrival process (default: the profile's scenario, else poisson); vllm: "
                        "vllm bench serve's own for --seed")
    g.add_argument("--trace", type=Path, default=None,
                   help="recorded arrivals (JSON list or CSV of arrival_s, prompt_len, "
                        "output_len) instead of --rate/--requests/lengths")
    g.add_argument("--prefix-hit", type=float, default=None,
                   help="fraction of each prompt P finds in its prefix cache (0..1)")
    g.add_argument("--fragmentation", type=float, default=None,
                   help="fraction of block boundaries breaking a descriptor run (0..1)")
    g.add_argument("--push-headroom", type=int, default=None,
                   help="headroom: push while the least-loaded D has fewer in flight")
    g.add_argument("--warmup", type=float, default=0.0,
                   help="fraction of the first requests left out of the figures")
    g.add_argument("--seed", type=int, default=None,
                   help="random seed (default: the profile's scenario, else 0)")
    pl = p.add_argument_group("auto mode: the planner's settings (the proxy's --plan-* flags)")
    d = PlannerSettings()
    pl.add_argument("--plan-ttft-slo-ms", type=float, default=d.ttft_slo_ms, metavar="MS",
                    help="the planner's TTFT SLO: of the paths expected to meet it, D alone "
                         "wins; 0: none, the fastest path wins")
    pl.add_argument("--plan-tpot-slo-ms", type=float, default=None, metavar="MS",
                    help="the TPOT guard's SLO: while a D's measured TPOT is past 75%% of it, "
                         "a prompt that would take D over half of it is not left to D alone "
                         "(default: none; in size, --tpot-slo)")
    pl.add_argument("--plan-tie", type=float, default=d.tie, metavar="F",
                    help="without an SLO, D alone wins within this share of the fastest path")
    pl.add_argument("--plan-explore-every", type=int, default=d.explore_every, metavar="N",
                    help="one decision in N of a kind tries another path (0: never)")
    pl.add_argument("--plan-warmup", type=int, default=d.warmup, metavar="N",
                    help="observations of a path before its estimate is trusted")
    pl.add_argument("--plan-half-life", type=float, default=d.half_life, metavar="N",
                    help="observations after which one weighs half in a path's cost model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="simulate", metavar="SUBCOMMAND", required=True)
    r = sub.add_parser("run", help="simulate one scenario; TTFT/TPOT p50/p90/p99 per mode")
    _common(r)
    r.add_argument("--rate", type=float, default=None, help="requests per second (Poisson)")
    r.set_defaults(func=_run)

    s = sub.add_parser("sweep", help="TTFT/TPOT against request rate per mode (a table; a plot "
                       "with --plot)")
    _common(s)
    s.add_argument("--rates", required=True, help="comma-separated rates, e.g. 1,2,4,8")
    s.add_argument("--plot", type=Path, default=None, metavar="PATH",
                   help="also draw a PNG here (needs matplotlib); none by default")
    s.set_defaults(func=_sweep)

    z = sub.add_parser("size", help="how many P and D for a rate at a TTFT (and TPOT) SLO")
    _common(z)
    z.add_argument("--rate", type=float, required=True, help="requests per second")
    z.add_argument("--ttft-slo", type=float, required=True, help="TTFT target, ms")
    z.add_argument("--tpot-slo", type=float, default=None, help="TPOT target, ms")
    z.add_argument("--percentile", type=int, default=90, help="50, 90 or 99 (default 90)")
    z.add_argument("--max-engines", type=int, default=16, help="search bound on P + D (2..64)")
    z.set_defaults(func=_size)

    v = sub.add_parser("validate", help="simulated vs measured for a `kvbridge bench serve` "
                       "results file")
    _common(v, workload=False)
    v.set_defaults(profile="host")
    v.add_argument("--results", type=Path, required=True, help="bench serve results.json")
    v.add_argument("--repeats", type=int, default=10, help="simulated runs per row (median)")
    v.add_argument("--tolerance", type=float, default=0.25, help="agreement bound (0.25: 25%%)")
    v.add_argument("--setup-prefix", default="kvbridge-", help="setups the profile models")
    v.add_argument("--prefills", type=int, default=None, help="override the file's P count")
    v.add_argument("--decodes", type=int, default=None, help="override the file's D count")
    v.add_argument("--plot", type=Path, default=None, help="also draw a PNG here")
    v.set_defaults(func=_validate)

    pb = sub.add_parser("published", help="vLLM PR #35264's published rows against the model "
                        "(fitted vs held-out rows), optionally refitting the in-flight limits")
    pb.add_argument("--profile", default="pr35264", help="profile (default pr35264)")
    pb.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one profile parameter (repeatable)")
    pb.add_argument("--fit", action="store_true",
                    help="refit proxy.pull/push_max_in_flight on the 8 QPS rows first")
    pb.add_argument("--seeds", default="0",
                    help="vllm bench serve seeds to replay, comma-separated (median; default 0)")
    pb.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pb.set_defaults(func=_published)

    pr = sub.add_parser("profiles", help="list the shipped profiles, or show one with sources")
    pr.add_argument("name", nargs="?", default=None,
                    help="a shipped profile to show, with each parameter's source (default: "
                         "list them all)")
    pr.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pr.set_defaults(func=_profiles)

    c = sub.add_parser("calibrate", help="measure this host's step costs on real engines and "
                       "write a profile (starts vLLM engines; takes minutes)")
    calibrate.add_arguments(c)
    c.set_defaults(func=calibrate.cli_main)
    for command in sub.choices.values():  # every subcommand's --help shows the defaults
        command.formatter_class = DefaultsFormatter


def cli_main(args: argparse.Namespace) -> int:
    code: int = args.func(args)
    return code


# -- option handling -----------------------------------------------------------------------------


def _profile(args: argparse.Namespace) -> Profile:
    profile = load_profile(args.profile)
    return override(profile, args.set) if args.set else profile


def _modes(text: str) -> tuple[str, ...]:
    names = parse_names(text, (*MODES, *ALIASES), "--mode", "mode")
    return tuple(dict.fromkeys(canonical_mode(m) for m in names))  # plan is auto


def _positive(value: float | int | None, option: str) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{option}: must be > 0, got {value}")


def _fraction(value: float | None, option: str, below_one: bool = False) -> None:
    if value is not None and not (0.0 <= value < 1.0 if below_one else 0.0 <= value <= 1.0):
        raise ConfigError(f"{option}: must be in [0, 1{')' if below_one else ']'}, got {value}")


def _planner(args: argparse.Namespace) -> PlannerSettings:
    """The ``--plan-*`` options, checked (ConfigError naming the option)."""
    tpot = getattr(args, "plan_tpot_slo_ms", None)
    if tpot is None:
        tpot = getattr(args, "tpot_slo", None) or 0.0  # size: the SLO it sizes for
    for name, value, low in (("--plan-ttft-slo-ms", args.plan_ttft_slo_ms, 0.0),
                             ("--plan-tpot-slo-ms", tpot, 0.0),
                             ("--plan-tie", args.plan_tie, 0.0),
                             ("--plan-explore-every", args.plan_explore_every, 0),
                             ("--plan-warmup", args.plan_warmup, 0)):
        if not low <= value <= 1e9:  # also refuses nan
            raise ConfigError(f"{name}: must be in [{low}, 1e9], got {value}")
    if not 0 < args.plan_half_life <= 1e6:
        raise ConfigError(f"--plan-half-life: must be in (0, 1e6], got {args.plan_half_life}")
    return PlannerSettings(ttft_slo_ms=args.plan_ttft_slo_ms, tpot_slo_ms=tpot,
                           tie=args.plan_tie, warmup=args.plan_warmup,
                           explore_every=args.plan_explore_every,
                           half_life=args.plan_half_life)


def _scenario(args: argparse.Namespace, profile: Profile,
              rate: float | None) -> tuple[Workload, Fleetspec]:
    sc = profile.scenario
    for name in ("decodes", "requests"):
        _positive(getattr(args, name), "--" + name)
    for name, value, bound in (("--prefills", args.prefills, _MAX_ENGINES),
                               ("--decodes", args.decodes, _MAX_ENGINES),
                               ("--push-headroom", args.push_headroom, 1 << 20)):
        if value is not None and not 0 <= value <= bound:
            raise ConfigError(f"{name}: must be in 0..{bound}, got {value}")
    _positive(rate, "--rate")
    _fraction(args.prefix_hit, "--prefix-hit", below_one=True)
    _fraction(args.fragmentation, "--fragmentation")
    _fraction(args.warmup, "--warmup", below_one=True)

    def pick(value: Any, attr: str, option: str) -> Any:
        if value is not None:
            return value
        if sc is None:
            raise ConfigError(f"{option}: required (profile {profile.name} has no scenario)")
        return getattr(sc, attr)

    prompt = (Lengths.parse(args.prompt_len, "--prompt-len") if args.prompt_len
              else Lengths(pick(None, "prompt_len", "--prompt-len")))
    output = (Lengths.parse(args.output_len, "--output-len") if args.output_len
              else Lengths(pick(None, "output_len", "--output-len")))
    workload = Workload(rate=float(pick(rate, "rate", "--rate")),
                        requests=int(pick(args.requests, "requests", "--requests")),
                        prompt=prompt, output=output,
                        arrival=args.arrival or (sc.arrival if sc else "poisson"),
                        seed=args.seed if args.seed is not None else (sc.seed if sc else 0))
    spec = Fleetspec(
        prefills=pick(args.prefills, "prefills", "--prefills") if sc else (
            1 if args.prefills is None else args.prefills),
        decodes=pick(args.decodes, "decodes", "--decodes") if sc else (args.decodes or 1),
        prefix_hit=args.prefix_hit if args.prefix_hit is not None else (
            sc.prefix_hit if sc else 0.0),
        fragmentation=args.fragmentation if args.fragmentation is not None else (
            sc.fragmentation if sc else None),
        push_headroom=args.push_headroom, warmup=args.warmup, planner=_planner(args))
    return workload, spec


def _check_fleet(spec: Fleetspec, modes: Sequence[str]) -> None:
    """A fleet without P runs only local and auto."""
    needs_p = [m for m in modes if m not in NO_P_MODES]
    if spec.prefills == 0 and needs_p:
        raise ConfigError(f"--prefills 0: only --mode {' or '.join(NO_P_MODES)} run without a "
                          f"P engine, not {', '.join(needs_p)}")


def _fmt(d: dict[str, float], key: str, nd: int = 1) -> str:
    v = d.get(key)
    return "-" if v is None else f"{v:.{nd}f}"


def _summary_rows(rows: Sequence[Summary]) -> tuple[list[str], list[list[str]]]:
    headers = ["mode", "fleet", "rate", "done", "TTFT p50", "p90", "p99", "mean",
               "TPOT p50", "p90", "p99", "mean", "hand-off p50", "req/s", "bench req/s",
               "chose"]
    out = []
    for s in rows:
        chose = _chose(s)
        out.append([s.mode, f"{s.prefills}P{s.decodes}D", f"{s.rate:g}", str(s.completed),
                    _fmt(s.ttft, "p50"), _fmt(s.ttft, "p90"), _fmt(s.ttft, "p99"),
                    _fmt(s.ttft, "mean"), _fmt(s.tpot, "p50", 2), _fmt(s.tpot, "p90", 2),
                    _fmt(s.tpot, "p99", 2), _fmt(s.tpot, "mean", 2), _fmt(s.handoff, "p50"),
                    f"{s.throughput:.2f}", f"{s.bench_throughput:.2f}", chose or "-"])
    return headers, out


def _chose(s: Summary) -> str:
    """How the planner or headroom chose (``local 250, pull 20, push 30``); empty otherwise."""
    if canonical_mode(s.mode) not in ("auto", "headroom"):
        return ""
    chose = ", ".join(f"{k} {v}" for k, v in sorted(s.chosen.items()))
    return chose + (f"; guard {s.guarded}" if s.guarded else "")


def _describe(profile: Profile, workload: Workload, spec: Fleetspec) -> str:
    return (f"profile {profile.name}: {spec.prefills}P{spec.decodes}D, {workload.requests} "
            f"requests at {workload.rate:g} req/s ({workload.arrival}), prompt {workload.prompt} "
            f"tokens, output {workload.output} tokens, prefix hit {spec.prefix_hit:g}; "
            "times in ms")


# -- subcommands ---------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    profile = _profile(args)
    workload, spec = _scenario(args, profile, args.rate)
    modes = _modes(args.mode)
    _check_fleet(spec, modes)
    rows: list[Summary] = []
    if args.trace is not None:
        specs = load_trace(args.trace)
        rate = len(specs) / max(specs[-1].arrival, 1e-9)
        for mode in modes:
            m = replace(spec, mode=mode)
            fleet = simulate(profile, specs, mode, m.p_engines, spec.decodes, spec.prefix_hit,
                             spec.fragmentation, spec.push_headroom, spec.planner)
            check_invariants(fleet)
            rows.append(summarize(fleet, rate, spec.warmup))
    else:
        rows = [run_one(profile, workload, replace(spec, mode=m)) for m in modes]
    if args.json:
        print(json.dumps([s.to_dict() for s in rows], indent=2))
        return 0
    print(_describe(profile, workload, spec) if args.trace is None
          else f"profile {profile.name}: {spec.prefills}P{spec.decodes}D, trace {args.trace} "
               f"({rows[0].completed} requests); times in ms")
    _table(*_summary_rows(rows))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    profile = _profile(args)
    rates = parse_rates(args.rates)
    workload, spec = _scenario(args, profile, rates[0])
    modes = _modes(args.mode)
    _check_fleet(spec, modes)
    rows = sweep(profile, workload, spec, rates, modes)
    if args.json:
        print(json.dumps([s.to_dict() for s in rows], indent=2))
    else:
        print(_describe(profile, workload, spec).replace(f" at {workload.rate:g} req/s",
                                                         " per rate"))
        _table(*_summary_rows(rows))
    if args.plot is None:
        return 0
    sys.stdout.flush()  # the table is out before any plotting error
    plot_sweep(rows, args.plot, f"kvbridge simulate: {profile.name}, "
               f"{spec.prefills}P{spec.decodes}D, prompt {workload.prompt.low}, "
               f"output {workload.output.low}")
    if not args.json:
        print(f"plot: {args.plot}")
    return 0


def _size(args: argparse.Namespace) -> int:
    profile = _profile(args)
    workload, spec = _scenario(args, profile, args.rate)
    slo = Slo(args.ttft_slo, args.tpot_slo, args.percentile)
    if not 2 <= args.max_engines <= 64:
        raise ConfigError(f"--max-engines: must be in 2..64, got {args.max_engines}")
    answers = [size_fleet(profile, workload, replace(spec, mode=m), slo, args.max_engines)
               for m in _modes(args.mode)]
    if args.json:
        print(json.dumps([{"mode": a.mode, "rate": a.rate,
                           "chosen": None if a.chosen is None else a.chosen.to_dict(),
                           "tried": [s.to_dict() for s in a.tried]} for a in answers], indent=2))
        return _no_fleet(answers, args.max_engines)
    key = f"p{slo.percentile}"
    print(_describe(profile, workload, spec) + f"; SLO: TTFT {key} <= {slo.ttft_ms:g} ms"
          + ("" if slo.tpot_ms is None else f", TPOT {key} <= {slo.tpot_ms:g} ms"))
    rows = []
    for a in answers:
        c = a.chosen
        rows.append([a.mode, "none" if c is None else f"{c.prefills}P{c.decodes}D",
                     "-" if c is None else _fmt(c.ttft, key),
                     "-" if c is None else _fmt(c.tpot, key, 2),
                     "-" if c is None else f"{c.throughput:.2f}", str(len(a.tried)),
                     ("" if c is None else _chose(c)) or "-"])
    _table(["mode", "fleet", f"TTFT {key}", f"TPOT {key}", "req/s", "fleets tried", "chose"],
           rows)
    if any(a.chosen is not None and a.chosen.prefills == 0 for a in answers):
        print("0P: D engines alone meet the SLO (each prefills its own requests; no P needed)")
    return _no_fleet(answers, args.max_engines)


def _no_fleet(answers: Sequence[Sizing], max_engines: int) -> int:
    """Exit status 1, with one line per mode on stderr, where no fleet meets the SLO."""
    missed = [a for a in answers if a.chosen is None]
    for a in missed:
        print(f"kvbridge: error: {a.mode}: no fleet of up to {max_engines} engines meets the "
              f"SLO: {why_none(a)}", file=sys.stderr)
    return 1 if missed else 0


def _validate(args: argparse.Namespace) -> int:
    if not 0 < args.tolerance < 10:
        raise ConfigError(f"--tolerance: must be in (0, 10), got {args.tolerance}")
    profile = _profile(args)
    results = load_results(args.results)
    rows = validate(profile, results, args.setup_prefix, args.repeats, args.prefills,
                    args.decodes)
    if not rows:
        raise ConfigError(f"--results: no row of {args.results} has a setup starting with "
                          f"{args.setup_prefix!r} and a mode suffix")
    if args.plot is not None:
        plot_validation([r.to_dict() for r in rows], args.plot,
                        f"simulated ({profile.name}) vs measured: {args.results.name}")
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    host = results.get("host") or {}
    print(f"profile {profile.name} vs {args.results} ({results.get('date', '?')}, load "
          f"{host.get('loadavg_start', '?')} -> {host.get('loadavg_end', '?')}); "
          f"{args.repeats} simulated runs per row (median); ms; x = simulated / measured")
    _table(*table(rows))
    for name in ("ttft_p50", "tpot_p50", "ttft_p99"):
        verdicts = [within(r, name, args.tolerance) for r in rows]
        ok = sum(1 for v in verdicts if v)
        print(f"{name}: {ok}/{sum(1 for v in verdicts if v is not None)} rows within "
              f"{args.tolerance:.0%}")
    if args.plot is not None:
        print(f"plot: {args.plot}")
    return 0


def _published(args: argparse.Namespace) -> int:
    profile = _profile(args)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--seeds: comma-separated integers, got {args.seeds!r}") from None
    if not seeds or len(seeds) > 100 or any(not 0 <= x < 2 ** 32 for x in seeds):
        raise ConfigError("--seeds: 1..100 integers in 0..2**32-1")
    n = profile.scenario.requests if profile.scenario else 100
    fit_rows = [r for r in PR35264_ROWS if r.qps == 8]
    fitted: dict[str, int] = {}
    if args.fit:
        bare = profile.replace(proxy=replace(profile.proxy, pull_max_in_flight=0,
                                             push_max_in_flight=0))
        fitted = fit_in_flight(bare, fit_rows, n, seeds)
        profile = profile.replace(proxy=replace(profile.proxy,
                                                pull_max_in_flight=fitted.get("pull", 0),
                                                push_max_in_flight=fitted.get("push", 0)))
    keys = ("mean_ttft", "median_ttft", "p99_ttft", "mean_tpot", "req_s")
    out = []
    for row in PR35264_ROWS:
        sim = simulate_row(profile, row, n, seeds)
        out.append({"row": row.name, "role": "fitted (req/s)" if row in fit_rows else "held out",
                    "num_prompts_implied": num_prompts_from(row),
                    **{f"published_{k}": getattr(row, k) for k in keys},
                    **{f"simulated_{k}": sim[k] for k in keys}})
    if args.json:
        print(json.dumps({"source": PR35264_SOURCE, "num_prompts": n, "fitted": fitted,
                          "limits": {"pull": profile.proxy.pull_max_in_flight,
                                     "push": profile.proxy.push_max_in_flight},
                          "rows": out}, indent=2))
        return 0
    print(f"{PR35264_SOURCE}\nprofile {profile.name}: {n} prompts per run, vllm bench serve seeds "
          f"{seeds}; in-flight limits pull {profile.proxy.pull_max_in_flight}, push "
          f"{profile.proxy.push_max_in_flight}" + (" (refitted)" if fitted else "")
          + "; published / simulated (x)")
    rows = []
    for o in out:
        cells = [o["row"], o["role"], f"{o['num_prompts_implied']:.0f}"]
        for k in keys:
            pub, sim = o[f"published_{k}"], o[f"simulated_{k}"]
            cells.append(f"{pub:g} / {sim:.1f} ({sim / pub:.2f})")
        rows.append(cells)
    _table(["row", "role", "N implied", "mean TTFT", "median TTFT", "p99 TTFT", "mean TPOT",
            "req/s"], rows)
    return 0


def _profiles(args: argparse.Namespace) -> int:
    shipped = builtin_profiles()
    if args.name is None:
        rows = [[name, load_profile(name).description] for name in shipped]
        if args.json:
            print(json.dumps(dict(rows), indent=2))
        else:
            _table(["profile", "description"], rows)
        return 0
    profile = load_profile(args.name)
    doc = profile_to_dict(profile)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{profile.name}: {profile.description}")
    rows = []
    for section in ("model", "prefill", "decode", "link", "pull", "push", "proxy", "scenario"):
        for key, value in (doc.get(section) or {}).items():
            name = f"{section}.{key}"
            rows.append([name, str(value), profile.sources.get(name, "")])
    rows.append(["fragmentation", str(profile.fragmentation),
                 profile.sources.get("fragmentation", "")])
    _table(["parameter", "value", "source"], rows)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
