"""FaultyTransport: each fault is really injected, and without faults the wrapper is transparent.

The local side is ``FaultyTransport(ShmTransport)`` in this process; the peer is a real shm
transport in a spawned process.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.errors import UnknownPeer
from kvbridge.layout import descriptor_pair
from kvbridge.testing.conformance import Pair, TransportConformance
from kvbridge.testing.faults import FaultyTransport
from kvbridge.testing.peer import PeerProcess, kv_buffer
from kvbridge.transport import HandleState, MemoryRegion, Op, Transport
from kvbridge.transports.shm import ShmTransport

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    p = PeerProcess("shm", timeout=20.0)
    try:
        p.start()
        yield p
    finally:
        p.close()


def _connect(ft: FaultyTransport, peer: PeerProcess, seed: int) -> Pair:
    buf, layout = kv_buffer(2, 16, 4096, seed)
    meta = ft.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    remote = peer.setup(2, 16, 4096, seed + 1)
    peer_name = ft.add_peer(remote.metadata, peer.invite(meta))
    local_name = peer.add_peer(meta, ft.invite(remote.metadata))
    return Pair(ft, peer, buf, layout, remote, peer_name, local_name, meta)


@pytest.fixture
def make(peer: PeerProcess) -> Iterator[Any]:
    made: list[FaultyTransport] = []

    def build(**faults: Any) -> tuple[FaultyTransport, Pair]:
        ft = FaultyTransport(ShmTransport(f"faulty-{uuid.uuid4().hex[:8]}"), **faults)
        made.append(ft)
        return ft, _connect(ft, peer, seed=len(made) * 10)

    try:
        yield build
    finally:
        for ft in made:
            ft.close()


def _write(pair: Pair, lids: list[int], rids: list[int], note: bytes | None = None) -> Any:
    loc, rem = descriptor_pair(pair.local_layout, lids, pair.remote.layout, rids)
    return pair.local.submit(Op.WRITE, pair.peer_name, loc, rem, note)


def test_transparent_without_faults(make: Any, peer: PeerProcess) -> None:
    ft, pair = make()
    src, dst = pair.local_buf.copy(), pair.remote_buf()
    h = _write(pair, [1, 5], [9, 2], b"plain")
    assert ft.wait(h, 10) is HandleState.DONE
    assert h.native is None or type(h.native).__name__ != "_Pending"  # the inner handle itself
    got, _ = peer.notifications(1, timeout=10)
    assert got == [(pair.local_name, b"plain")]
    dst[:, :, [9, 2]] = src[:, :, [1, 5]]
    np.testing.assert_array_equal(pair.remote_buf(), dst)
    assert ft.injected == []
    assert ft.capabilities == ft.inner.capabilities


def test_fail_nth_transfer(make: Any, peer: PeerProcess) -> None:
    ft, pair = make(fail=2)
    handles = [_write(pair, [k], [k], b"n%d" % k) for k in (1, 2, 3)]
    states = [ft.wait(h, 10) for h in handles]
    assert states == [HandleState.DONE, HandleState.FAILED, HandleState.DONE]
    assert handles[1].error is not None and "injected failure of transfer #2" in handles[1].error
    got, _ = peer.notifications(3, timeout=1.5)  # only two may come
    assert [m for _, m in got] == [b"n1", b"n3"]
    assert ft.injected == [("fail", 2)]


def test_refused_submit_is_not_counted(make: Any) -> None:
    ft, pair = make(fail=1)
    loc, rem = descriptor_pair(pair.local_layout, [0], pair.remote.layout, [0])
    with pytest.raises(UnknownPeer):
        ft.submit(Op.WRITE, "nobody", loc, rem)
    assert ft.wait(ft.submit(Op.WRITE, pair.peer_name, loc, rem), 10) is HandleState.FAILED


def test_corrupt_write_flips_one_byte_at_the_peer(make: Any) -> None:
    ft, pair = make(corrupt=2, corrupt_offset=4096 * 2 + 5)
    src, dst = pair.local_buf.copy(), pair.remote_buf()
    assert ft.wait(_write(pair, [0], [0]), 10) is HandleState.DONE  # #1: clean
    loc, rem = descriptor_pair(pair.local_layout, [3, 7], pair.remote.layout, [12, 4])
    h = ft.submit(Op.WRITE, pair.peer_name, loc, rem)
    assert ft.wait(h, 10) is HandleState.DONE
    expected = dst.copy()
    expected[:, :, [0, 12, 4]] = src[:, :, [0, 3, 7]]
    # offset 4096*2+5 walks the local descriptors: row 0 is 4096 bytes, row 1 too → row 2, +5
    target = int(rem[2, 0]) + 5 - pair.remote.layout.regions()[0][0]
    got = pair.remote_buf().reshape(-1)
    diff = np.flatnonzero(got != expected.reshape(-1))
    assert diff.tolist() == [target]
    assert got[target] == expected.reshape(-1)[target] ^ 0xFF
    np.testing.assert_array_equal(pair.local_buf, src)  # the source byte was restored
    assert ft.injected == [("corrupt", 2)]


def test_corrupt_read_flips_the_landed_byte(make: Any) -> None:
    ft, pair = make(corrupt=1, corrupt_offset=17)
    mine, theirs = pair.local_buf.copy(), pair.remote_buf()
    loc, rem = descriptor_pair(pair.local_layout, [6, 2], pair.remote.layout, [1, 11])
    assert ft.wait(ft.submit(Op.READ, pair.peer_name, loc, rem), 10) is HandleState.DONE
    expected = mine.copy()
    expected[:, :, [6, 2]] = theirs[:, :, [1, 11]]
    target = int(loc[0, 0]) + 17 - pair.local_layout.regions()[0][0]
    flat = pair.local_buf.reshape(-1)
    assert np.flatnonzero(flat != expected.reshape(-1)).tolist() == [target]
    assert flat[target] == expected.reshape(-1)[target] ^ 0xFF
    np.testing.assert_array_equal(pair.remote_buf(), theirs)


def test_drop_nth_notification(make: Any, peer: PeerProcess) -> None:
    ft, pair = make(drop_notification=[2, 4])
    ft.send_notification(pair.peer_name, b"m1")
    ft.send_notification(pair.peer_name, b"m2")  # dropped
    h = _write(pair, [1], [1], b"m3")
    assert ft.wait(h, 10) is HandleState.DONE
    h = _write(pair, [2], [2], b"m4")  # transfer runs, its notification is dropped
    assert ft.wait(h, 10) is HandleState.DONE
    ft.send_notification(pair.peer_name, b"m5")
    got, _ = peer.notifications(5, timeout=1.5)
    assert [m for _, m in got] == [b"m1", b"m3", b"m5"]
    assert ft.injected == [("drop_notification", 2), ("drop_notification", 4)]


def test_delay_holds_handle_and_notification(make: Any, peer: PeerProcess) -> None:
    ft, pair = make(delay=0.6)
    t0 = time.perf_counter()
    h = _write(pair, [3], [8], b"late")
    assert ft.poll(h) is HandleState.PENDING
    early, _ = peer.notifications(1, timeout=0.3)
    assert early == []
    assert ft.wait(h, 10) is HandleState.DONE
    assert time.perf_counter() - t0 >= 0.6
    got, _ = peer.notifications(1, timeout=10)
    assert got == [(pair.local_name, b"late")]


def test_post_delay_blocks_the_submit_and_then_runs_the_transfer(make: Any,
                                                                 peer: PeerProcess) -> None:
    ft, pair = make(post_delay=0.3)
    t0 = time.perf_counter()
    h = _write(pair, [4], [9], b"slow-post")
    assert time.perf_counter() - t0 >= 0.3  # the caller waited before anything was posted
    assert ft.wait(h, 10) is HandleState.DONE
    got, _ = peer.notifications(1, timeout=10)
    assert got == [(pair.local_name, b"slow-post")]
    assert ft.injected == []  # a slow post is not a fault of one transfer


def test_close_with_delayed_transfers_does_not_hang(make: Any) -> None:
    ft, pair = make(delay=30.0)
    handles = [_write(pair, [k], [k]) for k in range(4)]
    t0 = time.monotonic()
    ft.close(timeout=2.0)
    assert time.monotonic() - t0 < 10
    assert all(ft.poll(h).terminal for h in handles)


def test_stalled_transfer_stays_pending_until_unstalled(make: Any, peer: PeerProcess) -> None:
    ft, pair = make(stall=2)
    first = _write(pair, [1], [1], b"s1")
    stalled = _write(pair, [2], [2], b"s2")
    assert ft.wait(first, 10) is HandleState.DONE
    time.sleep(0.5)
    assert ft.poll(stalled) is HandleState.PENDING
    got, _ = peer.notifications(2, timeout=0.5)
    assert [m for _, m in got] == [b"s1"]  # the stalled one's notification is held back
    ft.unstall()
    assert ft.wait(stalled, 10) is HandleState.DONE
    got, _ = peer.notifications(1, timeout=10)
    assert [m for _, m in got] == [b"s2"]
    assert ft.injected == [("stall", 2)]


def test_stalled_transfer_fails_at_close(make: Any) -> None:
    ft, pair = make(stall=1)
    h = _write(pair, [4], [4])
    t0 = time.monotonic()
    ft.close(timeout=2.0)
    assert time.monotonic() - t0 < 10
    assert ft.poll(h) is HandleState.FAILED and "stalled" in (h.error or "")


def test_stalled_add_peer_blocks_until_unstalled_or_closed(peer: PeerProcess) -> None:
    import threading

    from kvbridge.errors import TransportClosed

    for end in ("unstall", "close"):
        ft = FaultyTransport(ShmTransport(f"faulty-{uuid.uuid4().hex[:8]}"), stall_add_peer=1)
        try:
            buf, _ = kv_buffer(2, 16, 4096, 3)
            meta = ft.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
            remote = peer.setup(2, 16, 4096, 4)
            proof = peer.invite(meta)
            out: list[object] = []

            def add(remote: Any = remote, proof: bytes = proof, ft: FaultyTransport = ft,
                    out: list[object] = out) -> None:
                try:
                    out.append(ft.add_peer(remote.metadata, proof))
                except TransportClosed as exc:
                    out.append(exc)

            t = threading.Thread(target=add)
            t.start()
            t.join(0.5)
            assert t.is_alive() and out == []  # stalled
            ft.unstall() if end == "unstall" else ft.close(2.0)
            t.join(10)
            assert len(out) == 1
            assert isinstance(out[0], str if end == "unstall" else TransportClosed), out
            assert ft.injected == [("stall_add_peer", 1)]
        finally:
            ft.close()


def test_faulty_backend_presents_its_inner_backend() -> None:
    from kvbridge.errors import ConfigError
    from kvbridge.testing.faults import FaultyBackend

    fb = FaultyBackend("fb", {"inner": "shm", "faults": {"stall": [1, 3]}})
    try:
        assert fb.name == "shm" and fb.stall == frozenset({1, 3})
        assert fb.capabilities == fb.inner.capabilities
    finally:
        fb.close()
    with pytest.raises(ConfigError, match="faults"):
        FaultyBackend("fb", {"faults": {"explode": 1}})


class TestFaultyTransportConformance(TransportConformance):
    """The whole suite through the wrapper (a small delay routes every transfer through it)."""

    backend = "shm"
    native_blocks = False  # the block tests run the core's descriptor fallback through it

    def make_transport(self, agent_name: str) -> Transport:
        return FaultyTransport(ShmTransport(agent_name), delay=0.002)
