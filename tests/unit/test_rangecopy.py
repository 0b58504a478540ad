"""shm's native range copy is a C extension built at install time (setup.py), never compiled at
run time: it is imported from kvbridge's own package directory, copies rows, stops when told,
and where it was not built :func:`load` gives None with one warning (shm then uses CMA)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvbridge
from kvbridge.transports.shm import rangecopy

PACKAGE = Path(kvbridge.__file__).resolve().parent


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No range copy loaded yet in this process."""
    monkeypatch.setattr(rangecopy, "_loaded", [])


def test_the_built_extension_is_imported_from_the_package_directory(fresh: None) -> None:
    import importlib

    try:
        module = importlib.import_module(rangecopy.MODULE)
    except ImportError:
        pytest.skip("range copy not built here (pip install --no-deps -e . builds it)")
    assert Path(module.__file__ or "").resolve().parent == PACKAGE / "transports" / "shm"
    copy = rangecopy.load()
    assert copy is not None
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    rows = np.array([[dst.ctypes.data + 1024 * i, src.ctypes.data + 1024 * (3 - i), 1024]
                     for i in range(4)], dtype=np.uint64)
    assert copy(rows, ctypes.c_int32(0)) == 4
    np.testing.assert_array_equal(dst.reshape(4, 1024), src.reshape(4, 1024)[::-1])
    assert copy(rows, ctypes.c_int32(1)) == 0  # stop is checked before the first row


def test_without_the_extension_load_is_none_and_says_why_once(
    fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: Any
) -> None:
    monkeypatch.setattr(rangecopy, "MODULE", "kvbridge.transports.shm._no_such_module")
    monkeypatch.setenv("KVBRIDGE_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvbridge.transport.shm"):
        assert rangecopy.load() is None
        assert rangecopy.load() is None
    warnings = [r for r in caplog.records if "no native range copy" in r.getMessage()]
    assert len(warnings) == 1 and "cross-memory attach" in warnings[0].getMessage()
    assert list(tmp_path.iterdir()) == []  # nothing compiled or cached at run time


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("rows_n", [2, 3, 257])
def test_two_threads_copy_every_row_once_and_stop_when_told(fresh: None, rows_n: int,
                                                             threads: int) -> None:
    """With a helper (threads 2; 0: the helper's path alone) every row lands exactly once
    whichever thread took it, the count is all of them, and a stop set first copies nothing."""
    copy = rangecopy.load()
    if copy is None:
        pytest.skip("range copy not built here (pip install --no-deps -e . builds it)")
    rng = np.random.default_rng(rows_n)
    size = 4099
    src = rng.integers(0, 256, rows_n * size, dtype=np.uint8)
    order = rng.permutation(rows_n)  # row i lands in slot order[i]
    for _ in range(20):  # the helper starts at a different point of the call each time
        dst = np.zeros_like(src)
        rows = np.array([[dst.ctypes.data + size * int(order[i]), src.ctypes.data + size * i,
                          size] for i in range(rows_n)], dtype=np.uint64)
        assert copy(rows, ctypes.c_int32(0), threads) == rows_n
        np.testing.assert_array_equal(dst.reshape(rows_n, size)[order], src.reshape(rows_n, size))
    assert copy(rows, ctypes.c_int32(1), threads) == 0
