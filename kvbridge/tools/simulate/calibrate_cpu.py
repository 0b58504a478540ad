"""CPU seconds per request and per token of every process a ``kvbridge bench serve`` run loads.

On a small host the load generator, the kvbridge proxy and both engines' API servers share the
cores with the pinned engine cores; :mod:`kvbridge.tools.simulate.cpu` models that sharing. Its
inputs are measured here, as CPU time (``/proc/<pid>/stat`` utime + stime, and ``getrusage`` of the
exited load generator), which a busy host inflates far less than wall time:

1. **Idle burn**: every process's CPU seconds per wall second while no request is in flight
   (an engine's loop and its transfer threads poll).
2. **Load runs**: real ``vllm bench serve`` runs (the command of ``kvbridge bench serve``)
   through the real proxy at a low rate, in each mode, with (prompts, output tokens) varied so
   that per-request and per-token costs separate. Per run and process: CPU seconds minus idle
   burn over the run's wall time.
3. **Fit**: per process, non-negative least squares ``cpu = a * requests + b * tokens``. Every
   process is sampled every 50 ms and its CPU counted from the run's first send to its last
   token (``start_times`` and ``latencies`` of the detailed result, on the monotonic clock), so
   the load generator's own start-up and teardown (seconds of CPU) stay out.

The processes (:func:`sample`): ``client`` (the load generator), ``proxy`` (the threads of this
process other than the main thread: :class:`~kvbridge.tools.proxies.ProxyThread`), ``p_api``
and ``d_api`` (each ``vllm serve`` leader: the API server), ``p_engine`` and ``d_engine`` (the
rest of each engine's process group: the engine core and its helpers).

Blocking; runs from the caller's thread while the proxies run on theirs. Not thread-safe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kvbridge.tools import prom
from kvbridge.tools.bench.serve_process import bench_serve_command
from kvbridge.tools.cpumeter import group_cpu, process_seconds
from kvbridge.tools.simulate.fit import nonneg_lstsq

__all__ = ["PROCESSES", "LOAD_RUNS", "CpuRun", "CpuMeasurements", "ProcSet", "Sampler", "sample",
           "measure_idle", "measure_cpu", "fit_cpu", "derive_cpu", "cpu_record"]

PROCESSES: tuple[str, ...] = ("client", "proxy", "p_api", "d_api", "p_engine", "d_engine")
#: (prompts, output tokens) of the load runs, per mode
LOAD_RUNS: tuple[tuple[int, int], ...] = ((8, 8), (40, 8), (40, 48))
LOAD_RATE = 4.0
PROMPT_LEN = 200
IDLE_WINDOW_S = 6.0


@dataclass
class CpuRun:
    """One load run: its shape and every process's CPU seconds over it."""

    mode: str
    prompts: int
    output_len: int
    wall_s: float
    cpu_s: dict[str, float]
    completed: int = 0
    d_steps: int = 0
    """D's engine steps during the run (``vllm:iteration_tokens_total`` count)"""


@dataclass
class CpuMeasurements:
    idle_rate: dict[str, float] = field(default_factory=dict)
    """process → CPU seconds per wall second with nothing in flight"""
    runs: list[CpuRun] = field(default_factory=list)


class ProcSet:
    """The processes of one engine pair and this process's proxy threads, resolved once, read
    cheaply (``psutil``: a few ``/proc`` files) as CPU seconds by role (see the module
    docstring)."""

    def __init__(self, p_pid: int, d_pid: int) -> None:
        self.procs: dict[str, list[int]] = {"p_api": [p_pid], "d_api": [d_pid]}
        for role, leader in (("p_engine", p_pid), ("d_engine", d_pid)):
            self.procs[role] = [pid for pid in group_cpu(leader) if pid != leader]
        self.me = psutil.Process()
        # threads by their own times (/proc/<pid>/task/<tid>/stat): psutil.Process(tid) would
        # read /proc/<tid>/stat, which holds the whole process's
        self.proxy_threads = {t.id for t in self.me.threads() if t.id != self.me.pid}
        self._handles: dict[int, psutil.Process] = {}

    def _seconds(self, pid: int) -> float:
        """utime + stime of process ``pid``; 0.0 once it ended."""
        try:
            if pid not in self._handles:
                self._handles[pid] = psutil.Process(pid)
            return process_seconds(self._handles[pid])
        except psutil.Error:
            return 0.0  # a helper that ended meanwhile

    def read(self, client: int | None = None) -> dict[str, float]:
        """CPU seconds so far by role (``client``: that pid too, if it still runs)."""
        out = {role: sum(self._seconds(pid) for pid in pids) for role, pids in self.procs.items()}
        out["proxy"] = float(sum(t.user_time + t.system_time for t in self.me.threads()
                                 if t.id in self.proxy_threads))  # an ended thread: left out
        if client is not None:
            out["client"] = self._seconds(client)
        return out


def sample(p_pid: int, d_pid: int) -> dict[str, float]:
    """CPU seconds so far of every process but the client (see the module docstring)."""
    return ProcSet(p_pid, d_pid).read()


def _at(timeline: Sequence[tuple[float, dict[str, float]]], t: float, role: str) -> float:
    """``role``'s CPU seconds at monotonic time ``t``, interpolated on the sampled timeline."""
    before = [(ts, v[role]) for ts, v in timeline if ts <= t and role in v]
    after = [(ts, v[role]) for ts, v in timeline if ts >= t and role in v]
    if not before:
        return after[0][1] if after else 0.0
    if not after:
        return before[-1][1]
    (t0, v0), (t1, v1) = before[-1], after[0]
    return v0 if t1 <= t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


class Sampler:
    """Samples a :class:`ProcSet` every ``every`` seconds on a background thread (a context
    manager); :meth:`at` interpolates a role's CPU seconds at a monotonic time."""

    def __init__(self, procs: ProcSet, every: float = 0.005) -> None:
        self.procs, self.every = procs, every
        self.timeline: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.timeline.append((time.monotonic(), self.procs.read()))
            self._stop.wait(self.every)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def at(self, t: float, role: str) -> float:
        return _at(self.timeline, t, role)


def _run_client(cmd: Sequence[str], log: Path, timeout: float, procs: ProcSet,
                every: float = 0.05) -> tuple[int, list[tuple[float, dict[str, float]]]]:
    """Run the load generator to its end, sampling every role's CPU seconds (the client's
    too) every ``every`` seconds on the monotonic clock; (exit status, timeline)."""
    timeline: list[tuple[float, dict[str, float]]] = []
    deadline = time.monotonic() + timeout
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, "HF_HUB_OFFLINE": "1",
                                     "TRANSFORMERS_OFFLINE": "1"})
        rc: int | None = None
        while rc is None:
            timeline.append((time.monotonic(), procs.read(proc.pid)))
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait(10)
                return -1, timeline
            time.sleep(every)
            rc = proc.poll()
    return rc, timeline


def _window(result: Mapping[str, Any]) -> tuple[float, float]:
    """The benchmark's first send and last token (``time.perf_counter``, which is the
    monotonic clock this process samples on, on Linux) from its detailed result."""
    starts = [float(s) for s in result["start_times"]]
    ends = [s + float(lat) for s, lat in zip(starts, result["latencies"], strict=False)
            if lat is not None]
    return min(starts), max(ends)


def measure_idle(procs: ProcSet, window_s: float = IDLE_WINDOW_S) -> dict[str, float]:
    """Every role's CPU seconds per wall second with nothing in flight."""
    s0, t0 = procs.read(), time.monotonic()
    time.sleep(window_s)
    s1, t1 = procs.read(), time.monotonic()
    rates = {k: max(0.0, (s1[k] - s0[k]) / (t1 - t0)) for k in s0}
    rates["client"] = 0.0
    return rates


def _steps(url: str) -> int:
    """An engine's steps so far (the count of vLLM's ``iteration_tokens_total`` histogram)."""
    return int(prom.histogram(prom.fetch(url), "vllm:iteration_tokens_total")[1])


def measure_cpu(procs: ProcSet, idle: Mapping[str, float], urls: Mapping[str, str],
                model: Path, out: Path, say: Callable[[str], None],
                modes: Sequence[str] = ("pull", "push"),
                runs: Sequence[tuple[int, int]] = LOAD_RUNS, d_url: str = "") -> CpuMeasurements:
    """The load runs of every mode (see the module docstring): each process's CPU seconds
    between the run's first send and its last token, when the load generator's own start-up
    and teardown are over."""
    m = CpuMeasurements(idle_rate=dict(idle))
    out.mkdir(parents=True, exist_ok=True)
    seed = 7000
    for mode in modes:
        for prompts, output_len in runs:
            seed += 1
            name = f"cpu-{mode}-{prompts}x{output_len}"
            cmd = bench_serve_command(urls[mode], model, out, name, rate=LOAD_RATE,
                                      num_prompts=prompts, input_len=PROMPT_LEN,
                                      output_len=output_len, seed=seed, warmups=0,
                                      ready_check_s=0, python=sys.executable)
            steps0 = _steps(d_url) if d_url else 0
            rc, timeline = _run_client(cmd, out / f"{name}.log", 600.0, procs)
            steps = _steps(d_url) - steps0 if d_url else 0
            try:
                result = json.loads((out / f"{name}.json").read_text())
                t0, t1 = _window(result)
                completed = int(result["completed"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                say(f"{name}: no usable result (exit status {rc}: {exc}); see "
                    f"{out / (name + '.log')}")
                continue
            cpu = {role: _at(timeline, t1, role) - _at(timeline, t0, role)
                   for role in PROCESSES}
            m.runs.append(CpuRun(mode, prompts, output_len, t1 - t0, cpu, completed, steps))
            say(f"{name}: {t1 - t0:.1f} s, D steps {steps}, CPU s " + ", ".join(
                f"{k} {v:.2f}" for k, v in cpu.items()))
    return m


def fit_cpu(m: CpuMeasurements, modes: Sequence[str] | None = None
            ) -> dict[str, dict[str, float]]:
    """Per process: ``request_s`` and ``token_s`` (CPU seconds), from the runs of ``modes``
    (all when None); for ``d_engine`` also ``request_s`` and ``step_s`` against D's own step
    count (its tokens per step vary with the batch, its steps do not)."""
    runs = [r for r in m.runs if modes is None or r.mode in modes]
    out: dict[str, dict[str, float]] = {}
    if len(runs) < 2:
        return out
    for proc in PROCESSES:
        rows, ys = [], []
        for r in runs:
            n = r.completed or r.prompts
            rows.append([n, n * r.output_len])
            ys.append(r.cpu_s[proc] - m.idle_rate.get(proc, 0.0) * r.wall_s)
        coef = nonneg_lstsq(rows, ys)
        out[proc] = {"request_s": coef[0], "token_s": coef[1]}
    if all(r.d_steps > 0 for r in runs):
        ys = [r.cpu_s["d_engine"] - m.idle_rate.get("d_engine", 0.0) * r.wall_s for r in runs]
        coef = nonneg_lstsq([[r.completed or r.prompts, r.d_steps] for r in runs], ys)
        out["d_engine"] |= {"request_s": coef[0], "step_s": coef[1]}
    return out


def derive_cpu(m: CpuMeasurements, doc: dict[str, Any], tag: str, cores: int,
               spin_s: float, engines: Mapping[str, tuple[float, str]]) -> None:
    """Add the ``cpu`` section to profile document ``doc`` (in place): the fitted per-request
    and per-token CPU seconds of the front ends, ``engines`` (``p_engine_request_s`` ... →
    (value, source), measured by the caller), and no wall-clock delay on the proxy's hops,
    whose every cost is now CPU on the shared cores."""
    fit = fit_cpu(m)
    if not fit:
        return
    src: dict[str, str] = doc.setdefault("sources", {})
    cpu = {
        "cores": cores,
        "client_request_s": fit["client"]["request_s"],
        "client_token_s": fit["client"]["token_s"],
        "proxy_request_s": fit["proxy"]["request_s"],
        "proxy_token_s": fit["proxy"]["token_s"],
        "p_api_request_s": fit["p_api"]["request_s"],
        "d_api_request_s": fit["d_api"]["request_s"],
        "d_api_token_s": fit["d_api"]["token_s"],
        **{k: v for k, (v, _) in engines.items()},
        "engine_spin_s": spin_s,
        "background": 0.0,
    }
    doc["cpu"] = cpu
    shapes = sorted({(r.prompts, r.output_len) for r in m.runs})
    how = (f"least squares (non-negative) of CPU seconds (/proc/<pid>/stat, sampled every 50 ms, "
           f"from each run's first send to its last token) over real `vllm bench serve` runs "
           f"through the kvbridge proxy at {LOAD_RATE:g} req/s, pull and push, (prompts, output "
           f"tokens) {shapes}, prompt {PROMPT_LEN}, less each process's idle CPU rate; {tag}")
    for key in cpu:
        if key.endswith(("_request_s", "_token_s")) and key not in engines:
            src[f"cpu.{key}"] = how
    src.update({f"cpu.{k}": why for k, (_, why) in engines.items()})
    src["cpu.cores"] = "os.cpu_count() of the calibrating host"
    src["cpu.engine_spin_s"] = ("KVBRIDGE_ENGINE_SPIN_MS of "
                                "kvbridge.tools.bench.fleet.engine_specs "
                                "(kvbridge bench serve's default)")
    src["cpu.background"] = ("0: other jobs on the host are not modelled (compare the load "
                             "average recorded with each measurement)")
    px = doc["proxy"]
    for key in ("client_s", "request_s", "answer_s", "per_prompt_token_s"):
        px[key] = 0.0
        src[f"proxy.{key}"] = ("0: with the cores modelled, a hop costs the CPU seconds of the "
                               "processes on it (cpu section); the wall-clock gaps calibrate "
                               "measures also hold the contention of the host at that time, "
                               "which the model produces itself")
    px["stream_s"] = max(0.0, px["stream_s"] - cpu["d_api_token_s"] - cpu["proxy_token_s"]
                         - cpu["client_token_s"])
    src["proxy.stream_s"] = (src.get("proxy.stream_s", "") + "; less the per-token CPU of D's "
                             "API server, the proxy and the client (cpu section): what is left "
                             "is the first token's own way out (engine → API server IPC, the "
                             "response's start), a wall-clock delay on every token")


def cpu_record(m: CpuMeasurements) -> dict[str, Any]:
    """The raw CPU measurements, for a profile's ``calibration`` section."""
    return {
        "idle_rate": {k: round(v, 4) for k, v in m.idle_rate.items()},
        "runs": [{"mode": r.mode, "prompts": r.prompts, "output_len": r.output_len,
                  "completed": r.completed, "d_steps": r.d_steps,
                  "wall_s": round(r.wall_s, 3),
                  "cpu_s": {k: round(v, 3) for k, v in r.cpu_s.items()}} for r in m.runs],
        "fit_by_mode": {mode: fit_cpu(m, [mode]) for mode in sorted({r.mode for r in m.runs})},
    }
