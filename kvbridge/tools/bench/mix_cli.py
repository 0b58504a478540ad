"""``kvbridge bench mix``: one seeded mixed workload, replayed identically under each hand-off
policy (``push``, ``pull``, ``local`` = D alone, ``headroom``, ``auto`` = the planner) through one
proxy.

The trace is :func:`~kvbridge.tools.bench.mix_workload.generate_trace`'s (classes ``short``,
``long``, ``chat``, ``system``, ``warm_d``; Poisson arrivals); the replay, the comparison with the
``local`` reference and the tables are :mod:`~kvbridge.tools.bench.mix`'s. Each request names its
policy in ``X-KVBridge-Mode``; the proxy answers with ``X-KVBridge-Plan`` when its planner chose.

Without ``--proxy`` the command starts the tiny model's engines
(:func:`~kvbridge.tools.bench.fleet.fleet_specs`, ``kvbridge-<backend>``, ``--fleet xPyD``) with
``VLLM_SERVER_DEV_MODE=1`` and one kvbridge proxy process in front of them (``python -m
kvbridge.proxy``, mode ``auto``, the planner, which so learns from every policy's requests; its
own process, so it never shares the load generator's GIL). Before each policy it waits until the
engines are idle, drops every engine's prefix cache (``POST /reset_prefix_cache``) and sends
``--warmups`` unmeasured requests with that policy; around the replay it reads the P engines'
``vllm:request_success_total``, so the table's ``P reqs`` says how many requests P finished
during the policy (``local`` must show 0: D alone). Everything it started is stopped when it
returns, fails, is interrupted (Ctrl-C) or gets SIGTERM/SIGHUP. With ``--proxy URL`` nothing is
started and nothing is reset: the per-policy ``cache_salt`` alone keeps the runs apart.

With ``--disk-tier`` D runs one ``slow_disk`` tier (:mod:`kvbridge.testing.slow_tier`; its read
delay in ``DIR/slow-tier-ms``), every engine publishes vLLM's KV events and the proxy follows
them (``--kv-events``: the planner sees which prompt tokens D holds on disk), and the trace
gets the ``disk`` class. Before each policy, after the warm-ups, each ``disk`` request's own
prefix is sent to D alone with that policy's ``cache_salt`` (D stores its blocks on disk), and
once D's tier has stored them vLLM's own prefix cache is dropped: the class's prefixes are then
on D's disk and nowhere else. ``--slow-tier-at N --slow-tier-ms MS --slow-tier-for M`` writes
the delay before request N is sent and 0 before request N + M
(:class:`~kvbridge.tools.bench.mix_tier.SlowTier`, every policy's replay); the report then says,
per policy, what the ``disk`` requests chose around it and after how many requests the choices
flipped off the tier and back (:func:`~kvbridge.tools.bench.mix_tier.flips`).

Prints one table per rate, then goodput against the rate; ``--out FILE`` gets the JSON report
(every request's outcome included). Exit status 0 when every policy ran and no request failed
or mismatched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.fleet import fleet_specs
from kvbridge.tools.bench.mix import (
    MODE_HEADER,
    POLICIES,
    format_goodput,
    format_rate,
    parse_policies,
    run_rate,
    write_plot,
)
from kvbridge.tools.bench.mix_tier import (
    SlowTier,
    disk_tier_offload,
    flips,
    format_flips,
    kv_events_config,
)
from kvbridge.tools.bench.mix_workload import (
    DEFAULT_SHARES,
    DISK_SHARES,
    MixTrace,
    generate_trace,
    parse_shares,
)
from kvbridge.tools.bench.serve_plots import matplotlib_available
from kvbridge.tools.bench.serve_settings import fleet_name, parse_fleet, parse_rates
from kvbridge.tools.engines import signals_unwind

if TYPE_CHECKING:
    from kvbridge.tools.proxies import ProxyProcess

__all__ = ["add_arguments", "cli_main", "parse_max_tokens", "proxy_mode"]

#: the transports the mix has been run on (mooncake, in fleet.BENCH_BACKENDS, not yet)
BACKENDS = ("shm", "nixl")
P_COUNTER = "vllm:request_success_total"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvbridge bench mix`` flags."""
    p.add_argument("--backend", choices=BACKENDS, default="shm",
                   help="transport of the engines this command starts")
    p.add_argument("--fleet", default="1P1D", metavar="xPyD",
                   help="x prefill and y decode engines behind the proxy, e.g. 1P1D or 2P2D")
    p.add_argument("--proxy", default=None, metavar="URL",
                   help="replay against this running kvbridge proxy; start no engines")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated hand-off policies, each sent as X-KVBridge-Mode "
                   "(local = D alone, the reference of the output comparison; run first)")
    p.add_argument("--rates", default="2,4",
                   help="comma-separated request rates, req/s (Poisson arrivals); one table each")
    p.add_argument("--num-requests", type=int, default=40, help="requests of the trace")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace (prompts, arrivals)")
    p.add_argument("--shares", default=None,
                   help="expected share of each request class, CLASS=SHARE,... (normalised; "
                   "default " + ",".join(f"{k}={v:g}" for k, v in DEFAULT_SHARES.items())
                   + ", with --disk-tier 30%% disk and the rest scaled)")
    p.add_argument("--max-tokens", default="8,16", metavar="LOW,HIGH",
                   help="each request's max_tokens is drawn from LOW..HIGH (>= 2: TPOT)")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0,
                   help="TTFT SLO of the goodput column, ms")
    p.add_argument("--tpot-slo-ms", type=float, default=50.0,
                   help="TPOT SLO of the goodput column, ms")
    p.add_argument("--warmups", type=int, default=2,
                   help="unmeasured requests per policy before its replay (engines started here)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds one request may take before it counts as failed")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds for the engines to become ready")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="before each policy, wait at most this long for the engines to be idle")
    p.add_argument("--engine-spin-ms", type=float, default=2.0,
                   help="KVBRIDGE_ENGINE_SPIN_MS of the engines (negative: vLLM's default)")
    p.add_argument("--model", choices=("tiny", "bench"), default="tiny",
                   help="tiny: the test model (cheap prefill); bench: the ~100 M-parameter bench "
                   "model, where prefill costs real time and D alone competes with its decodes")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the model is built (default: kvbridge's cache directory)")
    t = p.add_argument_group("a disk tier on D, slowed mid-run")
    t.add_argument("--disk-tier", action="store_true",
                   help="D runs a slow_disk tier, the engines publish KV events to the proxy, and "
                   "the trace has the disk class (prefixes only on D's disk); engines started "
                   "here only")
    t.add_argument("--slow-tier-at", type=int, default=None, metavar="N",
                   help="with --disk-tier: slow the tier's reads from request N of the trace on")
    t.add_argument("--slow-tier-ms", type=float, default=800.0, metavar="MS",
                   help="the read delay while the tier is slow, ms")
    t.add_argument("--slow-tier-for", type=int, default=20, metavar="M",
                   help="the tier is fast again from request N + M on")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="write the JSON report (every request's outcome) here")
    p.add_argument("--json", action="store_true", help="print the report as JSON, not tables")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="also draw goodput, TTFT p99 and TPOT p50 of the whole mix against the "
                        "rate, a line per policy, into this file (needs matplotlib)")
    p.add_argument("--plot-only", type=Path, default=None, metavar="RESULTS_JSON",
                   help="start and send nothing: print the tables of an earlier --out report "
                        "and, with --plot, draw its figure")


def parse_max_tokens(text: str) -> tuple[int, int]:
    """``"8,16"`` (or ``"8"``) → (8, 16); ConfigError naming ``--max-tokens``."""
    try:
        parts = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ConfigError(f"--max-tokens: {text!r} is not LOW,HIGH (integers)") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2:
        raise ConfigError(f"--max-tokens: {text!r} is not LOW,HIGH")
    return parts[0], parts[1]


def proxy_mode() -> str:
    """The started proxy's ``--mode``: ``auto``, the planner (it sees every request)."""
    return "auto"


def _check(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("ttft_slo_ms", "tpot_slo_ms", "request_timeout", "start_timeout",
                 "idle_timeout"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    if args.warmups < 0:
        raise ConfigError("--warmups must be >= 0")
    if args.proxy is not None and not args.proxy.startswith(("http://", "https://")):
        raise ConfigError(f"--proxy: {args.proxy!r} is not an http(s) URL")
    if args.disk_tier and args.proxy is not None:
        raise ConfigError("--disk-tier: the engines must be started here (not with --proxy)")
    if args.slow_tier_at is not None and not args.disk_tier:
        raise ConfigError("--slow-tier-at needs --disk-tier")
    slow = (None if args.slow_tier_at is None
            else SlowTier(args.slow_tier_at, args.slow_tier_ms, args.slow_tier_for))
    shares = (parse_shares(args.shares) if args.shares is not None
              else dict(DISK_SHARES if args.disk_tier else DEFAULT_SHARES))
    if shares.get("disk", 0.0) > 0 and not args.disk_tier:
        raise ConfigError("--shares: the disk class needs --disk-tier (a tier on D)")
    max_tokens = parse_max_tokens(args.max_tokens)
    rates = parse_rates(args.rates)
    traces = [generate_trace(args.num_requests, r, args.seed, shares=shares,
                             max_tokens=max_tokens) for r in rates]  # fmt: skip
    return {"policies": parse_policies(args.policies), "fleet": parse_fleet(args.fleet),
            "traces": traces, "shares": shares, "max_tokens": max_tokens, "slow": slow}


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _Engines:
    """The hooks around each policy when this command runs the engines."""

    def __init__(self, ps: Sequence[Any], ds: Sequence[Any], proxy_url: str,
                 args: argparse.Namespace, tier: _Tier | None = None) -> None:
        self.ps, self.ds, self.url, self.args = ps, ds, proxy_url, args
        self.p_before = 0.0
        self.tier = tier
        self.trace: MixTrace | None = None
        """The trace of the rate being replayed (its disk prefixes are seeded per policy)."""

    def _p_finished(self) -> float:
        from kvbridge.tools import prom

        return sum(prom.total(prom.fetch(p.url), P_COUNTER) for p in self.ps)

    def _idle(self) -> None:
        from kvbridge.tools.bench.serve_run import engines_idle

        idle, waited = engines_idle([e.url for e in (*self.ps, *self.ds)], self.args.idle_timeout)
        if not idle:
            _say(f"engines not idle after {waited:.0f} s; going on")

    def before(self, policy: str) -> Mapping[str, Any]:
        from kvbridge.tools.client import reset_prefix_cache, stream_complete
        from kvbridge.tools.tiny_model import random_prompts

        self._idle()
        for e in (*self.ps, *self.ds):
            reset_prefix_cache(e.url)
        warm_ok = 0
        for prompt in random_prompts(self.args.warmups, 64, seed=900_000 + self.args.seed):
            try:
                stream_complete(self.url, prompt, 4, None,
                                {"ignore_eos": True, "cache_salt": f"mix-warmup-{policy}"},
                                timeout=self.args.request_timeout,
                                headers={MODE_HEADER: policy})
                warm_ok += 1
            except Exception as exc:  # noqa: BLE001 - a warm-up is unmeasured; say why
                _say(f"{policy}: warm-up failed: {str(exc)[:200]}")
        out: dict[str, Any] = {"warmups_ok": warm_ok}
        if self.tier is not None and self.trace is not None:
            out["tier_seeded"] = self.tier.seed(self.ds, self.trace, policy, self.args)
        self._idle()
        self.p_before = self._p_finished()
        return out

    def after(self, policy: str) -> Mapping[str, Any]:
        self._idle()
        if self.tier is not None:
            self.tier.delay(0.0)
        return {"p_requests": self._p_finished() - self.p_before}


class _Tier:
    """D's ``slow_disk`` tier under ``--disk-tier``: its delay file, its seeding."""

    def __init__(self, root: Path, slow: SlowTier | None) -> None:
        self.root = root
        self.delay_file = root / "slow-tier-ms"
        self.slow = slow
        self.ctl: list[str] = []
        """Per D engine: its connector's control address (for its tier's counters)."""
        self.delay(0.0)

    def delay(self, ms: float) -> None:
        """Put ``ms`` in force (the tier re-reads its file within 100 ms)."""
        tmp = self.delay_file.with_suffix(".tmp")
        tmp.write_text(f"{ms:g}\n")
        os.replace(tmp, self.delay_file)

    def on_send(self, index: int) -> None:
        """Before request ``index`` is sent: the schedule's delay, if it changes there."""
        ms = None if self.slow is None else self.slow.delay_before(index)
        if ms is not None:
            self.delay(ms)
            _say(f"slow tier: read delay {ms:g} ms from request {index} on")

    def seed(self, ds: Sequence[Any], trace: MixTrace, policy: str,
             args: argparse.Namespace) -> int:
        """Each disk request's prefix into D's tier (D alone, the policy's salt), then vLLM's
        own prefix caches dropped; the blocks D's tiers stored (what the replay can hit)."""
        from kvbridge.tools.bench.mix import cache_salt
        from kvbridge.tools.client import (
            engine_stats,
            reset_prefix_cache,
            stream_complete,
            wait_stats,
        )

        self.delay(0.0)
        key = "offload_stored_blocks_slow_disk"
        before = [engine_stats(c).get(key, 0) for c in self.ctl]
        salt = cache_salt(policy, trace.seed, trace.rate)
        want = [0] * len(ds)
        for n, (_, prefix) in enumerate(trace.tier_prefixes()):
            d = n % len(ds)
            stream_complete(ds[d].url, list(prefix), 2, None,
                            {"ignore_eos": True, "cache_salt": salt},
                            timeout=args.request_timeout)
            want[d] += len(prefix) // 32  # whole blocks (--block-size 32)
        stored = 0
        for c, b, w in zip(self.ctl, before, want, strict=True):
            got = wait_stats(c, key, b + w, timeout=20.0).get(key, 0) - b
            if got < w:
                _say(f"{policy}: D's tier stored {got} of {w} blocks of the disk prefixes")
            stored += got
        for d in ds:
            reset_prefix_cache(d.url)
        return stored


@contextlib.contextmanager
def _started(args: argparse.Namespace, prefill: int, decode: int, out_dir: Path,
             slow: SlowTier | None = None) -> Iterator[tuple[str, _Engines, dict[str, Any]]]:
    """Engines and a proxy process, stopped on exit; (proxy URL, hooks, what ran). Under
    ``--disk-tier`` the tiers' files live in a temporary directory, removed on exit."""
    from kvbridge.tools.engines import start_servers
    from kvbridge.tools.proxies import ProxyProcess  # aiohttp: keeps --help fast
    from kvbridge.tools.tiny_model import build_bench_model, build_tiny_model

    model = (build_bench_model if args.model == "bench" else build_tiny_model)(args.model_dir)
    config = f"kvbridge-{args.backend}"
    ps, ds = fleet_specs(config, model, out_dir / "logs", args.engine_spin_ms, prefill, decode)
    for e in (*ps, *ds):
        e.env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache between policies
    tier_dir = Path(tempfile.mkdtemp(prefix="kvbridge-mix-tier-")) if args.disk_tier else None
    tier = None if tier_dir is None else _disk_tier(ps, ds, tier_dir, slow)
    mode = proxy_mode()
    proxy: ProxyProcess | None = None
    try:
        _say(f"starting {fleet_name(prefill, decode)} {config} engines (logs in {out_dir})")
        start_servers([*ps, *ds], timeout=args.start_timeout)
        # the engines' ports are known once they started
        # the planner is told the SLOs the goodput column counts (an operator tells it theirs)
        slos = (["--plan-ttft-slo-ms", str(args.ttft_slo_ms),
                 "--plan-tpot-slo-ms", str(args.tpot_slo_ms)] if mode == "auto" else [])
        if tier is not None:
            slos.append("--kv-events")
        # a process of its own, not a thread here: the replay's event loop and the proxy would
        # share one GIL, and the relay would stall behind the load generator
        proxy = ProxyProcess(["--prefill", *[p.url for p in ps], "--decode",
                              *[d.url for d in ds], "--mode", mode, *slos],
                             out_dir / "logs" / "proxy.log")
        url = proxy.start(timeout=60.0)
        info: dict[str, Any] = {"engines": config, "proxy_mode": mode,
                                "logs": str(out_dir / "logs")}
        if tier is not None:
            info["disk_tier"] = {"tier": "slow_disk", "delay_file": str(tier.delay_file),
                                 "kv_events": True}
        yield url, _Engines(ps, ds, url, args, tier), info
    finally:
        if proxy is not None:
            proxy.stop()
        for e in (*ps, *ds):
            e.stop()
        if tier_dir is not None:
            shutil.rmtree(tier_dir, ignore_errors=True)
        _say("engines and proxy stopped")


def _disk_tier(ps: Sequence[Any], ds: Sequence[Any], out_dir: Path,
               slow: SlowTier | None) -> _Tier:
    """``--disk-tier``: a ``slow_disk`` tier on every D (a control port to read its counters),
    vLLM's KV events published by every engine."""
    from kvbridge.tools.engines import free_port

    tier = _Tier(out_dir, slow)
    for i, d in enumerate(ds):
        ctl = free_port()
        extra = d.kv_transfer_config["kv_connector_extra_config"]
        extra["side_channel_port"] = ctl
        extra["offload"] = disk_tier_offload(str(out_dir / f"d{i}-tier"), str(tier.delay_file))
        tier.ctl.append(f"tcp://127.0.0.1:{ctl}")
    for e in (*ps, *ds):
        e.extra_args += ["--kv-events-config", json.dumps(kv_events_config(free_port()))]
    return tier


def _print(report: Mapping[str, Any]) -> None:
    s = report["settings"]
    print(f"kvbridge bench mix, {report['date']}, {s['fleet']}, "
          f"{report.get('setup', {}).get('engines', 'proxy ' + str(report['url']))}, "
          f"proxy mode {report.get('setup', {}).get('proxy_mode', '?')}, {s['num_requests']} "
          f"requests, seed {s['seed']}, SLO TTFT {s['ttft_slo_ms']:g} ms / TPOT "
          f"{s['tpot_slo_ms']:g} ms")
    for entry in report["rates"]:
        counts = ", ".join(f"{k} {n}" for k, n in entry["counts"].items())
        print(f"\nrate {entry['rate']:g} req/s ({counts})")
        print(format_rate(entry))
        for run in entry["policies"]:
            if run.get("slow_tier") and run["policy"] in ("auto", "plan"):  # plan: old reports
                print()
                print(format_flips(run["slow_tier"], run["policy"]))
    if len(report["rates"]) > 1:
        print("\ngoodput (whole mix, req/s) against the rate")
        print(format_goodput(report))


def _clean(report: Mapping[str, Any]) -> bool:
    for entry in report["rates"]:
        for run in entry["policies"]:
            whole = (run.get("rows") or [{}])[-1]
            if run.get("error") or whole.get("failures") or whole.get("mismatches"):
                return False
    return True


def run_mix(args: argparse.Namespace, say: Callable[[str], None] = _say) -> dict[str, Any]:
    """Validate, run every rate, return the report (written to ``--out`` after every rate)."""
    checked = _check(args)
    prefill, decode = checked["fleet"]
    report: dict[str, Any] = {
        "kind": "kvbridge-bench-mix", "date": datetime.date.today().isoformat(),
        "url": args.proxy,
        "settings": {"fleet": fleet_name(prefill, decode), "backend": args.backend,
                     "policies": list(checked["policies"]), "num_requests": args.num_requests,
                     "seed": args.seed, "shares": checked["shares"],
                     "max_tokens": list(checked["max_tokens"]), "ttft_slo_ms": args.ttft_slo_ms,
                     "tpot_slo_ms": args.tpot_slo_ms, "disk_tier": args.disk_tier,
                     "slow_tier": None if checked["slow"] is None else {
                         "at": checked["slow"].at, "ms": checked["slow"].ms,
                         "for": checked["slow"].count}},
        "rates": []}

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")

    def rates(url: str, hooks: _Engines | None) -> None:
        tier = hooks.tier if hooks else None
        for trace in checked["traces"]:
            if hooks is not None:
                hooks.trace = trace
            entry = run_rate(
                url, trace, checked["policies"], ttft_slo_ms=args.ttft_slo_ms,
                tpot_slo_ms=args.tpot_slo_ms, timeout=args.request_timeout,
                before=hooks.before if hooks else None, after=hooks.after if hooks else None,
                on_send=tier.on_send if tier else None, say=say)  # fmt: skip
            if checked["slow"] is not None:
                for run in entry["policies"]:
                    if run.get("requests"):
                        run["slow_tier"] = flips(run["requests"], checked["slow"])
            report["rates"].append(entry)
            save()

    with signals_unwind():
        if args.proxy is not None:
            rates(args.proxy, None)
        else:
            out_dir = (args.out.resolve().parent if args.out is not None
                       else Path(tempfile.mkdtemp(prefix="kvbridge-bench-mix-")))
            with _started(args, prefill, decode, out_dir, checked["slow"]) as (url, hooks,
                                                                               info):
                report["url"], report["setup"] = url, info
                rates(url, hooks)
    save()
    return report


def cli_main(args: argparse.Namespace) -> int:
    if args.plot is not None and not matplotlib_available():
        raise ConfigError("--plot: matplotlib is not installed (pip install matplotlib)")
    if args.plot_only is not None:
        try:
            report = json.loads(args.plot_only.read_text())
            if report.get("kind") != "kvbridge-bench-mix":
                raise ValueError("not a kvbridge bench mix report")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"--plot-only: cannot read {args.plot_only}: {exc}") from None
    else:
        report = run_mix(args)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print(report)
        if args.out is not None and args.plot_only is None:
            print(f"\nresults: {args.out}")
    if args.plot is not None:
        path = write_plot(report, args.plot)
        if not args.json:
            print(f"figure: {path}")
    return 0 if _clean(report) else 1
