"""The measurements of ``kvbridge simulate calibrate`` on real engines (see
:mod:`kvbridge.tools.simulate.calibrate` for the profile derived from them).

Starts the engine pair of ``kvbridge bench e2e`` (the tiny model, P on core 0, D on core 1,
``--block-size 32``, KVBridgeConnector over ``--backend``), then measures, one thing at a time:

1. **Idle burn** of every process (:func:`kvbridge.tools.simulate.calibrate_cpu.measure_idle`).
2. **P's prefill step** against prompt length: sequential one-token requests sent straight to P,
   each with a fresh prompt; the engine-side wall time is vLLM's
   ``vllm:request_prefill_time_seconds`` (one step for these lengths), the client-side wall time
   minus it is the HTTP round trip, and P's engine-core CPU seconds per request (idle burn and
   one spin removed) are its CPU time.
3. **D's decode step** against batch size and context: B concurrent streams through the kvbridge
   proxy in push mode, as ``kvbridge bench serve`` sends them (B = 1, 2, 4, 8 at one prompt
   length, and B = 4 at a longer one): the median of the streams' mean inter-token times (the
   step *as a client sees it*), and D's engine-core CPU per engine step.
4. **The hand-off**, through the real kvbridge proxy in pull and in push, sequential requests:
   the engines' own per-transfer timings (``StatsQuery``: P ``kv_ready``, ``write_posted``,
   ``write_done``; D ``recv_start``, ``recv_done``, ``first_step``) and the client's send and
   first-token times give each gap; P's and D's CPU, sampled every 5 ms, split at the first token.
5. **The front ends' CPU** under real ``vllm bench serve`` load
   (:func:`kvbridge.tools.simulate.calibrate_cpu.measure_cpu`).

Everything runs from this process; engines are stopped at the end, also on error. Run it under
``nice`` on a shared host, on a quiet one if possible: the load average is recorded.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge.params import probe_request
from kvbridge.tools import prom
from kvbridge.tools.bench.fleet import engine_specs
from kvbridge.tools.client import complete, stats_reply, stream_complete
from kvbridge.tools.cpumeter import loadavg
from kvbridge.tools.engines import start_servers
from kvbridge.tools.simulate.calibrate_cpu import (
    CpuMeasurements,
    ProcSet,
    Sampler,
    measure_cpu,
    measure_idle,
)
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

__all__ = ["Measurements", "measure"]

_PREFILL_LENS = (32, 128, 256, 512, 896)
_BATCHES = (1, 2, 4, 8)
_DECODE_PROMPT = 200
_LONG_PROMPT = 800
_DECODE_TOKENS = 48
_HANDOFF_PROMPT = 200
_HANDOFF_TOKENS = 16
_KV_CACHE_BYTES = 268435456  # kvbridge.tools.engines.BASE_ARGS --kv-cache-memory-bytes
_MAX_NUM_SEQS = 8  # BASE_ARGS --max-num-seqs
_SPIN_S = 0.002  # kvbridge.tools.bench.fleet.engine_specs: KVBRIDGE_ENGINE_SPIN_MS 2.0
_SETTLE_S = 0.2  # after each sequential hand-off request: its tail, before the next


@dataclass
class Measurements:
    """Raw figures of one calibration run (seconds)."""

    prefill: dict[int, list[float]] = field(default_factory=dict)
    """prompt length → engine-side prefill times"""
    http_rtt: list[float] = field(default_factory=list)
    """direct P requests: client wall time minus the engine's prefill time"""
    decode: list[tuple[int, int, float]] = field(default_factory=list)
    """(batch, summed context tokens, mean step time) per stream"""
    gaps: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """mode → gap name (``kv_ready->recv_done`` ...) → values"""
    ttft: dict[str, list[float]] = field(default_factory=dict)
    max_batched_tokens: int = 0
    loadavg: list[str] = field(default_factory=list)
    cpu: CpuMeasurements | None = None
    """CPU seconds of every process under load runs
    (:mod:`kvbridge.tools.simulate.calibrate_cpu`)"""
    prefill_cpu: dict[int, list[float]] = field(default_factory=dict)
    """prompt length → P engine CPU seconds per request (idle burn and one spin removed)"""
    decode_cpu: list[tuple[int, int, float]] = field(default_factory=list)
    """(batch, summed context tokens, D engine CPU seconds per step)"""
    request_cpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """mode → engine CPU seconds of one sequential request through the proxy (idle burn
    removed): ``p`` (P, send → end), ``d_first`` (D, send → first token), ``d_rest`` (D, first
    token → end)"""


def _metric(url: str, name: str) -> tuple[float, float]:
    return prom.histogram(prom.fetch(url), name)


def _engine_cpu(procs: ProcSet | None, role: str) -> tuple[float, float]:
    """(CPU seconds of ``role`` so far, monotonic now); zeros without ``procs``."""
    return (procs.read()[role] if procs is not None else 0.0), time.monotonic()


def _measure_prefill(url: str, reps: int, m: Measurements, say: Callable[[str], None],
                     procs: ProcSet | None = None, idle: float = 0.0) -> None:
    name = "vllm:request_prefill_time_seconds"
    prompts = {n: random_prompts(reps + 1, n, seed=1000 + i)
               for i, n in enumerate(_PREFILL_LENS)}
    for j in range(reps + 1):  # lengths interleaved, so drifting host load hits them alike
        for length in _PREFILL_LENS:
            s0, c0 = _metric(url, name)
            cpu0, w0 = _engine_cpu(procs, "p_engine")
            t0 = time.perf_counter()
            complete(url, prompts[length][j], 1, timeout=120)
            wall = time.perf_counter() - t0
            cpu1, w1 = _engine_cpu(procs, "p_engine")
            s1, c1 = _metric(url, name)
            if c1 - c0 != 1 or j == 0:  # the first round warms up every shape
                continue
            m.prefill.setdefault(length, []).append(s1 - s0)
            m.http_rtt.append(wall - (s1 - s0))
            if procs is not None:  # one spin after each request: the previous one's
                m.prefill_cpu.setdefault(length, []).append(
                    cpu1 - cpu0 - idle * (w1 - w0) - _SPIN_S)
    say("prefill (ms, medians): " + ", ".join(
        f"{n} tokens {statistics.median(v) * 1000:.1f}" for n, v in m.prefill.items()))


def _measure_decode(url: str, reps: int, m: Measurements, say: Callable[[str], None],
                    procs: ProcSet | None = None, idle: float = 0.0, d_url: str = "") -> None:
    shapes = [(b, _DECODE_PROMPT) for b in _BATCHES] + [(4, _LONG_PROMPT)]
    steps = "vllm:iteration_tokens_total"
    seed = 5000
    with ThreadPoolExecutor(max(_BATCHES)) as pool:
        for rep in range(max(2, reps // 2)):  # shapes interleaved, as for prefill
            for batch, plen in shapes:
                seed += 1
                prompts = random_prompts(batch, plen, seed=seed)
                n0 = _metric(d_url, steps)[1] if procs is not None else 0.0
                cpu0, w0 = _engine_cpu(procs, "d_engine")
                futs = [pool.submit(stream_complete, url, p, _DECODE_TOKENS,
                                    extra={"ignore_eos": True}, timeout=120) for p in prompts]
                tpots = [t for t in (f.result().tpot for f in futs) if t is not None]
                cpu1, w1 = _engine_cpu(procs, "d_engine")
                context = batch * (plen + _DECODE_TOKENS // 2)
                if rep > 0 and tpots:  # the first round warms up every shape
                    m.decode.append((batch, context, statistics.median(tpots)))
                    n1 = _metric(d_url, steps)[1] if procs is not None else 0.0
                    if procs is not None and n1 > n0:
                        m.decode_cpu.append((batch, context, (
                            cpu1 - cpu0 - idle * (w1 - w0) - _SPIN_S) / (n1 - n0)))
    by_shape: dict[tuple[int, int], list[float]] = {}
    for b, c, t in m.decode:
        by_shape.setdefault((b, c), []).append(t)
    say("decode step (ms, medians): " + ", ".join(
        f"batch {b} context {c} {statistics.median(v) * 1000:.2f}"
        for (b, c), v in by_shape.items()))


def _control(url: str) -> str:
    params = complete(url, [1], 1, probe_request(), timeout=60)["kv_transfer_params"]
    return f"tcp://{params['remote_host']}:{params['remote_port']}"


def _timings(address: str) -> dict[str, dict[str, float]]:
    reply = stats_reply(address, 10.0)
    return {k: dict(v) for k, v in reply.timings.items()}


def _gap(a: Mapping[str, float], ea: str, b: Mapping[str, float], eb: str) -> float | None:
    return b[eb] - a[ea] if ea in a and eb in b else None


def _measure_handoff(p_url: str, d_url: str, urls: Mapping[str, str], reps: int,
                     m: Measurements, say: Callable[[str], None], procs: ProcSet | None = None,
                     idle: Mapping[str, float] | None = None) -> None:
    p_ctl, d_ctl = _control(p_url), _control(d_url)
    idle = idle or {}
    for k, mode in enumerate(("pull", "push")):
        url = urls[mode]
        prompts = random_prompts(reps + 2, _HANDOFF_PROMPT, seed=9000 + k)
        for p in prompts[:2]:  # warm-up: handshakes, first transfers
            stream_complete(url, p, _HANDOFF_TOKENS, extra={"ignore_eos": True}, timeout=120)
        seen = set(_timings(d_ctl))
        sends: list[tuple[float, float]] = []
        marks: list[tuple[float, float, float]] = []
        with contextlib.ExitStack() as stack:
            sampler = stack.enter_context(Sampler(procs)) if procs is not None else None
            for p in prompts[2:]:
                t_wall, t_mono = time.time(), time.monotonic()
                res = stream_complete(url, p, _HANDOFF_TOKENS, extra={"ignore_eos": True},
                                      timeout=120)
                if res.ttft is not None:
                    sends.append((t_wall, t_wall + res.ttft))
                    m.ttft.setdefault(mode, []).append(res.ttft)
                    marks.append((t_mono, t_mono + res.ttft, t_mono + res.total))
                time.sleep(_SETTLE_S)  # the request's tail (frees, DONE, spin) ends here
        if sampler is not None:
            cpu = m.request_cpu.setdefault(mode, {})
            for t0, t1, t2 in marks:
                t3 = t2 + _SETTLE_S * 0.9
                for name, role, a, b in (("p", "p_engine", t0, t3), ("d_first", "d_engine", t0, t1),
                                         ("d_rest", "d_engine", t1, t3)):
                    used = sampler.at(b, role) - sampler.at(a, role) - idle.get(role, 0.0) * (b - a)
                    cpu.setdefault(name, []).append(used)
        pt, dt = _timings(p_ctl), _timings(d_ctl)
        # P records no kv_ready for pull transfers (only push producers are tracked):
        # order the new transfers by D's recv_start, which every mode records.
        fresh = sorted((t for t in dt if t not in seen and "recv_start" in dt[t]),
                       key=lambda t: dt[t]["recv_start"])
        gaps = m.gaps.setdefault(mode, {})
        for tid, (t_send, t_first) in zip(fresh, sends, strict=False):
            p_ev, d_ev = pt.get(tid, {}), dt[tid]
            c = {"send": t_send, "first_token": t_first}
            for name, value in (
                    ("send->kv_ready", _gap(c, "send", p_ev, "kv_ready")),
                    ("send->recv_start", _gap(c, "send", d_ev, "recv_start")),
                    ("kv_ready->recv_start", _gap(p_ev, "kv_ready", d_ev, "recv_start")),
                    ("recv_start->recv_done", _gap(d_ev, "recv_start", d_ev, "recv_done")),
                    ("kv_ready->write_posted", _gap(p_ev, "kv_ready", p_ev, "write_posted")),
                    ("write_posted->write_done",
                     _gap(p_ev, "write_posted", p_ev, "write_done")),
                    ("write_done->recv_done", _gap(p_ev, "write_done", d_ev, "recv_done")),
                    ("recv_done->first_step", _gap(d_ev, "recv_done", d_ev, "first_step")),
                    ("first_step->first_token",
                     _gap(d_ev, "first_step", c, "first_token"))):
                if value is not None:
                    gaps.setdefault(name, []).append(value)
        say(f"{mode}: " + ", ".join(f"{n} {statistics.median(v) * 1000:.1f}"
                                    for n, v in gaps.items()) + " (ms, medians)")


def _batched_tokens(log_path: Path | None) -> int:
    """vLLM's chunked-prefill budget, from the engine's start-up log (0: not found)."""
    if log_path is None:
        return 0
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return 0
    found = re.findall(r"max_num_batched_tokens[=: ]+(\d+)", text)
    return int(found[-1]) if found else 0


def measure(backend: str, reps: int, log_dir: Path, say: Callable[[str], None],
            cpu_modes: Sequence[str] = ("pull", "push")) -> Measurements:
    """Start the engines (and proxies), take every measurement, stop everything."""
    from kvbridge.tools.proxies import ProxyThread  # aiohttp: optional and heavy

    m = Measurements(loadavg=[loadavg()])
    model = build_tiny_model()
    p, d = engine_specs(f"kvbridge-{backend}", model, log_dir)
    proxies: ProxyThread | None = None
    try:
        say(f"starting the engine pair (logs in {log_dir})")
        start_servers([p, d], timeout=600)
        m.max_batched_tokens = _batched_tokens(p.log_path)
        assert p.pid is not None and d.pid is not None
        procs = ProcSet(p.pid, d.pid) if cpu_modes else None
        idle = measure_idle(procs) if procs is not None else {}
        if idle:
            say("idle CPU (s/s): " + ", ".join(f"{k} {v:.3f}" for k, v in idle.items()))
        _measure_prefill(p.url, reps, m, say, procs, idle.get("p_engine", 0.0))
        proxies = ProxyThread([p.url], [d.url], modes=("pull", "push")).start()
        _measure_decode(proxies.urls["push"], reps, m, say, procs, idle.get("d_engine", 0.0),
                        d.url)
        _measure_handoff(p.url, d.url, proxies.urls, reps, m, say, procs, idle)
        if cpu_modes:
            m.cpu = measure_cpu(ProcSet(p.pid, d.pid), idle, proxies.urls, model,
                                log_dir / "cpu", say, modes=cpu_modes, d_url=d.url)
    finally:
        if proxies is not None:
            proxies.close()
        p.stop()
        d.stop()
    m.loadavg.append(loadavg())
    return m
