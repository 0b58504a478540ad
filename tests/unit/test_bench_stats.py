"""kvbridge.tools.report: the median's order-statistics interval, paired ratios, formatting."""

from __future__ import annotations

import math
import random

import pytest

from kvbridge.tools.report import (
    MedianCI,
    median_ci,
    paired_ratios,
    percentile,
    size_label,
    table,
)


def test_interval_of_ten_values_is_the_textbook_one() -> None:
    ci = median_ci([float(v) for v in range(1, 11)])
    # n = 10 at 95 %: [x(2), x(9)], coverage 1 - 2 * 11/1024
    assert (ci.median, ci.low, ci.high, ci.n) == (5.5, 2.0, 9.0, 10)
    assert ci.coverage == pytest.approx(1 - 22 / 1024)


def test_interval_of_thirty_values() -> None:
    values = list(range(30))
    random.Random(1).shuffle(values)  # order does not matter
    ci = median_ci(values)
    assert (ci.low, ci.high) == (9.0, 20.0)  # x(10), x(21)
    assert 0.95 <= ci.coverage < 0.96


def test_coverage_at_least_the_confidence_when_enough_values() -> None:
    for n in range(6, 80):
        for confidence in (0.9, 0.95, 0.99):
            ci = median_ci(list(range(n)), confidence)
            if ci.low > 0:  # some order statistic could be left out: the exact coverage
                assert ci.coverage >= confidence
            j = int(ci.low)
            tail = sum(math.comb(n, i) for i in range(j + 1)) / 2 ** n
            assert ci.coverage == pytest.approx(1 - 2 * tail)
            assert ci.low <= ci.median <= ci.high


def test_too_few_values_report_their_lower_coverage() -> None:
    ci = median_ci([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (ci.low, ci.high) == (1.0, 5.0)
    assert ci.coverage == pytest.approx(1 - 2 / 32)  # < 0.95, and said so
    one = median_ci([7.0])
    assert (one.median, one.low, one.high, one.coverage) == (7.0, 7.0, 7.0, 0.0)


@pytest.mark.parametrize("confidence", [0.0, 1.0, -0.5, 2.0])
def test_bad_confidence(confidence: float) -> None:
    with pytest.raises(ValueError, match="confidence"):
        median_ci([1.0, 2.0], confidence)


def test_no_values() -> None:
    with pytest.raises(ValueError, match="at least one"):
        median_ci([])


def test_paired_ratios() -> None:
    assert paired_ratios([2.0, 3.0], [1.0, 4.0]) == [2.0, 0.75]
    with pytest.raises(ValueError, match="2 numerators but 1"):
        paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratios([1.0], [0.0])


def test_format_and_helpers() -> None:
    assert MedianCI(0.9731, 0.951, 0.989, 0.96, 30).format() == "0.973 [0.95, 0.99]"
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 90) == pytest.approx(4.6)
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert [size_label(n) for n in (16 << 10, 1 << 20, 1000)] == ["16 KiB", "1 MiB", "1000 B"]
    assert table(["a", "bb"], [["1", "22"], ["333", "4"]], "r") == [
        "  a  bb", "---  --", "  1  22", "333   4"]
    assert table(["a", "bb"], [[1, 22], [333, 4]], ["l", "r"]) == [
        "a    bb", "---  --", "1    22", "333   4"]
    with pytest.raises(ValueError, match="align"):
        table(["a", "b"], [], ["l"])


def test_scattered_permutation_never_coalesces() -> None:
    import numpy as np

    from kvbridge.testing.rawbench import scattered

    rng = np.random.default_rng(3)
    for n in (4, 5, 64, 4096):
        perm = scattered(rng, n)
        assert sorted(perm.tolist()) == list(range(n))
        assert not (np.diff(perm) == 1).any()


# -- the one percentile's convention: linear between the sorted values (numpy's "linear") -------


def _linear(values: list[float], q: float) -> float:
    """The hand-written interpolation every result so far was computed with."""
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def test_percentile_of_one_value_is_that_value() -> None:
    assert [percentile([3.0], q) for q in (0, 50, 90, 99, 100)] == [3.0] * 5


def test_percentile_of_two_values_interpolates() -> None:
    """Not the nearest rank (2.0 at p90), nor numpy's other methods."""
    assert percentile([2.0, 1.0], 50) == 1.5
    assert percentile([2.0, 1.0], 90) == pytest.approx(1.9)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0


def test_percentile_of_ten_values() -> None:
    values = [float(v) for v in (7, 3, 10, 1, 5, 2, 9, 4, 8, 6)]
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 10) == pytest.approx(1.9)


def test_percentile_skips_nan_and_none_and_checks_q() -> None:
    assert percentile([math.nan, 1.0, None, 3.0], 50) == 2.0  # type: ignore[list-item]
    assert percentile([], 50) is None and percentile([math.nan], 50) is None
    for q in (-1, 100.5):
        with pytest.raises(ValueError, match="0..100"):
            percentile([1.0], q)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 57])
def test_percentile_gives_what_the_results_so_far_were_computed_with(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(_linear(values, q), rel=1e-12, abs=1e-15)


def test_the_simulator_reports_the_same_percentiles() -> None:
    from kvbridge.tools.simulate.metrics import _stats

    got = _stats([v / 1000.0 for v in range(1, 11)])  # seconds in, milliseconds out
    assert got["p50"] == pytest.approx(5.5) and got["p90"] == pytest.approx(9.1)
    assert got["p99"] == pytest.approx(9.91) and got["mean"] == pytest.approx(5.5)


def test_median_ci_of_thousands_of_values() -> None:
    """2**n overflows a float from n = 1024: the interval stays exact and its coverage ~95 %."""
    values = [float(v) for v in range(2000)]
    ci = median_ci(values)
    assert ci.n == 2000 and ci.median == 999.5
    assert 950 <= ci.low < 999.5 < ci.high <= 1049 and ci.low + ci.high == 1999
    assert 0.95 <= ci.coverage < 0.96
