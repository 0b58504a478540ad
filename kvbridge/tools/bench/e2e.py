"""``kvbridge bench e2e``: kvbridge against vLLM's own NIXL connectors, end to end, in one run.

Every configuration gets its own fresh pair of real ``vllm serve`` engines (P pinned to core 0,
D to core 1, the tiny model of :mod:`kvbridge.tools.tiny_model`), runs the same seeded
workload, and is stopped before the next one starts (also on error or Ctrl-C):

==================  =========================================================================
``vllm-nixl-pull``  vLLM's ``NixlConnector``, its stock pull protocol (P leg with
                    ``max_tokens=1``, then D with P's returned params)
``vllm-nixl-push``  vLLM's ``NixlPushConnector``, its stock protocol (same ``X-Request-Id`` on
                    both legs, sent concurrently; D told P's engine id and side-channel port)
``kvbridge-shm``    ``KVBridgeConnector`` with ``backend: shm``: modes pull, push and headroom
``kvbridge-nixl``   ``KVBridgeConnector`` with ``backend: nixl``: modes pull, push and headroom
==================  =========================================================================

Workload per (configuration, mode): one warm-up request, then phase ``seq`` (N requests back to
back) and phase ``c8`` (waves of 8 concurrent requests); for kvbridge also ``proxy-seq``, the
same kind of sequential requests sent through the real kvbridge proxy
(:class:`~kvbridge.tools.proxies.ProxyThread`) so its overhead shows. Every request has a
fresh random-id prompt (no prefix-cache hit anywhere); the prompts depend only on the seed, the
mode slot (pull / push / headroom, the proxy's push-or-pull-by-load rule) and the phase, so vLLM's
pull and kvbridge's pull see the very same prompts, and likewise for push. D's leg is
streamed; greedy, ``ignore_eos``.

Measured per phase:

- TTFT: from dispatch (the P leg for pull, both legs for push) to D's first streamed token;
  TPOT: D's mean inter-token time.
- Hand-off (kvbridge only): ``D.first_step - P.kv_ready`` per transfer id, read from each
  engine's control channel (:class:`~kvbridge.messages.StatsQuery`; wall clock, same host), with
  a breakdown by step. vLLM's connectors report no such timings; for them the table shows the
  mean of ``vllm:nixl_xfer_time_seconds`` over the phase (a different, narrower quantity: the
  NIXL transfer itself).
- CPU seconds used by each engine's whole process group during the phase (``/proc/<pid>/stat``
  of every process in the group; no monitor processes), plus an ``idle`` phase that shows what an
  engine burns doing nothing (NIXL's UCX progress thread spins).
- Correctness: after the measured phases, the first ``--check`` requests of every phase are
  re-run as a plain single-engine greedy request on P; D's output must equal it (MATCH).

Blocking; meant for the command line. Engines are always stopped before returning, and at
interpreter exit (atexit in :mod:`kvbridge.tools.engines`). Numbers from small shared hosts
are noisy: compare ratios within one run.

This module runs the phases and is the command. The engines are
:mod:`~kvbridge.tools.bench.fleet`'s, one request :mod:`~kvbridge.tools.bench.dispatch`'s, the
hand-off numbers :mod:`~kvbridge.tools.bench.timings`', the CPU seconds
:mod:`kvbridge.tools.cpumeter`'s, and the settings, records, rows and tables
:mod:`~kvbridge.tools.bench.e2e_report`'s.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools import prom
from kvbridge.tools.bench.dispatch import (
    GREEDY,
    Pair,
    connect,
    control_stats,
    dispatch,
    via_proxy,
)
from kvbridge.tools.bench.e2e_report import (
    BenchSettings,
    PhaseResult,
    RequestRecord,
    add_ratios,
    format_bars,
    format_breakdown,
    format_table,
    parse_configs,
    summarize,
    workload_prompts,
)
from kvbridge.tools.bench.fleet import CONFIG_NAMES, PIN_HELP, engine_specs
from kvbridge.tools.bench.timings import (
    beyond_wire,
    handoff_breakdown,
    handoff_times,
    request_steps,
)
from kvbridge.tools.client import complete, output_token_ids
from kvbridge.tools.cpumeter import CpuMeter, loadavg
from kvbridge.tools.engines import EngineError, start_servers
from kvbridge.tools.tiny_model import build_tiny_model

__all__ = ["Progress", "add_arguments", "cli_main", "format_report", "run_benchmark",
           "run_config", "run_phase", "settings_from_args"]

log = logging.getLogger("kvbridge.tools.bench.e2e")

_XFER_METRIC = "vllm:nixl_xfer_time_seconds"


def _scrape(url: str, name: str, timeout: float = 5.0) -> tuple[float, float]:
    """(sum, count) of histogram *name* on one engine's ``/metrics``."""
    return prom.histogram(prom.fetch(url, timeout), name)



# -- phases --------------------------------------------------------------------------------------


def _run_requests(send: Callable[[list[int], int], RequestRecord], prompts: list[list[int]],
                  concurrency: int, max_failures: int) -> list[RequestRecord]:
    """Send *prompts* one at a time (concurrency 1) or in waves; stop early on repeated failure."""
    records: list[RequestRecord] = []
    if concurrency <= 1:
        streak = 0
        for i, prompt in enumerate(prompts):
            if streak >= max_failures:
                records.append(RequestRecord(index=i, mode="-", error="skipped: "
                                             f"{max_failures} failures in a row"))
                continue
            rec = send(prompt, i)
            records.append(rec)
            streak = 0 if rec.ok else streak + 1
        return records
    pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix="bench-req")
    try:
        for start in range(0, len(prompts), concurrency):
            wave = prompts[start:start + concurrency]
            if records and not any(r.ok for r in records[-concurrency:]):
                records += [RequestRecord(index=start + j, mode="-",
                                          error="skipped: the previous wave failed entirely")
                            for j in range(len(wave))]
                continue
            futs = [pool.submit(send, p, start + j) for j, p in enumerate(wave)]
            records += [f.result() for f in futs]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return records


def run_phase(pair: Pair, mode: str, phase: str, prompts: list[list[int]], concurrency: int,
              send: Callable[[list[int], int], RequestRecord]) -> PhaseResult:
    """Measure one phase: CPU, (vLLM) NIXL metrics and (kvbridge) timings around the requests."""
    res = PhaseResult(pair.config, mode, phase)
    xfer0 = _xfer_totals(pair)
    d_keys0: set[str] = set()
    if pair.kvbridge and pair.d_ctl:
        d_keys0 = set(control_stats(pair.d_ctl).timings)
    meter = CpuMeter(pair.p.pid or -1, pair.d.pid or -1)
    t0 = time.perf_counter()
    res.records = _run_requests(send, prompts, concurrency, pair.settings.max_failures)
    res.wall_s = time.perf_counter() - t0
    res.cpu_p, res.cpu_d, res.cpu_bench, res.cpu_other = meter.read()
    xfer1 = _xfer_totals(pair)
    if xfer0 is not None and xfer1 is not None and xfer1[1] > xfer0[1]:
        res.xfer_count = int(xfer1[1] - xfer0[1])
        res.xfer_avg_ms = (xfer1[0] - xfer0[0]) / (xfer1[1] - xfer0[1]) * 1000.0
    if pair.kvbridge and pair.p_ctl and pair.d_ctl:
        time.sleep(0.2)  # the last first_step reaches D's agent with its next engine step
        p_t, d_t = control_stats(pair.p_ctl).timings, control_stats(pair.d_ctl).timings
        tids = [r.transfer_id for r in res.records if r.transfer_id]
        if not tids:  # through the proxy: its transfer ids are the ones new on D
            tids = sorted(set(d_t) - d_keys0)
        res.handoffs = handoff_times(p_t, d_t, tids)
        res.beyond_wire = beyond_wire(p_t, d_t, tids)
        client = {r.transfer_id: {"dispatch": r.t0_wall, "first_token": r.t0_wall + r.ttft}
                  for r in res.records
                  if r.transfer_id and r.t0_wall is not None and r.ttft is not None}
        res.breakdown = handoff_breakdown(p_t, d_t, tids, client)
        for r in res.records:
            if r.transfer_id and r.t0_wall is not None:
                r.steps = request_steps(p_t, d_t, r.transfer_id, r.t0_wall)
    res.loadavg = loadavg()
    failed = [r for r in res.records if not r.ok]
    if failed:
        res.error = f"{len(failed)} failed, first: {failed[0].error}"
    return res


def _xfer_totals(pair: Pair) -> tuple[float, float] | None:
    """vLLM NIXL: summed (sum, count) of the transfer-time histogram over both engines."""
    if pair.kvbridge:
        return None
    try:
        a = _scrape(pair.p.url, _XFER_METRIC)
        b = _scrape(pair.d.url, _XFER_METRIC)
    except OSError as exc:
        log.warning("cannot scrape /metrics: %s", exc)
        return None
    return a[0] + b[0], a[1] + b[1]


def _idle_phase(pair: Pair) -> PhaseResult:
    res = PhaseResult(pair.config, "-", "idle")
    meter = CpuMeter(pair.p.pid or -1, pair.d.pid or -1)
    t0 = time.perf_counter()
    time.sleep(pair.settings.idle_s)
    res.wall_s = time.perf_counter() - t0
    res.cpu_p, res.cpu_d, res.cpu_bench, res.cpu_other = meter.read()
    res.loadavg = loadavg()
    return res


def _check(pair: Pair, results: Sequence[PhaseResult]) -> None:
    """Re-run the first ``check`` requests of every phase as plain greedy on P; count matches."""
    for res in results:
        for rec in [r for r in res.records if r.ok][:pair.settings.check]:
            try:
                ref = output_token_ids(complete(pair.p.url, rec.prompt, pair.settings.max_tokens,
                                                extra=GREEDY,
                                                timeout=pair.settings.request_timeout))
            except EngineError as exc:
                res.error = (res.error + "; " if res.error else "") + f"reference failed: {exc}"
                continue
            res.checked += 1
            res.matched += int(ref == rec.token_ids)


# -- one configuration ---------------------------------------------------------------------------


Progress = Callable[[str], None]


def _modes(config: str) -> list[str]:
    if config == "vllm-nixl-pull":
        return ["pull"]
    if config == "vllm-nixl-push":
        return ["push"]
    return ["pull", "push", "headroom"]


def run_config(config: str, settings: BenchSettings, model: Path, log_dir: Path,
               progress: Progress) -> tuple[list[PhaseResult], dict[str, Any]]:
    """Start *config*'s engines, run every mode and phase, check outputs, stop the engines."""
    info: dict[str, Any] = {"loadavg_start": loadavg(), "logs": str(log_dir)}
    results: list[PhaseResult] = []
    p, d = engine_specs(config, model, log_dir, settings.engine_spin_ms, settings.pin_engines)
    legs = cf.ThreadPoolExecutor(2 * settings.wave, thread_name_prefix="bench-leg")
    proxies: Any = None
    t_start = time.monotonic()
    try:
        progress(f"{config}: starting engines (logs in {log_dir})")
        start_servers([p, d], timeout=settings.start_timeout,
                      progress=lambda s, r: progress(f"{config}: waiting for engines {s:.0f} s "
                                                     f"ready={r}"), progress_every=30.0)
        info["ready_s"] = round(time.monotonic() - t_start, 1)
        pair = Pair(config, p, d, settings, legs)
        results.append(_idle_phase(pair))
        if pair.kvbridge:
            from kvbridge.tools.proxies import ProxyThread  # aiohttp: optional and heavy

            connect(pair)
            proxies = ProxyThread([p.url], [d.url], modes=_modes(config),
                                  push_headroom=settings.push_headroom).start()
        for mode in _modes(config):
            results += _run_mode(pair, mode, proxies, progress)
        progress(f"{config}: checking outputs against single-engine greedy on P")
        _check(pair, [r for r in results if r.phase != "idle"])
    except Exception as exc:  # noqa: BLE001 - report the configuration as failed, go on
        results.append(PhaseResult(config, "-", "setup", error=f"{type(exc).__name__}: {exc}"))
        progress(f"{config}: FAILED: {exc}")
    finally:
        if proxies is not None:
            proxies.close()
        legs.shutdown(wait=False, cancel_futures=True)
        p.stop()
        d.stop()
        info["loadavg_end"] = loadavg()
        info["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return results, info


def _run_mode(pair: Pair, mode: str, proxies: Any, progress: Progress) -> list[PhaseResult]:
    s = pair.settings
    out: list[PhaseResult] = []
    warm = RequestRecord(index=0, mode=mode)
    for attempt, prompt in enumerate(workload_prompts(s, mode, "warmup", s.warmup_tries)):
        warm = dispatch(pair, mode, prompt, attempt)
        if warm.ok:
            break
        progress(f"{pair.config} {mode}: warm-up attempt {attempt + 1} failed: {warm.error}")
    if not warm.ok:
        progress(f"{pair.config} {mode}: warm-up failed: {warm.error}")
        out.append(PhaseResult(pair.config, mode, "warmup", records=[warm],
                               error=f"warm-up failed: {warm.error}"))
        return out

    def send(prompt: list[int], i: int) -> RequestRecord:
        return dispatch(pair, mode, prompt, i)

    for phase, n, conc in (("seq", s.seq, 1), (s.conc_phase, s.concurrent, s.wave)):
        if n <= 0:
            continue
        slot = "seq" if phase == "seq" else "conc"
        progress(f"{pair.config} {mode}: phase {phase} ({n} requests)")
        out.append(run_phase(pair, mode, phase, workload_prompts(s, mode, slot, n), conc, send))
    if proxies is not None and s.proxy_requests > 0:
        url = proxies.urls[mode]

        def send_proxy(prompt: list[int], i: int) -> RequestRecord:
            return via_proxy(pair, url, mode, prompt, i)

        progress(f"{pair.config} {mode}: phase proxy-seq ({s.proxy_requests} requests)")
        out.append(run_phase(pair, mode, "proxy-seq",
                             workload_prompts(s, mode, "proxy-seq", s.proxy_requests), 1,
                             send_proxy))
    return out


# -- the whole run -------------------------------------------------------------------------------


def run_benchmark(settings: BenchSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Run every configuration of *settings* in turn; return the JSON-able report."""
    say: Progress = progress or (lambda msg: log.info("%s", msg))
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-bench-e2e-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "loadavg_start": loadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v)
                     for k, v in vars(settings).items()},
        "log_dir": str(log_dir), "configs": {}, "rows": [],
    }
    model = build_tiny_model(settings.model_dir)
    results: list[PhaseResult] = []
    for config in settings.configs:
        waited = _wait_quiet(settings, say)
        res, info = run_config(config, settings, model, log_dir, say)
        info["quiet_wait_s"] = round(waited, 1)
        results += res
        report["configs"][config] = info
    rows = [summarize(r) for r in results]
    add_ratios(rows)
    report["rows"] = rows
    report["records"] = [{"config": r.config, "mode": r.mode, "phase": r.phase,
                          "requests": [x.to_dict() for x in r.records]} for r in results]
    report["host"]["loadavg_end"] = loadavg()
    return report


def _load1() -> float:
    try:
        return float(loadavg().split()[0])
    except (ValueError, IndexError):
        return 0.0


def _wait_quiet(settings: BenchSettings, say: Progress) -> float:
    """Wait (bounded) until the 1-minute load average is below ``quiet_load``; seconds waited."""
    if settings.quiet_load <= 0:
        return 0.0
    t0 = time.monotonic()
    if _load1() >= settings.quiet_load:
        say(f"waiting up to {settings.quiet_wait_s:.0f} s for load < {settings.quiet_load} "
            f"(now {loadavg()})")
    while _load1() >= settings.quiet_load and time.monotonic() - t0 < settings.quiet_wait_s:
        time.sleep(5.0)
    return time.monotonic() - t0


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable result: the main table, the hand-off steps, per-configuration notes."""
    parts = [f"kvbridge bench e2e, {report['date']}, {report['host']['cpus']} CPUs, load "
             f"{report['host']['loadavg_start']} -> {report['host']['loadavg_end']}", "",
             format_table(report["rows"])]
    for extra in (format_breakdown(report["rows"]), format_bars(report["rows"])):
        if extra:
            parts += ["", extra]
    parts += ["", "engines (ready after, whole configuration, load at start -> end):"]
    for name, info in report["configs"].items():
        parts.append(f"  {name}: waited {info.get('quiet_wait_s', 0)} s for quiet, ready "
                     f"{info.get('ready_s', '-')} s, total "
                     f"{info.get('elapsed_s', '-')} s, load {info.get('loadavg_start')} -> "
                     f"{info.get('loadavg_end')}")
    parts += ["", f"engine logs: {report['log_dir']}",
              "TTFT x / TPOT x: ratio to vllm-nixl-pull's same phase (proxy-seq vs its seq); "
              "CPU-s: CPU seconds of each engine's process group during the phase (other: the "
              "rest of the host, this benchmark excluded); -wire: push hand-off minus the WRITE "
              "(P.write_posted -> P.write_done), p50 over transfers; nixl xfer: mean "
              "vllm:nixl_xfer_time_seconds (vLLM only)"]
    return "\n".join(parts)


# -- command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvbridge bench e2e`` flags."""
    d = BenchSettings()
    p.add_argument("--configs", default=",".join(CONFIG_NAMES),
                   help=f"comma-separated subset of {','.join(CONFIG_NAMES)} (default: all)")
    p.add_argument("--seq", type=int, default=d.seq, help="requests of phase seq")
    p.add_argument("--concurrent", type=int, default=d.concurrent,
                   help="requests of the concurrent phase")
    p.add_argument("--wave", type=int, default=d.wave, help="requests in flight per wave")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="output tokens per request")
    p.add_argument("--proxy-requests", type=int, default=d.proxy_requests,
                   help="kvbridge: sequential requests through the kvbridge proxy per mode")
    p.add_argument("--check", type=int, default=d.check,
                   help="requests per phase compared with single-engine greedy on P")
    p.add_argument("--push-headroom", type=int, default=d.push_headroom,
                   help="headroom: push while fewer than N requests are in flight at D")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds one request may take")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout,
                   help="seconds an engine pair may take to answer /health")
    p.add_argument("--idle-s", type=float, default=d.idle_s,
                   help="seconds of the idle phase (CPU burnt by engines doing nothing)")
    p.add_argument("--max-failures", type=int, default=d.max_failures,
                   help="give up a sequential phase after this many failures in a row")
    p.add_argument("--warmup-tries", type=int, default=d.warmup_tries,
                   help="warm-up attempts per mode before the mode is reported failed")
    p.add_argument("--quiet-load", type=float, default=d.quiet_load,
                   help="before each configuration, wait until the 1-minute load average is "
                   "below this (0: do not wait) ...")
    p.add_argument("--quiet-wait", type=float, default=d.quiet_wait_s,
                   help="... for at most this many seconds")
    p.add_argument("--engine-spin-ms", type=float, default=d.engine_spin_ms,
                   help="KVBRIDGE_ENGINE_SPIN_MS for kvbridge's engines (negative: vLLM default)")
    p.add_argument("--pin-engines", action="store_true", help=PIN_HELP)
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: a temp dir)")
    p.add_argument("--model-dir", type=Path, default=None, help="tiny model directory")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Validate the parsed flags into :class:`BenchSettings` (ConfigError names a bad one)."""
    for name in ("seq", "concurrent", "proxy_requests", "check", "push_headroom", "max_failures"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("wave", "prompt_len", "max_tokens", "warmup_tries"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        raise ConfigError("--max-tokens must be >= 2 (TPOT needs two tokens)")
    return BenchSettings(
        configs=parse_configs(args.configs), seq=args.seq, concurrent=args.concurrent,
        wave=args.wave, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        proxy_requests=args.proxy_requests, check=args.check, push_headroom=args.push_headroom,
        seed=args.seed, request_timeout=args.request_timeout, start_timeout=args.start_timeout,
        idle_s=args.idle_s, max_failures=args.max_failures, warmup_tries=args.warmup_tries,
        quiet_load=args.quiet_load, quiet_wait_s=args.quiet_wait,
        engine_spin_ms=args.engine_spin_ms, pin_engines=args.pin_engines, log_dir=args.log_dir,
        model_dir=args.model_dir,
    )


def cli_main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    report = run_benchmark(settings, progress)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0
