"""Block grids: registered memory cut into equal granules, for NIXL's prepared descriptor lists.

A :class:`Grid` over a set of registered regions and a granule ``G`` lists every ``G``-byte
chunk of every region (region order, then address order). NIXL prepares such a list once per
side (``prep_xfer_dlist``); a transfer then only passes *indices* (``make_prepped_xfer``).
:meth:`Grid.indices` maps an arbitrary ``(N, 3)`` descriptor array onto grid indices, splitting a
descriptor that spans ``k`` granules into ``k`` consecutive indices (NIXL merges them again), or
returns ``None`` when a descriptor is not granule-aligned or falls outside the grid, in which case
the caller posts the descriptors directly. Pure numpy, no Python loop over descriptors; nothing
here imports nixl. Not thread-safe (callers hold the transport's lock).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["Grid", "granule_of", "region_table"]

I64 = npt.NDArray[np.int64]


def region_table(regions: Sequence[tuple[int, int, int]]) -> I64:
    """Regions ``(addr, len, dev)`` as a sorted ``(R, 3)`` int64 array."""
    if not regions:
        return np.zeros((0, 3), dtype=np.int64)
    arr = np.asarray(sorted(regions), dtype=np.int64).reshape(-1, 3)
    return arr


def _locate(descs: I64, table: I64) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
    idx = np.searchsorted(table[:, 0], descs[:, 0], side="right") - 1
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    ok &= descs[:, 0] + descs[:, 1] <= table[safe, 0] + table[safe, 1]
    return safe, ok


def granule_of(descs: I64, table: I64) -> int:
    """Largest ``G`` dividing every descriptor's length and offset in its region (0 if none)."""
    if descs.shape[0] == 0 or table.shape[0] == 0:
        return 0
    r, ok = _locate(descs, table)
    if not ok.all():
        return 0
    offsets = descs[:, 0] - table[r, 0]
    return int(np.gcd.reduce(np.concatenate([offsets, descs[:, 1]])))


class Grid:
    """All ``granule``-byte chunks of ``regions``; see the module docstring."""

    def __init__(self, regions: Sequence[tuple[int, int, int]], granule: int) -> None:
        if granule <= 0:
            raise ValueError("granule must be > 0")
        self.granule = granule
        self.table = region_table(regions)
        self.chunks = self.table[:, 1] // granule
        self.first = np.concatenate([[0], np.cumsum(self.chunks)[:-1]]).astype(np.int64)
        self.size = int(self.chunks.sum())

    @staticmethod
    def entries_for(regions: Sequence[tuple[int, int, int]], granule: int) -> int:
        """How many entries a grid over ``regions`` at ``granule`` would have."""
        return int(sum(length // granule for _, length, _ in regions))

    def descriptors(self) -> I64:
        """The ``(size, 3)`` descriptor array to prepare with NIXL."""
        g = self.granule
        out = np.empty((self.size, 3), dtype=np.int64)
        for (addr, _, dev), first, n in zip(self.table, self.first, self.chunks, strict=True):
            rows = slice(int(first), int(first + n))
            out[rows, 0] = addr + np.arange(n, dtype=np.int64) * g
            out[rows, 1] = g
            out[rows, 2] = dev
        return out

    def indices(self, descs: I64) -> npt.NDArray[np.int32] | None:
        """Grid indices covering ``descs`` in order, or ``None`` if they do not fit the grid."""
        if self.table.shape[0] == 0 or self.size >= 2**31:
            return None
        g = self.granule
        r, ok = _locate(descs, self.table)
        if not ok.all():
            return None
        offsets = descs[:, 0] - self.table[r, 0]
        lengths = descs[:, 1]
        if (offsets % g).any() or (lengths % g).any() or (descs[:, 2] != self.table[r, 2]).any():
            return None
        start = self.first[r] + offsets // g
        count = lengths // g
        if (offsets // g + count > self.chunks[r]).any():
            return None  # reaches into the region's tail that is smaller than one granule
        if (count == 1).all():
            idx: npt.NDArray[np.int32] = start.astype(np.int32)
            return idx
        total = int(count.sum())
        run_start = np.cumsum(count) - count
        out = np.arange(total, dtype=np.int64) + np.repeat(start - run_start, count)
        result: npt.NDArray[np.int32] = out.astype(np.int32)
        return result
