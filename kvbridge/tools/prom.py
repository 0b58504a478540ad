"""The workshop's one Prometheus reader: series of text exposition, parsed, not grepped (tests,
benches, the simulator's calibration)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["samples", "value", "total"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of ``text`` keyed by (name, sorted label pairs)."""
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of series ``name`` with exactly ``labels``; None when absent."""
    return samples(text).get((name, tuple(sorted(labels.items()))))


def total(text: str, name: str) -> float:
    """The sum of every series ``name`` of ``text`` (all label sets); 0.0 when absent."""
    return sum(v for (n, _), v in samples(text).items() if n == name)
