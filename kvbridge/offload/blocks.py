"""Copying whole blocks between an engine rank's KV cache and chunks (host memory only).

A chunk is block ``b`` of every plane of a :class:`~kvbridge.layout.KVLayout`, concatenated in
plane order. :class:`BlockIO` maps each plane's memory once (a strided numpy view over its
blocks) and copies with one vectorised gather/scatter per plane, so the cost grows with bytes,
not with blocks × layers in Python.

Only host-addressable KV works (vLLM's CPU backend, or pinned host memory): GPU tiers would copy
with the device's own engine and are not built yet. Not thread-safe by itself: callers make
sure a block is not written by the forward pass while they read it (the scheduler holds a
finished request's blocks until the copy is done) and not read while they write it (loads run
before the step's forward).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbridge.errors import LayoutError
from kvbridge.layout import KVLayout, check_block_ids

__all__ = ["BlockIO", "Payload"]

#: A chunk's bytes as the load path hands them on: a copy, or a read-only view into a tier's
#: chunk (:func:`kvbridge.offload.seal.unseal`).
Payload = bytes | memoryview


class BlockIO:
    """See the module docstring."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.chunk_bytes = layout.bytes_per_block
        self._views: list[tuple[npt.NDArray[np.uint8], int, int]] = []
        offset = 0
        for plane in layout.planes:
            span = (layout.num_blocks - 1) * plane.block_stride + plane.block_bytes
            raw = (ctypes.c_uint8 * span).from_address(plane.base)
            flat = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
            view = np.lib.stride_tricks.as_strided(
                flat, shape=(layout.num_blocks, plane.block_bytes),
                strides=(plane.block_stride, 1), writeable=True)
            self._views.append((view, offset, plane.block_bytes))
            offset += plane.block_bytes

    @property
    def layers(self) -> list[tuple[str, list[int]]]:
        """Each layer's name and its planes' indexes, in the layout's order (first seen)."""
        out: dict[str, list[int]] = {}
        for i, plane in enumerate(self.layout.planes):
            out.setdefault(plane.layer, []).append(i)
        return list(out.items())

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        """The chunks of ``block_ids`` (copies), in order."""
        ids = check_block_ids(block_ids, self.layout.num_blocks)
        if ids.size == 0:
            return []
        out = np.empty((ids.size, self.chunk_bytes), dtype=np.uint8)
        for view, off, n in self._views:
            out[:, off:off + n] = view[ids]
        return [row.tobytes() for row in out]

    def check(self, block_ids: Sequence[int], chunks: Sequence[Payload]) -> list[int]:
        """The block ids, after checking them and that each chunk has the block's size."""
        ids = check_block_ids(block_ids, self.layout.num_blocks)
        if ids.size != len(chunks):
            raise LayoutError(f"{ids.size} blocks but {len(chunks)} chunks")
        for c in chunks:
            if len(c) != self.chunk_bytes:
                raise LayoutError(f"a chunk of {len(c)} bytes for blocks of {self.chunk_bytes}")
        return [int(i) for i in ids.tolist()]

    def write(self, block_ids: Sequence[int], chunks: Sequence[Payload],
              planes: Sequence[int] | None = None) -> None:
        """Copy ``chunks[i]`` into block ``block_ids[i]``: every plane, or only ``planes``
        (indexes into the layout's planes, e.g. one layer's from :attr:`layers`)."""
        rows = self.check(block_ids, chunks)
        views = self._views if planes is None else [self._views[p] for p in planes]
        for row, chunk in zip(rows, chunks, strict=True):
            for view, off, n in views:  # straight from each chunk: no joined copy
                view[row] = np.frombuffer(chunk, dtype=np.uint8, count=n, offset=off)
