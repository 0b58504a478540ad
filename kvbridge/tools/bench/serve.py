"""``kvbridge bench serve``: vLLM's own ``vllm bench serve`` load at several request rates,
against kvbridge's proxy modes and vLLM's two NIXL connectors.

Setups (``--setups``, default all):

=====================  ======================================================================
``kvbridge-pull``      ``KVBridgeConnector`` (``--backend``, default ``nixl``) behind the
``kvbridge-push``      kvbridge proxy in mode pull / push / auto (the planner) / headroom (push
``kvbridge-auto``      or pull by D's load: auto before the planner), one ``python -m
``kvbridge-headroom``  kvbridge.proxy`` process per setup; the kvbridge modes share one engine pair
``vllm-nixl-pull``     vLLM's ``NixlConnector`` behind :mod:`kvbridge.tools.bench.proxy` (a
                       process too) speaking its stock protocol (P leg with ``max_tokens=1``,
                       then D with P's params)
``vllm-nixl-push``     vLLM's ``NixlPushConnector`` behind :mod:`kvbridge.tools.bench.proxy`
                       (both legs at once, same ``X-Request-Id``, D told P's engine id and
                       side-channel port)
=====================  ======================================================================

Engines are those of ``kvbridge bench e2e`` (:func:`kvbridge.tools.bench.fleet.engine_specs`: the
tiny model, P pinned to core 0, D to core 1, ``--block-size 32``): one fresh pair per group (the
kvbridge modes; each vLLM connector), stopped before the next group starts, also on error or
Ctrl-C (and at interpreter exit). ``--fleet xPyD`` (e.g. ``2P2D``) runs the kvbridge setups on x
P and y D engines behind one proxy per mode (:func:`kvbridge.tools.bench.fleet.fleet_specs`,
engines pinned round-robin to the CPUs); the vLLM setups run 1P1D only, so they refuse another
shape. Per setup, ``--warmups`` streamed requests through its endpoint first (unmeasured; the first
transfer of a pair pays NIXL's handshake); a setup whose warm-ups all fail is reported failed at
every rate.

Then, per (setup, rate), after waiting until every engine is idle (``vllm:num_requests_running``
and ``vllm:num_requests_waiting`` are 0 on each engine's ``/metrics``, bounded by
``--idle-timeout``), one ``vllm bench serve`` run (``python -m kvbridge.integrations.vllm_serve
bench serve``): random dataset of ``--num-prompts`` prompts of ``--input-len`` tokens, streamed
``/v1/completions``, ``--output-len`` tokens with ``--ignore-eos``, Poisson arrivals at the rate,
no ready-check or warm-up requests of its own (they would repeat the first prompt and hit the
prefix cache). Its seed is ``--seed + 1000 x slot + rate index``, slot 0 for pull, 1 for push, 2
for auto, 3 for headroom: kvbridge's pull and vLLM's pull (likewise push) see the very same
prompts and arrival times, and no prompt repeats on a shared engine pair.

Measured, from ``vllm bench serve``'s result JSON (client side, milliseconds): TTFT p50 / p99
(request sent to first streamed token, so it includes the P leg and the hand-off), TPOT p50 /
p99 (D's time per output token after the first), E2E latency p99, completed / failed requests and
request throughput. ``--out DIR`` (default: a new temporary directory) gets ``results.json``
(written after every run, so an interrupted run keeps what it measured; the fleet shape is in
``fleet`` and ``settings.prefill_engines`` / ``decode_engines``), every run's own result
JSON and log, the engine logs, and ``bench_serve.png``: one figure, three panels (TTFT p50, TTFT
p99, TPOT p50 against the rate, one line per setup; log y-axis where a panel spans more than 10x).
``--plot-only RESULTS_JSON`` redraws the figure (and prints the table) from a results file.

Exit status 0 when every (setup, rate) produced a result, 1 otherwise (the table names why).
Numbers from small shared hosts are noisy: compare setups within one run.

This module is the command (flags, validation, the printed report). The setups and settings
are :mod:`~kvbridge.tools.bench.serve_settings`'s, one ``vllm bench serve`` process
:mod:`~kvbridge.tools.bench.serve_process`'s, the run :mod:`~kvbridge.tools.bench.serve_run`'s,
the figures and table :mod:`~kvbridge.tools.bench.serve_results`'s and the plots
:mod:`~kvbridge.tools.bench.serve_plots`'.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.fleet import BENCH_BACKENDS, PIN_HELP
from kvbridge.tools.bench.serve_plots import matplotlib_available, write_plots
from kvbridge.tools.bench.serve_results import (
    RESULTS_FILE,
    format_phases,
    format_push_pull,
    format_steps,
    format_table,
    load_results,
    push_pull,
)
from kvbridge.tools.bench.serve_run import run_serve_bench
from kvbridge.tools.bench.serve_settings import (
    KVBRIDGE_GROUP,
    SETUP_NAMES,
    ServeSettings,
    fleet_name,
    parse_fleet,
    parse_rates,
    parse_setups,
    setup_group,
)
from kvbridge.tools.engines import signals_unwind

__all__ = ["add_arguments", "cli_main", "settings_from_args"]


# -- command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvbridge bench serve`` flags."""
    d = ServeSettings()
    p.add_argument("--setups", default=",".join(SETUP_NAMES),
                   help=f"comma-separated subset of {','.join(SETUP_NAMES)} (default: all)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates),
                   help="comma-separated request rates, req/s (Poisson arrivals)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="requests per (setup, rate)")
    p.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=d.output_len,
                   help="output tokens (--ignore-eos)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="base seed of the prompts and arrival times")
    p.add_argument("--backend", choices=BENCH_BACKENDS, default=d.backend,
                   help="transport of the kvbridge setups")
    p.add_argument("--warmups", type=int, default=d.warmups,
                   help="unmeasured requests through each setup's endpoint before its runs")
    p.add_argument("--push-headroom", type=int, default=d.push_headroom,
                   help="kvbridge-headroom: push while fewer than N requests are in flight at D")
    p.add_argument("--fleet", default=fleet_name(d.prefill_engines, d.decode_engines),
                   metavar="xPyD", help="kvbridge setups: x prefill and y decode engines behind "
                   "the proxy, e.g. 2P2D (default 1P1D; the vLLM setups run 1P1D only)")
    p.add_argument("--engine-spin-ms", type=float, default=d.engine_spin_ms,
                   help="KVBRIDGE_ENGINE_SPIN_MS for kvbridge's engines (negative: vLLM default)")
    p.add_argument("--pin-engines", action="store_true", help=PIN_HELP)
    p.add_argument("--client-nice", type=int, default=d.client_nice, metavar="N",
                   help="run the proxy and vllm bench serve at niceness N (e.g. -10) while the "
                   "engines keep theirs, as if the client and the proxy had cores of their own; "
                   "their sessions get N too, where the kernel schedules sessions as groups "
                   "(autogroup) (needs root or CAP_SYS_NICE for N < 0; default 0: unchanged)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds for one warm-up request")
    p.add_argument("--bench-timeout", type=float, default=d.bench_timeout,
                   help="kill one vllm bench serve run after this many seconds")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout,
                   help="seconds for an engine pair to become ready")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout,
                   help="before each run, wait at most this long for the engines to be idle")
    p.add_argument("--out", type=Path, default=None,
                   help="results, plots and logs (default: a new temporary directory)")
    p.add_argument("--model-dir", type=Path, default=None, help="tiny model directory")
    p.add_argument("--no-plots", action="store_true", help="do not draw the plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plot-only", type=Path, default=None, metavar="RESULTS_JSON",
                   help="start nothing: redraw the plots (into --out, default the file's "
                   "directory) and print the table from a results.json")
    p.add_argument("--json", action="store_true", help="print the report as JSON, not a table")


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Validate the parsed flags into :class:`ServeSettings` (ConfigError names a bad one)."""
    for name in ("num_prompts", "input_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.output_len < 2:
        raise ConfigError("--output-len must be >= 2 (TPOT needs two tokens)")
    for name in ("warmups", "push_headroom"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("request_timeout", "bench_timeout", "start_timeout", "idle_timeout"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    setups = parse_setups(args.setups)
    prefill, decode = parse_fleet(args.fleet)
    stock = [s for s in setups if setup_group(s) != KVBRIDGE_GROUP]
    if (prefill, decode) != (1, 1) and stock:
        raise ConfigError(f"--fleet {fleet_name(prefill, decode)}: {', '.join(stock)} run 1P1D "
                          "only; pick kvbridge setups (--setups kvbridge-pull,kvbridge-push,"
                          "kvbridge-auto,kvbridge-headroom)")
    return ServeSettings(
        setups=setups, rates=parse_rates(args.rates),
        prefill_engines=prefill, decode_engines=decode,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        seed=args.seed, backend=args.backend, warmups=args.warmups,
        push_headroom=args.push_headroom, engine_spin_ms=args.engine_spin_ms,
        pin_engines=args.pin_engines, client_nice=args.client_nice,
        request_timeout=args.request_timeout, bench_timeout=args.bench_timeout,
        start_timeout=args.start_timeout, idle_timeout=args.idle_timeout,
        plots=not args.no_plots, out=args.out, model_dir=args.model_dir,
    )


def _print_report(report: Mapping[str, Any], plots: Sequence[Path], as_json: bool,
                  results: Path | None = None) -> None:
    if as_json:
        json.dump({**report, "plots": [str(p) for p in plots],
                   "push_pull": push_pull(report.get("rows") or [])}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    s = report.get("settings") or {}
    print(f"kvbridge bench serve, {report.get('date')}, {report.get('fleet') or '1P1D'}, "
          f"backend {s.get('backend')}, "
          f"{s.get('num_prompts')} prompts x {s.get('input_len')} -> {s.get('output_len')} "
          f"tokens, host {report.get('host', {}).get('cpus')} CPUs, load "
          f"{report.get('host', {}).get('loadavg_start')} -> "
          f"{report.get('host', {}).get('loadavg_end')}")
    print()
    print(format_table(report.get("rows") or []))
    rows = report.get("rows") or []
    for extra in (format_steps(rows), format_phases(rows), format_push_pull(push_pull(rows))):
        if extra:
            print()
            print(extra)
    print()
    print(f"results: {results or Path(str(report.get('out', '.'))) / RESULTS_FILE}")
    for path in plots:
        print(f"plot: {path}")


def cli_main(args: argparse.Namespace) -> int:
    if args.plot_only is not None:
        report = load_results(args.plot_only)
        out_dir = args.out or args.plot_only.resolve().parent
        if not matplotlib_available():
            raise ConfigError("--plot-only needs matplotlib (pip install matplotlib)")
        plots = write_plots(report, out_dir)
        _print_report({**report, "out": str(args.plot_only.resolve().parent)}, plots, args.json,
                      results=args.plot_only.resolve())
        return 0
    settings = settings_from_args(args)
    if settings.plots and not matplotlib_available():
        raise ConfigError("the plots need matplotlib (pip install matplotlib); or run with "
                          "--no-plots and draw them later with --plot-only RESULTS_JSON")
    out = (settings.out or Path(tempfile.mkdtemp(prefix="kvbridge-bench-serve-"))).resolve()
    settings = replace(settings, out=out)
    print(f"kvbridge bench serve: results and logs in {out}", file=sys.stderr, flush=True)
    with signals_unwind():
        report = run_serve_bench(settings, out, progress_bar=not args.no_progress)
    plots = write_plots(report, out) if settings.plots else []
    _print_report(report, plots, args.json)
    return 0 if all(not r.get("error") for r in report["rows"]) else 1
