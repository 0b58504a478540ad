"""Least squares for the calibration: fits that keep every coefficient non-negative.

Contract: pure numpy, no I/O; shared by :mod:`kvbridge.tools.simulate.calibrate` (step costs)
and :mod:`kvbridge.tools.simulate.calibrate_cpu` (the front ends' CPU costs), which is why it
is neither's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["nonneg_lstsq"]


def nonneg_lstsq(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Non-negative least squares by clipping (coefficients the data cannot resolve are 0)."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    coef = np.linalg.lstsq(a, b, rcond=None)[0]
    for _ in range(len(coef)):
        neg = coef < 0
        if not neg.any():
            break
        keep = ~neg
        coef = np.zeros_like(coef)
        coef[keep] = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
    return [max(0.0, float(c)) for c in coef]
