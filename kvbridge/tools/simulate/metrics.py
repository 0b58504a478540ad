"""What a simulated run measured, the way ``vllm bench serve`` reports it.

Per request: TTFT = client send → first token at the client (D's first token + the stream's
way back, or the client's own parse of it when the host's cores are modelled); TPOT = (last
token − first token) / (output tokens − 1), at the client likewise; hand-off = P's KV ready →
D's first step with the request (the same cut as ``kvbridge bench e2e``). :func:`summarize`
gives p50/p90/p99 and means in milliseconds, the completion rate (completions per second between
the first and the last completion: the offered rate when the fleet keeps up, its capacity when it
does not), ``vllm bench serve``'s request throughput (completed requests / time from the start
to the last token at the client, the "req/s" it prints), how headroom or the planner chose, and the
engines' and processes' utilisation. A ``local`` request (D alone) has no hand-off figure.
:func:`check_invariants` is what the tests assert after every run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.tools.report import percentile
from kvbridge.tools.simulate.engines import DecodeEngine, PrefillEngine, SimRequest
from kvbridge.tools.simulate.events import SimulationError
from kvbridge.tools.simulate.fleet import Fleet

__all__ = ["Summary", "summarize", "check_invariants", "PERCENTILES"]

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Summary:
    """One run's figures (milliseconds, req/s, fractions)."""

    mode: str
    prefills: int
    decodes: int
    rate: float
    completed: int
    ttft: dict[str, float]
    tpot: dict[str, float]
    handoff: dict[str, float]
    throughput: float
    offered: float = 0.0
    """The arrival rate the run actually drew (arrivals per second, first to last)."""
    chosen: dict[str, int] = field(default_factory=dict)
    utilisation: dict[str, float] = field(default_factory=dict)
    bench_throughput: float = 0.0
    """``vllm bench serve``'s req/s: completed / (start → last token at the client)."""
    guarded: int = 0
    """auto: decisions the TPOT guard kept from D alone (``guard=tpot``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "prefills": self.prefills, "decodes": self.decodes,
                "rate": self.rate, "completed": self.completed, "ttft_ms": self.ttft,
                "tpot_ms": self.tpot, "handoff_ms": self.handoff,
                "throughput": self.throughput, "offered": self.offered,
                "bench_throughput": self.bench_throughput, "chosen": self.chosen,
                "guarded": self.guarded,
                "utilisation": self.utilisation}


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ms = [v * 1000.0 for v in values]
    out = {f"p{q}": percentile(ms, q) or 0.0 for q in PERCENTILES}  # ms is not empty
    out["mean"] = float(np.mean(ms))
    return out


def seen_first(fleet: Fleet, r: SimRequest) -> float:
    """When the client has the first token."""
    if r.t_seen_first is not None:
        return r.t_seen_first
    assert r.t_first is not None
    return r.t_first + fleet.profile.proxy.stream_s


def seen_last(fleet: Fleet, r: SimRequest) -> float:
    """When the client has the last token."""
    if r.t_seen_last is not None:
        return r.t_seen_last
    assert r.t_finish is not None
    return r.t_finish + fleet.profile.proxy.stream_s


def ttft_s(fleet: Fleet, r: SimRequest) -> float:
    return seen_first(fleet, r) - r.spec.arrival


def tpot_s(r: SimRequest) -> float | None:
    if r.spec.output_len < 2 or r.t_first is None or r.t_finish is None:
        return None
    if r.t_seen_first is not None and r.t_seen_last is not None:
        return (r.t_seen_last - r.t_seen_first) / (r.spec.output_len - 1)
    return (r.t_finish - r.t_first) / (r.spec.output_len - 1)


def summarize(fleet: Fleet, rate: float, warmup: float = 0.0) -> Summary:
    """The figures of a finished run; the first ``warmup`` fraction of requests is left out."""
    reqs = [r for r in fleet.requests if r.t_finish is not None]
    skip = int(len(fleet.requests) * warmup)
    measured = [r for r in reqs if r.id >= skip]
    tpots = [v for v in (tpot_s(r) for r in measured) if v is not None]
    handoffs = [r.t_ready - r.t_kv_ready for r in measured
                if r.t_ready is not None and r.t_kv_ready is not None]
    finishes = sorted(r.t_finish for r in measured if r.t_finish is not None)
    span = finishes[-1] - finishes[0] if len(finishes) > 1 else 0.0
    arrivals = sorted(r.spec.arrival for r in fleet.requests if r.id >= skip)
    window = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    end = max(fleet.loop.now, 1e-9)
    util = {f"P{e.index}": e.busy_s / end for e in fleet.prefills}
    util |= {f"D{e.index}": e.busy_s / end for e in fleet.decodes}
    util |= {f"D{e.index} connector": e.onloop_s / end for e in fleet.decodes
             if e.onloop_s > 0}
    util |= {f"link P{i}": n.busy_s / end for i, n in enumerate(fleet.p_nics)}
    if fleet.cpu is not None:
        util |= {f"CPU {task.name}": task.cpu_s / end for task in fleet.cpu.tasks}
    last_seen = max((seen_last(fleet, r) for r in reqs), default=0.0)
    return Summary(
        mode=fleet.mode.value, prefills=len(fleet.prefills), decodes=len(fleet.decodes),
        rate=rate, completed=len(reqs),
        ttft=_stats([ttft_s(fleet, r) for r in measured]), tpot=_stats(tpots),
        handoff=_stats(handoffs),
        throughput=(len(finishes) - 1) / span if span > 0 else 0.0,
        offered=(len(arrivals) - 1) / window if window > 0 else rate,
        chosen=dict(Counter(r.mode for r in measured)), utilisation=util,
        guarded=sum(1 for r in measured if getattr(r.plan, "guard", "") == "tpot"),
        bench_throughput=len(reqs) / last_seen if last_seen > 0 else 0.0)


def check_invariants(fleet: Fleet) -> None:
    """Every request finished once, in causal order, and every KV block is back in its pool."""
    for r in fleet.requests:
        if r.finishes != 1 or r.t_finish is None or r.t_first is None:
            raise SimulationError(f"request {r.id} finished {r.finishes} times")
        order = ([r.spec.arrival, r.t_d_recv, r.t_ready, r.t_first, r.t_finish]
                 if r.mode == "local" else  # D alone: no P, no hand-off
                 [r.spec.arrival, r.t_p_recv, r.t_kv_ready, r.t_landed, r.t_ready, r.t_first,
                  r.t_finish])
        if any(t is None for t in order):
            raise SimulationError(f"request {r.id}: a step never happened: {order}")
        times = [t for t in order if t is not None]
        if any(b < a - 1e-9 for a, b in zip(times, times[1:], strict=False)) or times[0] < 0:
            raise SimulationError(f"request {r.id}: timestamps out of order: {times}")
        if r.generated != r.spec.output_len or r.p_blocks or r.d_blocks:
            raise SimulationError(f"request {r.id}: {r.generated} tokens, blocks still held")
    engines: list[PrefillEngine | DecodeEngine] = [*fleet.prefills, *fleet.decodes]
    for e in engines:
        e.kv.check()
        if e.kv.free != e.kv.total:
            raise SimulationError(f"{e.kv.name}: {e.kv.held} blocks still held at the end")
    for pool in (fleet.ppool, fleet.dpool):
        if any(e.in_flight for e in pool.engines):
            raise SimulationError("the proxy still counts requests in flight at the end")
    if any(fleet.in_flight.values()) or any(fleet.gate_queue.values()):
        raise SimulationError("requests still held by the proxy's in-flight limit at the end")
    if fleet.cpu is not None:
        if any(task.jobs for task in fleet.cpu.tasks):
            raise SimulationError("CPU work still queued at the end")
        for r in fleet.requests:
            if r.seen != r.spec.output_len or seen_first(fleet, r) < (r.t_first or 0) - 1e-9:
                raise SimulationError(f"request {r.id}: the client saw {r.seen} tokens")
