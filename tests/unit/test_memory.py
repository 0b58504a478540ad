"""The in-process ``memory`` transport: the conformance suite (in-process peer) plus its own
guarantees: forged metadata, bounded inboxes, closed and collected peers, every byte."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

from kvbridge import registry
from kvbridge.errors import (
    ConfigError,
    DescriptorError,
    MessageError,
    MessageTooLarge,
    PeerUnreachable,
    TransferFailed,
    TransportClosed,
)
from kvbridge.testing.conformance import TransportConformance
from kvbridge.testing.inprocess import InProcessPeer
from kvbridge.testing.peer import collect_notifications
from kvbridge.transport import PROOF_BYTES, HandleState, MemoryRegion, Op
from kvbridge.transports.memory import (
    MAX_METADATA_BYTES,
    MemoryMetadata,
    MemoryTransport,
)

pytestmark = pytest.mark.timeout(60)

U8 = np.ndarray[Any, np.dtype[np.uint8]]


class TestMemoryConformance(TransportConformance):
    backend = "memory"
    options: ClassVar[dict[str, Any]] = {}
    native_blocks = True
    in_process_peer = True


# -- helpers --------------------------------------------------------------------------------------


@pytest.fixture
def make() -> Iterator[Callable[..., MemoryTransport]]:
    made: list[MemoryTransport] = []

    def build(name: str | None = None, **options: Any) -> MemoryTransport:
        t = MemoryTransport(name or f"mem-{uuid.uuid4().hex[:8]}", options)
        made.append(t)
        return t

    try:
        yield build
    finally:
        for t in made:
            t.close()


def _reg(t: MemoryTransport, *arrays: U8) -> bytes:
    return t.register_memory([MemoryRegion(a.ctypes.data, a.nbytes) for a in arrays])


def _row(arr: U8, offset: int = 0, length: int | None = None) -> np.ndarray[Any, Any]:
    n = arr.nbytes - offset if length is None else length
    return np.array([[arr.ctypes.data + offset, n, 0]], dtype=np.int64)


def _descs(base: int, offsets: np.ndarray[Any, Any], length: int) -> np.ndarray[Any, Any]:
    n = offsets.size
    return np.stack(
        [base + offsets.astype(np.int64) * length, np.full(n, length), np.zeros(n, np.int64)], 1
    ).astype(np.int64)


def _forge(meta: bytes, **change: Any) -> bytes:
    real = msgspec.msgpack.decode(meta, type=MemoryMetadata)
    return msgspec.msgpack.encode(msgspec.structs.replace(real, **change))


def _pair(make: Callable[..., MemoryTransport]) -> tuple[MemoryTransport, MemoryTransport]:
    return make(), make()


# -- registration and metadata --------------------------------------------------------------------


def test_entry_point_and_capabilities() -> None:
    assert "memory" in registry.available()
    t = registry.create("memory", "ep-test")
    try:
        assert isinstance(t, MemoryTransport)
        caps = t.capabilities
        assert (caps.read, caps.write, caps.notifications) == (True, True, True)
        assert (caps.device_memory, caps.cross_host) == (False, False)
    finally:
        t.close()


def test_metadata_names_agent_pid_token_and_regions(make: Any) -> None:
    t = make("meta-agent")
    a, b = np.zeros(64, np.uint8), np.zeros(128, np.uint8)
    meta = msgspec.msgpack.decode(_reg(t, a), type=MemoryMetadata)
    assert (meta.agent, meta.pid, meta.token) == ("meta-agent", os.getpid(), t.token)
    assert meta.regions == [(a.ctypes.data, 64)]
    meta = msgspec.msgpack.decode(_reg(t, b), type=MemoryMetadata)
    assert meta.regions == [(a.ctypes.data, 64), (b.ctypes.data, 128)]
    assert make().token != t.token


def test_register_validation(make: Any) -> None:
    t = make()
    with pytest.raises(DescriptorError, match="DRAM"):
        t.register_memory([MemoryRegion(0x1000, 4096, device=0, kind="VRAM")])
    with pytest.raises(DescriptorError, match="bad region"):
        t.register_memory([MemoryRegion(0, 4096)])
    with pytest.raises(DescriptorError, match="bad region"):
        t.register_memory([MemoryRegion(0x1000, 0)])


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match="max_notifications"):
        MemoryTransport("x", {"max_notifications": 0})
    with pytest.raises(ConfigError, match="max_notification_bytes"):
        MemoryTransport("x", {"max_notification_bytes": "lots"})
    with pytest.raises(ConfigError, match="agent name"):
        MemoryTransport("")


# -- forged and malformed metadata ----------------------------------------------------------------


def test_refuses_another_process(make: Any) -> None:
    a, b = _pair(make)
    meta = _reg(b, np.zeros(64, np.uint8))
    with pytest.raises(PeerUnreachable, match="same process"):
        a.add_peer(_forge(meta, pid=os.getpid() + 1), b.invite())


def test_refuses_unknown_token(make: Any) -> None:
    a, b = _pair(make)
    meta = _reg(b, np.zeros(64, np.uint8))
    with pytest.raises(PeerUnreachable, match="no live memory transport"):
        a.add_peer(_forge(meta, token="0" * 32), b.invite())


def test_refuses_closed_peer_token(make: Any) -> None:
    a, b = _pair(make)
    meta = _reg(b, np.zeros(64, np.uint8))
    proof = b.invite()  # a valid proof: the closed peer is refused all the same
    b.close()
    with pytest.raises(PeerUnreachable, match="no live memory transport"):
        a.add_peer(meta, proof)


def test_refuses_agent_that_does_not_own_the_token(make: Any) -> None:
    a, b = _pair(make)
    meta = _reg(b, np.zeros(64, np.uint8))
    with pytest.raises(MessageError, match="'agent'"):
        a.add_peer(_forge(meta, agent="impostor"), b.invite())


def test_forged_regions_are_never_reachable(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer registered half a buffer; metadata claiming all of it opens nothing more."""
    a, b = _pair(make)
    victim = np.arange(8192, dtype=np.int64).astype(np.uint8)
    before = victim.copy()
    meta = b.register_memory([MemoryRegion(victim.ctypes.data, 4096)])  # first half only
    src = np.full(8192, 0xAB, np.uint8)
    _reg(a, src)
    forged = _forge(meta, regions=[(victim.ctypes.data, 8192), (0x1000, 1 << 40)])
    with caplog.at_level(logging.WARNING, "kvbridge.transport.memory"):
        name = a.add_peer(forged, b.invite())
    assert "never registered" in caplog.text
    for op in (Op.WRITE, Op.READ):
        with pytest.raises(DescriptorError, match="outside registered memory"):
            a.submit(op, name, _row(src, 0, 4096), _row(victim, 4096, 4096))
        with pytest.raises(DescriptorError, match="outside registered memory"):
            a.submit(op, name, _row(src, 0, 4096), _row(victim, 2048, 4096))  # straddles
    time.sleep(0.05)  # nothing was queued, but give a wrongly queued job time to show
    np.testing.assert_array_equal(victim, before)
    np.testing.assert_array_equal(src, np.full(8192, 0xAB, np.uint8))
    a.transfer(Op.WRITE, name, _row(src, 0, 4096), _row(victim, 0, 4096))  # registered half
    np.testing.assert_array_equal(victim[:4096], src[:4096])
    np.testing.assert_array_equal(victim[4096:], before[4096:])


def test_local_descriptors_checked_against_our_regions(make: Any) -> None:
    a, b = _pair(make)
    dst, mine, stray = np.zeros(4096, np.uint8), np.ones(4096, np.uint8), np.ones(4096, np.uint8)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, mine)
    with pytest.raises(DescriptorError, match="local"):
        a.submit(Op.WRITE, name, _row(stray), _row(dst))
    with pytest.raises(DescriptorError, match="local"):
        a.submit(Op.READ, name, _row(stray), _row(dst))
    assert not dst.any()


def test_peer_regions_registered_later_are_live(make: Any) -> None:
    """Reach follows what the peer registered now, not the (older) metadata we hold."""
    a, b = _pair(make)
    first, later, src = np.zeros(64, np.uint8), np.zeros(64, np.uint8), np.full(64, 9, np.uint8)
    name = a.add_peer(_reg(b, first), b.invite())
    _reg(a, src)
    with pytest.raises(DescriptorError):
        a.submit(Op.WRITE, name, _row(src), _row(later))
    _reg(b, later)  # not re-sent to a
    a.transfer(Op.WRITE, name, _row(src), _row(later))
    np.testing.assert_array_equal(later, src)


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\xc1",
        b"\x00" * (MAX_METADATA_BYTES + 1),
        msgspec.msgpack.encode({"type": "kvbridge.shm.v1", "agent": "x"}),
        msgspec.msgpack.encode({"type": "kvbridge.memory.v1", "agent": "x", "pid": 1}),
    ],
    ids=["empty", "invalid", "oversized", "other-tag", "missing-fields"],
)
def test_malformed_metadata_bytes(make: Any, blob: bytes) -> None:
    with pytest.raises(MessageError):
        make().add_peer(blob, os.urandom(PROOF_BYTES))


@pytest.mark.parametrize(
    "change",
    [
        {"agent": ""},
        {"agent": "x" * 257},
        {"pid": -1},
        {"token": "not-a-token"},
        {"token": "A" * 32},
        {"regions": [(0, 10)]},
        {"regions": [(1, -10)]},
        {"regions": [(2**63, 1)]},
        {"regions": [(1, 1)] * 16385},
    ],
    ids=["empty-agent", "long-agent", "pid", "token", "token-case", "null-region",
         "negative-length", "address-overflow", "too-many-regions"],
)
def test_out_of_bounds_metadata_fields(make: Any, change: dict[str, Any]) -> None:
    a, b = _pair(make)
    real = msgspec.msgpack.decode(_reg(b, np.zeros(8, np.uint8)), type=MemoryMetadata)
    fields = {f: getattr(real, f) for f in real.__struct_fields__} | change
    blob = msgspec.msgpack.encode({"type": "kvbridge.memory.v1", **fields})
    with pytest.raises(MessageError):
        a.add_peer(blob, b.invite())


def test_oversized_metadata_is_message_too_large(make: Any) -> None:
    with pytest.raises(MessageTooLarge, match="exceeds"):
        make().add_peer(b"\x00" * (MAX_METADATA_BYTES + 1), os.urandom(PROOF_BYTES))
    with pytest.raises(MessageError, match="must be bytes"):
        make().add_peer("text", os.urandom(PROOF_BYTES))


# -- every byte -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 512, 4096])
def test_every_byte_arrives_scattered(make: Any, size: int) -> None:
    """3000 scattered descriptors each way between two regions per side; buffers compared."""
    a, b = _pair(make)
    n = 3000
    rng = np.random.default_rng(size)
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    other = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst, back = np.zeros_like(src), np.zeros_like(src)
    name = a.add_peer(_reg(b, dst, other), b.invite())
    _reg(a, src, back)
    perm = rng.permutation(n)
    loc, rem = _descs(src.ctypes.data, np.arange(n), size), _descs(dst.ctypes.data, perm, size)
    h = a.transfer(Op.WRITE, name, loc, rem)
    assert h.state is HandleState.DONE and h.nbytes == n * size and h.count == n
    np.testing.assert_array_equal(dst.reshape(n, size)[perm], src.reshape(n, size))
    a.transfer(Op.READ, name, _descs(back.ctypes.data, np.arange(n), size),
               _descs(other.ctypes.data, perm, size))
    np.testing.assert_array_equal(back.reshape(n, size), other.reshape(n, size)[perm])


def test_large_contiguous_transfer_is_chunked_and_exact(make: Any) -> None:
    """40 MiB in 4096-byte descriptors that coalesce into one run (> one 16 MiB chunk)."""
    a, b = _pair(make)
    size, n = 4096, 10240
    src = np.random.default_rng(5).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, src)
    a.transfer(Op.WRITE, name, _descs(src.ctypes.data, np.arange(n), size),
               _descs(dst.ctypes.data, np.arange(n), size))
    assert np.array_equal(dst, src)


def test_loopback_and_empty_transfer(make: Any) -> None:
    t = make("loop")
    src, dst = np.full(256, 3, np.uint8), np.zeros(256, np.uint8)
    name = t.add_peer(_reg(t, src, dst), t.invite())
    assert name == "loop"
    t.transfer(Op.WRITE, name, _row(src), _row(dst), notification=b"self")
    np.testing.assert_array_equal(dst, src)
    empty = np.zeros((0, 3), np.int64)
    h = t.transfer(Op.READ, name, empty, empty, notification=b"empty")
    assert h.nbytes == 0
    assert t.get_notifications() == [("loop", b"self"), ("loop", b"empty")]


def test_submit_does_not_copy_on_the_caller_thread(make: Any) -> None:
    """submit returns before a 64 MiB copy finishes: the worker thread does the copy."""
    a, b = _pair(make)
    src, dst = np.ones(64 << 20, np.uint8), np.zeros(64 << 20, np.uint8)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, src)
    handles = [a.submit(Op.WRITE, name, _row(src), _row(dst)) for _ in range(8)]
    assert a.poll(handles[-1]) is HandleState.PENDING  # 512 MiB cannot be done by now
    assert all(a.wait(h, 30) is HandleState.DONE for h in handles)
    assert dst.all()


# -- closed and collected peers -------------------------------------------------------------------


def test_transfer_to_closed_peer_fails_cleanly(make: Any) -> None:
    a, b = _pair(make)
    src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, src)
    b.close()
    for op in (Op.WRITE, Op.READ):
        h = a.submit(op, name, _row(src), _row(dst), notification=b"never")
        assert a.wait(h, 5) is HandleState.FAILED
        assert h.error is not None and "closed" in h.error
    with pytest.raises(TransferFailed, match="closed"):
        a.transfer(Op.WRITE, name, _row(src), _row(dst))
    with pytest.raises(PeerUnreachable, match="closed"):
        a.send_notification(name, b"x")
    assert not dst.any()
    assert b.get_notifications() == []
    # the worker survived: a live peer still works
    c = make()
    dst2 = np.zeros(4096, np.uint8)
    a.transfer(Op.WRITE, a.add_peer(_reg(c, dst2), c.invite()), _row(src), _row(dst2))
    assert dst2.all()


def test_nothing_lands_after_peer_close_returns(make: Any) -> None:
    """The peer closes while our big WRITEs into it are queued: its memory is quiet afterwards."""
    a, b = _pair(make)
    src, dst = np.ones(32 << 20, np.uint8), np.zeros(32 << 20, np.uint8)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, src)
    handles = [a.submit(Op.WRITE, name, _row(src), _row(dst), b"n") for _ in range(30)]
    time.sleep(0.01)
    b.close()
    dst[:] = 7  # the owner reuses its memory once close returned
    states = [a.wait(h, 30) for h in handles]
    assert HandleState.FAILED in states  # ~1 GB cannot have been copied in 10 ms
    assert (dst == 7).all()
    assert len(b.get_notifications()) == states.count(HandleState.DONE)


def test_collected_peer_is_unreachable(make: Any) -> None:
    a = make()
    before = {th.ident for th in threading.enumerate()}
    b = MemoryTransport("ephemeral")  # dropped without close
    dst, src = np.zeros(64, np.uint8), np.ones(64, np.uint8)
    meta = _reg(b, dst)
    name = a.add_peer(meta, b.invite())
    late = b.invite()  # a valid proof: the collected peer is refused all the same
    _reg(a, src)
    del b
    gc.collect()
    h = a.submit(Op.WRITE, name, _row(src), _row(dst))
    assert a.wait(h, 5) is HandleState.FAILED
    with pytest.raises(PeerUnreachable, match="no live memory transport"):
        a.add_peer(meta, late)
    def new_threads() -> list[threading.Thread]:
        return [th for th in threading.enumerate() if th.ident not in before]

    deadline = time.monotonic() + 5
    while new_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert new_threads() == []  # the collected transport's worker ended
    assert not dst.any()


def test_dropped_transport_fails_its_queued_work() -> None:
    """A transport garbage-collected without close: its queued transfers fail, none hangs."""
    t, peer = MemoryTransport("dropped"), MemoryTransport("dropped-peer")
    try:
        src, dst = np.ones(32 << 20, np.uint8), np.zeros(32 << 20, np.uint8)
        name = t.add_peer(_reg(peer, dst), peer.invite())
        _reg(t, src)
        handles = [t.submit(Op.WRITE, name, _row(src), _row(dst)) for _ in range(30)]
        del t
        gc.collect()
        assert all(h.done_event.wait(10) for h in handles)
        assert HandleState.FAILED in {h.state for h in handles}
    finally:
        peer.close()


def test_remove_peer_lets_posted_transfers_finish(make: Any) -> None:
    a, b = _pair(make)
    src, dst = np.full(1 << 20, 5, np.uint8), np.zeros(1 << 20, np.uint8)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, src)
    handles = [a.submit(Op.WRITE, name, _row(src), _row(dst), b"n%d" % i) for i in range(4)]
    a.remove_peer(name)
    assert all(a.wait(h, 10) is HandleState.DONE for h in handles)
    assert [m for _, m in collect_notifications(b, 4, 5)] == [b"n0", b"n1", b"n2", b"n3"]
    np.testing.assert_array_equal(dst, src)


# -- notifications --------------------------------------------------------------------------------


def test_inbox_is_bounded_in_count(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    a = make()
    b = make()
    name = a.add_peer(_reg(b, np.zeros(8, np.uint8)), b.invite())
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "kvbridge.transport.memory"):
        for i in range(10_000):
            a.send_notification(name, b"m%d" % i)
    elapsed = time.monotonic() - t0
    got = b.get_notifications()
    assert len(got) == 4096 and got[0] == (a.agent_name, b"m0")
    assert got[-1] == (a.agent_name, b"m4095")  # the new messages are dropped, not the old
    assert b.dropped_notifications == 10_000 - 4096
    warnings = [r for r in caplog.records if "inbox full" in r.getMessage()]
    assert 1 <= len(warnings) <= 1 + int(elapsed)  # at most once a second
    a.send_notification(name, b"after-drain")  # draining makes room again
    assert b.get_notifications() == [(a.agent_name, b"after-drain")]


def test_inbox_is_bounded_in_bytes(make: Any) -> None:
    """A flood of 1 MiB messages keeps at most 4 MiB queued; the rest is counted as dropped."""
    a, b = make(), make()
    name = a.add_peer(_reg(b, np.zeros(8, np.uint8)), b.invite())
    big = bytes(1 << 20)
    for _ in range(200):
        a.send_notification(name, big)
    a.send_notification(name, bytes(5 << 20))  # larger than the whole bound
    got = b.get_notifications()
    assert sum(len(m) for _, m in got) <= 4 << 20 and len(got) == 4
    assert b.dropped_notifications == 197


def test_inbox_bounds_are_options_and_cover_attached_notifications(make: Any) -> None:
    a = make()
    b = make(max_notifications=3, max_notification_bytes=10)
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, src)
    for m in (b"aaaa", b"bbbb", b"cccc"):  # the third would pass 10 bytes
        a.send_notification(name, m)
    h = a.transfer(Op.WRITE, name, _row(src), _row(dst), notification=b"d")
    assert h.state is HandleState.DONE  # the bytes landed even though the note was dropped
    assert b.get_notifications() == [(a.agent_name, b"aaaa"), (a.agent_name, b"bbbb"),
                                     (a.agent_name, b"d")]
    assert b.dropped_notifications == 1
    for i in range(5):
        a.send_notification(name, b"%d" % i)
    assert len(b.get_notifications()) == 3 and b.dropped_notifications == 3


def test_attached_then_standalone_keep_order(make: Any) -> None:
    a, b = make(), make()
    src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, src)
    for i in range(5):
        a.transfer(Op.WRITE, name, _row(src), _row(dst), notification=b"xfer-%d" % i)
        a.send_notification(name, b"note-%d" % i)
    got = [m for _, m in b.get_notifications()]
    assert got == [m for i in range(5) for m in (b"xfer-%d" % i, b"note-%d" % i)]
    assert b.wait_notification(0.01) is False


def test_wait_notification_blocks_until_one_arrives(make: Any) -> None:
    a, b = make(), make()
    name = a.add_peer(_reg(b, np.zeros(8, np.uint8)), b.invite())
    threading.Timer(0.2, a.send_notification, (name, b"wake")).start()
    t0 = time.monotonic()
    assert b.wait_notification(5.0) is True
    assert 0.1 < time.monotonic() - t0 < 4.0
    assert b.get_notifications() == [(a.agent_name, b"wake")]


def test_wait_notification_wakes_on_close(make: Any) -> None:
    t = make()
    threading.Timer(0.2, t.close).start()
    t0 = time.monotonic()
    assert t.wait_notification(5.0) is False
    assert time.monotonic() - t0 < 4.0


# -- close ----------------------------------------------------------------------------------------


def test_close_fails_queued_work_and_joins_threads() -> None:
    before = {th.ident for th in threading.enumerate()}
    t, peer = MemoryTransport("closer"), MemoryTransport("closer-peer")
    src, dst = np.ones(8 << 20, np.uint8), np.zeros(8 << 20, np.uint8)
    name = t.add_peer(_reg(peer, dst), peer.invite())
    _reg(t, src)
    loc = _descs(src.ctypes.data, np.arange(2048), 4096)
    rem = _descs(dst.ctypes.data, np.random.default_rng(0).permutation(2048), 4096)
    handles = [t.submit(Op.WRITE, name, loc, rem) for _ in range(200)]
    t.close(timeout=0.0)
    states = {t.poll(h) for h in handles}
    assert all(s.terminal for s in states)
    assert HandleState.FAILED in states  # 1.6 GB cannot have been copied in no time
    t.close()  # idempotent
    with pytest.raises(TransportClosed):
        t.submit(Op.WRITE, name, loc, rem)
    with pytest.raises(TransportClosed):
        t.send_notification(name, b"x")
    with pytest.raises(TransportClosed):
        t.add_peer(b"", os.urandom(PROOF_BYTES))
    with pytest.raises(TransportClosed):
        t.register_memory([])
    peer.close()
    left = [th for th in threading.enumerate() if th.ident not in before and th.is_alive()]
    assert left == []


def test_close_waits_for_queued_transfers(make: Any) -> None:
    a, b = _pair(make)
    src, dst = np.full(16 << 20, 4, np.uint8), np.zeros(16 << 20, np.uint8)
    name = a.add_peer(_reg(b, dst), b.invite())
    _reg(a, src)
    handles = [a.submit(Op.WRITE, name, _row(src), _row(dst), b"n") for _ in range(4)]
    a.close(timeout=30.0)
    assert [h.state for h in handles] == [HandleState.DONE] * 4
    np.testing.assert_array_equal(dst, src)
    assert len(b.get_notifications()) == 4


def test_in_process_peer_helper() -> None:
    with pytest.raises(ValueError, match="environment"):
        InProcessPeer("memory", env={"X": "1"})
    with InProcessPeer("memory", timeout=5) as peer, MemoryTransport("helper") as t:
        mem = peer.setup(1, 4, 64, seed=3)
        assert t.add_peer(mem.metadata, peer.invite()) == peer.name
        assert peer.pid == os.getpid()
        src = np.full(64, 1, np.uint8)
        t.register_memory([MemoryRegion(src.ctypes.data, 64)])
        t.transfer(Op.WRITE, peer.name, _row(src), [[mem.layout.planes[0].base, 64, 0]],
                   notification=b"hi")
        got, snap = peer.notifications(1, timeout=5, snapshot=mem.index)
        assert got == [("helper", b"hi")]
        assert snap is not None and (snap[:64] == 1).all()
        assert (peer.buffer(mem.index)[:64] == 1).all()
        peer.kill()
        with pytest.raises(TransferFailed):
            t.transfer(Op.WRITE, peer.name, _row(src), [[mem.layout.planes[0].base, 64, 0]])
    peer.close()  # idempotent
