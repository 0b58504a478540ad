"""Layer-by-layer tier loads (kvbridge.offload.layerwise): the FIFO pipe between the loader
and the forward pass, on a real host-memory KV layout (no engine).

What must hold: after ``wait(layer)`` that layer's blocks hold the chunks' bytes (and layers
after it may not yet); ``finish`` ends the copy and reports nothing on success, every block on
failure; the forward never waits forever.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from kvbridge.layout import KVLayout, KVPlane
from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.layerwise import LayerFeed

LAYERS, BLOCKS, PLANE = 6, 8, 4096


@pytest.fixture
def io() -> Any:
    mem = [np.zeros(BLOCKS * PLANE, dtype=np.uint8) for _ in range(LAYERS * 2)]
    planes = [KVPlane(f"layer.{i // 2}", m.ctypes.data, PLANE, PLANE) for i, m in enumerate(mem)]
    layout = KVLayout(planes=planes, num_blocks=BLOCKS, block_size=16, dtype="uint8")
    blockio = BlockIO(layout)
    blockio.mem = mem  # keep the memory alive with the view over it
    return blockio


def _chunks(io: BlockIO, n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, io.chunk_bytes, dtype=np.uint8).tobytes() for _ in range(n)]


def test_each_layer_is_in_place_when_its_wait_returns(io: BlockIO) -> None:
    ids, chunks = [5, 1, 3], _chunks(io, 3, 0)
    gate = threading.Event()
    written: list[str] = []
    real_write = io.write

    def slow_write(block_ids: Any, data: Any, planes: Any = None) -> None:
        gate.wait(5)  # the loader cannot run ahead of the test
        real_write(block_ids, data, planes)
        written.append(io.layout.planes[planes[0]].layer)

    io.write = slow_write  # type: ignore[method-assign]
    feed = LayerFeed(io, [(ids, chunks)])
    feed.start()
    gate.set()
    for layer in range(LAYERS):
        name = f"layer.{layer}"
        feed.wait(name)
        assert name in written
        for plane_ix in (2 * layer, 2 * layer + 1):
            view = io._views[plane_ix][0]
            off = io._views[plane_ix][1]
            for b, c in zip(ids, chunks, strict=True):
                assert view[b].tobytes() == c[off:off + PLANE]
    feed.wait("not-a-kv-layer")  # returns at once
    assert feed.finish() == set() and feed.layers_waited == LAYERS
    io.write = real_write  # type: ignore[method-assign]
    got = io.read(ids)
    assert got == chunks


def test_the_forward_overlaps_the_copy(io: BlockIO) -> None:
    """wait(layer 0) returns before the last layer is copied: that is the point of the pipe."""
    release = threading.Event()
    real_write = io.write

    def write(block_ids: Any, data: Any, planes: Any = None) -> None:
        if io.layout.planes[planes[0]].layer == f"layer.{LAYERS - 1}":
            release.wait(5)
        real_write(block_ids, data, planes)

    io.write = write  # type: ignore[method-assign]
    feed = LayerFeed(io, [([0, 1], _chunks(io, 2, 1))])
    feed.start()
    t0 = time.monotonic()
    feed.wait("layer.0")
    assert time.monotonic() - t0 < 4 and not release.is_set()
    release.set()
    assert feed.finish() == set()


def test_a_failed_copy_unblocks_the_forward_and_reports_every_block(io: BlockIO) -> None:
    real_write = io.write

    def broken(block_ids: Any, data: Any, planes: Any = None) -> None:
        if io.layout.planes[planes[0]].layer == "layer.2":
            raise RuntimeError("copy broke")
        real_write(block_ids, data, planes)

    io.write = broken  # type: ignore[method-assign]
    feed = LayerFeed(io, [([2], _chunks(io, 1, 2)), ([4, 6], _chunks(io, 2, 3))])
    feed.start()
    for layer in range(LAYERS):
        feed.wait(f"layer.{layer}", timeout=5)
    assert feed.finish() == {2, 4, 6}


def test_a_stuck_copy_costs_the_forward_its_timeout_not_forever(io: BlockIO) -> None:
    stuck = threading.Event()

    def hang(block_ids: Any, data: Any, planes: Any = None) -> None:
        stuck.wait(10)

    io.write = hang  # type: ignore[method-assign]
    feed = LayerFeed(io, [([7], _chunks(io, 1, 4))])
    feed.start()
    t0 = time.monotonic()
    feed.wait("layer.0", timeout=0.2)
    feed.wait("layer.5", timeout=0.2)  # already given up: no second wait
    assert time.monotonic() - t0 < 2
    stuck.set()
    assert feed.finish(timeout=5) == {7}
