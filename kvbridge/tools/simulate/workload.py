"""The requests a simulation serves: arrival times, prompt and output lengths.

:func:`generate` draws them from a :class:`Workload` (Poisson or evenly spaced arrivals at a
rate, fixed or uniformly drawn lengths) with a seeded numpy generator, so a run is a pure
function of its inputs. :func:`load_trace` reads recorded arrivals instead: a JSON list of
``{"arrival_s": float, "prompt_len": int, "output_len": int}`` objects, or a CSV with those
three columns; every row is checked (bounded count, finite non-negative times, positive lengths).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError

__all__ = ["RequestSpec", "Workload", "Lengths", "generate", "vllm_arrivals", "load_trace",
           "MAX_REQUESTS"]

MAX_REQUESTS = 1_000_000
_MAX_TRACE_BYTES = 64 << 20


@dataclass(frozen=True)
class RequestSpec:
    """One client request: when it arrives and how long its prompt and answer are."""

    arrival: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Lengths:
    """A length distribution: ``low`` when ``high`` is None, else uniform on [low, high]."""

    low: int
    high: int | None = None

    @classmethod
    def parse(cls, text: str, option: str) -> Lengths:
        """``"16384"`` or ``"100-300"``; ConfigError naming ``option`` otherwise."""
        parts = text.split("-")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ConfigError(f"{option}: expected N or LOW-HIGH tokens, got {text!r}") from None
        if len(values) > 2 or any(v <= 0 for v in values) or (
                len(values) == 2 and values[1] < values[0]):
            raise ConfigError(f"{option}: expected N or LOW-HIGH with 0 < LOW <= HIGH, "
                              f"got {text!r}")
        return cls(values[0], values[1] if len(values) == 2 else None)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.high is None or self.high == self.low:
            return np.full(n, self.low, dtype=np.int64)
        return rng.integers(self.low, self.high + 1, size=n)

    def __str__(self) -> str:
        return str(self.low) if self.high is None else f"{self.low}-{self.high}"

    @property
    def mean(self) -> float:
        return self.low if self.high is None else (self.low + self.high) / 2


@dataclass(frozen=True)
class Workload:
    """Arrivals at ``rate`` req/s for ``requests`` requests (``arrival``: poisson | uniform |
    vllm, see :func:`vllm_arrivals`)."""

    rate: float
    requests: int
    prompt: Lengths
    output: Lengths
    arrival: str = "poisson"
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ConfigError(f"--rate: must be a positive number, got {self.rate!r}")
        if not 0 < self.requests <= MAX_REQUESTS:
            raise ConfigError(f"--requests: must be 1..{MAX_REQUESTS}, got {self.requests}")
        if self.arrival not in ("poisson", "uniform", "vllm"):
            raise ConfigError(f"--arrival: poisson, uniform or vllm, got {self.arrival!r}")


def vllm_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """The send times of ``vllm bench serve --request-rate rate --num-prompts n --seed seed``
    (vLLM 0.32, ``vllm/benchmarks/serve.py``): ``np.random.seed(seed)``, one gamma(1, 1/rate)
    gap per request (burstiness 1: exponential), cumulated, then rescaled so that the last
    request leaves at ``n / rate``. The first leaves after its own gap, not at 0. Exact when
    the dataset draws from its own generator (``random``, ``sonnet``; not ``sharegpt``)."""
    gaps = np.random.RandomState(seed).gamma(1.0, 1.0 / rate, size=n)
    times = np.cumsum(gaps)
    return times * ((n / rate) / times[-1]) if times[-1] > 0 else times


def generate(w: Workload) -> list[RequestSpec]:
    """The requests of ``w``; the same ``w`` always gives the same list."""
    rng = np.random.default_rng(w.seed)
    if w.arrival == "vllm":
        times = vllm_arrivals(w.requests, w.rate, w.seed)
        prompts = w.prompt.draw(rng, w.requests)
        outputs = w.output.draw(rng, w.requests)
        return [RequestSpec(float(t), int(p), int(o))
                for t, p, o in zip(times, prompts, outputs, strict=True)]
    if w.arrival == "poisson":
        gaps = rng.exponential(1.0 / w.rate, size=w.requests)
        gaps[0] = 0.0
    else:
        gaps = np.full(w.requests, 1.0 / w.rate)
        gaps[0] = 0.0
    times = np.cumsum(gaps)
    prompts = w.prompt.draw(rng, w.requests)
    outputs = w.output.draw(rng, w.requests)
    return [RequestSpec(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs,
                                                                     strict=True)]


def _row(obj: Any, n: int) -> RequestSpec:
    where = f"trace row {n}"
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: must be an object with arrival_s, prompt_len, output_len")
    try:
        t = float(obj["arrival_s"])
        p, o = int(obj["prompt_len"]), int(obj["output_len"])
    except KeyError as exc:
        raise ConfigError(f"{where}: missing {exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not math.isfinite(t) or t < 0:
        raise ConfigError(f"{where}: arrival_s must be finite and >= 0, got {t!r}")
    if p <= 0 or o <= 0:
        raise ConfigError(f"{where}: prompt_len and output_len must be > 0")
    return RequestSpec(t, p, o)


def load_trace(path: Path) -> list[RequestSpec]:
    """Requests recorded in ``path`` (JSON list or CSV), sorted by arrival."""
    try:
        if path.stat().st_size > _MAX_TRACE_BYTES:
            raise ConfigError(f"--trace: {path} is larger than {_MAX_TRACE_BYTES} bytes")
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--trace: cannot read {path}: {exc}") from None
    rows: Sequence[Any]
    if path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        try:
            rows = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--trace: {path} is not JSON: {exc}") from None
        if not isinstance(rows, list):
            raise ConfigError(f"--trace: {path} must hold a JSON list of requests")
    if not rows or len(rows) > MAX_REQUESTS:
        raise ConfigError(f"--trace: {path} must hold 1..{MAX_REQUESTS} requests")
    specs = sorted((_row(r, i) for i, r in enumerate(rows)), key=lambda s: s.arrival)
    t0 = specs[0].arrival
    return [RequestSpec(s.arrival - t0, s.prompt_len, s.output_len) for s in specs]
