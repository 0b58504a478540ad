"""Sweeps and fleet sizing on top of :func:`kvbridge.tools.simulate.fleet.simulate`.

- :func:`run_one`: one (profile, workload, fleet, mode) → :class:`~kvbridge.tools.simulate.metrics.
  Summary` (invariants checked).
- :func:`sweep`: the same fleet at several rates, every mode (one row per (mode, rate)).
- :func:`size_fleet`: the smallest fleet (fewest engines; among those, the lowest TTFT) whose
  TTFT and TPOT percentiles meet the SLOs at a rate, searched in order of total engines;
  :func:`why_none` says what stood in the way when there is none.

In ``local`` mode a fleet is D engines only (a P would sit idle): sizes start at one D. In
``auto`` mode (the planner; ``plan`` is its other name) every split from 0 P up is tried, so the
answer may be D alone (``0P``) when D prefilling for itself meets the SLO at the rate; with P
engines the planner sends each request down the path it measures cheapest. Pull, push and
headroom need a P: their sizes start at 1P1D.

*Meeting* an SLO: the chosen percentile of TTFT (and of TPOT, when given) is within the SLO, and
the fleet keeps up (its completion rate is at least ``keep_up`` of the arrival rate the run
drew), so an overloaded fleet whose queue simply had no time to grow in a short run does not
pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvbridge.errors import ConfigError
from kvbridge.proxy.planner import PlannerSettings
from kvbridge.tools.simulate.fleet import MODES, NO_P_MODES, canonical_mode, simulate
from kvbridge.tools.simulate.metrics import Summary, check_invariants, summarize
from kvbridge.tools.simulate.profile import Profile
from kvbridge.tools.simulate.workload import Workload, generate

__all__ = ["Fleetspec", "Slo", "Sizing", "run_one", "sweep", "meets", "size_fleet", "why_none"]


@dataclass(frozen=True)
class Fleetspec:
    """How many engines of each role, the mode, and the scenario knobs."""

    prefills: int = 1
    decodes: int = 1
    mode: str = "pull"
    prefix_hit: float = 0.0
    fragmentation: float | None = None
    push_headroom: int | None = None
    warmup: float = 0.0
    planner: PlannerSettings | None = None
    """auto mode: the planner's settings (None: the proxy's defaults)."""

    @property
    def p_engines(self) -> int:
        """The P engines the fleet runs with: none for ``local`` (D alone uses no P)."""
        return 0 if self.mode == "local" else self.prefills


@dataclass(frozen=True)
class Slo:
    """Latency targets in milliseconds at a percentile (50, 90 or 99)."""

    ttft_ms: float
    tpot_ms: float | None = None
    percentile: int = 90
    keep_up: float = 0.9

    def __post_init__(self) -> None:
        if self.percentile not in (50, 90, 99):
            raise ConfigError(f"--percentile: 50, 90 or 99, got {self.percentile}")
        if self.ttft_ms <= 0 or (self.tpot_ms is not None and self.tpot_ms <= 0):
            raise ConfigError("--ttft-slo / --tpot-slo: must be > 0 milliseconds")


@dataclass(frozen=True)
class Sizing:
    """A sizing answer: the fleet chosen (None: none up to the search bound) and every fleet
    tried, in order."""

    rate: float
    mode: str
    slo: Slo
    chosen: Summary | None
    tried: list[Summary] = field(default_factory=list)


def run_one(profile: Profile, workload: Workload, spec: Fleetspec) -> Summary:
    """Simulate one scenario to the end and summarise it."""
    fleet = simulate(profile, generate(workload), spec.mode, spec.p_engines, spec.decodes,
                     spec.prefix_hit, spec.fragmentation, spec.push_headroom, spec.planner)
    check_invariants(fleet)
    return summarize(fleet, workload.rate, spec.warmup)


def sweep(profile: Profile, workload: Workload, spec: Fleetspec, rates: Sequence[float],
          modes: Iterable[str] = MODES,
          progress: Callable[[Summary], None] | None = None) -> list[Summary]:
    """One summary per (mode, rate): the same prompts' lengths and seed at every rate."""
    rows = []
    for mode in modes:
        for rate in rates:
            s = run_one(profile, replace(workload, rate=rate), replace(spec, mode=mode))
            rows.append(s)
            if progress is not None:
                progress(s)
    return rows


def meets(s: Summary, slo: Slo) -> bool:
    """Whether one run meets the SLO (see the module docstring)."""
    key = f"p{slo.percentile}"
    if s.throughput < slo.keep_up * s.offered or key not in s.ttft:
        return False
    if s.ttft[key] > slo.ttft_ms:
        return False
    return slo.tpot_ms is None or s.tpot.get(key, float("inf")) <= slo.tpot_ms


def size_fleet(profile: Profile, workload: Workload, spec: Fleetspec, slo: Slo,
               max_engines: int = 16,
               progress: Callable[[Summary], None] | None = None) -> Sizing:
    """The fewest engines (P + D) meeting ``slo`` at ``workload.rate`` in ``spec.mode``.

    Fleets are tried by total size, smallest first; within a size every P/D split is tried and
    the one with the lowest TTFT at the SLO's percentile wins (fewer P on a tie). Stops at the
    first size with an answer, or after ``max_engines`` engines (then ``chosen`` is None).
    ``local`` tries D-only fleets from one D; ``auto`` every split from 0 P and one D; the
    others from 1P1D (module docstring).
    """
    if max_engines < 2:
        raise ConfigError("--max-engines: must be at least 2 (one P and one D)")
    tried: list[Summary] = []
    key = f"p{slo.percentile}"
    no_p = canonical_mode(spec.mode) in NO_P_MODES
    for total in range(1 if no_p else 2, max_engines + 1):
        ok: list[Summary] = []
        splits = [0] if spec.mode == "local" else range(0 if no_p else 1, total)
        for p in splits:
            s = run_one(profile, workload, replace(spec, prefills=p, decodes=total - p))
            tried.append(s)
            if progress is not None:
                progress(s)
            if meets(s, slo):
                ok.append(s)
        if ok:
            best = min(ok, key=lambda s: (s.ttft[key], s.prefills))
            return Sizing(workload.rate, spec.mode, slo, best, tried)
    return Sizing(workload.rate, spec.mode, slo, None, tried)


def _fleet(s: Summary) -> str:
    return f"{s.prefills}P{s.decodes}D"


def why_none(sizing: Sizing) -> str:
    """Why no fleet tried meets the SLO: the first test (keeping up, TTFT, TPOT) that the best
    of the fleets tried still fails, with its figure."""
    slo, tried = sizing.slo, sizing.tried
    if not tried:
        return "no fleet was tried"
    key = f"p{slo.percentile}"
    keeping = [s for s in tried if s.throughput >= slo.keep_up * s.offered]
    if not keeping:
        best = max(tried, key=lambda s: s.throughput / s.offered if s.offered else 0.0)
        return (f"no fleet keeps up: the best, {_fleet(best)}, completes "
                f"{best.throughput:.2f} req/s of {best.offered:.2f} offered (at least "
                f"{slo.keep_up:.0%} needed)")
    inf = float("inf")
    fast = min(keeping, key=lambda s: s.ttft.get(key, inf))
    if fast.ttft.get(key, inf) > slo.ttft_ms:
        return (f"the lowest TTFT {key} of a fleet that keeps up is "
                f"{fast.ttft.get(key, inf):.1f} ms ({_fleet(fast)}), over the SLO's "
                f"{slo.ttft_ms:g} ms")
    within = [s for s in keeping if s.ttft.get(key, inf) <= slo.ttft_ms]
    best = min(within, key=lambda s: s.tpot.get(key, inf))
    return (f"the lowest TPOT {key} of a fleet within the TTFT SLO is "
            f"{best.tpot.get(key, inf):.2f} ms ({_fleet(best)}), over the SLO's "
            f"{slo.tpot_ms:g} ms")
