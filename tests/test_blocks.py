"""kvbridge.blocks: request validation and coalescing, equivalence with descriptor_pair, the
prepared-pair cache (LRU, forgetting peers), and the descriptor fallback for other transports.

Transfers use the in-process ``memory`` transport (real bytes, no process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge import blocks
from kvbridge.blocks import BlockRequest, BlockTransport, prepare_blocks, submit_blocks
from kvbridge.errors import LayoutError, LayoutMismatch
from kvbridge.layout import KVLayout, KVPlane, check_block_ids, descriptor_pair
from kvbridge.testing.faults import FaultyTransport
from kvbridge.testing.peer import kv_buffer
from kvbridge.transport import HandleState, MemoryRegion, Op
from kvbridge.transports.memory import MemoryTransport

pytestmark = pytest.mark.timeout(60)


def layout(base: int, planes: int = 4, num_blocks: int = 32, block_bytes: int = 256,
           stride: int | None = None) -> KVLayout:
    stride = block_bytes if stride is None else stride
    return KVLayout(tuple(KVPlane(f"p{i}", base + i * num_blocks * stride, stride, block_bytes)
                          for i in range(planes)), num_blocks, 16, "bfloat16")


# -- BlockRequest ---------------------------------------------------------------------------------


def test_request_coalesces_runs_on_both_sides() -> None:
    a, b = layout(1 << 30), layout(1 << 31)
    req = BlockRequest.build(a, b, [1, 2, 3, 9, 10, 20], [5, 6, 7, 0, 2, 3])
    assert req.starts.tolist() == [0, 3, 4, 5] and req.counts.tolist() == [3, 1, 1, 1]
    assert req.runs == 4 and req.blocks == 6 and req.count(a) == 16
    assert req.nbytes == 6 * a.bytes_per_block


def test_request_does_not_merge_non_dense_planes() -> None:
    a, b = layout(1 << 30), layout(1 << 31, block_bytes=256, stride=512)
    req = BlockRequest.build(a, b, [1, 2, 3], [5, 6, 7])
    assert req.runs == 3


@pytest.mark.parametrize(
    ("lids", "rids", "planes"),
    [([1, 2, 3, 9], [4, 5, 6, 0], None), ([7, 3, 1], [0, 31, 2], [3, 1]),
     ([0, 1], [1, 2], [0, 1, 2, 3]), ([], [], None)],
    ids=["runs", "subset", "all-planes-listed", "empty"],
)
def test_descriptors_equal_descriptor_pair(lids: list[int], rids: list[int],
                                           planes: list[int] | None) -> None:
    a, b = layout(1 << 30), layout(1 << 31)
    pair = blocks.BlockPair("peer", a, b)
    req = BlockRequest.build(a, b, lids, rids, planes)
    sel = planes or list(range(4))
    want = descriptor_pair(a.select(sel), lids, b.select(sel), rids)
    got = req.descriptors(pair)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert req.count(a) == want[0].shape[0]
    assert req.nbytes == int(want[0][:, 1].sum())
    if planes == [0, 1, 2, 3]:
        assert req.planes is None  # every plane in order: the fast path


def test_iovec_columns() -> None:
    a, b = layout(1 << 30), layout(1 << 31)
    req = BlockRequest.build(a, b, [4], [2])
    loc, rem = req.descriptors(blocks.BlockPair("p", a, b), columns=2)
    assert loc.shape == (4, 2) and rem.shape == (4, 2)
    assert loc[0].tolist() == [(1 << 30) + 4 * 256, 256]


@pytest.mark.parametrize(
    ("lids", "rids", "planes", "message"),
    [([32], [0], None, "out of range"), ([-1], [0], None, "out of range"),
     ([1, 1], [0, 2], None, "duplicates"), ([1], [0, 2], None, "1 local block ids but 2"),
     ([1.0], [0], None, "must be integers"), ([True], [0], None, "must be integers"),
     ([1 << 70], [0], None, "must be integers"), (["3"], [0], None, "must be integers"),
     ([1], [0], [4], "plane index out of range"), ([1], [0], [2, 2], "duplicates"),
     ([1], [0], [], "at least one plane"), ([1], [0], ["x"], "not integers")],
)
def test_request_refuses(lids: list[Any], rids: list[Any], planes: Any, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        BlockRequest.build(layout(1 << 30), layout(1 << 31), lids, rids, planes)


def test_check_block_ids_accepts_numpy_and_tuples() -> None:
    assert check_block_ids(np.array([3, 1], dtype=np.uint32), 4).tolist() == [3, 1]
    assert check_block_ids((2, 0), 4).dtype == np.int64
    assert check_block_ids([], 4).size == 0


def test_layout_key_and_extents() -> None:
    a = layout(1 << 30)
    assert a.key == layout(1 << 30).key != layout((1 << 30) + 64).key
    assert a.extents()[1] == ((1 << 30) + 32 * 256, 32 * 256)
    view = KVLayout(tuple(KVPlane(p.layer, p.base + 128, p.block_stride, 128)
                          for p in a.planes), a.num_blocks, 16, "bfloat16")
    assert view.key != a.key and not view.dense_planes.any()
    assert view.extents()[0] == ((1 << 30) + 128, 31 * 256 + 128)


# -- the prepared-pair cache and the fallback ---------------------------------------------------


@pytest.fixture
def connected() -> Iterator[tuple[Any, ...]]:
    a, b = MemoryTransport("a"), MemoryTransport("b")
    ba, la = kv_buffer(2, 16, 256, 1)
    bb, lb = kv_buffer(2, 16, 256, 2)
    ma = a.register_memory([MemoryRegion(ba.ctypes.data, ba.nbytes)])
    mb = b.register_memory([MemoryRegion(bb.ctypes.data, bb.nbytes)])
    a.add_peer(mb)
    b.add_peer(ma)
    try:
        yield a, b, ba, la, bb, lb, mb
    finally:
        a.close()
        b.close()


def test_cache_is_keyed_by_the_layouts_memory(connected: tuple[Any, ...]) -> None:
    a, _, _, la, _, lb, _ = connected
    pair = a.prepare_blocks("b", la, lb)
    same = KVLayout.from_dict(la.to_dict())  # another object, the same memory
    assert a.prepare_blocks("b", same, lb) is pair
    half = KVLayout(tuple(KVPlane(p.layer, p.base, p.block_stride, 128) for p in la.planes),
                    la.num_blocks, la.block_size, la.dtype)
    with pytest.raises(LayoutMismatch):
        a.prepare_blocks("b", half, lb)  # 128 vs 256 bytes per block


def test_evicted_pairs_are_prepared_again(connected: tuple[Any, ...],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    a, _, ba, la, bb, lb, _ = connected
    monkeypatch.setattr(MemoryTransport, "max_block_pairs", 1)
    first = a.prepare_blocks("b", la, lb)
    other = KVLayout(la.planes[:2], la.num_blocks, la.block_size, la.dtype)
    a.prepare_blocks("b", other, KVLayout(lb.planes[:2], lb.num_blocks, 16, lb.dtype))
    assert not first.live and first.evicted
    handle = a.submit_blocks(Op.WRITE, first, [3], [4])  # transparently prepared again
    assert a.wait(handle, 10) is HandleState.DONE
    np.testing.assert_array_equal(bb[:, :, 4], ba[:, :, 3])


def test_fallback_uses_submit_with_descriptors(connected: tuple[Any, ...]) -> None:
    """A transport that is not a BlockTransport gets descriptor arrays through submit (and a
    wrapper's faults still apply)."""
    a, _, ba, la, bb, lb, _ = connected
    wrapped = FaultyTransport(a, fail=2)
    assert not isinstance(wrapped, BlockTransport)
    pair = prepare_blocks(wrapped, "b", la, lb)
    assert pair.owner is None
    h1 = submit_blocks(wrapped, Op.WRITE, pair, [1, 2], [7, 8], planes=[1])
    assert wrapped.wait(h1, 10) is HandleState.DONE
    np.testing.assert_array_equal(bb[0, 1, [7, 8]], ba[0, 1, [1, 2]])
    assert h1.count == 1 and h1.nbytes == 512  # one coalesced range of one plane
    h2 = submit_blocks(wrapped, Op.WRITE, pair, [3], [9])
    assert wrapped.wait(h2, 10) is HandleState.FAILED and wrapped.injected == [("fail", 2)]
    with pytest.raises(LayoutMismatch):
        prepare_blocks(wrapped, "b", la, KVLayout(lb.planes[:1], 16, 16, lb.dtype))
    wrapped.close()


def test_a_pair_prepared_while_its_peer_is_re_added_is_not_cached(
        connected: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """add_peer (forgetting the peer's pairs) overlapping a preparation: the pair prepared for
    the replaced peer must not stay cached, or every later transfer would be refused."""
    a, _, ba, la, bb, lb, mb = connected
    real = MemoryTransport._prepare_blocks
    calls = []

    def racing(self: MemoryTransport, pair: blocks.BlockPair) -> Any:
        native = real(self, pair)
        calls.append(native)
        if len(calls) == 1:
            self.add_peer(mb)  # the peer is replaced while this preparation runs
        return native

    monkeypatch.setattr(MemoryTransport, "_prepare_blocks", racing)
    pair = a.prepare_blocks("b", la, lb)
    assert len(calls) == 2 and pair.native is calls[1]  # prepared again, for the new peer
    handle = a.submit_blocks(Op.WRITE, pair, [2], [6])
    assert a.wait(handle, 10) is HandleState.DONE
    np.testing.assert_array_equal(bb[:, :, 6], ba[:, :, 2])
