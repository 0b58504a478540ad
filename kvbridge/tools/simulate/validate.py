"""Simulated vs measured: replay a ``kvbridge bench serve`` results file through the model.

For every row of the results (one setup at one rate) whose setup the profile models (by default
the ``kvbridge-pull|push|auto|headroom`` setups; in a results file of version 1, written before
``auto`` became the planner, ``kvbridge-auto`` is simulated as ``headroom``, what it ran), the
same workload is simulated: ``num_prompts`` arrivals
at the row's rate, ``input_len``-token prompts, ``output_len`` output tokens, the fleet shape the
file records (``settings.prefill_engines`` / ``decode_engines``, 1P1D when absent) and the
proxy's ``push_headroom``. A row that records its ``vllm bench serve --seed`` (every row
``kvbridge bench serve`` writes) is replayed once with the very arrival times that run had
(:func:`~kvbridge.tools.simulate.workload.vllm_arrivals`): the model is deterministic, so one run is
the comparison. A row without a seed is simulated ``repeats`` times with Poisson arrivals of
different seeds, and each percentile is the median over those runs. Each row then carries
measured and simulated TTFT p50/p99 and TPOT p50/p99 and their ratio (simulated / measured).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools.simulate.profile import Profile
from kvbridge.tools.simulate.sizing import Fleetspec, run_one
from kvbridge.tools.simulate.workload import Lengths, Workload

__all__ = ["RESULTS_KIND", "METRICS", "ValidationRow", "load_results", "validate",
           "within", "setup_mode"]

RESULTS_KIND = "kvbridge-bench-serve"
#: (metric, key) pairs compared, as named in bench serve's rows (``ttft_p50`` ...)
METRICS: tuple[tuple[str, str], ...] = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"),
                                        ("tpot", "p99"))
_MAX_BYTES = 16 << 20


@dataclass(frozen=True)
class ValidationRow:
    """One (setup, rate): measured and simulated figures in ms, and simulated / measured."""

    setup: str
    mode: str
    rate: float
    fleet: str
    measured: dict[str, float | None]
    simulated: dict[str, float]

    def ratio(self, name: str) -> float | None:
        m, s = self.measured.get(name), self.simulated.get(name)
        return None if not m or s is None else s / m

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"setup": self.setup, "mode": self.mode, "rate": self.rate,
                               "fleet": self.fleet}
        for metric, key in METRICS:
            name = f"{metric}_{key}"
            out[f"measured_{metric}_{key}"] = self.measured.get(name)
            out[f"simulated_{metric}_{key}"] = self.simulated.get(name)
            out[f"ratio_{name}"] = self.ratio(name)
        return out


def load_results(path: Path) -> dict[str, Any]:
    """A ``kvbridge bench serve`` results.json, checked (ConfigError naming what is wrong)."""
    try:
        if path.stat().st_size > _MAX_BYTES:
            raise ConfigError(f"--results: {path} is larger than {_MAX_BYTES} bytes")
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--results: cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--results: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != RESULTS_KIND:
        raise ConfigError(f"--results: {path} is not a kvbridge bench serve results file")
    settings, rows = data.get("settings"), data.get("rows")
    if not isinstance(settings, dict) or not isinstance(rows, list):
        raise ConfigError(f"--results: {path}: needs 'settings' (object) and 'rows' (list)")
    for key in ("input_len", "output_len", "num_prompts"):
        v = settings.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1_000_000:
            raise ConfigError(f"--results: {path}: settings.{key} must be a positive integer")
    return data


def setup_mode(setup: str, version: int = 2) -> str | None:
    """``kvbridge-push`` → ``push``; None for a name without a mode suffix. In a results file of
    ``version`` 1 ``kvbridge-auto`` ran the headroom rule (auto before the planner): ``headroom``.
    """
    mode = setup.rsplit("-", 1)[-1]
    if mode == "auto" and version < 2:
        return "headroom"
    return mode if mode in ("pull", "push", "auto", "headroom") else None


def _int_setting(settings: Mapping[str, Any], key: str, default: int) -> int:
    v = settings.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 64:
        raise ConfigError(f"--results: settings.{key} must be an integer 1..64, got {v!r}")
    return v


def within(row: ValidationRow, name: str, tolerance: float) -> bool | None:
    """Whether the simulated figure is within ``tolerance`` (0.25 = 25 %) of the measured one."""
    r = row.ratio(name)
    return None if r is None else abs(r - 1.0) <= tolerance


def validate(profile: Profile, results: Mapping[str, Any], setup_prefix: str = "kvbridge-",
             repeats: int = 10, prefills: int | None = None, decodes: int | None = None,
             seed: int = 0) -> list[ValidationRow]:
    """Simulate every modelled row of ``results`` (see the module docstring)."""
    if not 1 <= repeats <= 1000:
        raise ConfigError(f"--repeats: 1..1000, got {repeats}")
    settings: Mapping[str, Any] = results["settings"]
    n_p = prefills or _int_setting(settings, "prefill_engines", 1)
    n_d = decodes or _int_setting(settings, "decode_engines", 1)
    headroom = settings.get("push_headroom", profile.proxy.push_headroom)
    if isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0:
        raise ConfigError(f"--results: settings.push_headroom must be an integer >= 0, "
                          f"got {headroom!r}")
    version = results.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigError(f"--results: version must be an integer, got {version!r}")
    out: list[ValidationRow] = []
    for row in results["rows"]:
        if not isinstance(row, Mapping):
            raise ConfigError("--results: every row must be an object")
        setup, rate = row.get("setup"), row.get("rate")
        mode = setup_mode(setup, version) if isinstance(setup, str) else None
        if (mode is None or not isinstance(setup, str) or not setup.startswith(setup_prefix)
                or isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0
                or not row.get("completed")):
            continue
        run_seed = row.get("seed")
        exact = run_seed is not None
        if exact and (isinstance(run_seed, bool) or not isinstance(run_seed, int)
                      or not 0 <= run_seed < 2 ** 32):
            raise ConfigError(f"--results: row {setup} @ {rate}: seed must be an integer "
                              f"0..2**32-1, got {run_seed!r}")
        workloads = [Workload(rate=float(rate), requests=settings["num_prompts"],
                              prompt=Lengths(settings["input_len"]),
                              output=Lengths(settings["output_len"]),
                              arrival="vllm" if exact else "poisson",
                              seed=run_seed if isinstance(run_seed, int) else seed + 7919 * k)
                     for k in range(1 if exact else repeats)]
        runs = [run_one(profile, w, Fleetspec(n_p, n_d, mode, push_headroom=headroom))
                for w in workloads]
        simulated = {f"{metric}_{key}": statistics.median(
            getattr(s, metric)[key] for s in runs) for metric, key in METRICS}
        measured = {f"{metric}_{key}": _num(row.get(f"{metric}_{key}"))
                    for metric, key in METRICS}
        out.append(ValidationRow(setup, mode, float(rate), f"{n_p}P{n_d}D", measured,
                                 simulated))
    return out


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def table(rows: Sequence[ValidationRow]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells of the side-by-side table."""
    headers = ["setup", "fleet", "rate"]
    for metric, key in METRICS:
        name = f"{metric.upper()} {key}"
        headers += [f"{name} meas", f"{name} sim", "x"]
    cells = []
    for r in rows:
        line = [r.setup, r.fleet, f"{r.rate:g}"]
        for metric, key in METRICS:
            name = f"{metric}_{key}"
            m, s, x = r.measured.get(name), r.simulated.get(name), r.ratio(name)
            line += ["-" if m is None else f"{m:.1f}", "-" if s is None else f"{s:.1f}",
                     "-" if x is None else f"{x:.2f}"]
        cells.append(line)
    return headers, cells
