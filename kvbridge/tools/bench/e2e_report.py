"""``kvbridge bench e2e``'s settings and records, and the report rows and tables made of them.

Contract: :class:`BenchSettings` is every knob of one run (the CLI flags map one to one);
:class:`RequestRecord` is one measured request and :class:`PhaseResult` one (configuration,
mode, phase) cell. :func:`summarize`, :func:`add_ratios` and the ``format_*`` functions are
pure: plain JSON rows in, rows or text out. :func:`workload_prompts` depends only on the seed,
the mode slot and the phase, so every configuration sees the very same prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.tools.args import parse_names
from kvbridge.tools.bench.fleet import CONFIG_NAMES
from kvbridge.tools.bench.timings import HANDOFF_BAR_MS
from kvbridge.tools.report import percentile, table
from kvbridge.tools.tiny_model import random_prompts

__all__ = ["BASELINE", "BenchSettings", "PhaseResult", "RequestRecord", "TABLE_HEADERS",
           "add_ratios", "format_bars", "format_breakdown", "format_table", "parse_configs",
           "summarize", "table_rows", "workload_prompts"]

BASELINE = "vllm-nixl-pull"
#: ``headroom`` was ``auto`` before the planner took that name (same slot: same prompts)
_MODE_SLOT = {"pull": 0, "push": 1, "headroom": 2, "auto": 2}
_PHASE_SLOT = {"warmup": 0, "seq": 1, "conc": 2, "proxy-seq": 3}


# -- settings and results ------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    """Everything one run needs; the CLI flags map one to one."""

    configs: tuple[str, ...] = CONFIG_NAMES
    seq: int = 12
    concurrent: int = 16
    wave: int = 8
    prompt_len: int = 400
    max_tokens: int = 32
    proxy_requests: int = 8
    check: int = 2
    push_headroom: int = 4
    seed: int = 1234
    request_timeout: float = 120.0
    start_timeout: float = 600.0
    idle_s: float = 5.0
    max_failures: int = 3
    warmup_tries: int = 2
    quiet_load: float = 2.0
    quiet_wait_s: float = 120.0
    #: KVBRIDGE_ENGINE_SPIN_MS for kvbridge's engines (negative: vLLM's default 1 s spin)
    engine_spin_ms: float = 2.0
    #: pin each engine's whole process tree to its core (VllmServer.pin_cpus)
    pin_engines: bool = False
    log_dir: Path | None = None
    model_dir: Path | None = None

    @property
    def conc_phase(self) -> str:
        return f"c{self.wave}"


@dataclass
class RequestRecord:
    """One measured request. Times in seconds; ``mode`` is the mode actually used."""

    index: int
    mode: str
    ok: bool = False
    ttft: float | None = None
    tpot: float | None = None
    total: float | None = None
    transfer_id: str | None = None
    error: str | None = None
    t0_wall: float | None = None
    """Wall clock (time.time) at dispatch, to line up with the engines' timings."""
    steps: dict[str, float] = field(default_factory=dict)
    """Engine timing events of this transfer, seconds after dispatch (P.kv_ready, D.first_step…)."""
    token_ids: list[int] = field(default_factory=list, repr=False)
    prompt: list[int] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "mode": self.mode, "ok": self.ok, "ttft": self.ttft,
                "tpot": self.tpot, "total": self.total, "transfer_id": self.transfer_id,
                "error": self.error, "tokens": len(self.token_ids),
                "steps_ms": {k: round(v * 1000.0, 2) for k, v in self.steps.items()}}


@dataclass
class PhaseResult:
    """One (configuration, mode, phase) cell of the table."""

    config: str
    mode: str
    phase: str
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_p: float | None = None
    cpu_d: float | None = None
    cpu_bench: float | None = None
    cpu_other: float | None = None
    handoffs: list[float] = field(default_factory=list)
    beyond_wire: list[float] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)
    xfer_avg_ms: float | None = None
    xfer_count: int = 0
    checked: int = 0
    matched: int = 0
    error: str | None = None
    loadavg: str = ""

    @property
    def match(self) -> str:
        if self.checked == 0:
            return "-"
        word = "MATCH" if self.matched == self.checked else "MISMATCH"
        return f"{word} {self.matched}/{self.checked}"

    def chosen(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            if r.mode != "-":
                out[r.mode] = out.get(r.mode, 0) + 1
        return out


# -- pure helpers (unit-tested) ------------------------------------------------------------------


def parse_configs(text: str) -> tuple[str, ...]:
    """``"a,b"`` → the configurations, validated, duplicates removed, order kept; ``all`` → all."""
    return parse_names(text, CONFIG_NAMES, "--configs", "configuration")



def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def summarize(res: PhaseResult) -> dict[str, Any]:
    """One table row (plain JSON values) for a phase."""
    ok = [r for r in res.records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return {
        "config": res.config, "mode": res.mode, "phase": res.phase,
        "ok": len(ok), "failed": len(res.records) - len(ok),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "handoff_p50_ms": _ms(percentile(res.handoffs, 50)),
        "handoff_p90_ms": _ms(percentile(res.handoffs, 90)),
        "handoff_n": len(res.handoffs),
        "beyond_wire_p50_ms": _ms(percentile(res.beyond_wire, 50)),
        "nixl_xfer_avg_ms": res.xfer_avg_ms, "nixl_xfer_n": res.xfer_count,
        "cpu_p_s": res.cpu_p, "cpu_d_s": res.cpu_d, "cpu_bench_s": res.cpu_bench,
        "cpu_other_s": res.cpu_other, "wall_s": res.wall_s,
        "match": res.match, "chosen": res.chosen(),
        "breakdown_ms": {k: v * 1000.0 for k, v in res.breakdown.items()},
        "error": res.error, "loadavg_after": res.loadavg,
    }


def _baseline_phase(phase: str) -> str:
    return "seq" if phase == "proxy-seq" else phase


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``ttft_ratio``/``tpot_ratio``: row / vLLM-NIXL-pull's same phase (in place).

    ``proxy-seq`` rows compare against the baseline's ``seq``; no baseline → None.
    """
    base = {r["phase"]: r for r in rows if r["config"] == BASELINE}
    for row in rows:
        ref = base.get(_baseline_phase(row["phase"]))
        for key, out in (("ttft_p50_s", "ttft_ratio"), ("tpot_p50_ms", "tpot_ratio")):
            a = row.get(key)
            b = ref.get(key) if ref is not None else None
            row[out] = a / b if a is not None and b else None


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


TABLE_HEADERS = ("config", "mode", "phase", "ok/fail", "TTFT p50 s", "TTFT p90 s",
                 "TPOT p50 ms", "hand-off p50/p90 ms", "-wire p50 ms", "nixl xfer ms", "CPU-s P",
                 "CPU-s D", "CPU-s other", "wall s", "match", "TTFT x", "TPOT x")


def table_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The cells of the main table, one list per row."""
    out: list[list[str]] = []
    for r in rows:
        mode = r["mode"]
        chosen = r.get("chosen") or {}
        if mode in ("headroom", "auto") and chosen and set(chosen) != {mode}:
            mode += "(" + "/".join(f"{k}:{v}" for k, v in sorted(chosen.items())) + ")"
        if r.get("handoff_n"):
            handoff = f"{_fmt(r['handoff_p50_ms'], 1)}/{_fmt(r['handoff_p90_ms'], 1)}"
        else:
            handoff = "n/a" if r["config"].startswith("vllm") else "-"
        xfer = _fmt(r.get("nixl_xfer_avg_ms"), 1) if r.get("nixl_xfer_n") else "-"
        out.append([
            r["config"], mode, r["phase"], f"{r['ok']}/{r['failed']}",
            _fmt(r["ttft_p50_s"]), _fmt(r["ttft_p90_s"]), _fmt(r["tpot_p50_ms"], 1), handoff,
            _fmt(r.get("beyond_wire_p50_ms"), 2), xfer, _fmt(r["cpu_p_s"], 1),
            _fmt(r["cpu_d_s"], 1), _fmt(r.get("cpu_other_s"), 1),
            _fmt(r.get("wall_s"), 1), r["match"],
            _fmt(r.get("ttft_ratio"), 2), _fmt(r.get("tpot_ratio"), 2),
        ])
    return out


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The main table as aligned text (header, rule, rows), then the errors, if any."""
    lines = table(TABLE_HEADERS, table_rows(rows))
    errors = [f"  {r['config']} {r['mode']} {r['phase']}: {r['error']}" for r in rows
              if r.get("error")]
    if errors:
        lines += ["", "errors:"] + errors
    return "\n".join(lines)


def format_breakdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """Medians of each hand-off step (ms) for the kvbridge phases."""
    lines = []
    for r in rows:
        if r.get("breakdown_ms"):
            steps = ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown_ms"].items())
            lines.append(f"  {r['config']} {r['mode']} {r['phase']}: {steps}")
    return "\n".join(["hand-off steps (median ms):"] + lines) if lines else ""


def format_bars(rows: Sequence[Mapping[str, Any]]) -> str:
    """The hand-off issue's first bar, per kvbridge configuration: push hand-off minus wire
    time, p50, sequential (``seq``), against :data:`HANDOFF_BAR_MS`."""
    lines = []
    for r in rows:
        if r["mode"] == "push" and r["phase"] == "seq" and r.get("beyond_wire_p50_ms") is not None:
            v = r["beyond_wire_p50_ms"]
            verdict = "met" if v <= HANDOFF_BAR_MS else "NOT met"
            lines.append(f"  {r['config']}: push seq hand-off p50 {_fmt(r['handoff_p50_ms'], 2)} "
                         f"ms, minus wire {v:.2f} ms (bar <= {HANDOFF_BAR_MS:g} ms: {verdict})")
    return "\n".join(["hand-off minus wire time:"] + lines) if lines else ""


def workload_prompts(settings: BenchSettings, mode: str, phase: str, n: int) -> list[list[int]]:
    """*n* fresh prompts for (mode slot, phase); identical across configurations and runs."""
    seed = settings.seed * 100 + _MODE_SLOT[mode] * 10 + _PHASE_SLOT[phase]
    return random_prompts(n, settings.prompt_len, seed=seed)

