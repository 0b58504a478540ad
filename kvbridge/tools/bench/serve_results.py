"""``kvbridge bench serve``'s results: the figures of a run, the table, the push/pull verdict.

Contract: pure functions of ``vllm bench serve``'s result JSON and of the report rows (plain
JSON: one row per (setup, rate)); :func:`load_results` reads a ``results.json`` back and raises
:class:`~kvbridge.errors.ConfigError` when it is not one. Times are milliseconds, throughput
requests per second; a missing or non-finite number is None, shown as ``-``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.timings import beyond_wire, handoff_breakdown, handoff_times
from kvbridge.tools.report import percentile, table

__all__ = ["PUSH_PULL_BAR", "RESULTS_FILE", "RESULTS_KIND", "SUSTAINED_FRACTION", "TABLE_HEADERS",
           "finite", "format_phases", "format_push_pull", "format_steps", "format_table",
           "handoff_summary", "load_results", "phase_gaps", "push_pull", "result_metrics",
           "sustained", "table_rows"]

RESULTS_FILE = "results.json"
RESULTS_KIND = "kvbridge-bench-serve"


def finite(v: Any) -> float | None:
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
             if good and finite(t) is not None]
    lat = [t * 1000 for t, good in zip(result.get("latencies") or [], ok, strict=False)
           if good and finite(t) is not None]
    return {
        "completed": result.get("completed"), "failed": result.get("failed"),
        "ttft_p50": finite(result.get("p50_ttft_ms", result.get("median_ttft_ms"))),
        "ttft_p99": finite(result.get("p99_ttft_ms")),
        "ttft_max": max(ttfts) if ttfts else None,
        "tpot_p50": finite(result.get("p50_tpot_ms", result.get("median_tpot_ms"))),
        "tpot_p99": finite(result.get("p99_tpot_ms")),
        "e2e_p50": finite(result.get("p50_e2el_ms", result.get("median_e2el_ms"))),
        "e2e_p99": finite(result.get("p99_e2el_ms")),
        "e2e_max": max(lat) if lat else None,
        "request_throughput": finite(result.get("request_throughput")),
        "duration_s": finite(result.get("duration")),
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


def phase_gaps(result: Mapping[str, Any], whys: Mapping[int, Mapping[str, Any]],
               mono_to_wall: float | None = None) -> dict[str, Any]:
    """How well one run's flight records explain what the client saw: for each successful
    request ``i`` of ``vllm bench serve``'s result (``--save-detailed``) that the proxy gave a
    critical path for (``whys[i]``, its ``/admin/why`` answer), ``|sum of phases - TTFT|``.
    ``phases_n`` requests, the gap's p50/p99/max (ms), and the proxy-side share of the TTFT
    (``phases_proxy_p50``: sum of phases / client TTFT, median).

    With ``mono_to_wall`` (``time.time() - time.perf_counter()`` on the host that ran both the
    client and the proxy: bench serve's ``start_times`` are ``perf_counter`` values), the gap is
    also split where it lies: ``phases_before_*`` (the client's send to the first point of
    the proxy's record: the request's bytes in its socket, else its handler) and
    ``phases_after_*`` (the proxy's first write to the client's first token), p50/p99 ms;
    ``phases_socket_*`` is the part of the record spent in the proxy's socket before its
    handler ran (0 where the kernel gave no wait), and ``phases_requests`` lists each
    request's ``[i, sent (s after the run's first send), gap, before, after, socket]`` (ms) to
    find where a tail sits in the run."""
    ttfts, errors = result.get("ttfts") or [], result.get("errors") or []
    starts = result.get("start_times") or []
    gaps, shares, before, after, socket = [], [], [], [], []
    per: list[list[float]] = []
    first = min((t for t in starts if finite(t) is not None), default=0.0)
    for i, ttft in enumerate(ttfts):
        why = whys.get(i)
        good = i >= len(errors) or errors[i] in (None, "")
        if not good or why is None or finite(ttft) is None or not why.get("phases"):
            continue
        total = sum(p["seconds"] for p in why["phases"])
        gaps.append(abs(total - ttft) * 1000.0)
        if ttft > 0:
            shares.append(total / ttft)
        proxy = why.get("proxy") or {}
        if mono_to_wall is not None and i < len(starts) and finite(starts[i]) is not None \
                and "receive" in proxy and "first_token" in proxy:
            sent = starts[i] + mono_to_wall
            reached = proxy.get("arrived", proxy["receive"])
            before.append((reached - sent) * 1000.0)
            after.append((sent + ttft - proxy["first_token"]) * 1000.0)
            socket.append((proxy["receive"] - reached) * 1000.0)
            per.append([i, round(starts[i] - first, 4), round(gaps[-1], 3),
                        round(before[-1], 3), round(after[-1], 3), round(socket[-1], 3)])
    out = {"phases_n": len(gaps), "phases_gap_p50": percentile(gaps, 50),
           "phases_gap_p99": percentile(gaps, 99), "phases_gap_max": max(gaps, default=None),
           "phases_proxy_p50": percentile(shares, 50)}
    if before:
        out.update(phases_before_p50=percentile(before, 50),
                   phases_before_p99=percentile(before, 99),
                   phases_after_p50=percentile(after, 50), phases_after_p99=percentile(after, 99),
                   phases_socket_p99=percentile(socket, 99), phases_socket_max=max(socket),
                   phases_requests=per)
    return out


def run_window(result: Mapping[str, Any], mono_to_wall: float) -> tuple[float, float]:
    """Wall-clock ``(start, end)`` of one ``vllm bench serve`` run (``--save-detailed``): its
    first request's start to its last request's end (``start_times`` + ``latencies``, shifted by
    ``mono_to_wall``); an empty window, ``(inf, -inf)``, when it has no timed request."""
    starts, latencies = result.get("start_times") or [], result.get("latencies") or []
    timed = [(s, lat) for s, lat in zip(starts, latencies, strict=False)
             if finite(s) is not None and finite(lat) is not None]
    if not timed:
        return float("inf"), float("-inf")
    return (min(s for s, _ in timed) + mono_to_wall,
            max(s + lat for s, lat in timed) + mono_to_wall)


def format_phases(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per kvbridge (setup, rate): how far the joined phases are from the client's TTFT, and
    what the host's stall probe (:mod:`kvbridge.tools.bench.stallprobe`) saw meanwhile."""
    lines = [f"  {r['setup']} @ {r['rate']:g}: {r['phases_n']} requests, p50 "
             f"{_f(r.get('phases_gap_p50'), 2)}, p99 {_f(r.get('phases_gap_p99'), 2)}, max "
             f"{_f(r.get('phases_gap_max'), 2)}" + (
                 f"; client send -> proxy p50/p99 {_f(r.get('phases_before_p50'), 2)}/"
                 f"{_f(r.get('phases_before_p99'), 2)}, proxy first write -> client "
                 f"{_f(r.get('phases_after_p50'), 2)}/{_f(r.get('phases_after_p99'), 2)}"
                 f"; in the proxy's socket (recorded) p99/max "
                 f"{_f(r.get('phases_socket_p99'), 2)}/{_f(r.get('phases_socket_max'), 2)}"
                 if r.get("phases_before_p50") is not None else "") + (
                 f"; host stall probe p99/max {_f(r.get('probe_p99'), 2)}/"
                 f"{_f(r.get('probe_max'), 2)} ({r.get('probe_over_5ms')} of "
                 f"{r.get('probe_n')} round trips over 5 ms)" if r.get("probe_n") else "")
             for r in rows if r.get("phases_n")]
    return "\n".join(["|sum of the flight record's phases - client TTFT| (ms):"] + lines) \
        if lines else ""


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
    thr, rate = finite(row.get("request_throughput")), finite(row.get("rate"))
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
        a, b = finite(push.get("ttft_p50")), finite(pull.get("ttft_p50"))
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



def handoff_summary(p_timings: Mapping[str, Mapping[str, float]],
                    d_timings: Mapping[str, Mapping[str, float]],
                    transfer_ids: Sequence[str]) -> dict[str, Any]:
    """What the engines recorded for one run's transfers: hand-off p50 (``D.first_step -
    P.kv_ready``), push hand-off minus wire p50, and the median of every step (ms)."""
    def ms(values: Sequence[float]) -> float | None:
        v = percentile(values, 50)
        return None if v is None else v * 1000.0

    return {"handoff_n": len(handoff_times(p_timings, d_timings, transfer_ids)),
            "handoff_p50": ms(handoff_times(p_timings, d_timings, transfer_ids)),
            "beyond_wire_p50": ms(beyond_wire(p_timings, d_timings, transfer_ids)),
            "handoff_steps": {k: v * 1000.0 for k, v in
                              handoff_breakdown(p_timings, d_timings, transfer_ids).items()}}


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
            and finite(r.get("rate")) is not None for r in rows):
        raise ConfigError(f"--plot-only: {path}: 'rows' must be a list of objects with a setup "
                          "and a rate")
    return data


