"""Statistics and table formatting shared by ``kvbridge bench transfer`` and ``descriptors``.

:func:`median_ci` is a distribution-free confidence interval for a median: with the ``n``
values sorted, the interval ``[x(k), x(n-k+1)]`` holds the true median with probability
``1 - 2 P(B <= k-1)`` for ``B ~ Binomial(n, 1/2)`` (the sign-test interval), whatever the
distribution of the values. ``k`` is the largest that keeps that probability at least the
asked confidence; for too few values (fewer than 6 at 95 %) the interval is ``[min, max]`` and
the coverage it reports is lower than asked. No resampling, so the same values always give the
same interval. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MedianCI", "median_ci", "paired_ratios", "percentile", "size_label", "table"]


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
    alpha = 1.0 - confidence
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


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank on the sorted values."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def size_label(nbytes: int) -> str:
    """``16 KiB``, ``1 MiB``, else ``… B``."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Right-aligned columns, a dashed line under the header."""
    cells = [list(head)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out
