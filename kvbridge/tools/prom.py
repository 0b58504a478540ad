"""Read Prometheus text exposition in tests: the value of one series, parsed, not grepped."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["samples", "value"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of ``text`` keyed by (name, sorted label pairs)."""
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of series ``name`` with exactly ``labels``; None when absent."""
    return samples(text).get((name, tuple(sorted(labels.items()))))
