"""``kvbridge bench offload``'s rows, settings and results, and how they are judged and printed.

Contract: :data:`ROW_NAMES` are the rows (each an offload tier, or recompute) and
:data:`TIER_OF` / :data:`ENGINE_OF` what each reads from and which engine serves it;
:class:`BenchSettings` is every knob of one run (the CLI flags map one to one, ``--quick`` is
:meth:`BenchSettings.quick_defaults`). :class:`Rep` is one measured repetition and
:class:`RowResult` one row. Everything else is pure: :func:`source_ok` says whether a
repetition's KV came from the row's tier (engine counters), :func:`summarize`,
:func:`add_ratios` and :func:`verdicts` make the JSON rows, the ``format_*`` functions the text.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools.args import parse_names
from kvbridge.tools.report import median_ci, paired_ratios, percentile, table

__all__ = ["AGAINST", "AIMS", "BASELINE", "DEFAULT_ROWS", "ENGINE_OF", "LAYERWISE", "ROW_NAMES",
           "TABLE_HEADERS", "TIER_OF", "BenchSettings", "Rep", "RowResult", "add_ratios",
           "against_rows", "format_against", "format_report", "format_table", "median_min",
           "parse_rows", "parse_tier_options", "shared_blocks", "source_ok", "summarize",
           "table_rows", "usable_blocks", "variants_of", "verdicts"]

ROW_NAMES: tuple[str, ...] = ("recompute", "dram", "dram_layerwise", "disk", "disk_layerwise",
                              "disk_cold", "lmcache", "mooncake_store")
DEFAULT_ROWS = ROW_NAMES
#: rows whose engine loads tier hits layer by layer (``offload.layerwise_load``)
LAYERWISE: frozenset[str] = frozenset({"dram_layerwise", "disk_layerwise"})
BASELINE = "recompute"
#: rows measured on another row's engine (no engine of their own)
ENGINE_OF: dict[str, str] = {"disk_cold": "disk"}
#: the offload tier each row reads from (None: no tier)
TIER_OF: dict[str, str | None] = {"recompute": None, "dram": "dram", "disk": "disk",
                                  "dram_layerwise": "dram", "disk_layerwise": "disk",
                                  "disk_cold": "disk", "lmcache": "lmcache",
                                  "mooncake_store": "mooncake_store"}
#: the issue's aims: median TTFT at most this fraction of recompute's
AIMS: dict[str, float] = {"dram": 0.2, "disk": 0.5, "disk_cold": 0.5}
#: ``--against``: the baseline variant → its engines' extra connector settings. Every tier row
#: then runs on two engines at once, the default one (variant ``seal``) and the baseline, their
#: repetitions interleaved (ABBA); recompute (no tier) runs once
AGAINST: dict[str, dict[str, Any]] = {"noseal": {"checksum": False}}
#: the default engines' variant name next to a baseline
DEFAULT_VARIANT = "seal"


# -- settings and results ------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    """Everything one run needs; the CLI flags map one to one (``--quick`` changes defaults)."""

    rows: tuple[str, ...] = DEFAULT_ROWS
    reps: int = 5
    prompt_len: int = 3000
    #: share of the prompt the tier holds (1: all of it; 0.5: the first half, the rest is new
    #: in every repetition and computed)
    hit_fraction: float = 1.0
    max_tokens: int = 2
    block_size: int = 128
    seed: int = 4321
    quick: bool = False
    tier_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    cpu_bind: str | None = "0-1"
    engine_spin_ms: float = 2.0
    request_timeout: float = 300.0
    start_timeout: float = 600.0
    settle_timeout: float = 60.0
    quiet_wait_s: float = 1500.0
    quiet_poll_s: float = 30.0
    log_dir: Path | None = None
    work_dir: Path | None = None
    model_dir: Path | None = None
    #: a baseline variant of :data:`AGAINST` (None: one engine per row)
    against: str | None = None

    @classmethod
    def quick_defaults(cls) -> BenchSettings:
        """``--quick``: the tiny model, a short prompt, two repetitions (a smoke run)."""
        return cls(quick=True, reps=2, prompt_len=600, block_size=32, request_timeout=120.0)

    @property
    def max_model_len(self) -> int:
        """Prompt + output + slack, rounded up to 1024."""
        return max(1024, math.ceil((self.prompt_len + self.max_tokens + 16) / 1024) * 1024)


@dataclass
class Rep:
    """One measured request (seconds; ``deltas``: engine counter deltas over the request)."""

    index: int
    ok: bool = False
    ttft: float | None = None
    total: float | None = None
    queue: float | None = None
    prefill: float | None = None
    token_ids: list[int] = field(default_factory=list)
    deltas: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "ok": self.ok, "ttft_s": self.ttft, "total_s": self.total,
                "queue_s": self.queue, "prefill_s": self.prefill, "token_ids": self.token_ids,
                "deltas": self.deltas, "error": self.error}


@dataclass
class RowResult:
    """One row of the table: a tier (or recompute) measured on its engine."""

    row: str
    tiers: list[str] = field(default_factory=list)
    #: which engine of the row's variants measured it ("" without ``--against``)
    variant: str = ""
    unavailable: str | None = None
    error: str | None = None
    cold: Rep | None = None
    reps: list[Rep] = field(default_factory=list)
    expected_blocks: int = 0
    reference: list[int] | None = None
    #: per repetition index, where repetitions have prompts of their own (``hit_fraction`` < 1)
    rep_references: dict[int, list[int]] = field(default_factory=dict)
    reference_from: str = ""
    stored_blocks: int | None = None
    notes: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)


# -- pure helpers (unit-tested) ------------------------------------------------------------------


def parse_rows(text: str) -> tuple[str, ...]:
    """``"dram, disk"`` → the rows, validated, in the table's order; ``all`` → every row."""
    chosen = set(parse_names(text, ROW_NAMES, "--rows", "row"))
    return tuple(r for r in ROW_NAMES if r in chosen)


def variants_of(row: str, settings: BenchSettings) -> dict[str, dict[str, Any]]:
    """The engines of *row* (variant → extra connector settings): one plain engine, or with
    ``against`` and a tier the default and the baseline."""
    if settings.against is None or TIER_OF[row] is None:
        return {"": {}}
    return {DEFAULT_VARIANT: {}, settings.against: dict(AGAINST[settings.against])}


def parse_tier_options(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["lmcache={\"disk_path\": \"/x\"}"]`` → ``{"lmcache": {...}}`` (merged into the row's
    tier options); :class:`ConfigError` naming a bad one."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in ROW_NAMES or TIER_OF[name] is None:
            tiers = ", ".join(r for r in ROW_NAMES if TIER_OF[r] is not None)
            raise ConfigError(f"--tier-options {item!r}: expected ROW=JSON with ROW one of "
                              f"{tiers}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--tier-options {name}: not JSON ({exc})") from exc
        if not isinstance(value, dict):
            raise ConfigError(f"--tier-options {name}: expected a JSON object")
        out.setdefault(ENGINE_OF.get(name, name), {}).update(value)
    return out


def usable_blocks(prompt_len: int, block_size: int) -> int:
    """Blocks a tier can serve: full blocks, leaving at least one prompt token to compute."""
    return max(0, (prompt_len - 1) // block_size)


def shared_blocks(settings: BenchSettings) -> int:
    """Blocks of the prompt the tier holds in each repetition (``hit_fraction`` of the usable
    ones, at least one)."""
    usable = usable_blocks(settings.prompt_len, settings.block_size)
    if settings.hit_fraction >= 1.0:
        return usable
    return max(1, min(usable, int(settings.prompt_len * settings.hit_fraction)
                      // settings.block_size))


def median_min(values: Sequence[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.median(vals), min(vals)


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def source_ok(row: str, rep: Rep, expected: int) -> bool:
    """Did the KV of ``rep`` come from where ``row`` says (counter deltas)?"""
    d = rep.deltas
    if d.get("offload_load_failed", 0):
        return False
    tier = TIER_OF[row]
    if tier is None:
        return d.get("offload_loaded_blocks", 0) == 0
    hits = d.get(f"offload_hit_blocks_{tier}", 0)
    other = sum(v for k, v in d.items()
                if k.startswith("offload_hit_blocks_") and k != f"offload_hit_blocks_{tier}")
    return hits == expected and d.get("offload_loaded_blocks", 0) == expected and other == 0


def summarize(res: RowResult) -> dict[str, Any]:
    """The JSON-able summary of one row (what the table shows, plus the raw repetitions)."""
    ok = [r for r in res.reps if r.ok]
    med, low = median_min([r.ttft for r in ok if r.ttft is not None])
    tier = TIER_OF[res.row]
    def expected(r: Rep) -> list[int] | None:
        return res.rep_references.get(r.index, res.reference)

    checked = [r for r in ok if expected(r) is not None]
    hit_key = f"offload_hit_blocks_{tier}" if tier else "offload_loaded_blocks"
    return {
        "row": res.row, "variant": res.variant, "tiers": res.tiers,
        "unavailable": res.unavailable, "error": res.error,
        "reps": len(res.reps), "ok": len(ok),
        "ttft_median_s": med, "ttft_min_s": low,
        "ttft_cold_s": res.cold.ttft if res.cold is not None else None,
        "queue_mean_s": _mean([r.queue for r in ok]),
        "prefill_mean_s": _mean([r.prefill for r in ok]),
        # layer-wise rows: the loader's copy time and the forward's wait for it, per request
        # (1 - wait / copy is the share of the copy hidden behind compute)
        "layerwise_copy_ms": _mean([r.deltas.get("offload_layerwise_copy_us", 0) / 1e3
                                    for r in ok]) if res.row in LAYERWISE else None,
        "layerwise_wait_ms": _mean([r.deltas.get("offload_layerwise_wait_us", 0) / 1e3
                                    for r in ok]) if res.row in LAYERWISE else None,
        "expected_blocks": res.expected_blocks if tier else 0,
        "hit_blocks": [r.deltas.get(hit_key, 0) for r in ok],
        "source_ok": (all(source_ok(res.row, r, res.expected_blocks) for r in ok)
                      if ok else None),
        "output_ok": (all(r.token_ids == expected(r) for r in checked) if checked else None),
        "reference_from": res.reference_from,
        "stored_blocks": res.stored_blocks,
        "notes": list(res.notes), "engine": dict(res.engine),
        "cold": res.cold.to_dict() if res.cold is not None else None,
        "records": [r.to_dict() for r in res.reps],
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``ratio`` (median TTFT / recompute's) and ``ratio_min`` (min / min), in place."""
    base = next((r for r in rows if r["row"] == BASELINE and not r.get("variant")), None)
    for row in rows:
        for key, out in (("ttft_median_s", "ratio"), ("ttft_min_s", "ratio_min")):
            a = row.get(key)
            b = base.get(key) if base is not None else None
            row[out] = a / b if a is not None and b else None


def verdicts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per aim of :data:`AIMS` whose row was measured: held or not, with the numbers."""
    out = []
    for row in rows:
        aim = AIMS.get(row["row"])
        if aim is None or row.get("variant") not in (None, "", DEFAULT_VARIANT):
            continue
        ratio = row.get("ratio")
        if ratio is None:
            out.append(f"{row['row']}: aim <= {aim:g} x recompute: not measured")
            continue
        held = "holds" if ratio <= aim else "NOT met"
        out.append(f"{row['row']}: aim <= {aim:g} x recompute: {held} ({ratio:.3f} x, "
                   f"{row['ttft_median_s']:.3f} s vs "
                   f"{row['ttft_median_s'] / ratio:.3f} s)")
    return out


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _mark(v: bool | None) -> str:
    return "-" if v is None else ("✓" if v else "✗")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000.0:.0f}"


TABLE_HEADERS = ("row", "tiers", "ok/reps", "TTFT med s", "TTFT min s", "x recompute",
                 "cold s", "queue ms", "prefill ms", "hit blocks", "source", "out", "note")


def table_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The cells of the table, one list per row."""
    out: list[list[str]] = []
    for r in rows:
        if r.get("unavailable"):
            note = f"not available: {r['unavailable']}"
        elif r.get("error"):
            note = f"failed: {r['error']}"
        else:
            note = "; ".join(r.get("notes") or [])
        hits = r.get("hit_blocks") or []
        if not r.get("ok"):
            hit = "-"
        elif r.get("expected_blocks"):
            hit = (f"{hits[0]}/{r['expected_blocks']}" if len(set(hits)) == 1
                   else f"{min(hits)}..{max(hits)}/{r['expected_blocks']}")
        else:
            hit = "0" if set(hits) <= {0} else f"{max(hits)}"
        out.append([
            r["row"] + (f" ({r['variant']})" if r.get("variant") else ""),
            "+".join(r.get("tiers") or []) or "-",
            f"{r.get('ok', 0)}/{r.get('reps', 0)}",
            _fmt(r.get("ttft_median_s")), _fmt(r.get("ttft_min_s")),
            _fmt(r.get("ratio"), 3), _fmt(r.get("ttft_cold_s")),
            _ms(r.get("queue_mean_s")), _ms(r.get("prefill_mean_s")), hit,
            _mark(r.get("source_ok")), _mark(r.get("output_ok")), note,
        ])
    return out


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table as aligned text (header, rule, rows)."""
    lines = table(TABLE_HEADERS, table_rows(rows))
    return "\n".join(lines)


def _ttfts(row: Mapping[str, Any]) -> dict[int, float]:
    return {r["index"]: r["ttft_s"] for r in row.get("records") or []
            if r.get("ok") and r.get("ttft_s")}


def against_rows(rows: Sequence[Mapping[str, Any]], against: str) -> list[dict[str, Any]]:
    """Per tier row measured with both variants: each variant's median TTFT, the ratio of the
    medians, and the repetitions' paired ratios (default / *against*, same repetition index:
    measured back to back) with their median's 95 % interval; ``overhead_pct`` is that median's
    excess over 1, in percent of the baseline's TTFT."""
    out: list[dict[str, Any]] = []
    for a in rows:
        if a.get("variant") != DEFAULT_VARIANT:
            continue
        b = next((r for r in rows if r["row"] == a["row"] and r.get("variant") == against),
                 None)
        if b is None:
            continue
        ta, tb = _ttfts(a), _ttfts(b)
        both = sorted(set(ta) & set(tb))
        ratios = paired_ratios([ta[i] for i in both], [tb[i] for i in both])
        ci = median_ci(ratios) if ratios else None
        med_a, med_b = percentile(list(ta.values()), 50), percentile(list(tb.values()), 50)
        out.append({"row": a["row"], "pairs": len(both), "ttft_median_s": med_a,
                    f"ttft_median_{against}_s": med_b,
                    "ratio_of_medians": med_a / med_b if med_a and med_b else None,
                    "paired_ratio": ci.median if ci else None,
                    "paired_ratio_ci": [ci.low, ci.high] if ci else None,
                    "paired_diff_ms": percentile([(ta[i] - tb[i]) * 1e3 for i in both], 50),
                    "overhead_pct": (ci.median - 1.0) * 100.0 if ci else None})
    return out


def format_against(rows: Sequence[Mapping[str, Any]], against: str) -> str:
    """:func:`against_rows` as a table."""
    head = ("row", "pairs", f"TTFT med {DEFAULT_VARIANT} s", f"TTFT med {against} s",
            "ratio of medians", "paired ratio [95% CI]", "paired diff ms", "overhead %")
    cells = [[r["row"], r["pairs"], _fmt(r["ttft_median_s"]),
              _fmt(r[f"ttft_median_{against}_s"]), _fmt(r["ratio_of_medians"]),
              "-" if r["paired_ratio"] is None else
              f"{r['paired_ratio']:.3f} [{r['paired_ratio_ci'][0]:.3f}, "
              f"{r['paired_ratio_ci'][1]:.3f}]",
              _fmt(r["paired_diff_ms"], 1), _fmt(r["overhead_pct"], 1)] for r in rows]
    return "\n".join(table(head, cells))


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable result: facts, the table, the aims, the legend."""
    h = report["host"]
    m = report["model"]
    s = report["settings"]
    parts = [
        f"kvbridge bench offload, {report['date']}, {h['cpus']} CPUs, load "
        f"{h['loadavg_start']} -> {h.get('loadavg_end', '?')}, {report.get('elapsed_s', '?')} s",
        f"model {m['name']} ({m['params'] / 1e6:.1f} M parameters, float32), prompt "
        f"{s['prompt_len']} tokens (block {s['block_size']}: {report['expected_blocks']} blocks "
        f"= {report['prompt_kv_bytes'] / (1 << 20):.1f} MiB of KV from a tier), max_tokens "
        f"{s['max_tokens']}, {s['reps']} reps per row",
        "", format_table(report["rows"]), "",
    ]
    if report.get("against"):
        against = s["against"]
        how = ", ".join(f"{k}={v}" for k, v in AGAINST[against].items())
        parts += [f"{DEFAULT_VARIANT} vs {against} ({how}), "
                  "repetitions interleaved ABBA on two engines per row:", "",
                  format_against(report["against"], against), "",
                  f"paired ratio: each repetition's TTFT {DEFAULT_VARIANT} / {against} (the "
                  "two measured back to back), median and its 95 % interval; overhead: the "
                  f"paired ratio's excess over 1, in % of the {against} tier hit's TTFT", ""]
    parts += report.get("verdicts") or verdicts(report["rows"])
    parts += ["", "TTFT: client side, request sent -> first streamed token, after "
              "POST /reset_prefix_cache; x recompute: median / recompute's median; cold: the "
              "row's first (computed) request; queue/prefill: vLLM's own request histograms "
              "(mean; queue includes waiting for a tier's lookup answer); hit blocks: "
              "offload_hit_blocks_<tier> per rep / usable blocks; source: every rep's counters "
              "say the KV came from the row's tier (recompute: from none); out: every rep's "
              "output ids equal the reference (" + (report.get("reference_from") or "-") + ")",
              f"engine logs: {report['log_dir']}"]
    if report.get("foreign_waits"):
        parts.append("waited for other engines: " + ", ".join(
            f"{k} {v:.0f} s" for k, v in report["foreign_waits"].items()))
    return "\n".join(parts)


