"""The workshop's one table printer and one percentile, and the medians' confidence intervals.

Every bench, the demo, the doctor and the CLI print tables with :func:`table` /
:func:`print_table` (and JSON with :func:`print_json`) and take percentiles with
:func:`percentile` (Prometheus text is read by :mod:`kvbridge.tools.prom`), so two reports of
one number always agree.

:func:`median_ci` is a distribution-free confidence interval for a median: with the ``n``
values sorted, the interval ``[x(k), x(n-k+1)]`` holds the true median with probability
``1 - 2 P(B <= k-1)`` for ``B ~ Binomial(n, 1/2)`` (the sign-test interval), whatever the
distribution of the values. ``k`` is the largest that keeps that probability at least the
asked confidence; for too few values (fewer than 6 at 95 %) the interval is ``[min, max]`` and
the coverage it reports is lower than asked. No resampling, so the same values always give the
same interval. Pure functions; only the two printers write (to standard output).
"""

from __future__ import annotations

import fractions
import json
import math
import shutil
import statistics
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MedianCI", "median_ci", "paired_ratios", "percentile", "print_json", "print_table",
           "size_label", "table", "terminal_width"]


@dataclass(frozen=True)
class MedianCI:
    """A median and its confidence interval; ``coverage`` is the exact coverage achieved."""

    median: float
    low: float
    high: float
    coverage: float
    n: int

    def format(self, digits: int = 3) -> str:
        """``0.973 [0.95, 0.99]``."""
        return (f"{self.median:.{digits}f} [{self.low:.{digits - 1}f}, "
                f"{self.high:.{digits - 1}f}]")


def median_ci(values: Sequence[float], confidence: float = 0.95) -> MedianCI:
    """The median of ``values`` with its order-statistics interval (see the module docstring).

    Raises :class:`ValueError` for no values or a confidence outside (0, 1).
    """
    if len(values) == 0:
        raise ValueError("median_ci needs at least one value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    xs = sorted(float(v) for v in values)
    n = len(xs)
    alpha = fractions.Fraction(1.0 - confidence)  # exact: 2**n is past a float from n = 1024
    total = 2 ** n
    # j values are left out on each side while 2 * P(B <= j) stays within alpha
    j, tail = 0, 1  # tail = 2**n * P(B <= j)
    while j + 1 < (n + 1) // 2:
        nxt = tail + math.comb(n, j + 1)
        if 2 * nxt > alpha * total:
            break
        j, tail = j + 1, nxt
    return MedianCI(statistics.median(xs), xs[j], xs[n - 1 - j], 1.0 - 2 * tail / total, n)


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """``numerators[i] / denominators[i]`` for each pair (equal lengths, positive values)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators")
    if any(d <= 0 for d in denominators) or any(x < 0 for x in numerators):
        raise ValueError("ratios need positive denominators and non-negative numerators")
    return [x / d for x, d in zip(numerators, denominators, strict=True)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (``q`` in 0..100) of ``values``: ``numpy.percentile`` with
    ``method="linear"`` (numpy's default, Hyndman and Fan's type 7, as ``vllm bench serve``
    reports and as every result so far was computed): the sorted values' position
    ``(n - 1) * q / 100``, interpolated between its two neighbours. So one value is every
    percentile; of two, p90 is ``a + 0.9 (b - a)``; of 1..10, p50 is 5.5 and p90 is 9.1. None and
    NaN are skipped; None for no values. Raises :class:`ValueError` for ``q`` outside 0..100."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    import numpy as np  # here: the CLI's entry imports this module and stays light

    data = np.asarray([v for v in values if v is not None], dtype=float)
    data = data[~np.isnan(data)]
    if data.size == 0:
        return None
    return float(np.percentile(data, q, method="linear"))


def size_label(nbytes: int) -> str:
    """``16 KiB``, ``1 MiB``, else ``… B``."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def table(head: Sequence[str], rows: Sequence[Sequence[object]],
          align: str | Sequence[str] = "l", width: int | None = None) -> list[str]:
    """Aligned columns with a dashed rule under the header, as lines. ``align`` is ``"l"`` or
    ``"r"`` for every column, or one letter per column. ``width``: wrap the last column's cells
    (at blanks; a longer word is cut) onto continuation lines so that lines stay within
    ``width`` characters, or within the other columns plus 20 when they leave less; None or
    0: no wrapping."""
    cells = [[str(h) for h in head]] + [[str(c) for c in r] for r in rows]
    sides = [align] * len(head) if isinstance(align, str) else list(align)
    if len(sides) != len(head) or any(a not in ("l", "r") for a in sides):
        raise ValueError(f"align needs 'l' or 'r' for each of {len(head)} columns: {align!r}")
    if width:
        cells = [cells[0], *(line for r in cells[1:] for line in _wrapped(r, cells, width))]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                     for c, w, a in zip(r, widths, sides, strict=True)).rstrip() for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def _wrapped(row: list[str], cells: list[list[str]], width: int) -> list[list[str]]:
    """``row`` with its last cell wrapped (see :func:`table`)."""
    fixed = sum(max(len(r[i]) for r in cells) + 2 for i in range(len(row) - 1))
    parts = textwrap.wrap(row[-1], max(20, width - fixed), break_on_hyphens=False) or [""]
    return [[*row[:-1], parts[0]], *([*([""] * (len(row) - 1)), p] for p in parts[1:])]


def terminal_width(default: int = 100) -> int:
    """The terminal's width (``$COLUMNS`` first), else ``default`` (output to a pipe or file)."""
    return shutil.get_terminal_size((default, 24)).columns


def print_table(head: Sequence[str], rows: Sequence[Sequence[object]],
                align: str | Sequence[str] = "l", width: int | None = None) -> None:
    """Print :func:`table` to standard output."""
    print("\n".join(table(head, rows, align, width)))


def print_json(value: Any) -> None:
    """Print ``value`` as indented JSON (keys in their order) to standard output."""
    json.dump(value, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
