"""``kvbridge bench handoff``: the hand-off with and without wake on arrival, interleaved.

Two kvbridge engine pairs run at the same time on the same cores (the engines of
``kvbridge bench e2e``: tiny model, P on core 0, D on core 1): ``wake`` as configured by default,
and the baseline ``--against``: ``nowake`` with ``KVBRIDGE_WAKE_ON_ARRIVAL=0`` (no hook into
vLLM's idle path, no early posting: the behaviour before the wake-up), or ``nodirect`` with
``KVBRIDGE_DIRECT_ARRIVAL=0`` (the wake-up, but vLLM learns of a finished receive from the
workers' next step output), or ``nohuge`` with ``KVBRIDGE_HUGE_PAGES=0`` (the KV cache stays on
the 4 KiB pages torch gave it: compare the wire time), or ``nomap`` with
``KVBRIDGE_MAP_KV_CACHE=0`` (shm moves KV by cross-memory attach instead of copying through the
peer's mapped cache: compare the wire time), or ``nodigest`` with ``KVBRIDGE_CHECKSUM=0`` (no
hand-off digests: what computing and checking them costs), or ``norecorder`` with
``KVBRIDGE_FLIGHT_RECORDER=0`` (no flight recorder: what recording costs; that pair has no
step timings, so its hand-off columns are empty), or ``unrecorded``: no second pair — the
baseline is every other request on the *same* pair, sent with ``kvbridge_record: false`` (the
engines keep no record of it), so what recording costs is measured without the difference
between two pairs of processes (its rows share the pair's CPU columns), or ``same``: the same
pair, every other request unchanged (an A/A run: the noise floor of ``unrecorded``), or
``code``: the same
configuration running the kvbridge of ``--baseline-code``, a checkout of another commit (what a
change costs), with one fleet secret for all four engines. ``--model bench`` runs the ~100
M-parameter bench model (24 KiB of KV per token) instead of the tiny one, so that a request's
KV is tens of MiB and the wire time shows. Per mode, ``--requests`` rounds each send one sequential
request to each pair, the order alternating every round (ABBA), so both see the same host noise.
Idle engines cost next to nothing (measured in the ``idle`` rows), so the pair that is not being
measured does not disturb the other.

Per (pair, mode): TTFT p50; the hand-off (``D.first_step - P.kv_ready``) p50; for push the WRITE's
wire time (``P.write_posted -> P.write_done``) and the hand-off minus it (the issue's bar:
<= 2 ms); the median of every step of the hand-off; the engines' CPU seconds; and per round the
paired difference wake - baseline, of the TTFT and of the TTFT less P's prefill
(``P.scheduled -> P.kv_ready``): two engines configured alike can prefill ~10 % apart for a
whole run, which on the bench model is tens of ms no setting caused. Blocking; engines are
always stopped before returning.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.proxy.routing import new_transfer_id, push_decode_params
from kvbridge.tools.args import parse_names
from kvbridge.tools.bench.dispatch import (
    Pair,
    connect,
    control_stats,
    dispatch,
    kvbridge_prefill_params,
)
from kvbridge.tools.bench.e2e_report import BenchSettings, RequestRecord
from kvbridge.tools.bench.fleet import BENCH_BACKENDS, PIN_HELP, engine_specs
from kvbridge.tools.bench.handshake import code_path
from kvbridge.tools.bench.timings import (
    HANDOFF_BAR_MS,
    beyond_wire,
    handoff_breakdown,
    handoff_times,
    prefill_time,
    request_steps,
)
from kvbridge.tools.client import complete
from kvbridge.tools.cpumeter import CpuMeter, loadavg
from kvbridge.tools.engines import EngineError, start_servers
from kvbridge.tools.report import median_ci, table
from kvbridge.tools.tiny_model import (
    bench_prompts,
    build_bench_model,
    build_tiny_model,
    random_prompts,
)

__all__ = ["BASELINES", "pairs_of", "HandoffSettings", "run_handoff_bench", "format_handoff_report",
           "summarize_pair", "paired_deltas", "add_arguments", "cli_main"]

BASELINES: dict[str, dict[str, str]] = {"nowake": {"KVBRIDGE_WAKE_ON_ARRIVAL": "0"},
                                        "nodirect": {"KVBRIDGE_DIRECT_ARRIVAL": "0"},
                                        "nohuge": {"KVBRIDGE_HUGE_PAGES": "0"},
                                        "nomap": {"KVBRIDGE_MAP_KV_CACHE": "0"},
                                        "nodigest": {"KVBRIDGE_CHECKSUM": "0"},
                                        "norecorder": {"KVBRIDGE_FLIGHT_RECORDER": "0"},
                                        "unrecorded": {},
                                        "same": {},
                                        "code": {}}
"""Baseline pair name → extra environment of both its engines (``wake`` has none). ``code``:
the engines import kvbridge from ``--baseline-code``, a checkout of another commit."""
SAME_PAIR: dict[str, dict[str, Any]] = {"unrecorded": {"kvbridge_record": False}, "same": {}}
"""Baselines run on the ``wake`` pair itself: name → ``kv_transfer_params`` keys added to both
legs of each baseline request."""
MODES = ("push", "pull", "push-behind")
"""``push-behind``: a push sent while D already holds another push request that waits for its
KV (its P leg comes :data:`BEHIND_S` later): what D's idle wait does to a new arrival."""
BEHIND_S = 0.8


@dataclass(frozen=True)
class HandoffSettings:
    backend: str = "shm"
    requests: int = 20
    modes: tuple[str, ...] = MODES
    prompt_len: int = 400
    max_tokens: int = 8
    idle_s: float = 5.0
    engine_spin_ms: float = 2.0
    pin_engines: bool = False
    against: str = "nowake"
    baseline_code: Path | None = None  # with against "code"
    model: str = "tiny"  # or "bench" (kvbridge.tools.tiny_model.build_bench_model)
    seed: int = 4321
    request_timeout: float = 120.0
    start_timeout: float = 900.0
    log_dir: Path | None = None


def _prompts(settings: HandoffSettings, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``settings.prompt_len`` token ids in the model's vocabulary."""
    fn = bench_prompts if settings.model == "bench" else random_prompts
    return fn(n, settings.prompt_len, seed=seed)


def pairs_of(settings: HandoffSettings) -> dict[str, dict[str, str]]:
    """Pair name → extra environment of both its engines: ``wake`` and the baseline (only
    ``wake`` for a baseline of :data:`SAME_PAIR`)."""
    if settings.against in SAME_PAIR:
        return {"wake": {}}
    env = dict(BASELINES[settings.against])
    if settings.against == "code":
        if settings.baseline_code is None:
            raise ConfigError("--against code needs --baseline-code DIR")
        env["PYTHONPATH"] = code_path(settings.baseline_code, os.environ.get("PYTHONPATH"))
    return {"wake": {}, settings.against: env}


@dataclass
class _Cell:
    """One (pair, mode): its records and what the engines recorded for them."""

    pair: str
    mode: str
    records: list[RequestRecord] = field(default_factory=list)
    p_timings: dict[str, dict[str, float]] = field(default_factory=dict)
    d_timings: dict[str, dict[str, float]] = field(default_factory=dict)
    cpu_p: float = 0.0
    cpu_d: float = 0.0


def _ms(values: Sequence[float]) -> float | None:
    return statistics.median(values) * 1000.0 if values else None


def summarize_pair(cell: _Cell) -> dict[str, Any]:
    """One row: TTFT, hand-off, wire, hand-off minus wire (p50, ms), step medians, CPU."""
    ok = [r for r in cell.records if r.ok]
    tids = [r.transfer_id for r in ok if r.transfer_id]
    p, d = cell.p_timings, cell.d_timings
    wire = [w for w in (_wire(p, t) for t in tids) if w is not None]
    return {
        "pair": cell.pair, "mode": cell.mode, "ok": len(ok), "failed": len(cell.records) - len(ok),
        "ttft_p50_ms": _ms([r.ttft for r in ok if r.ttft is not None]),
        "prefill_p50_ms": _ms([x for x in (prefill_time(p, t) for t in tids) if x is not None]),
        "handoff_p50_ms": _ms(handoff_times(p, d, tids)),
        "wire_p50_ms": _ms(wire),
        "beyond_wire_p50_ms": _ms(beyond_wire(p, d, tids)),
        "steps_ms": {k: v * 1000.0 for k, v in handoff_breakdown(p, d, tids).items()},
        "cpu_p_s": cell.cpu_p, "cpu_d_s": cell.cpu_d,
    }


def _wire(p_timings: dict[str, dict[str, float]], tid: str) -> float | None:
    """A push's WRITE, ``write_posted -> write_done`` (s), or None (a pull, or not recorded)."""
    t = p_timings.get(tid, {})
    if "write_posted" in t and "write_done" in t:
        return t["write_done"] - t["write_posted"]
    return None


def paired_deltas(a: _Cell, b: _Cell) -> dict[str, Any]:
    """Median over rounds of (a - b) for TTFT, P's prefill, TTFT less P's prefill, hand-off
    and (push) wire time (ms), and the 95 % order-statistics intervals of the two TTFT medians
    (``ttft_ci_ms``, ``beyond_prefill_ci_ms``: [low, high]); rounds where both succeeded.

    Why TTFT less P's prefill: two engine processes configured alike can differ in prefill
    speed by up to ±11 % for as long as they run (docs/results/2026-12-06-digest-gil.md), which
    on the bench model is tens of ms of TTFT that no setting under test caused."""
    ttft: list[float] = []
    prefill: list[float] = []
    beyond: list[float] = []
    hand: list[float] = []
    wire: list[float] = []
    for ra, rb in zip(a.records, b.records, strict=False):
        if not (ra.ok and rb.ok):
            continue
        if ra.ttft is not None and rb.ttft is not None:
            ttft.append(ra.ttft - rb.ttft)
            pa = prefill_time(a.p_timings, ra.transfer_id or "")
            pb = prefill_time(b.p_timings, rb.transfer_id or "")
            if pa is not None and pb is not None:
                prefill.append(pa - pb)
                beyond.append((ra.ttft - pa) - (rb.ttft - pb))
        ha = handoff_times(a.p_timings, a.d_timings, [ra.transfer_id or ""])
        hb = handoff_times(b.p_timings, b.d_timings, [rb.transfer_id or ""])
        if ha and hb:
            hand.append(ha[0] - hb[0])
        wa, wb = _wire(a.p_timings, ra.transfer_id or ""), _wire(b.p_timings, rb.transfer_id or "")
        if wa is not None and wb is not None:
            wire.append(wa - wb)
    def ci_ms(values: list[float]) -> list[float] | None:
        ci = median_ci(values) if values else None  # distribution-free: the tails are heavy
        return None if ci is None else [ci.low * 1000.0, ci.high * 1000.0]

    return {"ttft_ms": _ms(ttft), "handoff_ms": _ms(hand), "wire_ms": _ms(wire),
            "ttft_ci_ms": ci_ms(ttft), "prefill_ms": _ms(prefill),
            "beyond_prefill_ms": _ms(beyond), "beyond_prefill_ci_ms": ci_ms(beyond),
            "rounds": float(len(ttft))}


def _f(v: Any, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def format_handoff_report(report: dict[str, Any]) -> str:
    """The report as text: the table, the steps, the paired differences, the bar."""
    s = report["settings"]
    head = ("pair", "mode", "ok/fail", "TTFT p50 ms", "hand-off p50 ms", "wire p50 ms",
            "-wire p50 ms", "CPU-s P", "CPU-s D")
    cells: list[list[str]] = []
    for r in report["rows"]:
        cells.append([r["pair"], r["mode"], f"{r['ok']}/{r['failed']}", _f(r["ttft_p50_ms"], 1),
                      _f(r["handoff_p50_ms"]), _f(r["wire_p50_ms"]), _f(r["beyond_wire_p50_ms"]),
                      _f(r["cpu_p_s"], 1), _f(r["cpu_d_s"], 1)])
    for what in ("idle", "waiting"):
        for name, (p_cpu, d_cpu) in report.get(what, {}).items():
            cells.append([name, what, "-", "-", "-", "-", "-", _f(p_cpu, 3), _f(d_cpu, 3)])
    lines = [f"kvbridge bench handoff, {report['date']}, backend {s['backend']}, "
             f"{s['requests']} sequential rounds per mode (ABBA), load {report['load_start']} -> "
             f"{report['load_end']}", ""]
    lines += table(head, cells)
    lines += ["", "hand-off steps (median ms):"]
    for r in report["rows"]:
        steps = ", ".join(f"{k} {v:.2f}" for k, v in r["steps_ms"].items())
        lines.append(f"  {r['pair']} {r['mode']}: {steps}")
    lines += ["", f"paired, wake - {s.get('against', 'nowake')} (median over rounds, its 95 % "
              "interval):"]
    for mode, delta in report["paired"].items():
        wire = "" if delta.get("wire_ms") is None else f", wire {_f(delta['wire_ms'])} ms"
        ci = delta.get("ttft_ci_ms")
        ci_text = "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"
        beyond = ""
        if delta.get("beyond_prefill_ms") is not None:
            bci = delta.get("beyond_prefill_ci_ms")
            bci_text = "" if bci is None else f" [{bci[0]:.2f}, {bci[1]:.2f}]"
            beyond = (f"; P's prefill {_f(delta.get('prefill_ms'))} ms, TTFT less P's prefill "
                      f"{_f(delta['beyond_prefill_ms'])}{bci_text} ms")
        lines.append(f"  {mode}: TTFT {_f(delta['ttft_ms'])}{ci_text} ms, hand-off "
                     f"{_f(delta['handoff_ms'])} ms{wire} ({int(delta['rounds'] or 0)} rounds)"
                     f"{beyond}")
    if any(d.get("beyond_prefill_ms") is not None for d in report["paired"].values()):
        lines.append("  (two engines configured alike can prefill at speeds ~10 % apart for a "
                     "whole run: read TTFT less P's prefill, not TTFT)")
    for r in report["rows"]:
        if r["pair"] == "wake" and r["mode"] == "push" and r["beyond_wire_p50_ms"] is not None:
            v = r["beyond_wire_p50_ms"]
            verdict = "met" if v <= HANDOFF_BAR_MS else "NOT met"
            lines += ["", f"push hand-off minus wire p50 (wake): {v:.2f} ms (bar <= "
                      f"{HANDOFF_BAR_MS:g} ms: {verdict})"]
    lines += ["", "idle / waiting rows: CPU-s per second of each engine's process group with "
              "nothing to do / while D holds a push whose KV never comes; CPU-s P/D: during the "
              "mode's rounds (both pairs' rounds interleaved)",
              f"engine logs: {report['log_dir']}"]
    return "\n".join(lines)


Say = Callable[[str], None]


def _open_pairs(settings: HandoffSettings, log_dir: Path, say: Say) -> dict[str, Any]:
    """Start both pairs at once (stopped by the caller) and connect the dispatchers."""
    model = build_bench_model() if settings.model == "bench" else build_tiny_model()
    config = f"kvbridge-{settings.backend}"
    servers: dict[str, tuple[Any, Any]] = {}
    for name, env in pairs_of(settings).items():
        p, d = engine_specs(config, model, log_dir / name, settings.engine_spin_ms,
                                settings.pin_engines)
        for server in (p, d):
            server.env.update(env)
            if "PYTHONPATH" in env and settings.baseline_code is not None:
                server.cwd = settings.baseline_code  # ``python -m`` imports from the cwd first
            assert server.kv_transfer_config is not None
            server.kv_transfer_config["engine_id"] += f"-{name}"
        servers[name] = (p, d)
    say(f"starting {2 * len(servers)} engines (logs in {log_dir})")
    start_servers([s for pd in servers.values() for s in pd], timeout=settings.start_timeout,
                  progress=lambda t, r: say(f"waiting for engines {t:.0f} s, ready={r}"),
                  progress_every=30.0)
    return servers


def _idle_cpu(pairs: dict[str, Pair], seconds: float) -> dict[str, tuple[float, float]]:
    """CPU-s per second of each pair's P and D over *seconds* (all pairs measured at once)."""
    meters = {n: CpuMeter(pp.p.pid or -1, pp.d.pid or -1) for n, pp in pairs.items()}
    time.sleep(seconds)
    out = {}
    for n, meter in meters.items():
        p_cpu, d_cpu, _, _ = meter.read()
        out[n] = (p_cpu / seconds, d_cpu / seconds)
    return out


def _waiting_cpu(pairs: dict[str, Pair], settings: HandoffSettings
                 ) -> dict[str, tuple[float, float]]:
    """Like :func:`_idle_cpu`, while each D holds one push request whose P leg never comes
    (the case where vLLM keeps stepping and kvbridge's idle wait decides what that costs); the
    client then gives up, which aborts the request."""
    prompt = _prompts(settings, 1, settings.seed - 2)[0]
    timeout = settings.idle_s + 3.0
    with cf.ThreadPoolExecutor(len(pairs)) as ex:
        futs = [ex.submit(complete, pp.d.url, prompt, 4,
                          push_decode_params(pp.probe, new_transfer_id()), timeout=timeout)
                for pp in pairs.values()]
        time.sleep(1.5)  # registered, waiting
        out = _idle_cpu(pairs, settings.idle_s)
        for fut in futs:
            try:
                fut.result(timeout=timeout + 30)
            except (EngineError, OSError):
                pass  # the expected end: the client stopped waiting
    time.sleep(1.0)
    return out


def _send(pair: Pair, mode: str, prompt: list[int], index: int,
          settings: HandoffSettings, extra: dict[str, Any] | None = None) -> RequestRecord:
    """One measured request (never raises). ``push-behind``: a push while D waits for another
    push's KV (see :data:`MODES`); the waiting one is finished afterwards, unmeasured.
    ``extra``: keys added to the measured request's ``kv_transfer_params``."""
    if mode != "push-behind":
        return dispatch(pair, mode, prompt, index, extra)

    other = _prompts(settings, 1, settings.seed * 7 + index)[0]
    tid = new_transfer_id()
    waiting = pair.legs.submit(complete, pair.d.url, other, 2, push_decode_params(pair.probe, tid),
                               timeout=settings.request_timeout)
    time.sleep(BEHIND_S / 2)  # D holds it, idle, waiting for its KV
    rec = dispatch(pair, "push", prompt, index, extra)
    rec.mode = mode
    time.sleep(max(0.0, BEHIND_S / 2 - (rec.total or 0.0)))
    try:
        complete(pair.p.url, other, 1, kvbridge_prefill_params(tid, "push"),
                 timeout=settings.request_timeout)
        waiting.result(timeout=settings.request_timeout)
    except Exception as exc:  # noqa: BLE001 - the measured request is what counts
        rec.error = rec.error or f"the waiting push failed: {exc}"[:300]
    return rec


def run_handoff_bench(settings: HandoffSettings, say: Say) -> dict[str, Any]:
    """Run the interleaved comparison; the JSON-able report."""
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-bench-handoff-"))
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_start": loadavg(), "log_dir": str(log_dir),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(settings).items()},
        "rows": [], "idle": {}, "waiting": {}, "paired": {},
    }
    e2e_settings = BenchSettings(prompt_len=settings.prompt_len,
                                     max_tokens=settings.max_tokens,
                                     request_timeout=settings.request_timeout)
    legs = cf.ThreadPoolExecutor(4, thread_name_prefix="handoff-leg")
    servers: dict[str, tuple[Any, Any]] = {}
    saved_secret = os.environ.get("KVBRIDGE_SECRET")
    if settings.against == "code" and not saved_secret:
        # one fleet secret for all four engines and this process: the baseline may predate
        # the per-user secret, and both versions then authenticate alike
        os.environ["KVBRIDGE_SECRET"] = os.urandom(16).hex()
    try:
        servers = _open_pairs(settings, log_dir, say)
        pairs: dict[str, Pair] = {}
        for name, (p, d) in servers.items():
            pairs[name] = Pair(f"kvbridge-{settings.backend}", p, d, e2e_settings, legs)
            connect(pairs[name])
        for pair in pairs.values():  # warm-up: the first transfer pays the handshakes
            for mode in ("push", "pull"):
                dispatch(pair, mode, _prompts(settings, 1, settings.seed - 1)[0], -1)
        time.sleep(1.0)
        report["idle"] = _idle_cpu(pairs, settings.idle_s)
        report["waiting"] = _waiting_cpu(pairs, settings)
        extras = {settings.against: SAME_PAIR[settings.against]} if (
            settings.against in SAME_PAIR) else {}
        for name in extras:  # the baseline's requests go to the wake pair itself
            pairs[name] = pairs["wake"]
        names = list(pairs)
        for mode in settings.modes:
            say(f"{mode}: {settings.requests} rounds")
            seed = settings.seed + 100 * MODES.index(mode)
            prompts = _prompts(settings, settings.requests, seed)
            # on one pair the round's second request must not find the first's prompt in the
            # prefix cache: the baseline gets prompts of its own
            others = _prompts(settings, settings.requests, seed + 50) if extras else prompts
            cells = {n: _Cell(n, mode) for n in names}
            meters = {n: CpuMeter(pp.p.pid or -1, pp.d.pid or -1) for n, pp in pairs.items()}
            for i in range(settings.requests):
                order = names if i % 4 in (0, 3) else names[::-1]
                for n in order:
                    prompt = others[i] if n in extras else prompts[i]
                    cells[n].records.append(_send(pairs[n], mode, prompt, i, settings,
                                                  extras.get(n)))
            time.sleep(0.3)  # the last first_step reaches D's rank with its next step
            for n, pair in pairs.items():
                cells[n].cpu_p, cells[n].cpu_d, _, _ = meters[n].read()
                assert pair.p_ctl is not None and pair.d_ctl is not None
                cells[n].p_timings = dict(control_stats(pair.p_ctl).timings)
                cells[n].d_timings = dict(control_stats(pair.d_ctl).timings)
                report["rows"].append(summarize_pair(cells[n]))
                report.setdefault("requests", []).extend(
                    {"pair": n, "mode": mode, "round": r.index, "ok": r.ok, "error": r.error,
                     "ttft_ms": None if r.ttft is None else r.ttft * 1000.0,
                     "steps_ms": {k: round(v * 1000.0, 3) for k, v in request_steps(
                         cells[n].p_timings, cells[n].d_timings, r.transfer_id or "",
                         r.t0_wall or 0.0).items()}}
                    for r in cells[n].records)
            report["paired"][mode] = paired_deltas(cells[names[0]], cells[names[1]])
    finally:
        legs.shutdown(wait=False, cancel_futures=True)
        for p, d in servers.values():
            p.stop()
            d.stop()
        if saved_secret is None:
            os.environ.pop("KVBRIDGE_SECRET", None)
        report["load_end"] = loadavg()
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = HandoffSettings()
    p.add_argument("--backend", choices=BENCH_BACKENDS, default=d.backend,
                   help="kvbridge transport of both pairs")
    p.add_argument("--requests", type=int, default=d.requests, help="rounds per mode")
    p.add_argument("--modes", default=",".join(d.modes), help="comma-separated: push, pull")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="output tokens per request")
    p.add_argument("--idle-s", type=float, default=d.idle_s,
                   help="seconds of the idle measurement (both pairs up, nothing to do)")
    p.add_argument("--engine-spin-ms", type=float, default=d.engine_spin_ms,
                   help="KVBRIDGE_ENGINE_SPIN_MS of every engine (negative: vLLM default)")
    p.add_argument("--pin-engines", action="store_true", help=PIN_HELP)
    p.add_argument("--against", choices=tuple(BASELINES), default=d.against,
                   help="the baseline pair: nowake (KVBRIDGE_WAKE_ON_ARRIVAL=0), nodirect "
                        "(KVBRIDGE_DIRECT_ARRIVAL=0), nohuge (KVBRIDGE_HUGE_PAGES=0), nomap "
                        "(KVBRIDGE_MAP_KV_CACHE=0), nodigest (KVBRIDGE_CHECKSUM=0: no "
                        "hand-off digests), norecorder (KVBRIDGE_FLIGHT_RECORDER=0: no flight "
                        "recorder; that pair has no step timings), unrecorded (no second "
                        "pair: every other request on the same pair is sent with "
                        "kvbridge_record false, so the engines keep no record of it), same (the "
                        "same pair and requests: the noise floor of unrecorded) or code "
                        "(the code of --baseline-code)")
    p.add_argument("--baseline-code", type=Path, default=None,
                   help="with --against code: a checkout of another commit (git worktree add "
                        "DIR COMMIT) whose kvbridge the baseline pair's engines run")
    p.add_argument("--model", choices=("tiny", "bench"), default=d.model,
                   help="tiny (the tests' model) or bench (~100 M parameters, 24 KiB of KV per "
                        "token: a request's KV is tens of MiB; use --prompt-len up to ~1000)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts")
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: temp dir)")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def settings_from_args(args: argparse.Namespace) -> HandoffSettings:
    if args.requests < 2:
        raise ConfigError("--requests must be >= 2")
    for name in ("prompt_len", "max_tokens"):
        if getattr(args, name) < 2:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 2")
    if not args.idle_s > 0:
        raise ConfigError("--idle-s must be > 0")
    return HandoffSettings(backend=args.backend, requests=args.requests,
                           modes=parse_names(args.modes, MODES, "--modes", "mode"),
                           prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                           idle_s=args.idle_s, engine_spin_ms=args.engine_spin_ms,
                           pin_engines=args.pin_engines, against=args.against,
                           baseline_code=args.baseline_code,
                           model=args.model, seed=args.seed, log_dir=args.log_dir)


def cli_main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    report = run_handoff_bench(settings, say)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_handoff_report(report))
    return 0 if all(r["failed"] == 0 for r in report["rows"]) else 1
