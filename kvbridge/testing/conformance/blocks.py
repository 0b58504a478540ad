"""Conformance tests of the block path (:mod:`kvbridge.blocks`), mixed into
:class:`kvbridge.testing.conformance.TransportConformance` so every backend runs them.

They go through :func:`kvbridge.blocks.prepare_blocks` / :func:`kvbridge.blocks.submit_blocks`,
exactly as the core does: a :class:`~kvbridge.blocks.BlockTransport` is tested on its prepared
path, any other transport on the descriptor fallback. Bytes are checked on both sides after
every transfer. Covered: scattered ids, runs (coalesced: fewer byte ranges), a subset of planes,
non-dense views (planes at an offset whose blocks are smaller than their stride, on both
sides), an empty transfer, a notification attached to a block transfer; refused before anything
moves: ids out of range, negative, duplicated, not integers, of unequal counts, bad plane
indices, a layout reaching past the peer's registered memory, an unknown or removed peer, a pair
of a re-added peer, a pair another transport prepared. Requests prepared ahead
(:func:`kvbridge.blocks.prepare_parts`): posted later they move the same bytes; posted twice,
or after their peer was removed, they are refused; discarded, they move nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from kvbridge.blocks import (
    BlockPair,
    BlockRequest,
    BlockTransport,
    prepare_blocks,
    prepare_parts,
    submit_blocks,
)
from kvbridge.errors import DescriptorError, LayoutError, UnknownPeer
from kvbridge.layout import KVLayout, KVPlane, descriptor_pair
from kvbridge.testing.conformance.pair import Pair
from kvbridge.testing.peer import Peer
from kvbridge.transport import HandleState, Op, Transport

__all__ = ["BlockConformance"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]


def _moved(before_dst: U8, src: U8, dst_ids: Any, src_ids: Any,
           planes: list[int] | None = None) -> U8:
    """``before_dst`` with blocks ``src_ids`` of ``src`` copied to ``dst_ids`` (buffers shaped
    (layers, 2, blocks, bytes); plane p is (p // 2, p % 2))."""
    out = before_dst.copy()
    layers = src.shape[0]
    for p in planes if planes is not None else range(2 * layers):
        out[p // 2, p % 2, dst_ids] = src[p // 2, p % 2, src_ids]
    return out


def _view(layout: KVLayout, offset: int, nbytes: int) -> KVLayout:
    """Every plane narrowed to bytes ``[offset, offset + nbytes)`` of each block (not dense)."""
    planes = tuple(KVPlane(p.layer, p.base + offset, p.block_stride, nbytes)
                   for p in layout.planes)
    return KVLayout(planes, layout.num_blocks, layout.block_size, layout.dtype, layout.device)


class BlockConformance:
    """The block-path tests (see the module docstring); needs TransportConformance's helpers."""

    timeout: ClassVar[float] = 30.0
    #: True: the backend must be a :class:`BlockTransport` (its prepared path is tested);
    #: False: it must not be (the fallback is tested); None: either.
    native_blocks: ClassVar[bool | None] = None

    def connect(self, local: Transport, peer: Peer, block_bytes: int = 4096,
                num_blocks: int = 16, layers: int = 2, seed: int = 0) -> Pair:
        raise NotImplementedError

    def _require(self, t: Transport, what: str) -> None:
        raise NotImplementedError

    def _transfer(self, pair: Pair, op: Op, lids: Any, rids: Any,
                  planes: list[int] | None = None, local_layout: KVLayout | None = None,
                  remote_layout: KVLayout | None = None) -> tuple[U8, U8, Any]:
        """Run one block transfer; return the local and remote buffers before it, and the
        handle."""
        t = pair.local
        mine, theirs = pair.local_buf.copy(), pair.remote_buf()
        bp = prepare_blocks(t, pair.peer_name, local_layout or pair.local_layout,
                            remote_layout or pair.remote.layout)
        handle = submit_blocks(t, op, bp, lids, rids, planes=planes)
        assert t.wait(handle, self.timeout) is HandleState.DONE, handle.error
        return mine, theirs, handle

    def test_blocks_native(self, local: Transport) -> None:
        if self.native_blocks is not None:
            assert isinstance(local, BlockTransport) is self.native_blocks

    def _check(self, pair: Pair, op: Op, mine: U8, theirs: U8, lids: Any, rids: Any,
               planes: list[int] | None = None) -> None:
        """Both buffers hold exactly what moving ``lids <-> rids`` should have left."""
        if op is Op.WRITE:
            np.testing.assert_array_equal(pair.remote_buf(),
                                          _moved(theirs, mine, rids, lids, planes))
            np.testing.assert_array_equal(pair.local_buf, mine)
        else:
            np.testing.assert_array_equal(pair.local_buf, _moved(mine, theirs, lids, rids, planes))
            np.testing.assert_array_equal(pair.remote_buf(), theirs)

    @pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
    def test_blocks_move(self, local: Transport, peer: Peer, op: Op) -> None:
        """Scattered ids, runs (coalesced into fewer ranges), a subset of planes, no ids."""
        self._require(local, op.value.lower())
        pair = self.connect(local, peer, 4096, num_blocks=64, layers=3)
        planes = len(pair.local_layout.planes)
        rng = np.random.default_rng(21)
        lids: Any = rng.permutation(64)[:12]
        rids: Any = rng.permutation(64)[:12]
        mine, theirs, handle = self._transfer(pair, op, lids, rids)
        self._check(pair, op, mine, theirs, lids, rids)
        loc, _ = descriptor_pair(pair.local_layout, lids, pair.remote.layout, rids)
        assert handle.nbytes == int(loc[:, 1].sum()) == 12 * pair.local_layout.bytes_per_block
        assert handle.count == loc.shape[0] == planes * 12
        if isinstance(local, BlockTransport):  # prepared once, then cached
            bp = local.prepare_blocks(pair.peer_name, pair.local_layout, pair.remote.layout)
            assert local.prepare_blocks(pair.peer_name, pair.local_layout,
                                        pair.remote.layout) is bp

        lids = [1, 2, 3, 10, 20, 30, 40]  # a run among single blocks
        rids = [5, 6, 7, 0, 50, 51, 62]
        mine, theirs, handle = self._transfer(pair, op, lids, rids, planes=[5, 0, 2])
        self._check(pair, op, mine, theirs, lids, rids, [5, 0, 2])
        assert handle.count == 3 * 5

        lids = [*range(3, 20), 40, *range(50, 60)]
        rids = [*range(30, 47), 2, *range(10, 20)]
        mine, theirs, handle = self._transfer(pair, op, lids, rids)
        self._check(pair, op, mine, theirs, lids, rids)
        assert handle.count == planes * 3

        subset = [4, 1]
        lids, rids = [7, 2, 9], [0, 15, 3]
        mine, theirs, handle = self._transfer(pair, op, lids, rids, planes=subset)
        self._check(pair, op, mine, theirs, lids, rids, subset)
        assert handle.nbytes == 2 * 3 * 4096

        mine, theirs, handle = self._transfer(pair, op, [], [])
        assert handle.nbytes == 0
        self._check(pair, op, mine, theirs, [], [])

        # two scattered transfers in flight at once (per-transfer buffers must not be shared)
        mine, theirs = pair.local_buf.copy(), pair.remote_buf()
        bp = prepare_blocks(local, pair.peer_name, pair.local_layout, pair.remote.layout)
        first = submit_blocks(local, op, bp, [0, 9, 5], [8, 1, 4])
        second = submit_blocks(local, op, bp, [33, 20, 61], [60, 41, 22])
        for h in (first, second):
            assert local.wait(h, self.timeout) is HandleState.DONE, h.error
        self._check(pair, op, mine, theirs, [0, 9, 5, 33, 20, 61], [8, 1, 4, 60, 41, 22])

    @pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
    def test_blocks_views(self, local: Transport, peer: Peer, op: Op) -> None:
        """Non-dense planes at an offset (a head-split view): half of each block, local first
        half <-> remote second half; runs must not merge, no byte outside the halves moves."""
        self._require(local, op.value.lower())
        pair = self.connect(local, peer, 8192, num_blocks=16)
        lv = _view(pair.local_layout, 0, 4096)
        rv = _view(pair.remote.layout, 4096, 4096)
        lids, rids = [4, 5, 6, 11], [0, 1, 2, 9]
        mine, theirs, handle = self._transfer(pair, op, lids, rids, local_layout=lv,
                                              remote_layout=rv)
        if op is Op.WRITE:
            expected = theirs.copy()
            expected[:, :, rids, 4096:] = mine[:, :, lids, :4096]
            np.testing.assert_array_equal(pair.remote_buf(), expected)
            np.testing.assert_array_equal(pair.local_buf, mine)
        else:
            expected = mine.copy()
            expected[:, :, lids, :4096] = theirs[:, :, rids, 4096:]
            np.testing.assert_array_equal(pair.local_buf, expected)
        assert handle.count == len(lv.planes) * 4  # one range per block: nothing merged
        assert handle.nbytes == len(lv.planes) * 4 * 4096

    def test_blocks_notification_after_bytes(self, local: Transport, peer: Peer) -> None:
        self._require(local, "notifications")
        self._require(local, "write")
        pair = self.connect(local, peer, 65536)
        lids, rids = [1, 2, 3, 9], [5, 6, 7, 0]
        mine, theirs = pair.local_buf.copy(), pair.remote_buf()
        bp = prepare_blocks(local, pair.peer_name, pair.local_layout, pair.remote.layout)
        handle = submit_blocks(local, Op.WRITE, bp, lids, rids, notification=b"blocks-done")
        got, snap = peer.notifications(1, timeout=self.timeout, snapshot=pair.remote.index)
        assert got == [(pair.local_name, b"blocks-done")]
        assert local.wait(handle, self.timeout) is HandleState.DONE, handle.error
        assert snap is not None
        expected = _moved(theirs, mine, rids, lids)
        np.testing.assert_array_equal(snap.reshape(expected.shape), expected)

    def test_blocks_refused(self, local: Transport, peer: Peer) -> None:
        """Bad ids and planes, a layout past the peer's memory, an unknown or removed peer:
        refused before anything moves."""
        pair = self.connect(local, peer)
        mine, theirs = pair.local_buf.copy(), pair.remote_buf()
        bp = prepare_blocks(local, pair.peer_name, pair.local_layout, pair.remote.layout)
        bad: list[tuple[list[Any], list[Any], list[int] | None]] = [
            ([0, 16], [1, 2], None),  # past num_blocks
            ([-1], [0], None),
            ([1 << 40], [0], None),  # forged, far outside
            ([1 << 70], [0], None),  # not even an int64
            ([3, 3], [1, 2], None),  # duplicate
            ([1, 2], [1, 2, 3], None),  # unequal counts
            ([1.5], [2], None),  # not an integer id
            ([1], [2], [0, 9]),  # plane out of range
            ([1], [2], [1, 1]),  # duplicate plane
            ([1], [2], []),  # no plane
        ]
        for lids, rids, planes in bad:
            for op in (Op.WRITE, Op.READ):
                with pytest.raises((LayoutError, DescriptorError)):
                    submit_blocks(local, op, bp, lids, rids, planes=planes)

        # a layout claiming more blocks than registered: refused at prepare (block transport)
        # or at submit (descriptor fallback)
        r, m = pair.remote.layout, pair.local_layout
        longer = KVLayout(r.planes, r.num_blocks * 4, r.block_size, r.dtype)
        bigger = KVLayout(m.planes, m.num_blocks * 4, m.block_size, m.dtype)
        for lay_l, lay_r, lids, rids in ((m, longer, [0, 1], [63, 62]),
                                         (bigger, r, [63, 62], [0, 1])):
            with pytest.raises(DescriptorError):
                bad_pair = prepare_blocks(local, pair.peer_name, lay_l, lay_r)
                submit_blocks(local, Op.WRITE, bad_pair, lids, rids)

        with pytest.raises(UnknownPeer):
            bad_pair = prepare_blocks(local, "no-such-peer", m, r)
            submit_blocks(local, Op.WRITE, bad_pair, [0], [0])
        local.remove_peer(pair.peer_name)
        with pytest.raises(UnknownPeer):
            submit_blocks(local, Op.WRITE, bp, [0], [0])
        with pytest.raises(UnknownPeer):
            bad_pair = prepare_blocks(local, pair.peer_name, m, r)
            submit_blocks(local, Op.WRITE, bad_pair, [0], [0])
        np.testing.assert_array_equal(pair.remote_buf(), theirs)
        np.testing.assert_array_equal(pair.local_buf, mine)

    def test_blocks_readded_peer(self, local: Transport, peer: Peer) -> None:
        """A pair prepared before the peer was re-added is refused; a fresh one works."""
        self._require(local, "write")
        pair = self.connect(local, peer)
        old = prepare_blocks(local, pair.peer_name, pair.local_layout, pair.remote.layout)
        assert pair.readd() == pair.peer_name
        if isinstance(local, BlockTransport):
            with pytest.raises(UnknownPeer):
                submit_blocks(local, Op.WRITE, old, [0], [0])
            forged = BlockPair(pair.peer_name, pair.local_layout, pair.remote.layout)
            with pytest.raises(DescriptorError):
                submit_blocks(local, Op.WRITE, forged, [0], [0])
        mine, theirs, _ = self._transfer(pair, Op.WRITE, [2, 5], [5, 2])
        self._check(pair, Op.WRITE, mine, theirs, [2, 5], [5, 2])

    @pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
    def test_blocks_prepared_ahead(self, local: Transport, peer: Peer, op: Op) -> None:
        """A request prepared ahead moves exactly what submitting it would have, when posted
        (after the source changed: the bytes are read at post time); it posts once; discarded
        it moves nothing; a peer removed meanwhile refuses it."""
        self._require(local, op.value.lower())
        pair = self.connect(local, peer, 4096, num_blocks=32)
        lids, rids = [3, 9, 4, 20], [1, 30, 2, 8]
        part = (pair.local_layout, lids, pair.remote.layout, rids)
        prep = prepare_parts(local, op, pair.peer_name, [part])
        if not isinstance(local, BlockTransport):
            assert prep is None  # the descriptor fallback has nothing to build ahead
            return
        assert prep is not None
        assert prepare_parts(local, op, pair.peer_name, [part, part]) is None  # several parts
        pair.local_buf[...] = (pair.local_buf + 1) % 251  # a WRITE reads the bytes at post time
        mine, theirs = pair.local_buf.copy(), pair.remote_buf()
        handle = prep.post()
        assert local.wait(handle, self.timeout) is HandleState.DONE, handle.error
        self._check(pair, op, mine, theirs, lids, rids)
        assert handle.nbytes == prep.req.nbytes == 4 * pair.local_layout.bytes_per_block
        assert handle.count == prep.req.count
        with pytest.raises(DescriptorError, match="already posted"):
            local.post_prepared(prep)

        bp = prepare_blocks(local, pair.peer_name, pair.local_layout, pair.remote.layout)
        unposted = local.prepare_request(op, bp, BlockRequest.build(bp.local, bp.remote, [0],
                                                                    [0]))
        pair.local_buf[...] = (pair.local_buf + 1) % 251
        mine, theirs = pair.local_buf.copy(), pair.remote_buf()
        unposted.discard()
        local.discard_prepared(unposted)  # idempotent
        with pytest.raises(DescriptorError, match="already posted or discarded"):
            local.post_prepared(unposted)
        np.testing.assert_array_equal(pair.remote_buf(), theirs)  # a discarded one moves nothing
        np.testing.assert_array_equal(pair.local_buf, mine)

        stale = local.prepare_request(op, bp, BlockRequest.build(bp.local, bp.remote, [5], [6]))
        local.remove_peer(pair.peer_name)
        with pytest.raises(UnknownPeer):
            local.post_prepared(stale)
        np.testing.assert_array_equal(pair.remote_buf(), theirs)
        np.testing.assert_array_equal(pair.local_buf, mine)
