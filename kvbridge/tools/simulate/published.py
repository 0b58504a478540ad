"""Published runs the model is checked against: vLLM PR #35264's table (the push connector).

The rows (:data:`PR35264_ROWS`) are the only ones any stored copy of the PR keeps: ``vllm bench
serve`` with the sonnet dataset on AWS P5en, P/D TP 4, 512 input tokens, in pull and in push mode;
the longer inputs were cut off in every copy. At 8 QPS both modes fall behind (achieved 4.65 and
5.92 req/s) although a 512-token prefill is a small fraction of one TP 4 step budget: the run
is bounded by something else, whose capacity the model needs.

- :func:`num_prompts_from`: ``vllm bench serve``'s req/s is ``completed / duration``, and when
  the fleet keeps up the duration is ``num_prompts / rate`` (its arrivals are rescaled to end
  there) plus the last request's own latency. Every 4 QPS row that keeps up then gives
  ``num_prompts`` on its own.
- :func:`simulate_row`: one row replayed the way ``vllm bench serve`` runs it (its arrivals for
  ``--seed``, ``num_prompts`` requests, req/s over the whole run, means over completed
  requests).
- :func:`fit_in_flight`: the smallest per-mode limit on requests in flight
  (``proxy.pull_max_in_flight`` / ``push_max_in_flight``) whose simulated req/s is closest to the
  published one on the rows given; every other row and statistic is then held out.

Pure computation; each row is a few hundred simulated requests.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvbridge.tools.simulate.metrics import Summary
from kvbridge.tools.simulate.profile import Profile
from kvbridge.tools.simulate.sizing import Fleetspec, run_one
from kvbridge.tools.simulate.workload import Lengths, Workload

__all__ = ["PublishedRow", "PR35264_ROWS", "PR35264_SOURCE", "num_prompts_from", "simulate_row",
           "fit_in_flight", "MAX_LIMIT"]

PR35264_SOURCE = ("vLLM PR #35264 (snadampal, 2026-02-25), 'Benchmarking results': vllm bench "
                  "serve, sonnet dataset, AWS P5en, P/D TP 4; "
                  "https://github.com/vllm-project/vllm/pull/35264; the rows after 512/128/8 "
                  "are cut off")
MAX_LIMIT = 256


@dataclass(frozen=True)
class PublishedRow:
    """One published (mode, input, output, QPS) row: milliseconds and req/s."""

    mode: str
    input_len: int
    output_len: int
    qps: float
    mean_ttft: float
    median_ttft: float
    p99_ttft: float
    mean_tpot: float
    req_s: float

    @property
    def name(self) -> str:
        return f"{self.mode} {self.input_len}/{self.output_len} @ {self.qps:g}"


PR35264_ROWS: tuple[PublishedRow, ...] = (
    PublishedRow("pull", 512, 64, 4, 110.94, 85.07, 740.03, 12.51, 3.86),
    PublishedRow("push", 512, 64, 4, 74.46, 77.13, 100.24, 12.50, 3.87),
    PublishedRow("pull", 512, 128, 4, 301.92, 89.22, 1125.98, 12.66, 3.63),
    PublishedRow("push", 512, 128, 4, 93.77, 79.95, 302.37, 12.59, 3.75),
    PublishedRow("pull", 512, 128, 8, 2948.11, 2682.32, 7258.96, 12.70, 4.65),
    PublishedRow("push", 512, 128, 8, 1212.48, 1275.05, 2826.72, 12.67, 5.92),
)


def num_prompts_from(row: PublishedRow) -> float:
    """``num_prompts`` implied by a row that keeps up: ``req/s = N / (N / qps + E)`` with ``E``
    the last request's latency, taken as median TTFT + (output - 1) x mean TPOT."""
    last = (row.median_ttft + (row.output_len - 1) * row.mean_tpot) / 1000.0
    deficit = 1.0 / row.req_s - 1.0 / row.qps
    return last / deficit if deficit > 0 else float("inf")


def simulate_row(profile: Profile, row: PublishedRow, num_prompts: int, seeds: Sequence[int] = (0,),
                 prefix_hit: float | None = None) -> dict[str, float]:
    """``row`` replayed through the model: mean/median/p99 TTFT, mean TPOT (ms) and req/s, each
    the median over ``seeds`` (``vllm bench serve --seed``; 0 is its default)."""
    sc = profile.scenario
    hit = prefix_hit if prefix_hit is not None else (sc.prefix_hit if sc else 0.0)
    runs: list[Summary] = []
    for seed in seeds:
        w = Workload(rate=row.qps, requests=num_prompts, prompt=Lengths(row.input_len),
                     output=Lengths(row.output_len), arrival="vllm", seed=seed)
        runs.append(run_one(profile, w, Fleetspec(mode=row.mode, prefix_hit=hit)))
    return {
        "mean_ttft": statistics.median(s.ttft["mean"] for s in runs),
        "median_ttft": statistics.median(s.ttft["p50"] for s in runs),
        "p99_ttft": statistics.median(s.ttft["p99"] for s in runs),
        "mean_tpot": statistics.median(s.tpot["mean"] for s in runs),
        "req_s": statistics.median(s.bench_throughput for s in runs),
    }


def _with_limit(profile: Profile, mode: str, limit: int) -> Profile:
    return profile.replace(proxy=replace(profile.proxy, **{f"{mode}_max_in_flight": limit}))


def fit_in_flight(profile: Profile, rows: Sequence[PublishedRow], num_prompts: int,
                  seeds: Sequence[int] = (0,)) -> dict[str, int]:
    """Per mode, the in-flight limit whose simulated req/s is closest to the published req/s of
    that mode's ``rows`` (summed absolute error; ties: the larger limit). The achieved req/s
    grows with the limit until the fleet keeps up, so the search walks up from 1 and stops one
    step after the error stops falling; 0 (no limit) when no limit does better than none."""
    out: dict[str, int] = {}
    for mode in sorted({r.mode for r in rows}):
        mine = [r for r in rows if r.mode == mode]

        def error(limit: int, mine: Sequence[PublishedRow] = mine, mode: str = mode) -> float:
            p = _with_limit(profile, mode, limit)
            return sum(abs(simulate_row(p, r, num_prompts, seeds)["req_s"] - r.req_s)
                       for r in mine)

        best, best_err = 0, error(0)
        prev = float("inf")
        for limit in range(1, MAX_LIMIT + 1):
            err = error(limit)
            if err <= best_err:
                best, best_err = limit, err
            if err > prev:
                break
            prev = err
        out[mode] = best
    return out
