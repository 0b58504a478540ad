"""kvbridge.blocks: request validation and coalescing, equivalence with descriptor_pair, the
prepared-pair cache (LRU, forgetting peers), and the descriptor fallback for other transports.

Transfers use the in-process ``memory`` transport (real bytes, no process)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge import blocks
from kvbridge.blocks import BlockRequest, BlockTransport, prepare_blocks, submit_blocks
from kvbridge.errors import LayoutError, LayoutMismatch
from kvbridge.groups import GroupKind, KVGroup, to_refs
from kvbridge.layout import KVLayout, KVPlane, check_block_ids, descriptor_pair
from kvbridge.testing.agents import make_caches
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
    (part,) = req.parts
    assert part.starts.tolist() == [0, 3, 4, 5] and part.counts.tolist() == [3, 1, 1, 1]
    assert req.runs == 4 and req.blocks == 6 and req.count == 16 and req.entries == 24
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
    assert req.count == want[0].shape[0]
    assert req.nbytes == int(want[0][:, 1].sum())
    if planes == [0, 1, 2, 3]:
        assert req.parts[0].planes is None  # every plane in order: the fast path


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
    a.add_peer(mb, b.invite(ma))
    b.add_peer(ma, a.invite(mb))
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
    a, b, ba, la, bb, lb, mb = connected
    real = MemoryTransport._prepare_blocks
    calls = []

    def racing(self: MemoryTransport, pair: blocks.BlockPair) -> Any:
        native = real(self, pair)
        calls.append(native)
        if len(calls) == 1:
            self.add_peer(mb, b.invite())  # the peer is replaced while this preparation runs
        return native

    monkeypatch.setattr(MemoryTransport, "_prepare_blocks", racing)
    pair = a.prepare_blocks("b", la, lb)
    assert len(calls) == 2 and pair.native is calls[1]  # prepared again, for the new peer
    handle = a.submit_blocks(Op.WRITE, pair, [2], [6])
    assert a.wait(handle, 10) is HandleState.DONE
    np.testing.assert_array_equal(bb[:, :, 6], ba[:, :, 2])


# -- hybrid models: KV-cache groups and block refs -------------------------------------------------


GROUPS = (KVGroup(GroupKind.SLIDING, 16, 40, (0,)), KVGroup(GroupKind.SLIDING, 16, 40, (1,)),
          KVGroup(GroupKind.FULL, 16, None, (2,)))


def hybrid(base: int) -> KVLayout:
    return dataclasses.replace(layout(base, planes=3, num_blocks=32), groups=GROUPS)


@pytest.mark.parametrize("planes", [None, [2], [1, 2], [0]], ids=["all", "full", "two", "sw"])
def test_refs_route_to_their_groups_planes_like_descriptor_pair(planes: list[int] | None
                                                                ) -> None:
    a, b = hybrid(1 << 30), hybrid(1 << 31)
    lrefs = to_refs(0, [3, 4], 3) + to_refs(1, [9], 3) + to_refs(2, [10, 11, 12], 3)
    rrefs = to_refs(0, [7, 8], 3) + to_refs(1, [1], 3) + to_refs(2, [20, 21, 2], 3)
    req = BlockRequest.build(a, b, lrefs, rrefs, planes)
    sel = planes or [0, 1, 2]
    want = descriptor_pair(a.select(sel), lrefs, b.select(sel), rrefs)
    for got, expected in zip(req.descriptors(blocks.BlockPair("p", a, b)), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert req.count == want[0].shape[0] and req.nbytes == int(want[0][:, 1].sum())
    if planes is None:
        assert req.nbytes == a.nbytes(lrefs) and req.blocks == 6


def test_refs_of_other_groups_or_shared_blocks_are_refused() -> None:
    a, b = hybrid(1 << 30), hybrid(1 << 31)
    with pytest.raises(LayoutError, match="different KV-cache groups"):
        BlockRequest.build(a, b, to_refs(0, [1], 3), to_refs(1, [1], 3))
    with pytest.raises(LayoutError, match="duplicates"):  # one pool: a block has one group
        BlockRequest.build(a, b, to_refs(0, [1], 3) + to_refs(2, [1], 3),
                           to_refs(0, [2], 3) + to_refs(2, [3], 3))
    with pytest.raises(LayoutError, match="out of range"):
        BlockRequest.build(a, b, to_refs(0, [32], 3), to_refs(0, [1], 3))
    with pytest.raises(LayoutError, match="must be integers"):
        BlockRequest.build(a, b, [0.5], [1])
    nothing = BlockRequest.build(a, b, to_refs(0, [5], 3), to_refs(0, [6], 3), planes=[2])
    assert nothing.count == 0 and nothing.nbytes == 0 and nothing.blocks == 1


def test_hybrid_transfer_moves_each_groups_blocks() -> None:
    """Real bytes through a block transport: each ref lands in its own group's plane only."""
    a, b = MemoryTransport("ha"), MemoryTransport("hb")
    caches_a, la = make_caches((3, 32, 16, 8), GROUPS)
    caches_b, lb = make_caches((3, 32, 16, 8), GROUPS)
    for arr in (*caches_a.values(), *caches_b.values()):
        arr[...] = np.random.default_rng(arr.ctypes.data % 1000).random(arr.shape)
    try:
        ma = a.register_memory([MemoryRegion(x.ctypes.data, x.nbytes) for x in caches_a.values()])
        mb = b.register_memory([MemoryRegion(x.ctypes.data, x.nbytes) for x in caches_b.values()])
        a.add_peer(mb, b.invite(ma))
        b.add_peer(ma, a.invite(mb))
        before = {k: v.copy() for k, v in caches_b.items()}
        pair = a.prepare_blocks("hb", la, lb)
        lrefs = to_refs(0, [3], 3) + to_refs(2, [10, 11], 3)
        rrefs = to_refs(0, [7], 3) + to_refs(2, [20, 5], 3)
        h = a.submit_blocks(Op.WRITE, pair, lrefs, rrefs)
        assert a.wait(h, 10) is HandleState.DONE and h.nbytes == la.nbytes(lrefs)
        expected = {k: v.copy() for k, v in before.items()}
        expected["layer.0"][7] = caches_a["layer.0"][3]
        expected["layer.2"][[20, 5]] = caches_a["layer.2"][[10, 11]]
        for k, v in caches_b.items():
            np.testing.assert_array_equal(v, expected[k])
    finally:
        a.close()
        b.close()


def test_submit_parts_moves_several_views_as_one_transfer(connected: tuple[Any, ...]) -> None:
    """Sub-transfers between views (as heterogeneous TP maps them): one part takes the block
    path, several go as one descriptor list; every byte lands where its part says."""
    a, _, ba, la, bb, lb, _ = connected

    def half(layout: KVLayout, offset: int) -> KVLayout:
        return KVLayout(tuple(KVPlane(p.layer, p.base + offset, p.block_stride, 128)
                              for p in layout.planes), layout.num_blocks, 16, layout.dtype)

    before = bb.copy()
    h = blocks.submit_parts(a, Op.WRITE, "b", [(half(la, 0), [1, 2], half(lb, 128), [3, 4]),
                                               (half(la, 128), [5], half(lb, 0), [6])])
    assert a.wait(h, 10) is HandleState.DONE and h.nbytes == 3 * 4 * 128
    expected = before.copy()
    expected[:, :, [3, 4], 128:] = ba[:, :, [1, 2], :128]
    expected[:, :, 6, :128] = ba[:, :, 5, 128:]
    np.testing.assert_array_equal(bb, expected)
    one = blocks.submit_parts(a, Op.WRITE, "b", [(la, [0], lb, [9])])
    assert a.wait(one, 10) is HandleState.DONE
    np.testing.assert_array_equal(bb[:, :, 9], ba[:, :, 0])
    assert a.prepare_blocks("b", la, lb).live  # the single part went through a prepared pair
