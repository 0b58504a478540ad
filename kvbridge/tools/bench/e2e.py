"""``kvbridge bench e2e``: kvbridge against vLLM's own NIXL connectors, end to end, in one run.

Every configuration gets its own fresh pair of real ``vllm serve`` engines (P pinned to core 0,
D to core 1, the tiny model of :mod:`kvbridge.tools.tiny_model`), runs the same seeded
workload, and is stopped before the next one starts (also on error or Ctrl-C):

==================  =========================================================================
``vllm-nixl-pull``  vLLM's ``NixlConnector``, its stock pull protocol (P leg with
                    ``max_tokens=1``, then D with P's returned params)
``vllm-nixl-push``  vLLM's ``NixlPushConnector``, its stock protocol (same ``X-Request-Id`` on
                    both legs, sent concurrently; D told P's engine id and side-channel port)
``kvbridge-shm``    ``KVBridgeConnector`` with ``backend: shm``: modes pull, push and auto
``kvbridge-nixl``   ``KVBridgeConnector`` with ``backend: nixl``: modes pull, push and auto
==================  =========================================================================

Workload per (configuration, mode): one warm-up request, then phase ``seq`` (N requests back to
back) and phase ``c8`` (waves of 8 concurrent requests); for kvbridge also ``proxy-seq``, the
same kind of sequential requests sent through the real kvbridge proxy
(:class:`~kvbridge.tools.proxies.ProxyThread`) so its overhead shows. Every request has a
fresh random-id prompt (no prefix-cache hit anywhere); the prompts depend only on the seed, the
mode slot (pull / push / auto) and the phase, so vLLM's pull and kvbridge's pull see the very same
prompts, and likewise for push. D's leg is streamed; greedy, ``ignore_eos``.

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
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import datetime
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.host.placement import fleet_cores
from kvbridge.tools import prom
from kvbridge.tools.engines import (
    EngineError,
    StreamResult,
    VllmServer,
    complete,
    free_port,
    output_token_ids,
    start_servers,
    stream_complete,
)
from kvbridge.tools.report import percentile, table

__all__ = [
    "CONFIG_NAMES",
    "BenchSettings",
    "RequestRecord",
    "PhaseResult",
    "parse_configs",
    "handoff_times",
    "beyond_wire",
    "handoff_breakdown",
    "request_steps",
    "parse_stat_line",
    "group_cpu_ticks",
    "cpu_seconds",
    "summarize",
    "add_ratios",
    "format_table",
    "workload_prompts",
    "engine_specs",
    "fleet_specs",
    "MAX_FLEET",
    "side_channel_port",
    "vllm_pull_params",
    "vllm_push_params",
    "Pair",
    "connect",
    "control_addresses",
    "dispatch",
    "kvbridge_prefill_params",
    "control_stats",
    "loadavg",
    "CpuMeter",
    "run_benchmark",
    "add_arguments",
    "cli_main",
]

log = logging.getLogger("kvbridge.tools.bench.e2e")

CONFIG_NAMES: tuple[str, ...] = ("vllm-nixl-pull", "vllm-nixl-push", "kvbridge-shm",
                                 "kvbridge-nixl")
BASELINE = "vllm-nixl-pull"
VLLM_PUSH_P_ENGINE = "prefill-engine-001"
VLLM_PUSH_D_ENGINE = "decode-engine-001"
_MODE_SLOT = {"pull": 0, "push": 1, "auto": 2}
_PHASE_SLOT = {"warmup": 0, "seq": 1, "conc": 2, "proxy-seq": 3}
_GREEDY = {"ignore_eos": True}
_XFER_METRIC = "vllm:nixl_xfer_time_seconds"

Timings = Mapping[str, Mapping[str, float]]


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
    from kvbridge.tools.cli import parse_names

    return parse_names(text, CONFIG_NAMES, "--configs", "configuration")


def handoff_times(p_timings: Timings, d_timings: Timings, transfer_ids: Sequence[str]) -> list[
        float]:
    """``D.first_step - P.kv_ready`` (seconds) for every transfer id both sides recorded."""
    out: list[float] = []
    for tid in transfer_ids:
        p = p_timings.get(tid) or {}
        d = d_timings.get(tid) or {}
        if "kv_ready" in p and "first_step" in d:
            out.append(d["first_step"] - p["kv_ready"])
    return out


#: Consecutive steps of a request, in the order they happen, with who records each (C: the
#: benchmark's client: dispatch, and the first token's arrival).
_STEPS: tuple[tuple[str, str], ...] = (
    ("C", "dispatch"), ("P", "kv_ready"), ("P", "ready_seen"), ("P", "write_posted"),
    ("P", "write_done"), ("D", "recv_done"), ("D", "recv_seen"), ("D", "first_step"),
    ("C", "first_token"),
)
"""P: ``kv_ready`` the forward wrote the KV, ``ready_seen`` the transfer loop took it,
``write_posted`` / ``write_done`` the WRITE (push); D: ``recv_done`` the transfer loop has the
KV, ``recv_seen`` vLLM's scheduler learned it, ``first_step`` the request was scheduled."""

PIN_HELP = ("restrict every process and thread of each engine to its core (P 0, D 1), not only "
            "vLLM's OpenMP threads, so one engine's API server and threads do not run on the "
            "other's core")
HANDOFF_BAR_MS = 2.0
"""The hand-off issue's bar: push hand-off minus wire time, p50, sequential."""


def beyond_wire(p_timings: Timings, d_timings: Timings, transfer_ids: Sequence[str]) -> list[
        float]:
    """Push hand-off minus its wire time, per transfer: ``(D.first_step - P.kv_ready) -
    (P.write_done - P.write_posted)`` (seconds), for transfers that recorded all four: the
    part of the hand-off that is waiting and bookkeeping, not moving bytes."""
    out: list[float] = []
    for tid in transfer_ids:
        p = p_timings.get(tid) or {}
        d = d_timings.get(tid) or {}
        if all(k in p for k in ("kv_ready", "write_posted", "write_done")) and "first_step" in d:
            out.append((d["first_step"] - p["kv_ready"]) - (p["write_done"] - p["write_posted"]))
    return out


def handoff_breakdown(p_timings: Timings, d_timings: Timings, transfer_ids: Sequence[str],
                      client: Timings | None = None) -> dict[str, float]:
    """Median seconds between consecutive recorded steps, e.g. ``kv_ready->recv_done``.

    Steps a transfer did not record (pull has no write_*) are skipped, so a pull gives
    ``kv_ready->recv_done`` and ``recv_done->first_step``; a push also splits the WRITE.
    *client* adds the client's ``dispatch`` and ``first_token`` (wall clock) per transfer id,
    so the steps add up to the TTFT.
    """
    gaps: dict[str, list[float]] = {}
    for tid in transfer_ids:
        sides = {"P": p_timings.get(tid) or {}, "D": d_timings.get(tid) or {},
                 "C": (client or {}).get(tid) or {}}
        seen = [(ev, sides[side][ev]) for side, ev in _STEPS if ev in sides[side]]
        for (a, ta), (b, tb) in zip(seen, seen[1:], strict=False):
            gaps.setdefault(f"{a}->{b}", []).append(tb - ta)
    return {k: statistics.median(v) for k, v in gaps.items()}


def request_steps(p_timings: Timings, d_timings: Timings, transfer_id: str,
                  t0_wall: float) -> dict[str, float]:
    """One transfer's engine events as seconds after dispatch, keyed ``P.kv_ready`` etc."""
    out: dict[str, float] = {}
    for side, timings in (("P", p_timings), ("D", d_timings)):
        for event, t in (timings.get(transfer_id) or {}).items():
            out[f"{side}.{event}"] = t - t0_wall
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def parse_stat_line(line: str) -> tuple[int, int]:
    """``/proc/<pid>/stat`` → (process group, utime + stime in clock ticks)."""
    rest = line[line.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
    return int(rest[2]), int(rest[11]) + int(rest[12])


def group_cpu_ticks(pgid: int) -> dict[int, int]:
    """CPU ticks used so far by every live process in process group *pgid*, by pid."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                group, ticks = parse_stat_line(f.read())
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if group == pgid:
            out[int(entry)] = ticks
    return out


def cpu_seconds(before: Mapping[int, int], after: Mapping[int, int]) -> float:
    """CPU seconds used between two :func:`group_cpu_ticks` snapshots (new pids count fully)."""
    ticks = sum(max(0, t - before.get(pid, 0)) for pid, t in after.items())
    return ticks / os.sysconf("SC_CLK_TCK")


def host_busy_ticks() -> int:
    """Busy CPU ticks of the whole host so far (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal


def self_ticks() -> int:
    """CPU ticks used so far by this process (the benchmark's client and proxies)."""
    with open("/proc/self/stat") as f:
        return parse_stat_line(f.read())[1]


class CpuMeter:
    """CPU seconds of P's and D's process groups, this process, and everything else."""

    def __init__(self, p_pgid: int, d_pgid: int) -> None:
        self.p_pgid, self.d_pgid = p_pgid, d_pgid
        self.p0, self.d0 = group_cpu_ticks(p_pgid), group_cpu_ticks(d_pgid)
        self.host0, self.self0 = host_busy_ticks(), self_ticks()

    def read(self) -> tuple[float, float, float, float]:
        """(P, D, this process, others) CPU seconds since construction."""
        p = cpu_seconds(self.p0, group_cpu_ticks(self.p_pgid))
        d = cpu_seconds(self.d0, group_cpu_ticks(self.d_pgid))
        tck = os.sysconf("SC_CLK_TCK")
        me = (self_ticks() - self.self0) / tck
        host = (host_busy_ticks() - self.host0) / tck
        return p, d, me, max(0.0, host - p - d - me)


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
        if mode == "auto" and chosen and set(chosen) != {"auto"}:
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
    from kvbridge.tools.tiny_model import random_prompts

    seed = settings.seed * 100 + _MODE_SLOT[mode] * 10 + _PHASE_SLOT[phase]
    return random_prompts(n, settings.prompt_len, seed=seed)


# -- engines -------------------------------------------------------------------------------------


def _kvbridge_connector(role: str, engine_id: str, backend: str) -> dict[str, Any]:
    return {"kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"backend": backend}}


def engine_specs(config: str, model: Path, log_dir: Path, engine_spin_ms: float = 2.0,
                 pin: bool = False) -> tuple[VllmServer, VllmServer]:
    """The (P, D) engines of *config*, not started: P on core 0, D on core 1 (vLLM's OpenMP
    threads; with *pin* every process and thread of each engine).

    kvbridge's engines get ``KVBRIDGE_ENGINE_SPIN_MS`` (its recommended setting on small hosts)
    unless *engine_spin_ms* is negative; vLLM's own connectors run as shipped.
    """
    env_p = {"VLLM_TARGET_DEVICE": "cpu"}
    env_d = {"VLLM_TARGET_DEVICE": "cpu"}
    if config in ("vllm-nixl-pull", "vllm-nixl-push"):
        connector = "NixlConnector" if config == "vllm-nixl-pull" else "NixlPushConnector"
        kv_p: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_producer",
                                "kv_buffer_device": "cpu"}
        kv_d: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_consumer",
                                "kv_buffer_device": "cpu"}
        if config == "vllm-nixl-push":
            kv_p["engine_id"] = VLLM_PUSH_P_ENGINE
            kv_d["engine_id"] = VLLM_PUSH_D_ENGINE
        p_port = free_port()
        d_port = free_port()
        while d_port == p_port:
            d_port = free_port()
        env_p["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(p_port)
        env_d["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(d_port)
    elif config in ("kvbridge-shm", "kvbridge-nixl"):
        backend = config.split("-", 1)[1]
        kv_p = _kvbridge_connector("kv_producer", f"bench-{backend}-P", backend)
        kv_d = _kvbridge_connector("kv_consumer", f"bench-{backend}-D", backend)
        if engine_spin_ms >= 0:
            spin = str(engine_spin_ms)
            env_p["KVBRIDGE_ENGINE_SPIN_MS"] = env_d["KVBRIDGE_ENGINE_SPIN_MS"] = spin
    else:
        raise ConfigError(f"unknown configuration {config!r}")
    args = ["--block-size", "32"]
    p = VllmServer(model, name=f"{config}-P", kv_transfer_config=kv_p, cpu_bind="0", env=env_p,
                   extra_args=args, log_path=log_dir / f"{config}-prefill.log", pin_cpus=pin)
    d = VllmServer(model, name=f"{config}-D", kv_transfer_config=kv_d, cpu_bind="1", env=env_d,
                   extra_args=args, log_path=log_dir / f"{config}-decode.log", pin_cpus=pin)
    return p, d


MAX_FLEET = 8
"""Most engines of one role :func:`fleet_specs` builds."""


def fleet_specs(config: str, model: Path, log_dir: Path, engine_spin_ms: float = 2.0,
                prefill: int = 1, decode: int = 1, pin: bool = False
                ) -> tuple[list[VllmServer], list[VllmServer]]:
    """The ``prefill`` P and ``decode`` D engines of a kvbridge *config*, not started.

    1P1D is :func:`engine_specs` unchanged (any config). A larger fleet (xPyD) is kvbridge's
    only, since vLLM's connectors are benchmarked behind a one-P-one-D stock proxy. P and D
    engines get disjoint cores of those this process may use (:func:`fleet_cores`: on two cores
    every P on the first, every D on the second; a P and a D confined to one core livelock in
    UCX's connection set-up), with engine ids and logs numbered per role. *pin*: each engine's
    whole process tree too (:func:`engine_specs`).
    """
    if not (1 <= prefill <= MAX_FLEET and 1 <= decode <= MAX_FLEET):
        raise ConfigError(f"a fleet has 1..{MAX_FLEET} engines per role, not {prefill}P{decode}D")
    if (prefill, decode) == (1, 1):
        p, d = engine_specs(config, model, log_dir, engine_spin_ms, pin)
        return [p], [d]
    if config not in ("kvbridge-shm", "kvbridge-nixl"):
        raise ConfigError(f"{config} runs 1P1D only (its stock proxy has one P and one D); "
                          f"{prefill}P{decode}D needs a kvbridge configuration")
    backend = config.split("-", 1)[1]
    env = {"VLLM_TARGET_DEVICE": "cpu"}
    if engine_spin_ms >= 0:
        env["KVBRIDGE_ENGINE_SPIN_MS"] = str(engine_spin_ms)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    cores = dict(zip("PD", fleet_cores(cpus, prefill, decode), strict=True))
    out: dict[str, list[VllmServer]] = {"P": [], "D": []}
    roles = [("P", "kv_producer", "prefill", i) for i in range(prefill)]
    roles += [("D", "kv_consumer", "decode", i) for i in range(decode)]
    for tag, kv_role, word, i in roles:
        kv = _kvbridge_connector(kv_role, f"bench-{backend}-{tag}{i}", backend)
        out[tag].append(VllmServer(
            model, name=f"{config}-{tag}{i}", kv_transfer_config=kv,
            cpu_bind=str(cores[tag][i]), env=dict(env), extra_args=["--block-size", "32"],
            log_path=log_dir / f"{config}-{word}{i}.log", pin_cpus=pin))  # fmt: skip
    return out["P"], out["D"]


def side_channel_port(server: VllmServer) -> int:
    """The NIXL side-channel port :func:`engine_specs` gave a vLLM-connector engine."""
    return int(server.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])


def _scrape(url: str, name: str, timeout: float = 5.0) -> tuple[float, float]:
    """(sum, count) of histogram *name* on one engine's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode("utf-8", "replace")
    return prom.total(text, name + "_sum"), prom.total(text, name + "_count")


def loadavg() -> str:
    """The host's 1, 5 and 15 minute load averages, as text."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# -- dispatch ------------------------------------------------------------------------------------


class _DecodeLoad:
    """Requests in flight at D, seen the way the proxy sees them: one
    :class:`~kvbridge.proxy.routing.Pool` of the pair's D, so that ``auto`` decides with the
    proxy's own :func:`~kvbridge.proxy.routing.decide` (the dispatcher's threads share it, under
    a lock)."""

    def __init__(self, d_url: str = "http://127.0.0.1:0") -> None:
        from kvbridge.proxy.routing import Pool, Role

        self._lock = threading.Lock()
        self.pool = Pool(Role.DECODE, [d_url])

    def choose(self, mode: str, headroom: int) -> tuple[str, bool]:
        """``(mode to run, reserved)``: ``auto`` becomes what the proxy would pick now; a push it
        picked is counted at once (``reserved``), so that concurrent decisions see it."""
        from kvbridge.proxy.routing import ProxyMode, decide

        if mode != "auto":
            return mode, False
        with self._lock:
            chosen = decide(ProxyMode.AUTO, self.pool, headroom).mode.value
            if chosen == "push":
                self.pool.engines[0].acquire()
            return chosen, chosen == "push"

    @contextlib.contextmanager
    def hold(self, reserved: bool = False) -> Iterator[None]:
        """Count a request at D for the block (*reserved*: already counted by :meth:`choose`)."""
        engine = self.pool.engines[0]
        if not reserved:
            with self._lock:
                engine.acquire()
        try:
            yield
        finally:
            with self._lock:
                engine.release()


@dataclass
class Pair:
    """A started engine pair and what the dispatchers need to know about it."""

    config: str
    p: VllmServer
    d: VllmServer
    settings: BenchSettings
    legs: cf.ThreadPoolExecutor
    p_ctl: str | None = None
    d_ctl: str | None = None
    probe: Any = None  # kvbridge.proxy.routing.ProbeInfo of P (kvbridge pairs)
    load: _DecodeLoad = field(default_factory=_DecodeLoad)

    @property
    def kvbridge(self) -> bool:
        return self.config.startswith("kvbridge")


def _stream_d(pair: Pair, url: str, prompt: list[int], params: Mapping[str, Any] | None,
              t0: float, rec: RequestRecord, headers: Mapping[str, str] | None = None) -> None:
    t_send = time.perf_counter()
    if rec.t0_wall is None:
        rec.t0_wall = time.time() - (t_send - t0)
    res: StreamResult = stream_complete(url, prompt, pair.settings.max_tokens, params, _GREEDY,
                                        timeout=pair.settings.request_timeout, headers=headers)
    if res.ttft is None:
        raise EngineError(f"D stream from {url} produced no token")
    rec.ttft = (t_send - t0) + res.ttft
    rec.tpot = res.tpot
    rec.total = (t_send - t0) + res.total
    rec.token_ids = res.token_ids
    if len(res.token_ids) != pair.settings.max_tokens:
        raise EngineError(f"D returned {len(res.token_ids)} tokens, expected "
                          f"{pair.settings.max_tokens} (finish_reason {res.finish_reason})")
    rec.ok = True


def _p_leg(pair: Pair, prompt: list[int], params: Mapping[str, Any],
           headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    return complete(pair.p.url, prompt, 1, params, timeout=pair.settings.request_timeout,
                    headers=headers)


def vllm_pull_params() -> dict[str, Any]:
    """P's ``kv_transfer_params`` in vLLM's stock NixlConnector protocol (the P leg, max_tokens=1);
    D then gets whatever ``kv_transfer_params`` P answers."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def vllm_push_params(rid: str, p_side_channel_port: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P's, D's) ``kv_transfer_params`` of one request in vLLM's stock NixlPushConnector
    protocol: both legs are sent concurrently with ``X-Request-Id: rid``; D is told P's engine id
    (:data:`VLLM_PUSH_P_ENGINE`) and side-channel port, and P's request id for *rid*."""
    transfer_id = "xfer-" + rid
    p_params = {**vllm_pull_params(), "transfer_id": transfer_id}
    d_params = {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": VLLM_PUSH_P_ENGINE, "remote_host": "localhost",
                "remote_port": p_side_channel_port, "tp_size": 1, "pp_size": 1,
                "remote_request_id": f"cmpl-{rid}-0", "transfer_id": transfer_id}
    return p_params, d_params


def kvbridge_prefill_params(transfer_id: str, mode: str) -> dict[str, Any]:
    """The P leg's ``kv_transfer_params`` the kvbridge proxy would send in *mode*."""
    from kvbridge.proxy.routing import ProxyMode, prefill_body

    params: dict[str, Any] = prefill_body({"prompt": []}, transfer_id,
                                          ProxyMode(mode))["kv_transfer_params"]
    return params


def _pull(pair: Pair, prompt: list[int], p_params: Mapping[str, Any],
          rec: RequestRecord) -> None:
    t0 = time.perf_counter()
    resp = _p_leg(pair, prompt, p_params)
    d_params = resp.get("kv_transfer_params")
    if not isinstance(d_params, dict):
        raise EngineError(f"P returned no kv_transfer_params: {str(resp)[:200]}")
    with pair.load.hold():
        _stream_d(pair, pair.d.url, prompt, d_params, t0, rec)


def _concurrent_legs(pair: Pair, prompt: list[int], p_params: Mapping[str, Any],
                     d_params: Mapping[str, Any], rec: RequestRecord,
                     headers: Mapping[str, str] | None = None) -> None:
    t0 = time.perf_counter()
    p_fut = pair.legs.submit(_p_leg, pair, prompt, p_params, headers)
    try:
        _stream_d(pair, pair.d.url, prompt, d_params, t0, rec, headers)
    finally:
        # Bounded by the P leg's own timeout; its failure fails the request even if D answered.
        p_fut.result(timeout=pair.settings.request_timeout + 10)


def dispatch(pair: Pair, mode: str, prompt: list[int], index: int) -> RequestRecord:
    """Run one request of *mode* on *pair* and return its record (never raises)."""
    rec = RequestRecord(index=index, mode=mode, prompt=list(prompt))
    try:
        if pair.config == "vllm-nixl-pull":
            _pull(pair, prompt, vllm_pull_params(), rec)
        elif pair.config == "vllm-nixl-push":
            rid = uuid.uuid4().hex
            p_params, d_params = vllm_push_params(rid, side_channel_port(pair.p))
            rec.transfer_id = p_params["transfer_id"]
            _concurrent_legs(pair, prompt, p_params, d_params, rec, {"X-Request-Id": rid})
        else:
            from kvbridge.proxy.routing import new_transfer_id, push_decode_params

            rec.transfer_id = new_transfer_id()
            chosen, reserved = pair.load.choose(mode, pair.settings.push_headroom)
            rec.mode = chosen
            if chosen == "pull":
                _pull(pair, prompt, kvbridge_prefill_params(rec.transfer_id, "pull"), rec)
            else:
                with pair.load.hold(reserved):
                    _concurrent_legs(pair, prompt, kvbridge_prefill_params(rec.transfer_id, "push"),
                                     push_decode_params(pair.probe, rec.transfer_id), rec)
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.ok = False
        rec.error = f"{type(exc).__name__}: {exc}"[:500]
    return rec


def via_proxy(pair: Pair, url: str, mode: str, prompt: list[int], index: int) -> RequestRecord:
    """One streamed request through a kvbridge proxy at *url* (never raises)."""
    rec = RequestRecord(index=index, mode=mode, prompt=list(prompt))
    try:
        _stream_d(pair, url, prompt, None, time.perf_counter(), rec)
    except Exception as exc:  # noqa: BLE001
        rec.ok = False
        rec.error = f"{type(exc).__name__}: {exc}"[:500]
    return rec


# -- phases --------------------------------------------------------------------------------------


def control_stats(address: str) -> Any:
    """One engine rank's :class:`~kvbridge.messages.StatsReply` (counters and timings)."""
    from kvbridge.tools.engines import stats_reply

    return stats_reply(address, 10.0)


def control_addresses(p_url: str, d_url: str, timeout: float) -> tuple[str, str, Any]:
    """Two started kvbridge engines: (P's control address, D's, P's parsed probe answer).
    Raises EngineError when an engine does not answer."""
    from kvbridge.proxy.routing import parse_probe

    p_probe = _control_probe(p_url, timeout)
    d_probe = _control_probe(d_url, timeout)
    return (f"tcp://{p_probe['remote_host']}:{p_probe['remote_port']}",
            f"tcp://{d_probe['remote_host']}:{d_probe['remote_port']}", parse_probe(p_probe))


def connect(pair: Pair) -> None:
    """A started kvbridge pair: learn P's probe answer (for push dispatch) and both control
    addresses (for the engines' timings). Raises EngineError when an engine does not answer."""
    pair.p_ctl, pair.d_ctl, pair.probe = control_addresses(pair.p.url, pair.d.url,
                                                           pair.settings.request_timeout)


def _control_probe(url: str, timeout: float) -> dict[str, Any]:
    from kvbridge.params import probe_request

    params = complete(url, [1], 1, probe_request(), timeout=timeout)["kv_transfer_params"]
    if not isinstance(params, dict) or "remote_port" not in params:
        raise EngineError(f"{url} did not answer the kvbridge probe: {params!r}")
    return params


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
                                                extra=_GREEDY,
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
    return ["pull", "push", "auto"]


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
            from kvbridge.tools.proxies import ProxyThread

            connect(pair)
            proxies = ProxyThread([p.url], [d.url],
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
    from kvbridge.tools.tiny_model import build_tiny_model

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
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--proxy-requests", type=int, default=d.proxy_requests,
                   help="kvbridge: sequential requests through the kvbridge proxy per mode")
    p.add_argument("--check", type=int, default=d.check,
                   help="requests per phase compared with single-engine greedy on P")
    p.add_argument("--push-headroom", type=int, default=d.push_headroom,
                   help="auto: push while fewer than N requests are in flight at D")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.add_argument("--start-timeout", type=float, default=d.start_timeout)
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
