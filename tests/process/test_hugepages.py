"""kvbridge.host.hugepages: a fresh KV cache refaults on huge pages; no byte ever changes."""

from __future__ import annotations

import mmap
import re
import subprocess
import sys

import numpy as np
import pytest

from kvbridge.host import hugepages
from kvbridge.host.hugepages import back_with_huge_pages, thp_mode

pytestmark = pytest.mark.skipif(thp_mode() != "madvise",
                                reason="needs transparent huge pages in 'madvise' mode")

PAGE = hugepages._page_bytes()


def _anon_huge_kb(address: int, size: int) -> int:
    """AnonHugePages of the mappings overlapping ``[address, address + size)`` (kB)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m[1], 16) < address + size and address < int(m[2], 16)
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def _buffer(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Anonymous memory on 4 KiB pages, populated, as torch.zeros leaves a KV cache."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(m, dtype=np.uint8)
    view[::4096] = 1
    view[::4096] = 0
    return m, view


def test_a_zeroed_region_refaults_as_huge_pages() -> None:
    m, view = _buffer(32 * PAGE + 12345)
    start = int(view.ctypes.data) + 100  # not aligned: partial pages at both ends
    size = 30 * PAGE
    assert _anon_huge_kb(start, size) == 0
    report = back_with_huge_pages([(start, size)])
    assert not report.skipped and not report.error
    lo = -(-start // PAGE) * PAGE
    assert report.huge_bytes == (start + size) // PAGE * PAGE - lo
    assert report.kept_bytes == 0 and report.edge_bytes == size - report.huge_bytes
    assert _anon_huge_kb(start, size) == report.huge_bytes >> 10  # faulted in already
    assert not view.any()  # still all zero
    view[:] = 7
    assert bool((view == 7).all())
    del view
    m.close()


def test_pages_holding_data_and_the_partial_edges_keep_every_byte() -> None:
    m, view = _buffer(10 * PAGE)
    lo = -(-int(view.ctypes.data) // PAGE) * PAGE - int(view.ctypes.data)  # first whole page
    region = view[lo + 100:lo + 8 * PAGE + 100]  # partial pages at both ends, 7 whole ones
    rng = np.random.default_rng(0)
    region[:64] = rng.integers(1, 256, 64, dtype=np.uint8)  # in the first, partial page
    region[2 * PAGE] = 9  # the second whole huge page holds one byte of data
    region[-3:] = 4  # in the last, partial page
    before = region.copy()
    report = back_with_huge_pages([(int(region.ctypes.data), region.size)])
    assert report.kept_bytes == PAGE
    assert report.huge_bytes == 6 * PAGE and report.edge_bytes == PAGE  # (PAGE - 100) + 100
    assert np.array_equal(region, before)
    del view, region
    m.close()


@pytest.mark.parametrize("pages, huge", [("small", False), ("kvbridge", True)])
def test_bench_buffers_sit_on_the_pages_asked_for(pages: str, huge: bool) -> None:
    from kvbridge.tools.bench.transfer_target import host_buffer

    fill = np.arange(8 * PAGE, dtype=np.uint64).view(np.uint8)[:8 * PAGE]
    buf = host_buffer(8 * PAGE, pages, fill)
    assert np.array_equal(buf, fill)
    assert (_anon_huge_kb(int(buf.ctypes.data), buf.size) > 0) is huge


def test_without_populate_write_each_huge_page_is_touched_once() -> None:
    m, view = _buffer(4 * PAGE)
    lo = -(-int(view.ctypes.data) // PAGE) * PAGE
    madvise = hugepages._madvise()
    assert madvise is not None
    calls: list[int] = []

    def old_kernel(at: int, length: int, advice: int) -> int:
        calls.append(advice)
        return -1 if advice == hugepages.MADV_POPULATE_WRITE else madvise(at, length, advice)

    assert madvise(lo, 2 * PAGE, hugepages.MADV_HUGEPAGE) == 0
    assert madvise(lo, 2 * PAGE, hugepages.MADV_DONTNEED) == 0
    hugepages._populate(old_kernel, lo, 2 * PAGE, PAGE)
    assert calls == [hugepages.MADV_POPULATE_WRITE]
    assert _anon_huge_kb(lo, 2 * PAGE) == 2 * PAGE >> 10 and not view.any()
    del view
    m.close()


def test_bad_regions_are_skipped_or_reported_never_raised() -> None:
    m = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = int(np.frombuffer(m, dtype=np.uint8).ctypes.data)
    m.close()  # unmapped now: madvise fails, the zero check must not read it
    report = back_with_huge_pages([(0, 1 << 30), (4096, -5), (address, 4 * PAGE)])
    assert report.huge_bytes == 0
    assert "MADV_HUGEPAGE" in report.error and "ENOMEM" in report.error
    assert "failed" in report.describe()


_UNDER_PRCTL = """
import ctypes, mmap, sys
import numpy as np
from kvbridge.host.hugepages import back_with_huge_pages
assert ctypes.CDLL(None).prctl(41, 1, int(sys.argv[1]), 0, 0) == 0  # PR_SET_THP_DISABLE
m = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
view = np.frombuffer(m, dtype=np.uint8)
view[::4096] = 0
report = back_with_huge_pages([(int(view.ctypes.data), view.size)])
print(report.huge_bytes, report.skipped)
"""


@pytest.mark.parametrize("except_advised", [0, 2])
def test_a_process_with_thp_disabled_is_left_alone(except_advised: int) -> None:
    """PR_SET_THP_DISABLE (container runtimes set it) makes MADV_HUGEPAGE a no-op: releasing
    and refaulting would only cost time, so it is skipped and said. With Linux 6.18's
    PR_THP_DISABLE_EXCEPT_ADVISED, madvised ranges still get huge pages: it runs."""
    res = subprocess.run([sys.executable, "-c", _UNDER_PRCTL, str(except_advised)],
                         capture_output=True, text=True, timeout=60, check=False)
    if except_advised and "AssertionError" in res.stderr:
        pytest.skip("this kernel has no PR_THP_DISABLE_EXCEPT_ADVISED")
    assert res.returncode == 0, res.stderr
    huge, _, skipped = res.stdout.strip().partition(" ")
    if except_advised:
        assert int(huge) > 0 and not skipped
    else:
        assert int(huge) == 0 and "PR_SET_THP_DISABLE" in skipped


def test_the_report_says_why_nothing_happened(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    report = back_with_huge_pages([(4096, 4096)])
    assert report.skipped == "transparent huge pages are never"
    assert report.describe() == "huge pages: not used (transparent huge pages are never)"
