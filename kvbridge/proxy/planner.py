"""The hand-off planner: per request, where its KV comes from, chosen by measured cost.

For each request the planner weighs three *paths* (:class:`Path`):

- ``local`` — D alone: the request goes to a decode engine without ``kv_transfer_params``; D
  prefills it, and its own prefix cache and offload tiers serve what they hold. No P is used.
- ``push`` / ``pull`` — P prefills and hands the KV off. Where D already holds a leading part
  (its prefix cache, its tiers) D keeps it and only the rest moves (the connector's partial
  receive), so the cost of a hand-off counts only the tokens D lacks.

Each path's expected TTFT comes from measurement: a :class:`CostModel` per path, a ridge
regression of the TTFTs the proxy observed for that path on features of the request
(:class:`Features`: tokens to compute, tokens to move, tokens the chosen D holds — in its prefix
cache, a host-memory tier or a disk tier, when the engines' KV events say which — and requests in
flight on the engine that prefills), each observation weighted by its recency (a half-life of
``half_life`` observations), so the costs follow a host that slows down or speeds up. Until a path
has ``warmup`` observations it is tried (``why=warmup``); afterwards one decision in
``explore_every`` *of its kind* (:func:`kind_of`: short, medium or long; nothing, part or most of
it held by D; held in D's prefix cache, a host-memory tier or a disk tier) goes to the path
other than the cheapest that was observed longest ago for that kind (``why=explore``), so a path
that got cheaper again for requests like it is noticed. An exploration waits (for the next request
of the kind) while the engine that would prefill on that path has prefill work queued: behind a
queue it would measure the queue, which the cost model knows already, and cost the request the
whole wait — in ``bench mix`` such explorations sent short prompts behind long prefills on P at
6–13 times D alone's estimate. An exploration that comes back well under its estimate (under
``1 - surprise`` of it) is tried again on a next request of that kind, until the estimate has
caught up (``why=recheck``): a recovery is followed within a few requests instead of one
exploration period each. A recheck is taken only where it could change the choice — where
the path would be the fastest were its estimate as far off as the exploration found (an
exploration that came back at half its estimate makes a path worth rechecking only where its
estimate is at most twice the fastest) — and one at a time per kind: a path whose estimate is ten
times the fastest because its engine is busy now is not what the exploration's surprise was about.

A hand-off to a D that holds part of the prompt in its offload tiers has two variants: D loads
that part from its tiers and P sends the rest (the default), or D's tiers are left out and P
sends it all (``Plan.d_tiers`` False, ``tiers=off`` in the header, ``kvbridge_tiers: false`` in
D's params) — chosen when the path's own cost model says reading the tier is slower than moving
the tokens, e.g. a disk tier that slowed down.

The choice (:meth:`Planner.choose`): the fastest path, except that ``local`` wins when it is
within ``tie`` of the fastest (``why=tie``: it leaves P free for others); otherwise
``why=fastest``, or ``why=slo_missed`` when even the fastest is expected to miss the request's
TTFT SLO. The **TPOT guard** leaves ``local`` out of the candidates first (``guard=tpot``), with a
TPOT SLO (``tpot_slo_ms``). A prefill on D stalls every stream decoding there for as long as it
runs, and a stall of *s* ms inside a stream of *n* tokens adds *s / (n - 1)* to its TPOT; so when
the caller knows the streams decoding on the chosen D (:class:`Stream`: their token budgets and
TPOTs so far, as the proxy does), ``local`` is left out when its prefill (``local.compute``
tokens at ``local``'s learnt cost per token) would push one of them past :data:`TPOT_MARGIN` of
the SLO that the prefill work already queued on D would not (:func:`stalled_streams`). And, for
the stalls that add up where none alone pushes a stream over: while D's measured TPOT
(``d_tpot_ms``, an average of its recent streams, :func:`smoothed_tpot`) is past
:data:`TPOT_GUARD` of the SLO, a prefill that would take D more than half an SLO is handed off.
The guard yields (``guard=tpot_yield``) where it would put one stream at risk and every
hand-off is expected to miss the request's TTFT SLO that D alone is expected to meet: one sure
miss against one possible one, and the request's TTFT kept out of the queue behind P (in
``bench mix`` at 6 req/s, requests the guard sent to a queued P set the planner's TTFT p99).
(In ``kvbridge simulate``, either rule alone lost goodput to the two together on some
workload.) The proxy
(:mod:`kvbridge.proxy.planning`) and the simulator (``kvbridge simulate --mode plan``) both
decide through it. The estimates of every path go into the :class:`Plan`, which the proxy
returns as the ``X-KVBridge-Plan`` header.

Plain data and arithmetic (numpy for a 4x4 solve): no I/O, no aiohttp. Not thread-safe: the
proxy's event loop owns the planner.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TPOT_GUARD", "TPOT_MARGIN", "CostModel", "Features", "Path", "Plan", "Planner",
           "PlannerSettings", "Stream", "kind_of", "smoothed_tpot", "stalled_streams"]


class Path(enum.StrEnum):
    """Where a request's KV comes from (module docstring)."""

    LOCAL = "local"
    PUSH = "push"
    PULL = "pull"


@dataclass(frozen=True)
class Features:
    """What a path costs for one request, in the units the cost models use."""

    compute: float
    """Prompt tokens the prefilling engine computes (its own prefix-cache hit taken off)."""
    move: float
    """Prompt tokens that move from P to D (0 for ``local``)."""
    held: float
    """Prompt tokens the chosen D holds already in its prefix cache (or, when the proxy cannot
    tell where, anywhere) and reuses."""
    queue: float
    """Prompt tokens already sent to the engine that prefills (D for ``local``, P otherwise)
    and not yet past their first token: the prefill work ahead of this one."""
    cpu: float = 0.0
    """Prompt tokens the chosen D holds only in a host-memory tier (KV events' medium CPU)."""
    storage: float = 0.0
    """Prompt tokens the chosen D holds only in a disk or remote tier (medium STORAGE)."""
    decodes: float = 0.0
    """``local``: requests in flight on D, whose decode steps D's prefill shares."""

    def vector(self) -> np.ndarray:
        """The cost models' inputs. The work queued ahead is computed by the same engine at the
        same cost per token as the prompt, so it is counted with the computed tokens; its own
        column carries it once more, for what a queued token costs beyond that (prior 0)."""
        return np.array([1.0, (self.compute + self.queue) / 1000.0, self.move / 1000.0,
                         self.held / 1000.0, self.queue / 1000.0, self.cpu / 1000.0,
                         self.storage / 1000.0, self.decodes])


#: Prior coefficients (ms): fixed cost, per 1000 computed tokens (those queued ahead included), per
#: 1000 moved tokens, per 1000 held tokens, per 1000 prefill tokens queued ahead beyond what
#: computing them costs, per 1000 tokens from a host-memory tier, per 1000 from a disk or remote
#: tier, per request decoding on D (D alone). Only the first few
#: decisions of a path lean on them, and a coefficient no recent observation informs drifts back
#: to its prior: reading a tier is assumed cheaper than moving the tokens from P, so a tier found
#: slow is tried again once its slow observations have aged out.
_PRIORS: dict[Path, tuple[float, ...]] = {
    Path.LOCAL: (10.0, 100.0, 0.0, 2.0, 0.0, 2.0, 5.0, 5.0),
    Path.PUSH: (20.0, 100.0, 10.0, 2.0, 0.0, 2.0, 5.0, 0.0),
    Path.PULL: (30.0, 100.0, 10.0, 2.0, 0.0, 2.0, 5.0, 0.0),
}
_FEATURES = 8
#: Index of the per-1000-queued-tokens coefficient in a cost model's ``coef``.
QUEUE = 4
#: Index of the per-1000-computed-tokens coefficient in a cost model's ``coef``.
COMPUTE = 1
#: Index of the per-decoding-request coefficient (D alone) in a cost model's ``coef``.
DECODES = 7

TPOT_GUARD = 0.75
"""The share of the TPOT SLO a D's measured TPOT may reach before long prefills leave it: a mean
of the last requests' TPOTs at 75 % of the SLO already has a tail past it."""

TPOT_MARGIN = 0.9
"""The share of the TPOT SLO a stall may push a stream decoding on D to (:func:`stalled_streams`):
the stream's TPOT so far and the stall are estimates. In ``bench mix`` (seeds 6 and 7, 6 req/s)
a third of the planner's misses were streams it had kept on D that ended 1–3 ms past a 40 ms
SLO."""


@dataclass(frozen=True)
class Stream:
    """A stream decoding on a D, as the TPOT guard sees it."""

    tokens: int
    """The tokens it may produce (its ``max_tokens``): a stall is spread over them."""
    tpot_ms: float | None = None
    """Its TPOT so far (ms); None when not measured yet (D's measured TPOT stands in)."""
    started: bool = True
    """Whether its first token is out: the prefill work queued on D before a stream starts
    runs before its first token, outside its TPOT (its own prefill among it)."""


def stalled_streams(streams: Iterable[Stream], ahead_ms: float, prefill_ms: float,
                    slo_ms: float, d_tpot_ms: float | None, margin: float = 1.0) -> int:
    """How many of ``streams`` a prefill of ``prefill_ms`` on their D would push past
    ``margin`` of the TPOT SLO ``slo_ms``, beyond the ``ahead_ms`` of prefill work already
    queued there (which stalls only the streams already started): a stall of *s* ms adds
    *s / (tokens - 1)* to a stream's TPOT. With ``margin`` under 1, a stream already within
    the margin (between ``margin * slo_ms`` and ``slo_ms``) counts for any stall: its TPOT and
    the stall are estimates. A stream past the SLO already, or of fewer than 2 tokens, is not
    counted; one not measured yet is taken at ``d_tpot_ms`` (0 when that is None too)."""
    limit = slo_ms * margin
    count = 0
    for s in streams:
        if s.tokens < 2:
            continue
        now = s.tpot_ms if s.tpot_ms is not None else (d_tpot_ms or 0.0)
        before = now + (ahead_ms / (s.tokens - 1) if s.started else 0.0)
        if before <= slo_ms and before + prefill_ms / (s.tokens - 1) > limit:
            count += 1
    return count


def smoothed_tpot(old: float | None, tpot_ms: float) -> float:
    """A D's measured TPOT (ms) once one more of its streams ended with ``tpot_ms``: an
    exponential average of its last streams (``old`` None: the first)."""
    return tpot_ms if old is None else 0.7 * old + 0.3 * tpot_ms


def kind_of(features: Mapping[Path, Features]) -> tuple[int, int, int]:
    """A request's kind for exploration: (0, 1, 2 for under 256, under 2048, more prompt tokens;
    0, 1, 2 for none, under half, at least half of them held by the chosen D; 0, 1, 2 for most
    of what D holds being in its prefix cache, a host-memory tier, a disk tier)."""
    f = next(iter(features.values()))
    held = f.held + f.cpu + f.storage
    tokens = f.compute + held if Path.LOCAL in features else f.move + held
    f = features.get(Path.LOCAL, f)
    held = f.held + f.cpu + f.storage
    size = 0 if tokens < 256 else (1 if tokens < 2048 else 2)
    share = 0 if held <= 0 else (1 if held < tokens / 2 else 2)
    medium = max(range(3), key=lambda i: (f.held, f.cpu, f.storage)[i]) if held > 0 else 0
    return size, share, medium


class CostModel:
    """One path's TTFT in ms as a function of :class:`Features`, fit to what was observed.

    A recency-weighted ridge regression towards ``prior``: observation ``i`` of the last
    ``window`` weighs ``0.5 ** (age / half_life)``, and ``ridge`` pulls each coefficient towards
    its prior with the weight of that many observations. Predictions are at least 0.
    """

    def __init__(self, prior: Iterable[float], window: int = 64, half_life: float = 8.0,
                 ridge: float = 0.05) -> None:
        self.prior = np.array(list(prior), dtype=float)
        if self.prior.shape != (_FEATURES,):
            raise ValueError(f"a prior has {_FEATURES} coefficients")
        self.window = window
        self.half_life = half_life
        self.ridge = ridge
        self._seen: collections.deque[tuple[np.ndarray, float]] = collections.deque(
            maxlen=window)
        self.coef = self.prior.copy()
        self.count = 0

    def predict(self, f: Features) -> float:
        return max(0.0, float(f.vector() @ self.coef))

    def observe(self, f: Features, ttft_ms: float) -> None:
        """Add one observed TTFT (ms) and refit. A non-finite or negative value is ignored."""
        if not math.isfinite(ttft_ms) or ttft_ms < 0:
            return
        self._seen.append((f.vector(), float(ttft_ms)))
        self.count += 1
        n = len(self._seen)
        x = np.stack([v for v, _ in self._seen])
        y = np.array([t for _, t in self._seen])
        w = 0.5 ** (np.arange(n - 1, -1, -1) / self.half_life)
        scale = np.maximum(np.abs(x).max(axis=0), 1e-3)  # ridge in each feature's own units
        lam = self.ridge * np.diag(scale ** 2)
        a = (x * w[:, None]).T @ x + lam
        b = (x * w[:, None]).T @ y + lam @ self.prior
        try:
            self.coef = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:  # cannot happen with a positive ridge; keep the last fit
            pass


@dataclass(frozen=True)
class PlannerSettings:
    """The planner's knobs; the proxy's ``--plan-*`` flags map one to one."""

    ttft_slo_ms: float = 0.0
    """Default TTFT SLO (ms) of a request without the ``X-KVBridge-TTFT-SLO-Ms`` header; 0:
    none. A plan expected to miss it says ``why=slo_missed``."""
    tpot_slo_ms: float = 0.0
    """TPOT SLO (ms) of the decode engines' streams; 0: none. While a D's recent TPOT is near
    it, requests whose prefill would stall D's decodes are not served by D alone."""
    tie: float = 0.1
    """``local`` wins when its estimate is within this share of the fastest."""
    warmup: int = 3
    """Observations of a path before its estimate is trusted."""
    explore_every: int = 16
    """One decision in this many of a kind goes to another path than the cheapest, the one
    observed longest ago for that kind (0: never); the first one after, when that path's
    prefilling engine has work queued."""
    half_life: float = 8.0
    """Observations after which one weighs half as much in a path's cost model."""
    surprise: float = 0.25
    """An exploration that comes back under ``1 - surprise`` of its estimate is rechecked on
    the next request of its kind."""


@dataclass(frozen=True)
class Plan:
    """One request's chosen path, why, and every path's estimate (ms)."""

    path: Path
    why: str
    estimates: Mapping[Path, float]
    features: Mapping[Path, Features] = field(default_factory=dict)
    d_tiers: bool = True
    """A hand-off: whether D's offload tiers load what they hold (False: P sends it all)."""
    guard: str = ""
    """Why a path was left out of the candidates (``tpot``: D's decodes at their TPOT SLO)."""

    def header(self) -> str:
        """The ``X-KVBridge-Plan`` value: ``path=push; est_ms=41.0; local=80.2; push=41.0;
        pull=55.3; why=fastest``."""
        parts = [f"path={self.path.value}"]
        if self.path in self.estimates:
            parts.append(f"est_ms={self.estimates[self.path]:.1f}")
        parts += [f"{p.value}={self.estimates[p]:.1f}" for p in Path if p in self.estimates]
        if not self.d_tiers:
            parts.append("tiers=off")
        if self.guard:
            parts.append(f"guard={self.guard}")
        parts.append(f"why={self.why}")
        return "; ".join(parts)


class Planner:
    """The cost models of the three paths and the choice between them (module docstring)."""

    def __init__(self, settings: PlannerSettings | None = None) -> None:
        self.settings = s = settings or PlannerSettings()
        self.models = {p: CostModel(_PRIORS[p], half_life=s.half_life) for p in Path}
        self._decisions = 0
        self._observed = 0
        #: per request kind: its decisions since its last exploration, and when each path was
        #: last observed for it
        self._kinds: dict[tuple[int, int, int], dict[str, int]] = {}
        #: per request kind: a path whose last exploration came back well under its estimate,
        #: and the share of the estimate it took (observed / estimated)
        self._again: dict[tuple[int, int, int], tuple[Path, float]] = {}

    def estimate(self, path: Path, f: Features) -> float:
        return self.models[path].predict(f)

    def stalls(self, local: Features, d_tpot_ms: float | None,
               streams: Iterable[Stream] | None = None) -> int:
        """The TPOT guard (module docstring): how many of ``streams``, those decoding on D, this
        prefill (``local.compute`` tokens at ``local``'s learnt cost per token) would push
        past :data:`TPOT_MARGIN` of the TPOT SLO (:func:`stalled_streams`, after the
        ``local.queue`` tokens queued ahead of it; not checked when ``streams`` is None); else
        1 when D's measured TPOT ``d_tpot_ms`` is past :data:`TPOT_GUARD` of the SLO and the
        prefill would take D more than half an SLO (many short stalls add up where no single
        one pushes a stream over); else 0."""
        slo = self.settings.tpot_slo_ms
        if slo <= 0:
            return 0
        per_token = max(0.0, float(self.models[Path.LOCAL].coef[COMPUTE])) / 1000.0
        if streams is not None:
            count = stalled_streams(streams, local.queue * per_token,
                                    local.compute * per_token, slo, d_tpot_ms, TPOT_MARGIN)
            if count:
                return count
        if d_tpot_ms is None or d_tpot_ms < TPOT_GUARD * slo:
            return 0
        return int(local.compute * per_token > 0.5 * slo)

    def _only_local_meets(self, features: Mapping[Path, Features], slo_ms: float | None) -> bool:
        """Whether D alone is expected to meet the request's TTFT SLO and every hand-off to
        miss it (False without an SLO)."""
        slo = self.settings.ttft_slo_ms if slo_ms is None else slo_ms
        hand, _ = self._tier_variants({p: f for p, f in features.items() if p is not Path.LOCAL})
        if slo <= 0 or not hand:
            return False
        return (self.estimate(Path.LOCAL, features[Path.LOCAL]) <= slo
                < min(self.estimate(p, f) for p, f in hand.items()))

    def choose(self, features: Mapping[Path, Features], slo_ms: float | None = None, *,
               d_tpot_ms: float | None = None, streams: Iterable[Stream] | None = None,
               dry_run: bool = False) -> Plan:
        """The path for a request whose possible paths (those with an engine to take them) have
        ``features``; ``slo_ms`` overrides the default SLO (0: none); ``d_tpot_ms``: the
        measured TPOT of the D ``local`` would use (None: not measured) and ``streams`` those
        decoding on it (None: not known), for the TPOT guard (:meth:`stalls`: ``local`` left
        out, ``guard=tpot`` in the plan, when another path is possible; ``guard=tpot_yield``
        when it would stall one stream only and every hand-off is expected to miss the TTFT
        SLO that D alone is expected to meet: ``local`` stays a candidate). Counts as one
        decision, unless ``dry_run``: then nothing is counted and nothing explored (what would
        it choose now?). A hand-off whose D holds part of the
        prompt in its tiers is planned with D's tiers off (P sends those tokens too) when that
        is expected to be faster."""
        if not features:
            raise ValueError("no path to choose from")
        guard = ""
        if len(features) > 1 and Path.LOCAL in features:
            stalled = self.stalls(features[Path.LOCAL], d_tpot_ms, streams)
            if stalled == 1 and self._only_local_meets(features, slo_ms):
                guard = "tpot_yield"  # one stream at risk against this request's sure miss
            elif stalled:
                features = {p: f for p, f in features.items() if p is not Path.LOCAL}
                guard = "tpot"
        if not dry_run:
            self._decisions += 1
        kind = kind_of(features)
        features, off = self._tier_variants(features)
        est = {p: self.estimate(p, f) for p, f in features.items()}
        path, why = self._pick(kind, est, {p: f.queue for p, f in features.items()}, slo_ms,
                               dry_run)
        return Plan(path, why, est, features, d_tiers=path not in off, guard=guard)

    def _tier_variants(self, features: Mapping[Path, Features]
                       ) -> tuple[dict[Path, Features], set[Path]]:
        """``features`` with each hand-off whose D holds tier tokens replaced by its tiers-off
        variant (those tokens move from P instead) where that one is estimated cheaper; and
        the paths so replaced."""
        out = dict(features)
        off: set[Path] = set()
        for p, f in features.items():
            if p is Path.LOCAL or f.cpu + f.storage <= 0:
                continue
            alt = Features(f.compute, f.move + f.cpu + f.storage, f.held, f.queue,
                           decodes=f.decodes)
            if self.estimate(p, alt) < self.estimate(p, f):
                out[p] = alt
                off.add(p)
        return out, off

    def _pick(self, kind: tuple[int, int, int], est: Mapping[Path, float],
              queued: Mapping[Path, float], slo_ms: float | None,
              dry_run: bool) -> tuple[Path, str]:
        s = self.settings
        cold = [p for p in Path if p in est and self.models[p].count < s.warmup]
        if cold and not dry_run:
            return min(cold, key=lambda p: self.models[p].count), "warmup"
        seen = self._kinds.setdefault(kind, {"since": 0, **{p.value: -1 for p in Path}})
        seen["since"] += 0 if dry_run else 1
        best = min(est, key=lambda p: est[p])
        again = self._recheck(kind, est, best)
        if again is not None and not dry_run:
            del self._again[kind]  # one recheck in flight per kind; observe() re-arms it
            return again, "recheck"
        if s.explore_every and not dry_run and len(est) > 1 and seen["since"] >= s.explore_every:
            path = min((p for p in est if p is not best), key=lambda p: seen[p.value])
            if queued.get(path, 0.0) <= 0:  # else: deferred to a request its engine is free for
                seen["since"] = 0
                return path, "explore"
        slo = s.ttft_slo_ms if slo_ms is None else slo_ms
        fastest = min(est, key=lambda p: (est[p], p is not Path.LOCAL))
        if slo > 0 and est[fastest] > slo:
            return fastest, "slo_missed"
        if (fastest is not Path.LOCAL and Path.LOCAL in est
                and est[Path.LOCAL] <= est[fastest] * (1.0 + s.tie)):
            return Path.LOCAL, "tie"
        return fastest, "fastest"

    def _recheck(self, kind: tuple[int, int, int], est: Mapping[Path, float],
                 best: Path) -> Path | None:
        """The path to recheck for a request of ``kind`` with estimates ``est``: the one whose
        exploration came back well under its estimate, when it is possible, not the cheapest
        already, and would be the cheapest were its estimate off by as much as then."""
        again = self._again.get(kind)
        if again is None:
            return None
        path, ratio = again
        if path not in est or path is best or est[path] * ratio > est[best]:
            return None
        return path

    def observe(self, plan: Plan, path: Path, ttft_ms: float) -> None:
        """Request planned as ``plan`` went ``path`` (a fallback may differ from the plan) and
        its first token came ``ttft_ms`` after the proxy got it."""
        f = plan.features.get(path)
        if f is None:
            return
        self.models[path].observe(f, ttft_ms)
        self._observed += 1
        kind = kind_of(plan.features)
        seen = self._kinds.setdefault(kind, {"since": 0, **{p.value: -1 for p in Path}})
        seen[path.value] = self._observed
        expected = plan.estimates.get(path)
        if (plan.why in ("explore", "recheck") and expected is not None
                and ttft_ms < (1.0 - self.settings.surprise) * expected):
            self._again[kind] = (path, ttft_ms / expected)
        elif self._again.get(kind, (None, 0.0))[0] is path:
            del self._again[kind]

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """Each path's coefficients and observation count (for ``/admin`` and tests)."""
        names = ("base_ms", "ms_per_1k_compute", "ms_per_1k_move", "ms_per_1k_held",
                 "ms_per_1k_queued", "ms_per_1k_cpu_tier", "ms_per_1k_storage_tier",
                 "ms_per_decoding")
        return {p.value: {"observations": m.count,
                          **{n: round(float(c), 3) for n, c in zip(names, m.coef, strict=True)}}
                for p, m in self.models.items()}
