"""``kvbridge bench offload``: TTFT of one long prompt served from each offload tier vs recompute.

One real ``vllm serve`` engine at a time (``KVBridgeConnector``, ``kv_both``, backend ``shm``;
the ~100 M-parameter bench model of :func:`kvbridge.tools.tiny_model.build_bench_model`), one
engine per row, each started with the offload tiers of its row and stopped before the next
(also on error or Ctrl-C):

==================  ===========================================================================
``recompute``       no tier: the prompt is computed every time (the baseline)
``dram``            ``tiers: [dram]``
``disk``            ``tiers: [disk]`` (a fresh directory; no DRAM tier above it, so every hit
                    is read from the files — which the OS page cache may still hold)
``disk_cold``       the same engine as ``disk``; before every repetition the tier's files are
                    dropped from the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``)
``lmcache``         ``tiers: [lmcache]``
``mooncake_store``  ``tiers: [mooncake_store]`` against a local ``mooncake_master``
                    (:class:`~kvbridge.tools.mooncake_master.MooncakeMaster`)
==================  ===========================================================================

A row whose tier cannot load here (package missing, placeholder, no master binary) stays in the
table as ``not available: <reason>``.

Per engine: one warm-up request (another prompt of the same length), then the *cold* request
(the bench prompt, computed: the tier is empty) whose output is the row's reference; the bench
waits until the tier has stored the prompt's blocks; then ``--reps`` repetitions of
``POST /reset_prefix_cache`` + the same prompt, streamed, so vLLM's own prefix cache never
serves it and any reuse comes from the tier. Every repetition records:

- TTFT (client side, to the first streamed token) and vLLM's own queue and prefill times
  (``/metrics`` histogram deltas: queue includes waiting for a tier lookup's answer);
- the engine counters' deltas (:func:`~kvbridge.tools.engines.engine_stats`):
  ``offload_hit_blocks_<tier>`` and ``offload_loaded_blocks`` must both equal the usable
  blocks of the prompt (``(len - 1) // block_size``; vLLM computes at least one token) and
  ``offload_load_failed`` must stay 0 — column ``source``;
- the output token ids, which must equal the recompute row's (or, without that row, the row's
  own cold output) — column ``out``.

The table reports median and minimum TTFT and the median's ratio to recompute's median.
Before every engine start the bench waits (bounded) until no ``vllm_serve`` process of someone
else runs on the host, and notes any that appeared during a row. Blocking; for the command
line. Numbers from small shared hosts are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools.report import table

__all__ = [
    "ROW_NAMES",
    "DEFAULT_ROWS",
    "ENGINE_OF",
    "BenchSettings",
    "Rep",
    "RowResult",
    "parse_rows",
    "parse_tier_options",
    "usable_blocks",
    "median_min",
    "summarize",
    "add_ratios",
    "verdicts",
    "format_table",
    "format_report",
    "offload_config",
    "row_unavailable",
    "foreign_engines",
    "run_benchmark",
    "add_arguments",
    "settings_from_args",
    "cli_main",
]

log = logging.getLogger("kvbridge.tools.bench.offload")

ROW_NAMES: tuple[str, ...] = ("recompute", "dram", "disk", "disk_cold", "lmcache",
                              "mooncake_store")
DEFAULT_ROWS = ROW_NAMES
BASELINE = "recompute"
#: rows measured on another row's engine (no engine of their own)
ENGINE_OF: dict[str, str] = {"disk_cold": "disk"}
#: the offload tier each row reads from (None: no tier)
TIER_OF: dict[str, str | None] = {"recompute": None, "dram": "dram", "disk": "disk",
                                  "disk_cold": "disk", "lmcache": "lmcache",
                                  "mooncake_store": "mooncake_store"}
#: the issue's aims: median TTFT at most this fraction of recompute's
AIMS: dict[str, float] = {"dram": 0.2, "disk": 0.5, "disk_cold": 0.5}
SERVE_MODULE = "kvbridge.integrations.vllm_serve"
_GREEDY = {"ignore_eos": True}
_POKE = (5, 6, 7)
_METRICS = {"queue": "vllm:request_queue_time_seconds",
            "prefill": "vllm:request_prefill_time_seconds",
            "ttft_server": "vllm:time_to_first_token_seconds"}

Progress = Callable[[str], None]


# -- settings and results ------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    """Everything one run needs; the CLI flags map one to one (``--quick`` changes defaults)."""

    rows: tuple[str, ...] = DEFAULT_ROWS
    reps: int = 5
    prompt_len: int = 3000
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
    unavailable: str | None = None
    error: str | None = None
    cold: Rep | None = None
    reps: list[Rep] = field(default_factory=list)
    expected_blocks: int = 0
    reference: list[int] | None = None
    reference_from: str = ""
    stored_blocks: int | None = None
    notes: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)


# -- pure helpers (unit-tested) ------------------------------------------------------------------


def parse_rows(text: str) -> tuple[str, ...]:
    """``"dram, disk"`` → the rows, validated, in the table's order; ``all`` → every row."""
    from kvbridge.tools.cli import parse_names

    chosen = set(parse_names(text, ROW_NAMES, "--rows", "row"))
    return tuple(r for r in ROW_NAMES if r in chosen)


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
    checked = [r for r in ok if res.reference is not None]
    hit_key = f"offload_hit_blocks_{tier}" if tier else "offload_loaded_blocks"
    return {
        "row": res.row, "tiers": res.tiers, "unavailable": res.unavailable, "error": res.error,
        "reps": len(res.reps), "ok": len(ok),
        "ttft_median_s": med, "ttft_min_s": low,
        "ttft_cold_s": res.cold.ttft if res.cold is not None else None,
        "queue_mean_s": _mean([r.queue for r in ok]),
        "prefill_mean_s": _mean([r.prefill for r in ok]),
        "expected_blocks": res.expected_blocks if tier else 0,
        "hit_blocks": [r.deltas.get(hit_key, 0) for r in ok],
        "source_ok": (all(source_ok(res.row, r, res.expected_blocks) for r in ok)
                      if ok else None),
        "output_ok": (all(r.token_ids == res.reference for r in checked) if checked else None),
        "reference_from": res.reference_from,
        "stored_blocks": res.stored_blocks,
        "notes": list(res.notes), "engine": dict(res.engine),
        "cold": res.cold.to_dict() if res.cold is not None else None,
        "records": [r.to_dict() for r in res.reps],
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``ratio`` (median TTFT / recompute's) and ``ratio_min`` (min / min), in place."""
    base = next((r for r in rows if r["row"] == BASELINE), None)
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
        if aim is None:
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
            r["row"], "+".join(r.get("tiers") or []) or "-",
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
    parts += verdicts(report["rows"])
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


# -- engines -------------------------------------------------------------------------------------


def offload_config(row: str, settings: BenchSettings, disk_dir: Path,
                   master: Any = None) -> dict[str, Any] | None:
    """The ``offload`` object of *row*'s engine (None: no tiers)."""
    tier = TIER_OF[row]
    if tier is None:
        return None
    spec: dict[str, Any] = {"name": tier}
    if tier == "dram":
        spec["capacity_bytes"] = "2GiB"
    elif tier == "disk":
        spec.update(path=str(disk_dir), capacity_bytes="4GiB")
    elif tier == "lmcache":
        spec["capacity_bytes"] = "2GiB"
    elif tier == "mooncake_store":
        spec["global_segment_bytes"] = 2 << 30
        if master is not None:
            spec.update(master=master.master_address, metadata_url=master.metadata_url)
    spec.update(settings.tier_options.get(ENGINE_OF.get(row, row), {}))
    return {"tiers": [spec]}


def row_unavailable(row: str) -> str | None:
    """Why *row*'s tier cannot run on this host, or None (imports the tier's module)."""
    tier = TIER_OF[row]
    if tier is None:
        return None
    from kvbridge import registry
    from kvbridge.errors import KVBridgeError

    try:
        registry.load_tier_class(tier)
    except KVBridgeError as exc:
        return str(exc).splitlines()[0]
    if tier == "mooncake_store":
        try:
            from kvbridge.tools.mooncake_master import skip_reason
        except ImportError as exc:
            return f"kvbridge.tools.mooncake_master cannot be imported: {exc}"
        return skip_reason()
    return None


def foreign_engines(own_pgids: Sequence[int] = ()) -> list[int]:
    """Pids of ``vllm_serve`` processes on this host not in process groups *own_pgids*
    (what ``pgrep -f kvbridge.integrations.vllm_serve`` finds, less ours)."""
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            if SERVE_MODULE.encode() not in cmd:
                continue
            if os.getpgid(int(entry)) in own_pgids:
                continue
        except OSError:
            continue
        out.append(int(entry))
    return sorted(out)


def wait_quiet(settings: BenchSettings, say: Progress,
               own_pgids: Sequence[int] = ()) -> float:
    """Wait (bounded by ``quiet_wait_s``) until :func:`foreign_engines` is empty; seconds."""
    t0 = time.monotonic()
    others = foreign_engines(own_pgids)
    while others and time.monotonic() - t0 < settings.quiet_wait_s:
        say(f"other engines running (pids {' '.join(map(str, others))}); waiting "
            f"{settings.quiet_poll_s:.0f} s (waited {time.monotonic() - t0:.0f} of "
            f"{settings.quiet_wait_s:.0f} s)")
        time.sleep(settings.quiet_poll_s)
        others = foreign_engines(own_pgids)
    if others:
        say(f"still other engines after {settings.quiet_wait_s:.0f} s: going on anyway")
    return time.monotonic() - t0


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _metrics(url: str) -> dict[str, tuple[float, float]]:
    from kvbridge.tools import prom

    with urllib.request.urlopen(url + "/metrics", timeout=10.0) as r:
        text = r.read().decode("utf-8", "replace")
    return {k: (prom.total(text, n + "_sum"), prom.total(text, n + "_count"))
            for k, n in _METRICS.items()}


def _metric_delta(before: Mapping[str, tuple[float, float]],
                  after: Mapping[str, tuple[float, float]], key: str) -> float | None:
    ds = after[key][0] - before[key][0]
    dc = after[key][1] - before[key][1]
    return ds / dc if dc > 0 else None


def drop_page_cache(root: Path) -> int:
    """``fsync`` + ``POSIX_FADV_DONTNEED`` every file under *root*; how many files."""
    n = 0
    for path in root.rglob("*.kvb"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


class _Engine:
    """One running engine of the bench and what the rows need from it."""

    def __init__(self, server: Any, ctl: str) -> None:
        self.server = server
        self.ctl = ctl

    @property
    def url(self) -> str:
        return str(self.server.url)

    def stats(self) -> dict[str, int]:
        from kvbridge.tools.engines import engine_stats

        return engine_stats(self.ctl)

    def poke(self) -> None:
        """A 3-token, 1-token-output request (no full block: no lookup, no store). Counters
        are current without it since the manager delivers them after every job; the poke is
        kept as a cheap barrier so a settle never waits on an engine that is asleep."""
        from kvbridge.tools.engines import complete

        complete(self.url, list(_POKE), 1, extra=_GREEDY, timeout=60.0)

    def settle(self, key: str | None, at_least: int, timeout: float) -> dict[str, int]:
        """Counters once ``key`` reached ``at_least`` (poking the engine meanwhile); with
        ``key`` None, the counters after one poke."""
        deadline = time.monotonic() + timeout
        self.poke()
        stats = self.stats()
        while key is not None and stats.get(key, 0) < at_least and time.monotonic() < deadline:
            time.sleep(0.2)
            self.poke()
            stats = self.stats()
        return stats


@contextlib.contextmanager
def _engine(row: str, settings: BenchSettings, model: Path, model_cfg: Mapping[str, Any],
            offload: dict[str, Any] | None, log_dir: Path, say: Progress,
            info: dict[str, Any]) -> Iterator[_Engine]:
    from kvbridge.tools.engines import VllmServer, free_port

    ctl_port = free_port()
    extra: dict[str, Any] = {"backend": "shm", "side_channel_port": ctl_port}
    if offload is not None:
        extra["offload"] = offload
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both",
          "engine_id": f"bench-offload-{row}", "kv_connector_extra_config": extra}
    per_token = (model_cfg["num_hidden_layers"] * 2 * model_cfg["num_key_value_heads"]
                 * model_cfg["head_dim"] * 4)
    mml = settings.max_model_len
    kv_bytes = max(256 << 20, 4 * mml * per_token)
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if settings.engine_spin_ms >= 0:
        env["KVBRIDGE_ENGINE_SPIN_MS"] = f"{settings.engine_spin_ms:g}"
    log_path = log_dir / f"engine-{row}.log"
    server = VllmServer(model, name=f"offload-{row}", port=free_port(), kv_transfer_config=kv,
                        cpu_bind=settings.cpu_bind, env=env, log_path=log_path,
                        extra_args=["--block-size", str(settings.block_size),
                                    "--max-model-len", str(mml),
                                    "--max-num-batched-tokens", str(mml),
                                    "--max-num-seqs", "4",
                                    "--kv-cache-memory-bytes", str(kv_bytes)])
    info["log"] = str(log_path)
    t0 = time.monotonic()
    try:
        say(f"{row}: starting engine (tiers {offload['tiers'] if offload else 'none'}; "
            f"log {log_path})")
        server.start().wait_ready(settings.start_timeout)
        info["ready_s"] = round(time.monotonic() - t0, 1)
        say(f"{row}: engine ready after {info['ready_s']} s")
        yield _Engine(server, f"tcp://127.0.0.1:{ctl_port}")
    finally:
        server.stop()
        info["engine_s"] = round(time.monotonic() - t0, 1)


def _request(eng: _Engine, prompt: list[int], settings: BenchSettings, index: int,
             expect: tuple[str, int] | None = None) -> Rep:
    """One streamed request with counter and metric deltas around it."""
    from kvbridge.tools.engines import EngineError, stream_complete

    rep = Rep(index)
    try:
        before, m0 = eng.stats(), _metrics(eng.url)
        res = stream_complete(eng.url, prompt, settings.max_tokens, extra=_GREEDY,
                              timeout=settings.request_timeout)
        m1 = _metrics(eng.url)
        # stores are written behind: wait (briefly) until the expected counter moved
        after = (eng.settle(expect[0], before.get(expect[0], 0) + expect[1], 5.0)
                 if expect else eng.settle(None, 0, 0.0))
    except (EngineError, OSError) as exc:
        rep.error = f"{type(exc).__name__}: {exc}"
        return rep
    rep.ok = res.ttft is not None
    rep.ttft, rep.total, rep.token_ids = res.ttft, res.total, list(res.token_ids)
    rep.queue = _metric_delta(m0, m1, "queue")
    rep.prefill = _metric_delta(m0, m1, "prefill")
    rep.deltas = {k: after.get(k, 0) - before.get(k, 0)
                  for k in sorted(set(after) | set(before))
                  if k.startswith("offload_") and after.get(k, 0) != before.get(k, 0)}
    if not rep.ok:
        rep.error = "no token streamed"
    return rep


def _measure(row: str, eng: _Engine, settings: BenchSettings, prompt: list[int],
             res: RowResult, say: Progress) -> None:
    """The repetitions of one row on a running engine (after its cold request)."""
    from kvbridge.tools.engines import reset_prefix_cache

    tier = TIER_OF[row]
    disk_dir = res.engine.get("disk_dir")
    expect = (f"offload_hit_blocks_{tier}", res.expected_blocks) if tier else None
    for i in range(settings.reps):
        reset_prefix_cache(eng.url)
        if row == "disk_cold" and disk_dir:
            n = drop_page_cache(Path(disk_dir))
            if i == 0:
                res.notes.append(f"page cache of {n} files dropped before each rep")
        time.sleep(0.3)  # let the previous request's store bookkeeping finish
        rep = _request(eng, prompt, settings, i, expect)
        res.reps.append(rep)
        say(f"{row}: rep {i + 1}/{settings.reps}: "
            + (f"TTFT {rep.ttft:.3f} s, counters {rep.deltas}" if rep.ok
               else f"failed: {rep.error}"))


def run_engine(engine_row: str, rows: Sequence[str], settings: BenchSettings, model: Path,
               model_cfg: Mapping[str, Any], prompts: Sequence[list[int]], work: Path,
               log_dir: Path, say: Progress) -> list[RowResult]:
    """Start *engine_row*'s engine, measure every row of *rows* on it, stop it."""
    from kvbridge.tools.engines import reset_prefix_cache

    prompt, warm = prompts
    expected = usable_blocks(len(prompt), settings.block_size)
    results = [RowResult(r, expected_blocks=expected) for r in rows]
    info: dict[str, Any] = {"loadavg_start": _loadavg()}
    disk_dir = work / f"disk-{engine_row}"
    info["disk_dir"] = str(disk_dir)
    master: Any = None
    t0 = time.monotonic()
    try:
        if TIER_OF[engine_row] == "mooncake_store":
            from kvbridge.tools.mooncake_master import MooncakeMaster

            master = MooncakeMaster().start()
            info["mooncake_master"] = master.master_address
        offload = offload_config(engine_row, settings, disk_dir, master)
        for r in results:
            r.tiers = [t["name"] for t in offload["tiers"]] if offload else []
        with _engine(engine_row, settings, model, model_cfg, offload, log_dir, say,
                     info) as eng:
            tier = TIER_OF[engine_row]
            say(f"{engine_row}: warm-up request ({len(warm)} tokens, another prompt)")
            w = _request(eng, warm, settings, -1)
            if not w.ok:
                raise RuntimeError(f"warm-up failed: {w.error}")
            stored_key = f"offload_stored_blocks_{tier}"
            full = len(prompt) // settings.block_size
            if tier:  # the warm-up prompt's store first, so it is not counted as the cold's
                eng.settle(stored_key, full, settings.settle_timeout)
            reset_prefix_cache(eng.url)
            base = eng.stats().get(stored_key, 0) if tier else 0
            cold = _request(eng, prompt, settings, 0)
            if not cold.ok:
                raise RuntimeError(f"cold request failed: {cold.error}")
            say(f"{engine_row}: cold (computed) TTFT {cold.ttft:.3f} s")
            stored = None
            if tier:
                stats = eng.settle(stored_key, base + full, settings.settle_timeout)
                stored = stats.get(stored_key, 0) - base
                if stored < full:
                    say(f"{engine_row}: only {stored} of {full} blocks stored in "
                        f"{settings.settle_timeout:.0f} s")
            for r in results:
                r.cold, r.stored_blocks, r.engine = cold, stored, info
                _measure(r.row, eng, settings, prompt, r, say)
    except Exception as exc:  # noqa: BLE001 - report the row as failed, go on
        for r in results:
            if not r.reps:
                r.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        say(f"{engine_row}: FAILED: {exc}")
    finally:
        if master is not None:
            master.stop()
        info["loadavg_end"] = _loadavg()
        info["elapsed_s"] = round(time.monotonic() - t0, 1)
        for r in results:
            r.engine = info
    return results


# -- the whole run -------------------------------------------------------------------------------


def _model(settings: BenchSettings) -> tuple[Path, dict[str, Any], int, str]:
    from kvbridge.tools import tiny_model as tm

    if settings.quick:
        spec = tm.tiny_model_spec()
        path = tm.build_tiny_model(settings.model_dir)
        name = "tiny-qwen3"
    else:
        spec = tm.bench_model_spec()
        path = tm.build_bench_model(settings.model_dir)
        name = "bench-qwen3"
    return path, spec["config"], tm.spec_param_count(spec), name


def _prompts(settings: BenchSettings) -> list[list[int]]:
    from kvbridge.tools import tiny_model as tm

    if settings.quick:
        return tm.random_prompts(2, settings.prompt_len, settings.seed)
    return tm.bench_prompts(2, settings.prompt_len, settings.seed)


def run_benchmark(settings: BenchSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Run every row of *settings*, one engine at a time; return the JSON-able report."""
    say: Progress = progress or (lambda msg: log.info("%s", msg))
    t_start = time.monotonic()
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-bench-offload-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvbridge-bench-offload-work-",
                                 dir=str(settings.work_dir) if settings.work_dir else None))
    model, cfg, params, name = _model(settings)
    prompts = _prompts(settings)
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    expected = usable_blocks(settings.prompt_len, settings.block_size)
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "loadavg_start": _loadavg()},
        "model": {"name": name, "path": str(model), "params": params,
                  "kv_bytes_per_token": per_token},
        "settings": {k: (str(v) if isinstance(v, Path) else v)
                     for k, v in vars(settings).items()},
        "expected_blocks": expected,
        "prompt_kv_bytes": expected * settings.block_size * per_token,
        "log_dir": str(log_dir), "foreign_waits": {}, "rows": [],
    }
    results: dict[str, RowResult] = {}
    try:
        engines: dict[str, list[str]] = {}
        for row in settings.rows:
            engines.setdefault(ENGINE_OF.get(row, row), []).append(row)
        for engine_row, rows in engines.items():
            reason = row_unavailable(engine_row)
            if reason:
                say(f"{engine_row}: not available: {reason}")
                for r in rows:
                    results[r] = RowResult(r, tiers=[str(TIER_OF[r])], unavailable=reason)
                continue
            waited = wait_quiet(settings, say)
            if waited >= 1.0:
                report["foreign_waits"][engine_row] = round(waited, 1)
            for res in run_engine(engine_row, rows, settings, model, cfg, prompts, work,
                                  log_dir, say):
                results[res.row] = res
            others = foreign_engines()
            if others:
                for r in rows:
                    results[r].notes.append(f"other engines ran meanwhile: {others}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results.get(BASELINE)
    ref = base.cold.token_ids if base is not None and base.cold is not None and base.cold.ok \
        else None
    for res in results.values():
        if ref is not None:
            res.reference, res.reference_from = ref, "recompute's output"
        elif res.cold is not None and res.cold.ok:
            res.reference, res.reference_from = res.cold.token_ids, "the row's own cold output"
    report["reference_from"] = ("recompute's first output" if ref is not None
                                else "each row's own cold output")
    rows_out = [summarize(results[r]) for r in settings.rows if r in results]
    add_ratios(rows_out)
    report["rows"] = rows_out
    report["verdicts"] = verdicts(rows_out)
    report["host"]["loadavg_end"] = _loadavg()
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return report


# -- command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvbridge bench offload`` flags (defaults: the full run; ``--quick`` a smoke run)."""
    d, q = BenchSettings(), BenchSettings.quick_defaults()
    p.add_argument("--rows", default="all",
                   help=f"comma-separated subset of {','.join(ROW_NAMES)} (default: all)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: the tiny model, --prompt-len {q.prompt_len}, --reps "
                   f"{q.reps}, --block-size {q.block_size} (flags given still win)")
    p.add_argument("--reps", type=int, default=None,
                   help=f"measured repetitions per row (default {d.reps})")
    p.add_argument("--prompt-len", type=int, default=None,
                   help=f"prompt tokens (default {d.prompt_len})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--block-size", type=int, default=None,
                   help=f"vLLM --block-size = offload chunk (default {d.block_size}, vLLM's CPU "
                   "default)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts")
    p.add_argument("--tier-options", action="append", default=[], metavar="ROW=JSON",
                   help="extra options of a row's tier, e.g. lmcache='{\"disk_path\": \"/x\"}' "
                   "(repeatable)")
    p.add_argument("--cpu-bind", default=d.cpu_bind,
                   help="VLLM_CPU_OMP_THREADS_BIND of the engines ('' : unset)")
    p.add_argument("--engine-spin-ms", type=float, default=d.engine_spin_ms,
                   help="KVBRIDGE_ENGINE_SPIN_MS (negative: vLLM default)")
    p.add_argument("--request-timeout", type=float, default=None)
    p.add_argument("--start-timeout", type=float, default=d.start_timeout)
    p.add_argument("--settle-timeout", type=float, default=d.settle_timeout,
                   help="seconds to wait for the tier to store the prompt after the cold run")
    p.add_argument("--quiet-wait", type=float, default=d.quiet_wait_s,
                   help="before each engine, wait at most this long for other people's "
                   "vllm_serve processes to end (0: do not wait)")
    p.add_argument("--quiet-poll", type=float, default=d.quiet_poll_s)
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: a temp dir)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="parent of the disk tier's temporary directory (default: $TMPDIR)")
    p.add_argument("--model-dir", type=Path, default=None, help="model directory")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the JSON report here")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Validate the parsed flags into :class:`BenchSettings` (ConfigError names a bad one)."""
    base = BenchSettings.quick_defaults() if args.quick else BenchSettings()
    chosen = {k: getattr(args, k) for k in ("reps", "prompt_len", "block_size",
                                             "request_timeout")
              if getattr(args, k) is not None}
    s = replace(base, rows=parse_rows(args.rows), max_tokens=args.max_tokens, seed=args.seed,
                tier_options=parse_tier_options(args.tier_options),
                cpu_bind=args.cpu_bind or None, engine_spin_ms=args.engine_spin_ms,
                start_timeout=args.start_timeout, settle_timeout=args.settle_timeout,
                quiet_wait_s=args.quiet_wait, quiet_poll_s=args.quiet_poll,
                log_dir=args.log_dir, work_dir=args.work_dir, model_dir=args.model_dir,
                **chosen)
    for name in ("reps", "max_tokens", "block_size"):
        if getattr(s, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if s.prompt_len < 2 * s.block_size:
        raise ConfigError(f"--prompt-len must be at least two blocks ({2 * s.block_size} "
                          f"tokens with --block-size {s.block_size})")
    limit = 4096 if s.quick else 8192  # the models' max_position_embeddings
    if s.max_model_len > limit:
        raise ConfigError(f"--prompt-len {s.prompt_len} + --max-tokens {s.max_tokens} does not "
                          f"fit the model's {limit} positions")
    if s.quiet_poll_s <= 0:
        raise ConfigError("--quiet-poll must be > 0")
    return s


def cli_main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    report = run_benchmark(settings, progress)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    return 0
