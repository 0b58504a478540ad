"""The transport conformance suite: pytest classes every backend's test module subclasses.

Usage (fsspec style)::

    from kvbridge.testing.conformance import TransportConformance

    class TestShmConformance(TransportConformance):
        backend = "shm"                 # entry-point name in ``kvbridge.backends``
        options = {}                    # options of both transports (the local one and the peer's)
        peer_options = None             # optional: other options for the peer (None = options)
        peer_env = {"UCX_TLS": "tcp"}   # optional: environment of the peer process
        timeout = 30.0                  # optional: bound of one peer command / wait
        in_process_peer = False         # optional: True = the peer is a second transport here
        local_env = False               # optional: True = apply peer_env to this process too

Override :meth:`TransportConformance.make_transport` to build the local transport differently
(e.g. wrapped in :class:`kvbridge.testing.faults.FaultyTransport`), and
:meth:`TransportConformance.make_peer` to build the peer differently. A backend that lacks a
capability (``Capabilities.read`` …) has the matching tests skipped.

By default every test uses a REAL second process (:class:`kvbridge.testing.peer.PeerProcess`,
spawn context) holding registered memory; metadata goes both ways over its command pipe
(``add_peer`` on both sides, each with a proof the other side attested:
:meth:`~kvbridge.transport.Transport.invite`). A backend that only reaches its own process
(``memory``) sets ``in_process_peer = True`` and gets an
:class:`kvbridge.testing.inprocess.InProcessPeer` (a second transport object in this process,
same methods) instead. Bytes are checked on both
sides after every transfer: the blocks moved, the blocks not moved, and the source. Tests are
bounded (``pytest.mark.timeout`` plus per-call timeouts) and the peer is closed (its process
killed) in teardown even when a test fails.

What is checked: register + handshake; READ and WRITE of scattered blocks (random permutations,
several block sizes, descriptors from :func:`kvbridge.layout.descriptor_pair`); transfers the
peer initiates; memory registered after the handshake; notifications (standalone, in order per
peer; attached to a transfer, visible only once the bytes landed); many concurrent transfers;
``close`` with transfers in flight (no hang, every handle DONE or FAILED, DONE ones correct);
errors: unequal descriptor lists and sizes, descriptors outside registered memory (local and
remote) → :class:`DescriptorError`, unknown or removed peer → :class:`UnknownPeer`, malformed
metadata → :class:`MessageError`, a layout of the wrong geometry → :class:`LayoutMismatch`;
the block path the core uses (:mod:`kvbridge.testing.conformance.blocks`); and hostile peers
— relayed, forged, stale — refused (:mod:`kvbridge.testing.conformance.hostile_peer`). Set
``native_blocks = True`` when the backend is a :class:`kvbridge.blocks.BlockTransport`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

from kvbridge import registry
from kvbridge.errors import (
    DescriptorError,
    LayoutMismatch,
    MessageError,
    TransportClosed,
    UnknownPeer,
)
from kvbridge.layout import KVLayout, KVPlane, descriptor_pair
from kvbridge.testing.conformance.blocks import BlockConformance
from kvbridge.testing.conformance.hostile_peer import HostilePeerConformance
from kvbridge.testing.conformance.pair import Pair
from kvbridge.testing.inprocess import InProcessPeer
from kvbridge.testing.peer import (
    Peer,
    PeerProcess,
    collect_notifications,
    kv_buffer,
)
from kvbridge.transport import (
    Capabilities,
    HandleState,
    MemoryRegion,
    Notifying,
    Op,
    Transport,
    notifying,
)

__all__ = ["TransportConformance", "Pair", "BLOCK_SIZES"]

#: Block sizes (bytes per block per plane) of the scattered READ/WRITE tests.
BLOCK_SIZES = (4096, 65536, 262144)


class TransportConformance(BlockConformance, HostilePeerConformance):
    """Base class of every backend's conformance tests (not collected itself: no ``Test``)."""

    backend: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    peer_options: ClassVar[dict[str, Any] | None] = None
    peer_env: ClassVar[dict[str, str]] = {}
    timeout: ClassVar[float] = 30.0
    #: True: the peer is an :class:`InProcessPeer` (no process; ``peer_env`` must stay empty).
    in_process_peer: ClassVar[bool] = False
    #: True: ``peer_env`` is also set in this process during each test (both agents then use,
    #: e.g., the same UCX transports), and restored afterwards.
    local_env: ClassVar[bool] = False

    pytestmark = [pytest.mark.timeout(180)]

    # -- hooks ----------------------------------------------------------------------------------

    def make_transport(self, agent_name: str) -> Transport:
        """Create the local transport under test (override to wrap or configure it)."""
        t: Transport = registry.create(self.backend, agent_name, self.options)
        return t

    def make_peer(self) -> Peer:
        """Create (not start) the peer: a :class:`PeerProcess`, or an :class:`InProcessPeer`
        when ``in_process_peer`` is set (override to build it differently)."""
        opts = self.options if self.peer_options is None else self.peer_options
        if self.in_process_peer:
            return InProcessPeer(self.backend, opts, self.peer_env, timeout=self.timeout)
        return PeerProcess(self.backend, opts, self.peer_env, timeout=self.timeout)

    # -- fixtures -------------------------------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _local_env(self) -> Iterator[None]:
        if not self.local_env:
            yield
            return
        saved = {k: os.environ.get(k) for k in self.peer_env}
        os.environ.update(self.peer_env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    @pytest.fixture
    def local(self) -> Iterator[Transport]:
        t = self.make_transport(f"local-{uuid.uuid4().hex[:8]}")
        try:
            yield t
        finally:
            t.close(timeout=5.0)

    @pytest.fixture
    def peer(self) -> Iterator[Peer]:
        p = self.make_peer()
        try:
            p.start()
            yield p
        finally:
            p.close()

    # -- helpers --------------------------------------------------------------------------------

    def connect(
        self,
        local: Transport,
        peer: Peer,
        block_bytes: int = 4096,
        num_blocks: int = 16,
        layers: int = 2,
        seed: int = 0,
    ) -> Pair:
        """Register one random KV buffer per side and add each side as the other's peer, each
        with a proof the other side attested (:meth:`Transport.invite`)."""
        buf, layout = kv_buffer(layers, num_blocks, block_bytes, seed)
        meta = local.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
        remote = peer.setup(layers, num_blocks, block_bytes, seed + 1000)
        peer_name = local.add_peer(remote.metadata, peer.invite(meta))
        local_name = peer.add_peer(meta, local.invite(remote.metadata))
        assert peer_name == peer.name, "add_peer must return the peer's agent name"
        assert local_name == local.agent_name
        return Pair(local, peer, buf, layout, remote, peer_name, local_name, meta)

    def _wait_all(self, t: Transport, handles: list[Any]) -> list[HandleState]:
        return [t.wait(h, self.timeout) for h in handles]

    def _require(self, t: Transport, what: str) -> None:
        if not getattr(t.capabilities, what):
            pytest.skip(f"{self.backend} lacks capability {what!r}")
        if what == "notifications" and not isinstance(t, Notifying):
            pytest.skip(f"{self.backend} carries no notifications (kvbridge.transport.Notifying)")

    # -- lifecycle and handshake ----------------------------------------------------------------

    def test_capabilities(self, local: Transport) -> None:
        assert isinstance(local.capabilities, Capabilities)
        assert local.agent_name.startswith("local-")
        assert not local.closed

    def test_register_and_handshake(self, local: Transport, peer: Peer) -> None:
        pair = self.connect(local, peer)
        assert isinstance(pair.remote.metadata, bytes)
        # re-adding a peer (a new handshake, a new proof) replaces it and keeps the name
        assert pair.readd() == pair.peer_name

    def test_register_after_handshake(self, local: Transport, peer: Peer) -> None:
        """Memory registered later is reachable once the new metadata was re-sent."""
        pair = self.connect(local, peer)
        self._require(local, "write")
        extra, extra_layout = kv_buffer(1, 8, 4096, 77)
        meta = local.register_memory([MemoryRegion(extra.ctypes.data, extra.nbytes)])
        assert peer.add_peer(meta, local.invite(pair.remote.metadata)) == pair.local_name
        remote_layout = pair.remote.layout
        small = KVLayout(remote_layout.planes[:2], remote_layout.num_blocks, 16, "uint8")
        ids = [3, 1, 6]
        p_loc, p_rem = descriptor_pair(small, ids, extra_layout, [0, 5, 7])
        state, error = peer.transfer(Op.WRITE, pair.local_name, p_loc, p_rem)
        assert state == "done", error
        remote = pair.remote_buf()
        np.testing.assert_array_equal(extra[0][:, [0, 5, 7]], remote[0][:, ids])

    # -- data path ------------------------------------------------------------------------------

    @pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
    def test_write_scattered(
        self, local: Transport, peer: Peer, block_bytes: int
    ) -> None:
        self._require(local, "write")
        pair = self.connect(local, peer, block_bytes)
        nb = pair.local_layout.num_blocks
        rng = np.random.default_rng(block_bytes)
        lids, rids = rng.permutation(nb)[: nb // 2], rng.permutation(nb)[: nb // 2]
        src_before, dst_before = pair.local_buf.copy(), pair.remote_buf()
        loc, rem = descriptor_pair(pair.local_layout, lids, pair.remote.layout, rids)
        handle = local.submit(Op.WRITE, pair.peer_name, loc, rem)
        assert local.wait(handle, self.timeout) is HandleState.DONE, handle.error
        expected = dst_before.copy()
        expected[:, :, rids] = src_before[:, :, lids]
        np.testing.assert_array_equal(pair.remote_buf(), expected)
        np.testing.assert_array_equal(pair.local_buf, src_before)
        assert handle.nbytes == int(loc[:, 1].sum())
        assert handle.nbytes == lids.size * pair.local_layout.bytes_per_block

    @pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
    def test_read_scattered(
        self, local: Transport, peer: Peer, block_bytes: int
    ) -> None:
        self._require(local, "read")
        pair = self.connect(local, peer, block_bytes)
        nb = pair.local_layout.num_blocks
        rng = np.random.default_rng(block_bytes + 1)
        lids, rids = rng.permutation(nb)[: nb // 2], rng.permutation(nb)[: nb // 2]
        dst_before, src_before = pair.local_buf.copy(), pair.remote_buf()
        loc, rem = descriptor_pair(pair.local_layout, lids, pair.remote.layout, rids)
        handle = local.submit(Op.READ, pair.peer_name, loc, rem)
        assert local.wait(handle, self.timeout) is HandleState.DONE, handle.error
        expected = dst_before.copy()
        expected[:, :, lids] = src_before[:, :, rids]
        np.testing.assert_array_equal(pair.local_buf, expected)
        np.testing.assert_array_equal(pair.remote_buf(), src_before)

    @pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
    def test_peer_initiated(self, local: Transport, peer: Peer, op: Op) -> None:
        """The other direction: the peer READs from / WRITEs into our registered memory."""
        pair = self.connect(local, peer, 8192)
        self._require(local, op.value.lower())
        lids, rids = [5, 0, 9, 2], [1, 14, 3, 8]
        mine_before, theirs_before = pair.local_buf.copy(), pair.remote_buf()
        p_loc, p_rem = descriptor_pair(pair.remote.layout, rids, pair.local_layout, lids)
        state, error = peer.transfer(op, pair.local_name, p_loc, p_rem)
        assert state == "done", error
        if op is Op.WRITE:
            expected = mine_before.copy()
            expected[:, :, lids] = theirs_before[:, :, rids]
            np.testing.assert_array_equal(pair.local_buf, expected)
        else:
            expected = theirs_before.copy()
            expected[:, :, rids] = mine_before[:, :, lids]
            np.testing.assert_array_equal(pair.remote_buf(), expected)
            np.testing.assert_array_equal(pair.local_buf, mine_before)

    def test_many_concurrent_transfers(self, local: Transport, peer: Peer) -> None:
        """64 transfers (WRITEs and READs on disjoint blocks) in flight at once."""
        self._require(local, "write")
        self._require(local, "read")
        pair = self.connect(local, peer, 16384, num_blocks=128)
        rng = np.random.default_rng(7)
        lperm, rperm = rng.permutation(128), rng.permutation(128)
        mine_before, theirs_before = pair.local_buf.copy(), pair.remote_buf()
        handles = []
        for k in range(64):
            op = Op.WRITE if k % 2 == 0 else Op.READ
            lid, rid = lperm[2 * k : 2 * k + 2], rperm[2 * k : 2 * k + 2]
            loc, rem = descriptor_pair(pair.local_layout, lid, pair.remote.layout, rid)
            handles.append((op, lid, rid, local.submit(op, pair.peer_name, loc, rem)))
        states = self._wait_all(local, [h for *_, h in handles])
        assert all(s is HandleState.DONE for s in states), [h.error for *_, h in handles]
        exp_mine, exp_theirs = mine_before.copy(), theirs_before.copy()
        for op, lid, rid, _ in handles:
            if op is Op.WRITE:
                exp_theirs[:, :, rid] = mine_before[:, :, lid]
            else:
                exp_mine[:, :, lid] = theirs_before[:, :, rid]
        np.testing.assert_array_equal(pair.local_buf, exp_mine)
        np.testing.assert_array_equal(pair.remote_buf(), exp_theirs)

    def test_close_with_transfers_in_flight(self, local: Transport, peer: Peer) -> None:
        """close() returns in bounded time; every handle ends DONE or FAILED; DONE is correct."""
        self._require(local, "write")
        pair = self.connect(local, peer, 262144, num_blocks=32)
        rng = np.random.default_rng(11)
        lperm, rperm = rng.permutation(32), rng.permutation(32)
        src, dst_before = pair.local_buf.copy(), pair.remote_buf()
        handles = []
        for k in range(16):
            lid, rid = lperm[2 * k : 2 * k + 2], rperm[2 * k : 2 * k + 2]
            loc, rem = descriptor_pair(pair.local_layout, lid, pair.remote.layout, rid)
            handles.append((rid, lid, local.submit(Op.WRITE, pair.peer_name, loc, rem)))
        t0 = time.monotonic()
        local.close(timeout=10.0)
        assert time.monotonic() - t0 < 20.0
        assert local.closed
        for _, _, h in handles:
            assert local.poll(h).terminal, f"handle {h.id} still {h.state} after close"
        after = pair.remote_buf()
        for rid, lid, h in handles:
            if h.state is HandleState.DONE:
                np.testing.assert_array_equal(after[:, :, rid], src[:, :, lid])
        touched = np.zeros(32, bool)
        touched[[r for rid, _, _ in handles for r in rid]] = True
        np.testing.assert_array_equal(after[:, :, ~touched], dst_before[:, :, ~touched])
        loc, rem = descriptor_pair(pair.local_layout, [0], pair.remote.layout, [0])
        with pytest.raises(TransportClosed):
            local.submit(Op.WRITE, pair.peer_name, loc, rem)
        local.close()  # idempotent

    # -- notifications --------------------------------------------------------------------------

    def test_notifications_in_order(self, local: Transport, peer: Peer) -> None:
        self._require(local, "notifications")
        pair = self.connect(local, peer)
        sent = [b"note-%d" % i for i in range(40)]
        for m in sent:
            notifying(local).send_notification(pair.peer_name, m)
        got, _ = peer.notifications(len(sent), timeout=self.timeout)
        assert got == [(pair.local_name, m) for m in sent]
        back = [b"back-%d" % i for i in range(20)]
        for m in back:
            peer.send_notification(pair.local_name, m)
        received = collect_notifications(local, len(back), self.timeout)
        assert received == [(pair.peer_name, m) for m in back]

    @pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
    def test_notification_after_bytes(self, local: Transport, peer: Peer, op: Op) -> None:
        """A transfer's notification reaches the peer only once the bytes are visible there."""
        self._require(local, "notifications")
        self._require(local, op.value.lower())
        pair = self.connect(local, peer, 65536)
        lids, rids = [4, 11, 2, 7], [9, 0, 15, 3]
        mine_before, theirs_before = pair.local_buf.copy(), pair.remote_buf()
        loc, rem = descriptor_pair(pair.local_layout, lids, pair.remote.layout, rids)
        handle = local.submit(op, pair.peer_name, loc, rem, notification=b"xfer-done")
        got, snap = peer.notifications(1, timeout=self.timeout, snapshot=pair.remote.index)
        assert got == [(pair.local_name, b"xfer-done")]
        assert local.wait(handle, self.timeout) is HandleState.DONE, handle.error
        assert snap is not None
        if op is Op.WRITE:
            expected = theirs_before.copy()
            expected[:, :, rids] = mine_before[:, :, lids]
            np.testing.assert_array_equal(snap.reshape(expected.shape), expected)
        else:
            expected = mine_before.copy()
            expected[:, :, lids] = theirs_before[:, :, rids]
            np.testing.assert_array_equal(pair.local_buf, expected)

    def test_attached_notifications_all_arrive(self, local: Transport, peer: Peer) -> None:
        self._require(local, "notifications")
        self._require(local, "write")
        pair = self.connect(local, peer, 4096, num_blocks=32)
        handles, sent = [], []
        for k in range(12):
            loc, rem = descriptor_pair(pair.local_layout, [k], pair.remote.layout, [31 - k])
            msg = b"t-%d" % k
            sent.append(msg)
            handles.append(local.submit(Op.WRITE, pair.peer_name, loc, rem, notification=msg))
        assert all(s is HandleState.DONE for s in self._wait_all(local, handles))
        got, _ = peer.notifications(len(sent), timeout=self.timeout)
        assert sorted(m for _, m in got) == sorted(sent)
        assert {n for n, _ in got} == {pair.local_name}

    # -- errors ---------------------------------------------------------------------------------

    def test_unequal_descriptor_lists(self, local: Transport, peer: Peer) -> None:
        pair = self.connect(local, peer)
        loc, rem = descriptor_pair(pair.local_layout, [0, 2], pair.remote.layout, [1, 3])
        with pytest.raises(DescriptorError):
            local.submit(Op.WRITE, pair.peer_name, loc, rem[:-1])
        bad = rem.copy()
        bad[0, 1] -= 1
        with pytest.raises(DescriptorError):
            local.submit(Op.READ, pair.peer_name, loc, bad)

    def test_descriptors_outside_registered_memory(
        self, local: Transport, peer: Peer
    ) -> None:
        pair = self.connect(local, peer)
        before = pair.remote_buf()
        loc, rem = descriptor_pair(pair.local_layout, [0, 1], pair.remote.layout, [2, 3])
        beyond = rem.copy()
        beyond[-1, 0] = rem[:, 0].max() + pair.remote_buf().nbytes  # past the peer's buffer
        with pytest.raises(DescriptorError):
            local.submit(Op.WRITE, pair.peer_name, loc, beyond)
        overhang = rem.copy()
        end = min(a + n for a, n in pair.remote.layout.regions())
        overhang[0, 0] = end - int(overhang[0, 1]) // 2  # straddles the end of the region
        with pytest.raises(DescriptorError):
            local.submit(Op.WRITE, pair.peer_name, loc, overhang)
        stray = np.zeros(loc[:, 1].sum(), dtype=np.uint8)  # local memory never registered
        unreg = loc.copy()
        unreg[:, 0] = stray.ctypes.data
        unreg[1, 0] = stray.ctypes.data + int(loc[0, 1])
        with pytest.raises(DescriptorError):
            local.submit(Op.READ, pair.peer_name, unreg, rem)
        np.testing.assert_array_equal(pair.remote_buf(), before)

    def test_unknown_peer(self, local: Transport, peer: Peer) -> None:
        pair = self.connect(local, peer)
        loc, rem = descriptor_pair(pair.local_layout, [0], pair.remote.layout, [0])
        with pytest.raises(UnknownPeer):
            local.submit(Op.WRITE, "no-such-peer", loc, rem)
        if isinstance(local, Notifying):
            with pytest.raises(UnknownPeer):
                local.send_notification("no-such-peer", b"x")
        local.remove_peer(pair.peer_name)
        local.remove_peer(pair.peer_name)  # no-op
        with pytest.raises(UnknownPeer):
            local.submit(Op.WRITE, pair.peer_name, loc, rem)

    @pytest.mark.parametrize(
        "blob",
        [b"", b"\x00\xffgarbage", msgspec.msgpack.encode({"agent": "x"}), b"\x92\x01\x02"],
        ids=["empty", "garbage", "wrong-map", "wrong-array"],
    )
    def test_malformed_metadata(self, local: Transport, blob: bytes) -> None:
        with pytest.raises(MessageError):
            local.add_peer(blob, bytes(32))

    def test_layout_of_wrong_geometry(self, local: Transport, peer: Peer) -> None:
        pair = self.connect(local, peer, 4096)
        remote = pair.remote.layout
        fatter = KVLayout(
            tuple(KVPlane(p.layer, p.base, p.block_stride * 2, p.block_bytes * 2)
                  for p in remote.planes),
            remote.num_blocks // 2, remote.block_size, remote.dtype,
        )
        with pytest.raises(LayoutMismatch):
            descriptor_pair(pair.local_layout, [0], fatter, [0])
        fewer = KVLayout(remote.planes[:2], remote.num_blocks, remote.block_size, remote.dtype)
        with pytest.raises(LayoutMismatch):
            descriptor_pair(pair.local_layout, [0], fewer, [0])
        other_dtype = KVLayout(remote.planes, remote.num_blocks, remote.block_size, "float16")
        with pytest.raises(LayoutMismatch):
            descriptor_pair(pair.local_layout, [0], other_dtype, [0])
