"""``kvbridge bench serve``: vLLM's own ``vllm bench serve`` load at several request rates,
against kvbridge's three modes and vLLM's two NIXL connectors.

Setups (``--setups``, default all):

==================  =========================================================================
``kvbridge-pull``   ``KVBridgeConnector`` (``--backend``, default ``nixl``) behind the kvbridge
``kvbridge-push``   proxy in mode pull / push / auto (:class:`~kvbridge.tools.proxies.
``kvbridge-auto``   ProxyThread`); the three modes share one engine pair
``vllm-nixl-pull``  vLLM's ``NixlConnector`` behind :mod:`kvbridge.tools.bench.proxy` speaking its
                    stock protocol (P leg with ``max_tokens=1``, then D with P's params)
``vllm-nixl-push``  vLLM's ``NixlPushConnector`` behind :mod:`kvbridge.tools.bench.proxy` (both legs
                    at once, same ``X-Request-Id``, D told P's engine id and side-channel port)
==================  =========================================================================

Engines are those of ``kvbridge bench e2e`` (:func:`kvbridge.tools.bench.e2e.engine_specs`: the tiny
model, P pinned to core 0, D to core 1, ``--block-size 32``): one fresh pair per group (the
kvbridge modes; each vLLM connector), stopped before the next group starts, also on error or
Ctrl-C (and at interpreter exit). ``--fleet xPyD`` (e.g. ``2P2D``) runs the kvbridge setups on x
P and y D engines behind one proxy per mode (:func:`kvbridge.tools.bench.e2e.fleet_specs`, engines
pinned round-robin to the CPUs); the vLLM setups run 1P1D only, so they refuse another shape.
Per setup, ``--warmups`` streamed requests through its endpoint first (unmeasured; the first
transfer of a pair pays NIXL's handshake); a setup whose warm-ups all fail is reported failed at
every rate.

Then, per (setup, rate), after waiting until every engine is idle (``vllm:num_requests_running``
and ``vllm:num_requests_waiting`` are 0 on each engine's ``/metrics``, bounded by
``--idle-timeout``), one ``vllm bench serve`` run (``python -m kvbridge.integrations.vllm_serve
bench serve``): random dataset of ``--num-prompts`` prompts of ``--input-len`` tokens, streamed
``/v1/completions``, ``--output-len`` tokens with ``--ignore-eos``, Poisson arrivals at the rate,
no ready-check or warm-up requests of its own (they would repeat the first prompt and hit the
prefix cache). Its seed is ``--seed + 1000 x slot + rate index``, slot 0 for pull, 1 for push, 2
for auto: kvbridge's pull and vLLM's pull (likewise push) see the very same prompts and arrival
times, and no prompt repeats on a shared engine pair.

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
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.e2e import PIN_HELP
from kvbridge.tools.report import table

__all__ = [
    "SETUP_NAMES",
    "BACKENDS",
    "PLOT_FILE",
    "RESULTS_FILE",
    "ServeSettings",
    "parse_setups",
    "parse_rates",
    "parse_fleet",
    "fleet_name",
    "setup_groups",
    "run_seed",
    "bench_serve_command",
    "run_bench_process",
    "result_metrics",
    "engines_idle",
    "format_table",
    "sustained",
    "push_pull",
    "format_push_pull",
    "handoff_summary",
    "format_steps",
    "write_plots",
    "load_results",
    "run_serve_bench",
    "add_arguments",
    "settings_from_args",
    "cli_main",
]

log = logging.getLogger("kvbridge.tools.bench.serve")

SETUP_NAMES: tuple[str, ...] = ("kvbridge-pull", "kvbridge-push", "kvbridge-auto",
                                "vllm-nixl-pull", "vllm-nixl-push")
#: kvbridge backends the setups can run on (those :func:`~kvbridge.tools.bench.e2e.engine_specs`
#: builds)
BACKENDS: tuple[str, ...] = ("nixl", "shm")
KVBRIDGE_GROUP = "kvbridge"
RESULTS_FILE = "results.json"
RESULTS_KIND = "kvbridge-bench-serve"
PLOT_FILE = "bench_serve.png"
#: (row key, panel title) of the figure's panels, left to right
PLOT_PANELS: tuple[tuple[str, str], ...] = (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"),
                                            ("tpot_p50", "TPOT p50"))
MAX_RATES = 100
_SLOT = {"pull": 0, "push": 1, "auto": 2}
_IDLE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class ServeSettings:
    """Everything one run needs; the CLI flags map one to one."""

    setups: tuple[str, ...] = SETUP_NAMES
    rates: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0)
    num_prompts: int = 40
    input_len: int = 200
    output_len: int = 16
    seed: int = 0
    backend: str = "nixl"
    warmups: int = 2
    push_headroom: int = 4
    prefill_engines: int = 1
    decode_engines: int = 1
    #: KVBRIDGE_ENGINE_SPIN_MS for kvbridge's engines (negative: vLLM's default 1 s spin)
    engine_spin_ms: float = 2.0
    pin_engines: bool = False
    request_timeout: float = 120.0
    bench_timeout: float = 600.0
    start_timeout: float = 600.0
    idle_timeout: float = 120.0
    plots: bool = True
    out: Path | None = None
    model_dir: Path | None = None


# -- pure helpers (unit-tested) ------------------------------------------------------------------


def parse_setups(text: str) -> tuple[str, ...]:
    """``"a,b"`` → the setups, validated, duplicates removed, order kept; ``all`` → all."""
    from kvbridge.tools.cli import parse_names

    return parse_names(text, SETUP_NAMES, "--setups", "setup")


def parse_rates(text: str) -> tuple[float, ...]:
    """``"2,4,8"`` → request rates (req/s): positive, finite, duplicates removed, order kept."""
    rates: list[float] = []
    for part in text.split(","):
        word = part.strip()
        if not word:
            continue
        try:
            rate = float(word)
        except ValueError:
            raise ConfigError(f"--rates: {word!r} is not a number") from None
        if not math.isfinite(rate) or rate <= 0:
            raise ConfigError(f"--rates: {word!r} must be a positive, finite request rate "
                              "(req/s)")
        rates.append(rate)
    if not rates:
        raise ConfigError("--rates names no rate")
    out = tuple(dict.fromkeys(rates))
    if len(out) > MAX_RATES:
        raise ConfigError(f"--rates: at most {MAX_RATES} rates")
    return out


def parse_fleet(text: str) -> tuple[int, int]:
    """``"2P2D"`` → (2, 2): how many prefill and decode engines (1..MAX_FLEET each)."""
    from kvbridge.tools.bench.e2e import MAX_FLEET

    m = re.fullmatch(r"\s*(\d{1,2})\s*[pP]\s*(\d{1,2})\s*[dD]\s*", text)
    if m is None:
        raise ConfigError(f"--fleet: {text!r} is not a fleet shape such as 1P1D or 2P2D")
    shape = (int(m.group(1)), int(m.group(2)))
    if not all(1 <= n <= MAX_FLEET for n in shape):
        raise ConfigError(f"--fleet: {text!r}: 1..{MAX_FLEET} engines per role")
    return shape


def fleet_name(prefill: int, decode: int) -> str:
    return f"{prefill}P{decode}D"


def setup_mode(setup: str) -> str:
    """The transfer mode of a setup: ``pull``, ``push`` or ``auto``."""
    return setup.rsplit("-", 1)[1]


def setup_group(setup: str) -> str:
    """The engine pair a setup runs on: ``kvbridge`` (shared by its modes) or the vLLM setup."""
    return KVBRIDGE_GROUP if setup.startswith("kvbridge-") else setup


def setup_groups(setups: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """Setups by engine pair, groups in order of first appearance: ``[(group, setups), ...]``."""
    groups: dict[str, list[str]] = {}
    for s in setups:
        groups.setdefault(setup_group(s), []).append(s)
    return [(g, tuple(members)) for g, members in groups.items()]


def run_seed(seed: int, setup: str, rate_index: int) -> int:
    """The ``vllm bench serve --seed`` of one run: equal for the same mode and rate index."""
    return seed + 1000 * _SLOT[setup_mode(setup)] + rate_index


def _rate_name(rate: float) -> str:
    return f"{rate:g}".replace(".", "p")


def bench_serve_command(url: str, model: Path, result_dir: Path, name: str, *, rate: float,
                        num_prompts: int, input_len: int, output_len: int, seed: int,
                        warmups: int = 0, ready_check_s: int | None = None,
                        python: str = sys.executable) -> list[str]:
    """The ``vllm bench serve`` command line of one run (result in ``result_dir/name.json``).

    *ready_check_s* None keeps bench serve's default ready check (a request with the first
    prompt); 0 skips it.
    """
    cmd = [
        python, "-m", "kvbridge.integrations.vllm_serve", "bench", "serve",
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "tiny", "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
        "--request-rate", f"{rate:g}", "--ignore-eos", "--seed", str(seed),
        "--num-warmups", str(warmups),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", f"{name}.json", "--disable-tqdm",
    ]  # fmt: skip
    if ready_check_s is not None:
        cmd += ["--ready-check-timeout-sec", str(ready_check_s)]
    return cmd


def run_bench_process(cmd: Sequence[str], log_path: Path, timeout: float) -> int:
    """Run ``vllm bench serve`` in its own process group, output to *log_path*; its exit
    status, or -1 after *timeout* seconds. The group is killed on any exit (also Ctrl-C)."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1",
                                     "TRANSFORMERS_OFFLINE": "1"})
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -1
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def result_metrics(result: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one ``vllm bench serve`` result JSON (times in ms, throughput in req/s).

    TTFT/TPOT/E2E percentiles are bench serve's own (``--metric-percentiles 50,99``); the max
    values come from its per-request lists (``--save-detailed``), successful requests only.
    """
    ok = [e in (None, "") for e in result.get("errors") or []]
    ttfts = [t * 1000 for t, good in zip(result.get("ttfts") or [], ok, strict=False)
             if good and _num(t) is not None]
    lat = [t * 1000 for t, good in zip(result.get("latencies") or [], ok, strict=False)
           if good and _num(t) is not None]
    return {
        "completed": result.get("completed"), "failed": result.get("failed"),
        "ttft_p50": _num(result.get("p50_ttft_ms", result.get("median_ttft_ms"))),
        "ttft_p99": _num(result.get("p99_ttft_ms")),
        "ttft_max": max(ttfts) if ttfts else None,
        "tpot_p50": _num(result.get("p50_tpot_ms", result.get("median_tpot_ms"))),
        "tpot_p99": _num(result.get("p99_tpot_ms")),
        "e2e_p50": _num(result.get("p50_e2el_ms", result.get("median_e2el_ms"))),
        "e2e_p99": _num(result.get("p99_e2el_ms")),
        "e2e_max": max(lat) if lat else None,
        "request_throughput": _num(result.get("request_throughput")),
        "duration_s": _num(result.get("duration")),
    }


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


TABLE_HEADERS = ("setup", "rate", "ok/fail", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                 "TPOT p99 ms", "E2E p99 ms", "req/s", "hand-off p50 ms", "-wire p50 ms")


def table_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The cells of the table, one list per (setup, rate). The hand-off columns (kvbridge only)
    come from the engines' own timings of the run's transfers (:func:`handoff_summary`)."""
    return [[str(r["setup"]), f"{r['rate']:g}", f"{_f(r.get('completed'))}/{_f(r.get('failed'))}",
             _f(r.get("ttft_p50")), _f(r.get("ttft_p99")), _f(r.get("tpot_p50")),
             _f(r.get("tpot_p99")), _f(r.get("e2e_p99")), _f(r.get("request_throughput"), 2),
             _f(r.get("handoff_p50"), 2), _f(r.get("beyond_wire_p50"), 2)]
            for r in rows]


def format_steps(rows: Sequence[Mapping[str, Any]]) -> str:
    """Median of each hand-off step (ms) per kvbridge (setup, rate)."""
    lines = [f"  {r['setup']} @ {r['rate']:g}: " + ", ".join(
        f"{k} {v:.1f}" for k, v in r["handoff_steps"].items())
        for r in rows if r.get("handoff_steps")]
    return "\n".join(["hand-off steps (median ms):"] + lines) if lines else ""


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The results as aligned text (header, rule, one row per run), then the errors, if any."""
    lines = table(TABLE_HEADERS, table_rows(rows))
    errors = [f"  {r['setup']} @ {r['rate']:g} req/s: {r['error']}" for r in rows
              if r.get("error")]
    if errors:
        lines += ["", "errors:"] + errors
    return "\n".join(lines)


SUSTAINED_FRACTION = 0.9
"""A run *sustains* its offered rate when every request completed and the measured request
throughput is at least this fraction of the rate (Poisson arrivals: a finite run's tail makes
it a little below the rate even when nothing queues)."""
PUSH_PULL_BAR = 1.0 / 3.0
"""The hand-off issue's bar: push TTFT p50 <= 1/3 of pull's at the highest rate D sustains."""


def sustained(row: Mapping[str, Any]) -> bool:
    """Whether one (setup, rate) run kept up with its rate (see :data:`SUSTAINED_FRACTION`)."""
    thr, rate = _num(row.get("request_throughput")), _num(row.get("rate"))
    return (not row.get("error") and not row.get("failed") and thr is not None
            and rate is not None and thr >= SUSTAINED_FRACTION * rate)


def push_pull(rows: Sequence[Mapping[str, Any]], prefix: str = "kvbridge") -> dict[str, Any]:
    """Push against pull TTFT p50 of one connector family (``<prefix>-push`` / ``-pull``): the
    ratio at every rate both ran, and at the highest rate both sustained, with the verdict
    against :data:`PUSH_PULL_BAR`. Empty when the run had not both setups."""
    by = {(str(r["setup"]), float(r["rate"])): r for r in rows}
    rates = sorted({rate for (setup, rate) in by if setup == f"{prefix}-push"}
                   & {rate for (setup, rate) in by if setup == f"{prefix}-pull"})
    ratios: dict[str, float | None] = {}
    best: float | None = None
    for rate in rates:
        push, pull = by[(f"{prefix}-push", rate)], by[(f"{prefix}-pull", rate)]
        a, b = _num(push.get("ttft_p50")), _num(pull.get("ttft_p50"))
        ratios[f"{rate:g}"] = a / b if a is not None and b else None
        if sustained(push) and sustained(pull) and ratios[f"{rate:g}"] is not None:
            best = rate
    if not rates:
        return {}
    out: dict[str, Any] = {"prefix": prefix, "ratios": ratios, "sustained_rate": best}
    if best is not None:
        ratio = ratios[f"{best:g}"]
        out.update(ratio=ratio, met=ratio is not None and ratio <= PUSH_PULL_BAR)
    return out


def format_push_pull(summary: Mapping[str, Any]) -> str:
    """The :func:`push_pull` summary as text (empty for an empty summary)."""
    if not summary:
        return ""
    prefix = summary["prefix"]
    ratios = ", ".join(f"{rate} req/s {_f(v, 2)}" for rate, v in summary["ratios"].items())
    lines = [f"{prefix} push/pull TTFT p50: {ratios}"]
    if summary.get("sustained_rate") is None:
        lines.append(f"  no rate was sustained by both {prefix}-push and {prefix}-pull "
                     f"(every request completed, throughput >= {SUSTAINED_FRACTION:g} x rate)")
    else:
        verdict = "met" if summary.get("met") else "NOT met"
        lines.append(f"  at the highest rate both sustain, {summary['sustained_rate']:g} req/s: "
                     f"push/pull = {_f(summary.get('ratio'), 2)} (bar <= 1/3: {verdict})")
    return "\n".join(lines)


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> dict[str, list[tuple[float, float]]]:
    """setup → [(rate, value)] sorted by rate, runs without the value left out."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        v = _num(r.get(key))
        out.setdefault(str(r["setup"]), [])
        if v is not None and v > 0:
            out[str(r["setup"])].append((float(r["rate"]), v))
    return {s: sorted(points) for s, points in out.items()}


def _setup_order(name: str) -> tuple[int, str]:
    return (SETUP_NAMES.index(name) if name in SETUP_NAMES else len(SETUP_NAMES), name)


def write_plots(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Draw :data:`PLOT_FILE` into *out_dir* from a report's rows; the files written.

    One figure, one panel per :data:`PLOT_PANELS` entry, the rate on a log2 x-axis, one line per
    setup (a run without the value leaves a gap); a panel whose values span more than 10x gets
    a log y-axis. Needs matplotlib (drawn off-screen, Agg).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    rows = list(report.get("rows") or [])
    rates = sorted({float(r["rate"]) for r in rows})
    setups = sorted({str(r["setup"]) for r in rows}, key=_setup_order)
    fig, axes = plt.subplots(1, len(PLOT_PANELS), figsize=(5.2 * len(PLOT_PANELS), 4.4),
                             squeeze=False)
    try:
        for ax, (key, title) in zip(axes[0], PLOT_PANELS, strict=True):
            series = _series(rows, key)
            values = [v for s in setups for _, v in series.get(s, [])]
            for s in setups:
                points = series.get(s) or []
                if points:
                    ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=s)
            if rates and max(rates) / min(rates) >= 2:
                ax.set_xscale("log", base=2)
            ax.set_xticks(rates)
            ax.set_xticklabels([f"{r:g}" for r in rates])
            ax.minorticks_off()
            if values and max(values) / min(values) > 10:
                ax.set_yscale("log")  # ticks at 1, 2, 5 x 10^k, written as plain numbers
                ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_minor_locator(NullLocator())
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.set_title(f"{title} vs request rate")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(f"{title} (ms)")
            ax.grid(True, which="major", alpha=0.3)
            if not values:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        handles, labels = axes[0][0].get_legend_handles_labels()
        if not handles:
            for ax in axes[0][1:]:
                handles, labels = ax.get_legend_handles_labels()
                if handles:
                    break
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5),
                       frameon=False)
        cfg: Mapping[str, Any] = report.get("settings") or {}
        fleet = report.get("fleet") or "1P1D"
        fig.suptitle(f"kvbridge bench serve ({fleet}): backend {cfg.get('backend', '?')}, "
                     f"{cfg.get('num_prompts', '?')} prompts of {cfg.get('input_len', '?')} "
                     f"tokens, {cfg.get('output_len', '?')} output tokens, "
                     f"{report.get('date', '')}")
        fig.tight_layout(rect=(0.0, 0.08, 1.0, 1.0))
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / PLOT_FILE
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return [path]


def load_results(path: Path) -> dict[str, Any]:
    """A ``results.json`` written by this command, checked enough to plot (ConfigError if not)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--plot-only: cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--plot-only: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != RESULTS_KIND:
        raise ConfigError(f"--plot-only: {path} is not a kvbridge bench serve results file")
    rows = data.get("rows")
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("setup"), str)
            and _num(r.get("rate")) is not None for r in rows):
        raise ConfigError(f"--plot-only: {path}: 'rows' must be a list of objects with a setup "
                          "and a rate")
    return data


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


# -- engines and endpoints -----------------------------------------------------------------------


Say = Callable[[str], None]


def _scrape_idle(url: str, timeout: float = 5.0) -> float:
    """Requests running or waiting on one engine (its ``/metrics``)."""
    from kvbridge.tools import prom

    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode("utf-8", "replace")
    return sum(prom.total(text, name) for name in _IDLE_METRICS)


def engines_idle(urls: Sequence[str], timeout: float, interval: float = 0.5) -> tuple[bool, float]:
    """Wait until no engine of *urls* runs or queues a request, twice in a row; (idle, seconds
    waited). Gives up after *timeout* seconds (or when an engine stops answering)."""
    t0 = time.monotonic()
    quiet = 0
    while True:
        try:
            busy = sum(_scrape_idle(u) for u in urls)
        except OSError as exc:
            log.warning("cannot read engine metrics: %s", exc)
            return False, time.monotonic() - t0
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= 2:
            return True, time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            return False, time.monotonic() - t0
        time.sleep(interval)


def _warm_up(url: str, settings: ServeSettings, setup: str) -> str | None:
    """*settings.warmups* streamed requests through *url*; None if one succeeded, else why not."""
    from kvbridge.tools.engines import EngineError, stream_complete
    from kvbridge.tools.tiny_model import random_prompts

    if settings.warmups <= 0:
        return None
    prompts = random_prompts(settings.warmups, settings.input_len,
                             seed=900_000 + settings.seed * 10 + _SLOT[setup_mode(setup)])
    last = "no warm-up ran"
    ok = 0
    for prompt in prompts:
        try:
            res = stream_complete(url, prompt, settings.output_len, None, {"ignore_eos": True},
                                  timeout=settings.request_timeout)
            if res.ttft is None:
                raise EngineError("no token streamed")
            ok += 1
        except EngineError as exc:
            last = str(exc)[:300]
    return None if ok else f"warm-up failed ({settings.warmups} requests): {last}"


@contextlib.contextmanager
def _endpoints(group: str, setups: Sequence[str], ps: Sequence[Any], ds: Sequence[Any],
               settings: ServeSettings) -> Iterator[dict[str, str]]:
    """The one URL per setup that ``vllm bench serve`` is pointed at; closed on exit."""
    if group == KVBRIDGE_GROUP:
        from kvbridge.tools.proxies import ProxyThread

        proxies = ProxyThread([p.url for p in ps], [d.url for d in ds],
                              modes=[setup_mode(s) for s in setups],
                              push_headroom=settings.push_headroom)
        try:
            proxies.start()
            yield {s: proxies.urls[setup_mode(s)] for s in setups}
        finally:
            proxies.close()
        return
    from kvbridge.tools.bench.e2e import side_channel_port
    from kvbridge.tools.bench.proxy import StockProxyThread

    [p], [d] = ps, ds  # the stock proxies speak to one P and one D
    mode = setup_mode(group)
    port = side_channel_port(p) if mode == "push" else None
    stock = StockProxyThread(mode, p.url, d.url, p_side_channel_port=port,
                             timeout_s=max(settings.request_timeout, settings.bench_timeout))
    try:
        stock.start()
        yield {group: stock.url}
    finally:
        stock.close()


class _Recorder:
    """Collects rows, rewrites ``results.json`` after each, drives the progress bar."""

    def __init__(self, report: dict[str, Any], out: Path, bar: Any) -> None:
        self.report = report
        self.out = out
        self.bar = bar

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def add(self, row: dict[str, Any]) -> None:
        self.report["rows"].append(row)
        self.save()
        if self.bar is not None:
            self.bar.update(1)

    def save(self) -> None:
        path = self.out / RESULTS_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=1) + "\n")
        tmp.replace(path)


def _failed_rows(setups: Sequence[str], settings: ServeSettings, error: str,
                 done: set[tuple[str, float]]) -> list[dict[str, Any]]:
    return [{"setup": s, "rate": rate, "seed": run_seed(settings.seed, s, i), "error": error}
            for s in setups for i, rate in enumerate(settings.rates) if (s, rate) not in done]


def _run_group(group: str, setups: Sequence[str], settings: ServeSettings, model: Path,
               out: Path, rec: _Recorder) -> None:
    """Start the group's engines, run every (setup, rate), stop everything."""
    from kvbridge.tools.bench.e2e import fleet_specs
    from kvbridge.tools.engines import start_servers

    config = f"kvbridge-{settings.backend}" if group == KVBRIDGE_GROUP else group
    log_dir = out / "logs"
    ps, ds = fleet_specs(config, model, log_dir, settings.engine_spin_ms,
                         settings.prefill_engines, settings.decode_engines, settings.pin_engines)
    engines = [*ps, *ds]
    info: dict[str, Any] = {"setups": list(setups), "engines": config, "logs": str(log_dir),
                            "fleet": fleet_name(len(ps), len(ds))}
    rec.report["groups"][group] = info
    done: set[tuple[str, float]] = set()
    t_start = time.monotonic()
    try:
        rec.say(f"{group}: starting engines ({config}; logs in {log_dir})")
        start_servers(engines, timeout=settings.start_timeout, progress_every=30.0,
                      progress=lambda s, r: rec.say(f"{group}: waiting for engines {s:.0f} s, "
                                                    f"ready={r}"))
        info["ready_s"] = round(time.monotonic() - t_start, 1)
        controls = None  # the engines' hand-off timings: read on a 1P1D kvbridge pair
        if group == KVBRIDGE_GROUP and len(ps) == len(ds) == 1:
            from kvbridge.tools.bench.e2e import control_addresses

            controls = control_addresses(ps[0].url, ds[0].url, settings.request_timeout)[:2]
        with _endpoints(group, setups, ps, ds, settings) as urls:
            for setup in setups:
                _run_setup(setup, urls[setup], settings, model, out, rec, engines, done,
                           controls)
    except Exception as exc:  # noqa: BLE001 - report the group failed, go on with the next
        info["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        rec.say(f"{group}: FAILED: {info['error'][:300]}")
        for row in _failed_rows(setups, settings, f"{group}: {info['error'][:300]}", done):
            rec.add(row)
    finally:
        for e in engines:
            e.stop()
        info["elapsed_s"] = round(time.monotonic() - t_start, 1)
        rec.save()
        rec.say(f"{group}: engines stopped")


def handoff_summary(p_timings: Mapping[str, Mapping[str, float]],
                    d_timings: Mapping[str, Mapping[str, float]],
                    transfer_ids: Sequence[str]) -> dict[str, Any]:
    """What the engines recorded for one run's transfers: hand-off p50 (``D.first_step -
    P.kv_ready``), push hand-off minus wire p50, and the median of every step (ms)."""
    from kvbridge.tools.bench.e2e import beyond_wire, handoff_breakdown, handoff_times
    from kvbridge.tools.report import percentile

    def ms(values: Sequence[float]) -> float | None:
        v = percentile(values, 50)
        return None if v is None else v * 1000.0

    return {"handoff_n": len(handoff_times(p_timings, d_timings, transfer_ids)),
            "handoff_p50": ms(handoff_times(p_timings, d_timings, transfer_ids)),
            "beyond_wire_p50": ms(beyond_wire(p_timings, d_timings, transfer_ids)),
            "handoff_steps": {k: v * 1000.0 for k, v in
                              handoff_breakdown(p_timings, d_timings, transfer_ids).items()}}


def _run_setup(setup: str, url: str, settings: ServeSettings, model: Path, out: Path,
               rec: _Recorder, engines: Sequence[Any], done: set[tuple[str, float]],
               controls: tuple[str, str] | None = None) -> None:
    engine_urls = [e.url for e in engines]
    rec.say(f"{setup}: {settings.warmups} warm-up request(s) through {url}")
    warm_error = _warm_up(url, settings, setup)
    if warm_error is not None:
        rec.say(f"{setup}: {warm_error}")
    for i, rate in enumerate(settings.rates):
        seed = run_seed(settings.seed, setup, i)
        row: dict[str, Any] = {"setup": setup, "rate": rate, "seed": seed}
        dead = [e.name for e in engines if e.proc is None or e.proc.poll() is not None]
        if warm_error is not None or dead:
            row["error"] = warm_error or f"engine(s) exited: {', '.join(dead)}"
            rec.add(row)
            done.add((setup, rate))
            continue
        if rec.bar is not None:
            rec.bar.set_description(f"{setup} @ {rate:g} req/s")
        idle, waited = engines_idle(engine_urls, settings.idle_timeout)
        row["idle_wait_s"] = round(waited, 2)
        row["idle"] = idle
        if not idle:
            rec.say(f"{setup}: engines not idle after {waited:.0f} s; running anyway")
        name = f"{setup}-rate{_rate_name(rate)}"
        cmd = bench_serve_command(url, model, out, name, rate=rate,
                                  num_prompts=settings.num_prompts, input_len=settings.input_len,
                                  output_len=settings.output_len, seed=seed, warmups=0,
                                  ready_check_s=0)
        rec.say(f"{setup}: vllm bench serve at {rate:g} req/s ({settings.num_prompts} prompts, "
                f"seed {seed}) -> {url}")
        row["wall_start"] = time.time()
        from kvbridge.tools.bench.e2e import control_stats

        seen = set(control_stats(controls[1]).timings) if controls else set()
        rc = run_bench_process(cmd, out / f"{name}.bench.log", settings.bench_timeout)
        if controls is not None:
            try:
                time.sleep(0.3)  # the last first_step reaches D's rank with its next step
                p_t, d_t = (control_stats(c).timings for c in controls)
                row.update(handoff_summary(p_t, d_t, sorted(set(d_t) - seen)))
            except Exception as exc:  # noqa: BLE001 - timings are extra; the run stands
                rec.say(f"{setup}: no hand-off timings: {exc}")
        path = out / f"{name}.json"
        row.update(rc=rc, result_file=path.name, log_file=f"{name}.bench.log")
        if rc == 0 and path.is_file():
            try:
                row.update(result_metrics(json.loads(path.read_text())))
            except (OSError, ValueError) as exc:
                row["error"] = f"unreadable result {path.name}: {exc}"
            else:
                if not row.get("completed"):
                    row["error"] = f"no request completed ({row.get('failed')} failed)"
        else:
            why = "timed out" if rc == -1 else f"exit status {rc}"
            row["error"] = f"vllm bench serve {why}; see {name}.bench.log"
        rec.add(row)
        done.add((setup, rate))


# -- the whole run -------------------------------------------------------------------------------


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def new_report(settings: ServeSettings, out: Path) -> dict[str, Any]:
    return {
        "kind": RESULTS_KIND, "version": 1,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "fleet": fleet_name(settings.prefill_engines, settings.decode_engines),
        "host": {"cpus": os.cpu_count(), "loadavg_start": _loadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple)
                         else v) for k, v in vars(settings).items()},
        "out": str(out), "groups": {}, "rows": [],
    }


def run_serve_bench(settings: ServeSettings, out: Path, *, progress_bar: bool = True
                    ) -> dict[str, Any]:
    """Run every group of *settings* in turn into *out*; return the report (also written to
    ``out/results.json``). Engines and proxies are stopped before this returns or raises."""
    from kvbridge.tools.tiny_model import build_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    report = new_report(settings, out)
    bar: Any = None
    if progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(settings.setups) * len(settings.rates), unit="run",
                   desc="kvbridge bench serve", file=sys.stderr, dynamic_ncols=True)
    rec = _Recorder(report, out, bar)
    try:
        rec.save()
        model = build_tiny_model(settings.model_dir)
        for group, setups in setup_groups(settings.setups):
            _run_group(group, setups, settings, model, out, rec)
    finally:
        report["host"]["loadavg_end"] = _loadavg()
        rec.save()
        if bar is not None:
            bar.close()
    return report


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
    p.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="transport of the kvbridge setups")
    p.add_argument("--warmups", type=int, default=d.warmups,
                   help="unmeasured requests through each setup's endpoint before its runs")
    p.add_argument("--push-headroom", type=int, default=d.push_headroom,
                   help="kvbridge-auto: push while fewer than N requests are in flight at D")
    p.add_argument("--fleet", default=fleet_name(d.prefill_engines, d.decode_engines),
                   metavar="xPyD", help="kvbridge setups: x prefill and y decode engines behind "
                   "the proxy, e.g. 2P2D (default 1P1D; the vLLM setups run 1P1D only)")
    p.add_argument("--engine-spin-ms", type=float, default=d.engine_spin_ms,
                   help="KVBRIDGE_ENGINE_SPIN_MS for kvbridge's engines (negative: vLLM default)")
    p.add_argument("--pin-engines", action="store_true", help=PIN_HELP)
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
                          "kvbridge-auto)")
    return ServeSettings(
        setups=setups, rates=parse_rates(args.rates),
        prefill_engines=prefill, decode_engines=decode,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        seed=args.seed, backend=args.backend, warmups=args.warmups,
        push_headroom=args.push_headroom, engine_spin_ms=args.engine_spin_ms,
        pin_engines=args.pin_engines,
        request_timeout=args.request_timeout, bench_timeout=args.bench_timeout,
        start_timeout=args.start_timeout, idle_timeout=args.idle_timeout,
        plots=not args.no_plots, out=args.out, model_dir=args.model_dir,
    )


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: engines are stopped


@contextlib.contextmanager
def _signals_unwind() -> Iterator[None]:
    """SIGTERM/SIGHUP raise SystemExit (so finally blocks stop the engines) while inside."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


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
    for extra in (format_steps(report.get("rows") or []),
                  format_push_pull(push_pull(report.get("rows") or []))):
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
    with _signals_unwind():
        report = run_serve_bench(settings, out, progress_bar=not args.no_progress)
    plots = write_plots(report, out) if settings.plots else []
    _print_report(report, plots, args.json)
    return 0 if all(not r.get("error") for r in report["rows"]) else 1
