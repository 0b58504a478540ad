"""shm-specific behaviour beyond the conformance suite (tests/process/test_conformance_shm.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge import registry
from kvbridge.blocks import BlockRequest, prepare_blocks, prepare_parts
from kvbridge.errors import (
    DescriptorError,
    PeerUnreachable,
    TransferFailed,
    TransportClosed,
)
from kvbridge.layout import KVLayout, KVPlane
from kvbridge.messages import Codec
from kvbridge.testing.peer import PeerProcess, collect_notifications
from kvbridge.transport import PROOF_BYTES, HandleState, MemoryRegion, Op
from kvbridge.transports.notify import NotificationSender
from kvbridge.transports.shm import (
    DEFAULT_THREADS,
    IOV_MAX,
    ShmMetadata,
    ShmTransport,
    copy_iovecs,
    split_iovecs,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shm() -> Iterator[ShmTransport]:
    t = ShmTransport(f"shm-{uuid.uuid4().hex[:8]}")
    try:
        yield t
    finally:
        t.close()


def _descs(base: int, offsets: np.ndarray[Any, Any], length: int) -> np.ndarray[Any, Any]:
    n = offsets.size
    return np.stack(
        [base + offsets.astype(np.int64) * length, np.full(n, length), np.zeros(n, np.int64)], 1
    ).astype(np.int64)


def _loopback(t: ShmTransport, *arrays: np.ndarray[Any, Any]) -> str:
    meta = t.register_memory([MemoryRegion(a.ctypes.data, a.nbytes) for a in arrays])
    return t.add_peer(meta, t.invite(meta))


def test_entry_point_and_capabilities() -> None:
    t = registry.create("shm", "ep-test")
    try:
        assert isinstance(t, ShmTransport)
        caps = t.capabilities
        assert (caps.read, caps.write, caps.notifications) == (True, True, True)
        assert (caps.device_memory, caps.cross_host) == (False, False)
    finally:
        t.close()


@pytest.mark.parametrize("iov_max", [IOV_MAX, 7])
def test_batches_beyond_iov_max(iov_max: int) -> None:
    """2500 scattered 512-byte descriptors: several system calls, every byte checked."""
    t = ShmTransport("batch", {"iov_max": iov_max})
    try:
        n, size = 2500, 512
        src = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        name = _loopback(t, src, dst)
        perm = np.random.default_rng(2).permutation(n)
        loc, rem = _descs(src.ctypes.data, np.arange(n), size), _descs(dst.ctypes.data, perm, size)
        h = t.transfer(Op.WRITE, name, loc, rem)
        assert h.state is HandleState.DONE and h.nbytes == n * size
        np.testing.assert_array_equal(dst.reshape(n, size)[perm], src.reshape(n, size))
        back = np.zeros_like(src)
        name = _loopback(t, back)
        t.transfer(Op.READ, name, _descs(back.ctypes.data, np.arange(n), size), rem)
        np.testing.assert_array_equal(back, src)
    finally:
        t.close()


@pytest.mark.parametrize("threads", [2, 3])
def test_large_transfers_split_across_threads(threads: int) -> None:
    """With ``threads`` > 1 a transfer of at least ``split_bytes`` is cut into parts copied in
    parallel (ranges split mid-way, one huge range too); every byte lands where it should."""
    t = ShmTransport("split", {"threads": threads, "split_bytes": 4096})
    try:
        n, size = 300, 1000  # 1000-byte blocks: cuts fall inside ranges
        src = np.random.default_rng(4).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        name = _loopback(t, src, dst)
        perm = np.random.default_rng(5).permutation(n)
        rem = _descs(dst.ctypes.data, perm, size)
        t.transfer(Op.WRITE, name, _descs(src.ctypes.data, np.arange(n), size), rem)
        np.testing.assert_array_equal(dst.reshape(n, size)[perm], src.reshape(n, size))
        back = np.zeros_like(src)
        name = _loopback(t, back)
        whole = np.array([[dst.ctypes.data, dst.nbytes, 0]])  # one range, split by bytes
        t.transfer(Op.READ, name, np.array([[back.ctypes.data, back.nbytes, 0]]), whole)
        np.testing.assert_array_equal(back, dst)
    finally:
        t.close()


def test_by_default_a_large_transfer_is_split_where_there_are_two_cpus() -> None:
    """``threads`` defaults to 2 (1 on a one-CPU host): a transfer of at least ``split_bytes``
    (16 MiB) is copied by the worker and a helper, and every byte lands."""
    t = ShmTransport("split-default", {})
    try:
        assert t._threads == DEFAULT_THREADS == min(2, os.cpu_count() or 1)
        n, size = 68, 256 << 10  # 17 MiB
        src = np.random.default_rng(8).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        name = _loopback(t, src, dst)
        perm = np.random.default_rng(9).permutation(n)
        t.transfer(Op.WRITE, name, _descs(src.ctypes.data, np.arange(n), size),
                   _descs(dst.ctypes.data, perm, size))
        np.testing.assert_array_equal(dst.reshape(n, size)[perm], src.reshape(n, size))
        assert (t._helpers is not None) == (DEFAULT_THREADS > 1)
    finally:
        t.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prepared_request_is_built_at_prepare_and_only_queued_at_post(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prepare_request`` builds the iovecs (split across the copy threads when large); posting
    builds nothing more, and every byte lands (the connector prepares a push during the
    forward, so the hand-off only queues)."""
    t = ShmTransport("prepared", {"threads": threads, "split_bytes": 4096})
    try:
        n, size = 64, 1000
        src = np.random.default_rng(10).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        name = _loopback(t, src, dst)
        src_plane, dst_plane = (KVLayout((KVPlane("p", a.ctypes.data, size, size),), n, 16, "uint8")
                                for a in (src, dst))
        pair = prepare_blocks(t, name, src_plane, dst_plane)
        perm = np.random.default_rng(11).permutation(n)
        prep = prepare_parts(t, Op.WRITE, name, [(pair.local, np.arange(n), pair.remote, perm)])
        assert prep is not None and len(prep.native.parts) == threads

        def no_building(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("iovecs built after prepare")

        monkeypatch.setattr(BlockRequest, "descriptors", no_building)
        monkeypatch.setattr("kvbridge.transports.shm.worker.split_iovecs", no_building)
        h = prep.post()
        assert t.wait(h, 10) is HandleState.DONE, h.error
        np.testing.assert_array_equal(dst.reshape(n, size)[perm], src.reshape(n, size))
    finally:
        t.close()


def test_split_iovecs_covers_every_byte_once() -> None:
    rng = np.random.default_rng(6)
    for _ in range(100):
        k = int(rng.integers(1, 12))
        lengths = rng.integers(1, 500, k).astype(np.uint64)
        local = np.stack([rng.integers(1 << 20, 1 << 30, k).astype(np.uint64), lengths], 1)
        remote = np.stack([rng.integers(1 << 20, 1 << 30, k).astype(np.uint64), lengths], 1)
        parts = split_iovecs(local, remote, int(rng.integers(1, 6)))

        def bytes_of(arrays: list[np.ndarray[Any, Any]]) -> list[int]:
            return [int(a) + i for arr in arrays for a, n in arr.tolist() for i in range(n)]

        assert bytes_of([p[0] for p in parts]) == bytes_of([local])
        assert bytes_of([p[1] for p in parts]) == bytes_of([remote])
        assert all((p[0][:, 1] > 0).all() and p[0].flags.c_contiguous for p in parts)


def test_copy_iovecs_resumes_after_partial_results() -> None:
    """A system call that moves fewer bytes than asked (even mid-iovec) is resumed exactly."""
    src = np.random.default_rng(3).integers(0, 256, 10_000, dtype=np.uint8)
    dst = np.zeros_like(src)
    sizes = np.array([1000, 3000, 10, 5990])
    offs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    local = np.stack([src.ctypes.data + offs, sizes], 1).astype(np.uint64)
    remote = np.stack([dst.ctypes.data + offs, sizes], 1).astype(np.uint64)
    calls: list[int] = []

    def stingy(pid: int, lptr: int, lcnt: int, rptr: int, rcnt: int, flags: int) -> int:
        lv = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * lcnt)).from_address(lptr))
        rv = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * rcnt)).from_address(rptr))
        budget = 1700  # at most this many bytes per call
        moved = 0
        for k in range(lcnt):
            n = min(int(lv[2 * k + 1]), budget - moved)
            ctypes.memmove(int(rv[2 * k]), int(lv[2 * k]), n)
            moved += n
            if moved == budget:
                break
        calls.append(moved)
        return moved

    assert copy_iovecs(stingy, 0, local, remote, iov_max=3) == src.size
    np.testing.assert_array_equal(dst, src)
    assert len(calls) > 5 and max(calls) <= 1700


def test_system_error_names_the_problem() -> None:
    """A region that is registered but not mapped: EFAULT → FAILED, no notification sent."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = 4096
    base = libc.mmap(None, 2 * page, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    assert base not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(base + page, page) == 0  # the second page is gone
    t = ShmTransport("efault")
    try:
        src = np.ones(page, dtype=np.uint8)
        meta = t.register_memory([MemoryRegion(src.ctypes.data, page),
                                  MemoryRegion(base, 2 * page)])
        name = t.add_peer(meta, t.invite(meta))
        loc = np.array([[src.ctypes.data, page, 0]])
        h = t.submit(Op.WRITE, name, loc, np.array([[base + page, page, 0]]), b"must-not-arrive")
        assert t.wait(h, 10) is HandleState.FAILED
        assert h.error is not None and "Bad address" in h.error
        with pytest.raises(TransferFailed, match="Bad address"):
            t.transfer(Op.READ, name, loc, np.array([[base + page, page, 0]]))
        ok = t.transfer(Op.WRITE, name, loc, np.array([[base, page, 0]]), notification=b"ok")
        assert ok.state is HandleState.DONE
        assert collect_notifications(t, 1, 5) == [("efault", b"ok")]
    finally:
        t.close()
        libc.munmap(base, page)


def test_vanished_peer_fails_transfer() -> None:
    with PeerProcess("shm", timeout=20) as peer, ShmTransport("survivor") as t:
        mem = peer.setup(1, 4, 4096, 5)
        src = np.ones(4096, np.uint8)
        own = t.register_memory([MemoryRegion(src.ctypes.data, src.nbytes)])
        name = t.add_peer(mem.metadata, peer.invite(own))
        # hold off the pidfd watcher (it forgets an exited peer at once: test_shm_trust.py)
        # as in the moment between the exit and the watcher seeing it: the transfer still fails
        listener, key = t._peers[name].watch or (None, 0)
        assert listener is not None
        t._peers[name].watch = None
        listener.unwatch(key)
        deadline = time.monotonic() + 5
        while key in listener._watched:  # the listener thread applies it
            assert time.monotonic() < deadline, "the listener did not stop watching"
            time.sleep(0.001)
        peer.kill()
        rem = np.array([[mem.layout.planes[0].base, 4096, 0]])
        h = t.submit(Op.WRITE, name, np.array([[src.ctypes.data, 4096, 0]]), rem)
        assert t.wait(h, 10) is HandleState.FAILED
        assert h.error is not None and "No such process" in h.error


def _meta(t: ShmTransport, **change: Any) -> bytes:
    src = np.zeros(64, np.uint8)
    meta = msgspec.msgpack.decode(
        t.register_memory([MemoryRegion(src.ctypes.data, 64)]), type=ShmMetadata
    )
    return msgspec.msgpack.encode(msgspec.structs.replace(meta, **change))


def test_refuses_other_host(shm: ShmTransport) -> None:
    with pytest.raises(PeerUnreachable, match="another host.*same host"):
        shm.add_peer(_meta(shm, agent="far", boot_id="0000-other", hostname="elsewhere"),
                     shm.invite())
    with pytest.raises(PeerUnreachable, match="PID namespace"):
        shm.add_peer(_meta(shm, agent="boxed", pid_ns=1), shm.invite())


def test_rejects_device_memory(shm: ShmTransport) -> None:
    with pytest.raises(DescriptorError, match="DRAM"):
        shm.register_memory([MemoryRegion(0x1000, 4096, device=0, kind="VRAM")])


def test_attached_then_standalone_notifications_keep_order(shm: ShmTransport) -> None:
    src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
    name = _loopback(shm, src, dst)
    loc, rem = np.array([[src.ctypes.data, 4096, 0]]), np.array([[dst.ctypes.data, 4096, 0]])
    for i in range(5):
        shm.transfer(Op.WRITE, name, loc, rem, notification=b"xfer-%d" % i)
        shm.send_notification(name, b"note-%d" % i)
    got = [m for _, m in collect_notifications(shm, 10, 10)]
    assert got == [m for i in range(5) for m in (b"xfer-%d" % i, b"note-%d" % i)]
    assert shm.wait_notification(0.01) is False


def test_wait_notification_blocks_until_one_arrives(shm: ShmTransport) -> None:
    name = _loopback(shm, np.zeros(8, np.uint8))
    threading.Timer(0.2, shm.send_notification, (name, b"wake")).start()
    t0 = time.monotonic()
    assert shm.wait_notification(5.0) is True
    assert 0.1 < time.monotonic() - t0 < 4.0
    assert shm.get_notifications() == [(shm.agent_name, b"wake")]


def test_notification_secret() -> None:
    a = ShmTransport("a", {"secret": "s1"})
    b = ShmTransport("b", {"secret": "s1"})
    c = ShmTransport("c", {"secret": "other"})
    try:
        mem = np.zeros(8, np.uint8)
        meta_a, _, meta_c = (t.register_memory([MemoryRegion(mem.ctypes.data, 8)])
                             for t in (a, b, c))
        meta_b = b.register_memory([])
        a.add_peer(meta_b, b.invite(meta_a))
        # the handshake is authenticated too: c cannot even add b (even with a proof b attested)
        with pytest.raises(PeerUnreachable, match="another shared secret"):
            c.add_peer(meta_b, b.invite(meta_c))
        forger = NotificationSender(b._inbox.address, "c", Codec("other"))
        try:
            forger.send(b"forged")
            a.send_notification("b", b"genuine")
            assert collect_notifications(b, 2, 1.5) == [("a", b"genuine")]
            assert b.dropped_notifications == 1
        finally:
            forger.close()
    finally:
        for t in (a, b, c):
            t.close()


def test_remove_peer_lets_posted_transfer_notify(shm: ShmTransport) -> None:
    src, dst = np.full(1 << 20, 7, np.uint8), np.zeros(1 << 20, np.uint8)
    name = _loopback(shm, src, dst)
    loc, rem = _descs(src.ctypes.data, np.arange(256), 4096), _descs(dst.ctypes.data,
                                                                      np.arange(256), 4096)
    handles = [shm.submit(Op.WRITE, name, loc, rem, b"n%d" % i) for i in range(4)]
    shm.remove_peer(name)
    assert all(shm.wait(h, 10) is HandleState.DONE for h in handles)
    assert [m for _, m in collect_notifications(shm, 4, 10)] == [b"n0", b"n1", b"n2", b"n3"]


def test_close_fails_queued_work_and_joins_threads() -> None:
    before = {th.ident for th in threading.enumerate()}
    t = ShmTransport("closer")
    src, dst = np.ones(8 << 20, np.uint8), np.zeros(8 << 20, np.uint8)
    name = _loopback(t, src, dst)
    loc = _descs(src.ctypes.data, np.arange(2048), 4096)
    rem = _descs(dst.ctypes.data, np.random.default_rng(0).permutation(2048), 4096)
    handles = [t.submit(Op.WRITE, name, loc, rem) for _ in range(200)]
    t.close(timeout=0.0)
    states = {t.poll(h) for h in handles}
    assert all(s.terminal for s in states)
    assert HandleState.FAILED in states  # 1.6 GB cannot have been copied in no time
    t.close()
    with pytest.raises(TransportClosed):
        t.submit(Op.WRITE, name, loc, rem)
    with pytest.raises(TransportClosed):
        t.send_notification(name, b"x")
    with pytest.raises(TransportClosed):
        t.add_peer(b"", os.urandom(PROOF_BYTES))
    left = [th for th in threading.enumerate() if th.ident not in before and th.is_alive()]
    assert left == []


def test_handshake_refuses_a_pid_the_socket_does_not_prove(shm: ShmTransport) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    own = shm.register_memory([])  # proofs attested for this very process: only the claim fails
    with pytest.raises(PeerUnreachable, match=f"claims pid {proc.pid}.*is pid {os.getpid()}"):
        shm.add_peer(_meta(shm, pid=proc.pid), shm.invite(own))
    with pytest.raises(PeerUnreachable, match="is agent .* but the metadata names agent 'ghost'"):
        shm.add_peer(_meta(shm, agent="ghost"), shm.invite(own))


def test_handshake_refuses_a_dead_process(shm: ShmTransport) -> None:
    with PeerProcess("shm", timeout=20) as peer:
        mem = peer.setup(1, 4, 4096, 5)
        proof = peer.invite(shm.register_memory([]))
        peer.kill()
        with pytest.raises(PeerUnreachable, match="gone"):
            shm.add_peer(mem.metadata, proof)


def test_metadata_names_the_listener_and_a_version(shm: ShmTransport) -> None:
    first = msgspec.msgpack.decode(shm.register_memory([]), type=ShmMetadata)
    src = np.zeros(64, np.uint8)
    second = msgspec.msgpack.decode(
        shm.register_memory([MemoryRegion(src.ctypes.data, 64)]), type=ShmMetadata
    )
    assert first.socket == second.socket and first.socket.startswith("\0kvbridge-shm-")
    assert second.version == first.version + 1
    assert second.pid == os.getpid()
    other = ShmTransport("other")
    try:
        assert msgspec.msgpack.decode(other.register_memory([]), type=ShmMetadata).socket \
            != first.socket
    finally:
        other.close()


def test_re_adding_fetches_the_current_registration() -> None:
    """Regions registered later are reachable once the peer is re-added (even from older
    metadata: the answer is the current one); metadata newer than the answer is refused."""
    with PeerProcess("shm", timeout=20) as peer, ShmTransport("readd") as t:
        mine = np.random.default_rng(9).integers(0, 256, 8192, dtype=np.uint8)
        own = t.register_memory([MemoryRegion(mine.ctypes.data, mine.nbytes)])
        first = peer.setup(1, 2, 4096, 1)
        name = t.add_peer(first.metadata, peer.invite(own))
        second = peer.setup(1, 2, 4096, 2)
        loc = np.array([[mine.ctypes.data, 4096, 0]])
        rem = np.array([[second.layout.planes[0].base, 4096, 0]])
        with pytest.raises(DescriptorError, match="outside registered memory"):
            t.submit(Op.WRITE, name, loc, rem)
        # stale metadata, current answer (a new handshake: proofs are one-time)
        assert t.add_peer(first.metadata, peer.invite(own)) == name
        t.transfer(Op.WRITE, name, loc, rem, timeout=10)
        np.testing.assert_array_equal(peer.buffer(second.index)[:4096], mine[:4096])
        meta = msgspec.msgpack.decode(second.metadata, type=ShmMetadata)
        future = msgspec.msgpack.encode(msgspec.structs.replace(meta, version=meta.version + 5))
        with pytest.raises(PeerUnreachable, match="older than the metadata's"):
            t.add_peer(future, peer.invite(own))


@pytest.mark.timeout(120)
def test_raw_session_is_cma_alone_and_verifies() -> None:
    """The raw column of ``kvbridge bench transfer --backend shm``."""
    from kvbridge.tools.bench.shm_raw import raw_session

    with raw_session(1 << 20, seed=9) as session:
        for op in ("read", "write"):
            session.reset(op, 65536)  # zeroes the destination: verify proves the copy
            assert session.run(op, 65536) > 0
            session.verify(op, 65536)
        session._mine[3] ^= 0xFF  # noqa: SLF001 - corrupt one byte on purpose
        with pytest.raises(TransferFailed, match="bytes differ"):
            session.verify("write", 65536)
