"""The workshop's one Prometheus reader: series of text exposition, parsed, not grepped (tests,
benches, the simulator's calibration).

Every reader parses with ``prometheus_client.parser.text_string_to_metric_families``, so a
sample line carrying a timestamp (``name{l="v"} 3 1700000000000``), labels in any order, escaped
label values and lookalike names (``x_sum_other`` for ``x_sum``) read as Prometheus reads them.
:func:`fetch` is the one place that asks a server's ``/metrics``. prometheus_client (the
``proxy`` extra) is imported when a text is parsed, so the CLI starts without it.
"""

from __future__ import annotations

import urllib.request

__all__ = ["by_label", "fetch", "histogram", "samples", "total", "value"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def fetch(url: str, timeout: float = 10.0) -> str:
    """The text of ``url``'s ``/metrics`` (``url`` is the server's base, e.g. an engine's)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return str(r.read().decode("utf-8", "replace"))


def samples(text: str) -> Samples:
    """Every sample of ``text`` keyed by (name, sorted label pairs); a sample's timestamp is
    not part of its value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of series ``name`` with exactly ``labels``; None when absent."""
    return samples(text).get((name, tuple(sorted(labels.items()))))


def total(text: str, name: str, **labels: str) -> float:
    """The sum of every series ``name`` of ``text`` whose labels include ``labels`` (none given:
    all label sets); 0.0 when absent."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples(text).items() if n == name and want <= set(lab))


def histogram(text: str, name: str, **labels: str) -> tuple[float, float]:
    """(sum, count) of histogram (or summary) ``name`` over the label sets that include
    ``labels``: its ``name_sum`` and ``name_count`` series, as :func:`total` adds them."""
    return total(text, name + "_sum", **labels), total(text, name + "_count", **labels)


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Series ``name`` summed by the value of ``label`` (series without it are left out)."""
    out: dict[str, float] = {}
    for (n, lab), v in samples(text).items():
        key = dict(lab).get(label)
        if n == name and key is not None:
            out[key] = out.get(key, 0.0) + v
    return out
