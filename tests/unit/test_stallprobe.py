"""kvbridge.tools.bench.stallprobe's parser and summary, and kvbridge.tools.priority's checks
(no process is started here: tests/process/test_stallprobe.py runs the probe)."""

from __future__ import annotations

import json

import pytest

from kvbridge.tools.bench.stallprobe import MAX_BYTES, parse, summarize
from kvbridge.tools.priority import follow_niceness, set_group_nice


def test_the_summary_keeps_the_window_only() -> None:
    samples = [[10.0, 0.1], [11.0, 0.2], [12.0, 30.0], [13.0, 6.0], [20.0, 99.0]]
    out = summarize(samples, 10.5, 13.0)
    assert out["probe_n"] == 3 and out["probe_max"] == 30.0 and out["probe_over_5ms"] == 2
    assert summarize(samples)["probe_n"] == 5
    assert summarize(samples, 30.0, 40.0) == {} and summarize([]) == {}


def test_the_parser_takes_pairs_of_numbers() -> None:
    assert parse(json.dumps([[1.5, 0.25], [2, 3]]).encode()) == [[1.5, 0.25], [2.0, 3.0]]
    assert parse(b"[]") == []


@pytest.mark.parametrize("data", [
    b"", b"not json", b"{}", b'"x"', b"[1, 2]", b"[[1, 2, 3]]", b'[["a", 1]]', b"[[1, -1]]",
    b"[[1, NaN]]", b"[[Infinity, 1]]", b"[" * 100_000, b"[[1, null]]",
])
def test_the_parser_refuses_what_the_probe_never_writes(data: bytes) -> None:
    """The probe's file lies in a directory other processes of the user can write to: a
    forged or broken file gives no samples, never an exception or a wrong summary."""
    assert parse(data) == []


def test_the_parser_refuses_an_oversized_file() -> None:
    big = b"[" + b"[1.0, 1.0]," * (MAX_BYTES // 11 + 1) + b"[1.0, 1.0]]"
    assert len(big) > MAX_BYTES and parse(big) == []


def test_a_niceness_outside_the_kernel_range_is_refused() -> None:
    for nice in (-21, 20):
        with pytest.raises(ValueError, match="nice must be in -20..19"):
            set_group_nice(1, nice)


def test_following_niceness_zero_changes_nothing() -> None:
    import os

    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        pytest.skip("this test process does not run at niceness 0")
    assert follow_niceness(1) is None  # nothing to do: pid 1 is not touched
