"""shm's mapped copies: registered memory on a sealed memfd, peers copy it with the native range
copy (kvbridge.transports.shm.memfd, .rangecopy). The conformance suite runs with it too
(test_conformance_shm.py::TestShmMappedConformance); here: what it maps and how each byte
moved, that a registration keeps every byte, and hostile fds and pieces from a peer."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.blocks import prepare_blocks, prepare_parts
from kvbridge.errors import ConfigError, PeerUnreachable
from kvbridge.scheduling import digests, follow
from kvbridge.testing.peer import PeerProcess, kv_buffer
from kvbridge.transport import HandleState, MemoryRegion, Op
from kvbridge.transports.shm import ShmTransport, _encoder, _Registration, memfd
from kvbridge.transports.shm import rangecopy as _rangecopy
from kvbridge.transports.shm.memfd import MAX_FDS

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(_rangecopy.load() is None,
                       reason="range copy not built (no C compiler at install)"),
]

PAGE = mmap.PAGESIZE
MiB = 1 << 20


def _buffer(nbytes: int, seed: int | None = None) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Page-aligned host memory (an anonymous mapping, as a large torch.zeros gets)."""
    area = mmap.mmap(-1, nbytes)
    buf = np.frombuffer(area, dtype=np.uint8)
    if seed is not None:
        buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


def _registered(owner: ShmTransport, nbytes: int,
                seed: int) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], bytes]:
    """A random buffer ``owner`` registered (and shared), and its metadata."""
    buf = _buffer(nbytes, seed=seed)
    return buf, owner.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])


def _proof(owner: ShmTransport, dialler: ShmTransport) -> bytes:
    """A proof ``owner`` attested for ``dialler``'s process, as the engine's handshake does
    (one-time: every ``add_peer`` needs a new one)."""
    return owner.invite(dialler.register_memory([]))


def _descs(base: int, offsets: np.ndarray[Any, Any], length: int) -> np.ndarray[Any, Any]:
    n = offsets.size
    return np.stack([base + offsets.astype(np.int64) * length, np.full(n, length),
                     np.zeros(n, np.int64)], 1).astype(np.int64)


def _received() -> list[str]:
    """What this process holds open of the kinds the forged answers send."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "forged" in target or target in _PIPES or target.endswith("/plain"):
            out.append(target)
    return sorted(out)


_PIPES: set[str] = set()


def _pipe() -> int:
    r, w = os.pipe()
    os.close(w)
    _PIPES.add(f"pipe:[{os.fstat(r).st_ino}]")
    return r


@pytest.fixture
def pair() -> Iterator[tuple[ShmTransport, ShmTransport]]:
    tag = uuid.uuid4().hex[:6]
    a = ShmTransport(f"own-{tag}", {"map_memory": True})
    b = ShmTransport(f"map-{tag}", {"map_memory": True})
    try:
        yield a, b
    finally:
        b.close()
        a.close()


def test_registration_keeps_every_byte_and_seals_the_memfd() -> None:
    buf = _buffer(8 * MiB, seed=1)
    ref = buf.copy()
    start = buf.ctypes.data + 100  # partial pages at both ends stay as they were
    t = ShmTransport("seal", {"map_memory": True})
    try:
        t.register_memory([MemoryRegion(start, buf.nbytes - 300)])
        np.testing.assert_array_equal(buf, ref)
        (area,) = t._areas
        (piece,) = area.pieces
        assert piece.address == buf.ctypes.data + PAGE
        assert piece.length == buf.nbytes - 2 * PAGE
        seals = fcntl.fcntl(area.fd, memfd.F_GET_SEALS)
        assert seals & memfd.F_SEAL_SHRINK and seals & memfd.F_SEAL_GROW
        assert seals & memfd.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(area.fd, PAGE)
        maps = memfd._maps_of(os.getpid(), {os.fstat(area.fd).st_ino})
        assert maps and maps[0][0] == piece.address
        buf[PAGE:PAGE + 4] = 7  # the memory still works as memory
        assert bytes(buf[PAGE:PAGE + 4]) == b"\x07" * 4
    finally:
        t.close()


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_mapped_ranges_move_by_memcpy_and_the_edges_by_cma(
    pair: tuple[ShmTransport, ShmTransport], op: Op
) -> None:
    """The owner registers a region with partial pages at its ends: ranges inside the mapped
    pages are copied through the mapping, the two that touch an edge page by CMA."""
    owner, mapper = pair
    n, size = 64, 64 << 10
    theirs = _buffer(n * size + 2 * PAGE, seed=2)
    mine = _buffer(n * size, seed=3 if op is Op.WRITE else None)
    base = theirs.ctypes.data + 1000
    own = mapper.register_memory([MemoryRegion(mine.ctypes.data, mine.nbytes)])
    name = mapper.add_peer(owner.register_memory([MemoryRegion(base, n * size)]),
                           owner.invite(own))
    assert mapper._peers[name].mapping is not None
    perm = np.random.default_rng(4).permutation(n)
    h = mapper.submit(op, name, _descs(mine.ctypes.data, np.arange(n), size),
                      _descs(base, perm, size))
    assert mapper.wait(h, 20) is HandleState.DONE, h.error
    view = theirs[1000:1000 + n * size].reshape(n, size)
    np.testing.assert_array_equal(view[perm], mine.reshape(n, size))
    edges = 2 * size  # the first and the last block each touch a partial page
    assert (mapper.mapped_bytes, mapper.cma_bytes) == (n * size - edges, edges)


@contextlib.contextmanager
def _block_pair(layers: int, blocks: int,
                size: int) -> Iterator[tuple[PeerProcess, Any, ShmTransport, str, Any, Any]]:
    """A peer process holding a random KV cache of ``layers`` x 2 x ``blocks`` x ``size`` bytes
    (mapped memory) and a transport here with one of its own, the peer added and the block pair
    prepared: (peer, its memory, the transport, the peer's name, the pair, the local cache)."""
    with PeerProcess("shm", options={"map_memory": True}, timeout=30) as peer, \
            ShmTransport("mapper", {"map_memory": True}) as t:
        mem = peer.setup(layers, blocks, size, 6)
        local, lay = kv_buffer(layers, blocks, size, 99)
        own = t.register_memory([MemoryRegion(local.ctypes.data, local.nbytes)])
        name = t.add_peer(mem.metadata, peer.invite(own))
        yield peer, mem, t, name, prepare_blocks(t, name, lay, mem.layout), local


def test_block_requests_prepared_ahead_copy_through_the_mapping() -> None:
    """The connector's path: the peer in another process, a READ by block ids prepared ahead;
    every block lands, and all but the blocks on the peer's partial edge pages are copied
    through the mapping."""
    layers, blocks, size = 2, 32, 64 << 10
    with _block_pair(layers, blocks, size) as (peer, mem, t, name, pair_, local):
        lids, rids = np.arange(blocks), np.random.default_rng(7).permutation(blocks)
        prep = prepare_parts(t, Op.READ, name, [(pair_.local, lids, pair_.remote, rids)])
        assert prep is not None
        h = prep.post()
        assert t.wait(h, 20) is HandleState.DONE, h.error
        theirs = peer.buffer(mem.index).reshape(layers, 2, blocks, size)
        np.testing.assert_array_equal(local[:, :, lids], theirs[:, :, rids])
        assert t.mapped_bytes + t.cma_bytes == local.nbytes
        assert t.mapped_bytes >= local.nbytes - 2 * size  # at most the two edge blocks by CMA


def test_a_prepared_request_with_a_landing_copy_puts_what_it_learnt_on_the_handle() -> None:
    """The decode rank's READ with digests on (``PreparedRequest.landing``, as the pull sink sets
    it): every range mapped, shm copies with the caller's copy, which digests each piece as it
    lands, and the handle carries the digests of what landed; a range by CMA (the peer's
    partial edge pages) and shm makes its own copy (``takes_landing`` says so ahead), ``landed``
    stays None. A WRITE's (push) copy digests its sources, what was sent. A landing copy that
    stops or raises fails the handle."""
    layers, blocks, size = 2, 32, 64 << 10
    with _block_pair(layers, blocks, size) as (peer, mem, t, name, pair_, local):
        theirs = peer.buffer(mem.index).reshape(layers, 2, blocks, size)
        rng = np.random.default_rng(8)
        inner = rng.permutation(np.arange(1, blocks - 1))  # no block of a partial page
        for rids, mapped in ((inner, True), (rng.permutation(blocks), False)):
            lids = rng.permutation(blocks)[:rids.size]
            local[:] = 0
            before = t.cma_bytes
            prep = prepare_parts(t, Op.READ, name, [(pair_.local, lids, pair_.remote, rids)])
            assert prep is not None and prep.takes_landing() is mapped
            stream = pair_.local.descriptors(lids)
            prep.landing = digests.landing(stream)
            h = prep.post()
            assert t.wait(h, 20) is HandleState.DONE, h.error
            np.testing.assert_array_equal(local[:, :, lids], theirs[:, :, rids])
            assert (t.cma_bytes == before) is mapped
            assert h.landed == (digests.compute(stream) if mapped else None)
        # a WRITE (push): the copy hashes its sources, what was sent, as it reads them
        lids = rng.permutation(blocks)[:inner.size]
        prep = prepare_parts(t, Op.WRITE, name, [(pair_.local, lids, pair_.remote, inner)])
        assert prep is not None and prep.takes_landing()
        sent = pair_.local.descriptors(lids)
        prep.landing = digests.landing(sent, source=True)
        h = prep.post()
        assert t.wait(h, 20) is HandleState.DONE, h.error
        theirs = peer.buffer(mem.index).reshape(layers, 2, blocks, size)  # as it is now
        np.testing.assert_array_equal(theirs[:, :, inner], local[:, :, lids])
        assert h.landed == digests.compute(sent)
        for landing, error in ((lambda moves, stop, word: None, "transport closed during the"),
                               (lambda moves, stop, word: 1 / 0, "division by zero")):
            prep = prepare_parts(t, Op.READ, name, [(pair_.local, inner[:4], pair_.remote,
                                                     inner[:4])])
            assert prep is not None
            prep.landing = landing
            h = prep.post()
            assert t.wait(h, 20) is HandleState.FAILED and error in (h.error or ""), h.error


@pytest.mark.skipif(not follow.available(), reason="kvbridge built without _digest")
def test_a_push_write_keeps_the_receivers_word_and_the_receiver_hashes_behind_it(
        pair: tuple[ShmTransport, ShmTransport]) -> None:
    """Push over shm with digests (kvbridge.scheduling.follow): D registers its board of words
    beside its KV; P's prepared WRITE, with its landing copy and D's word
    (``PreparedRequest.progress``, as the push source sets it from D's ``PushRegister``), keeps
    the word through P's mapping of D's memfd, waking D's follower asleep on it; the follower's
    digests (D's, of what landed) equal P's (of what it read). A word P has not mapped as 8
    aligned bytes of D's (outside D's regions, misaligned) is ignored: the WRITE lands the same,
    and no byte outside the KV named is written."""
    d, p = pair
    board = follow.Board(slots=4)
    theirs, rlay = kv_buffer(2, 16, 64 << 10, 5)  # D's KV, written
    mine, lay = kv_buffer(2, 16, 64 << 10, 6)  # P's KV
    dmeta = d.register_memory([MemoryRegion(theirs.ctypes.data, theirs.nbytes),
                               MemoryRegion(*board.region)])
    name = p.add_peer(dmeta, d.invite(p.register_memory([MemoryRegion(mine.ctypes.data,
                                                                      mine.nbytes)])))
    pair_ = prepare_blocks(p, name, lay, rlay)
    rng = np.random.default_rng(9)
    inner = rng.permutation(np.arange(1, 15))  # no block on a partial edge page (moved by CMA)
    outside = np.zeros(2, dtype=np.uint64)  # 8 aligned bytes of P's, none of D's
    first, second = board.take(), board.take()
    assert first is not None and second is not None
    # (D's word, what P is asked to keep, whether P keeps it)
    for word, named, followed in ((first, first, True), (outside.ctypes.data, outside.ctypes.data,
                                                         False), (second, second + 4, False)):
        lids = rng.permutation(16)[:inner.size]
        prep = prepare_parts(p, Op.WRITE, name, [(pair_.local, lids, pair_.remote, inner)])
        assert prep is not None and prep.takes_landing()
        sent = pair_.local.descriptors(lids)
        prep.landing = digests.landing(sent, source=True)
        prep.progress = named
        follower = follow.Follower(pair_.remote.descriptors(inner), word)
        h = prep.post()
        assert p.wait(h, 20) is HandleState.DONE, h.error
        np.testing.assert_array_equal(theirs[:, :, inner], mine[:, :, lids])
        assert h.landed == digests.compute(sent)
        assert follower.moved is followed
        if followed:
            assert ctypes.c_uint64.from_address(word).value == h.nbytes
            assert follower.finish() == h.landed
        else:
            assert follower.finish() is None  # D hashes after the result, as before
            assert ctypes.c_uint64.from_address(word).value == 0
    assert not outside.any()


# -- hostile fds and pieces -----------------------------------------------------------------------


def _forge(owner: ShmTransport, shared: list[tuple[int, int, int, int]],
           fds: Callable[[], list[int]]) -> None:
    """Make ``owner``'s listener answer its true registration (to a query it lets in), but
    with ``shared`` pieces and the fds ``fds()`` returns (opened per answer, closed after
    sending)."""

    def answer(proof: bytes, want_fds: bool, pid: int) -> tuple[bytes, list[int]]:
        payload, _ = owner._registration(proof, False, pid)
        reg = msgspec.msgpack.decode(payload, type=_Registration)
        reg = msgspec.structs.replace(reg, shared=shared)
        sent = fds()
        owner._forged.extend(sent)  # type: ignore[attr-defined]
        return _encoder.encode(reg), sent

    owner._forged = []  # type: ignore[attr-defined]
    owner._listener._answer = answer


def _new_memfd(size: int, seals: int = memfd.F_SEAL_SHRINK | memfd.F_SEAL_GROW,
           flags: int = os.MFD_ALLOW_SEALING) -> int:
    fd = os.memfd_create("forged", flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, memfd.F_ADD_SEALS, seals)
    return fd


def _tmpfile(tmp_path: Any) -> int:
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * (1 << 20))
    return os.open(path, os.O_RDWR)


HOSTILE: dict[str, tuple[Callable[[int, int, Any], tuple[list[Any], Callable[[], list[int]]]],
                         str]] = {
    "a regular file": (lambda a, n, tmp: ([(a, n, 0, 0)], lambda: [_tmpfile(tmp)]),
                       "is not a memfd"),
    "a pipe": (lambda a, n, tmp: ([(a, n, 0, 0)], lambda: [_pipe()]),
               "is not a regular file"),
    "an unsealed memfd": (lambda a, n, tmp: ([(a, n, 0, 0)], lambda: [_new_memfd(n, seals=0)]),
                          "not sealed against shrinking"),
    "a write-sealed memfd": (
        lambda a, n, tmp: ([(a, n, 0, 0)],
                           lambda: [_new_memfd(n, memfd.F_SEAL_SHRINK | memfd.F_SEAL_WRITE)]),
        "sealed against writing"),
    "a memfd too small": (lambda a, n, tmp: ([(a, n, 0, 0)], lambda: [_new_memfd(n // 2)]),
                          "past the end"),
    "a memfd the process does not map there": (
        lambda a, n, tmp: ([(a, n, 0, 0)], lambda: [_new_memfd(n)]), "does not map"),
    "a piece outside the regions": (
        lambda a, n, tmp: ([(a + n, n, 0, 0)], lambda: [_new_memfd(2 * n)]),
        "not inside one of the peer's registered regions"),
    "an unaligned piece": (lambda a, n, tmp: ([(a + 1, PAGE, 0, 0)], lambda: [_new_memfd(n)]),
                           "not page-aligned"),
    "an fd no piece uses": (lambda a, n, tmp: ([], lambda: [_new_memfd(n)]), "pieces use fds []"),
    "a piece without its fd": (lambda a, n, tmp: ([(a, n, 0, 0)], lambda: []),
                               "pieces use fds [0]"),
    "more fds than allowed": (
        lambda a, n, tmp: ([(a, n, 0, 0)], lambda: [_new_memfd(n) for _ in range(MAX_FDS + 1)]),
        f"more than {MAX_FDS} fds sent"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_fds_and_pieces_are_refused_and_closed(
    pair: tuple[ShmTransport, ShmTransport], tmp_path: Any, case: str
) -> None:
    """Each forged answer fails the handshake with PeerUnreachable naming what is wrong; no fd
    and no mapping is left behind, and the transports go on working."""
    owner, mapper = pair
    buf, meta = _registered(owner, 1 * MiB, 8)
    got = np.zeros(4096, np.uint8)
    own = mapper.register_memory([MemoryRegion(got.ctypes.data, got.nbytes)])
    shared, fds = HOSTILE[case][0](buf.ctypes.data, buf.nbytes, tmp_path)
    _forge(owner, shared, fds)
    with pytest.raises(PeerUnreachable, match=re.escape(HOSTILE[case][1])):
        mapper.add_peer(meta, owner.invite(own))
    for fd in owner._forged:  # type: ignore[attr-defined]
        os.close(fd)  # the test's own copies (the listener sent them, it does not own them)
    assert _received() == [], "the mapper kept a received fd"
    owner._listener._answer = owner._registration  # behave again: the peer is added, works
    name = mapper.add_peer(meta, owner.invite(own))  # a new handshake: proofs are one-time
    h = mapper.submit(Op.READ, name, np.array([[got.ctypes.data, 4096, 0]]),
                      np.array([[buf.ctypes.data, 4096, 0]]))
    assert mapper.wait(h, 10) is HandleState.DONE, h.error
    np.testing.assert_array_equal(got, buf[:4096])


def test_a_peer_that_does_not_map_gets_no_fds_and_moves_by_cma(
    pair: tuple[ShmTransport, ShmTransport]
) -> None:
    owner, _ = pair
    buf, meta = _registered(owner, 1 * MiB, 9)
    with ShmTransport("cma-only", {"map_peers": False}) as t:
        got = np.zeros(buf.nbytes, np.uint8)
        own = t.register_memory([MemoryRegion(got.ctypes.data, got.nbytes)])
        name = t.add_peer(meta, owner.invite(own))
        assert t._peers[name].mapping is None
        t.transfer(Op.READ, name, np.array([[got.ctypes.data, got.nbytes, 0]]),
                   np.array([[buf.ctypes.data, buf.nbytes, 0]]))
        np.testing.assert_array_equal(got, buf)
        assert (t.mapped_bytes, t.cma_bytes) == (0, buf.nbytes)


def test_fds_nobody_asked_for_are_closed_and_ignored(
    pair: tuple[ShmTransport, ShmTransport]
) -> None:
    owner, _ = pair
    buf, meta = _registered(owner, 1 * MiB, 10)
    _forge(owner, [], lambda: [_new_memfd(PAGE), _new_memfd(PAGE)])
    with ShmTransport("cma-only", {"map_peers": False}) as t:
        name = t.add_peer(meta, _proof(owner, t))
        for fd in owner._forged:  # type: ignore[attr-defined]
            os.close(fd)
        assert t._peers[name].mapping is None and _received() == []


def _hold_off_the_exit_watcher(t: ShmTransport, name: str) -> None:
    """Stop ``t`` watching peer ``name``'s pidfd (it would forget the peer when it exits)."""
    peer = t._peers[name]
    assert peer.watch is not None
    listener, key = peer.watch
    peer.watch = None
    listener.unwatch(key)
    deadline = time.monotonic() + 5
    while key in listener._watched:  # the listener thread applies it
        assert time.monotonic() < deadline, "the listener did not stop watching"
        time.sleep(0.001)


def test_a_mapped_write_to_a_peer_that_exited_fails() -> None:
    """A mapping outlives its process; the transfer must not report DONE into it. (The pidfd
    watcher forgets such a peer at once, tests/process/test_shm_trust.py; here it is held off, as in
    the moment between the exit and the watcher seeing it.)"""
    with PeerProcess("shm", options={"map_memory": True}, timeout=30) as peer, \
            ShmTransport("survivor", {"map_memory": True}) as t:
        mem = peer.setup(1, 4, 1 << 20, 5)
        src = _buffer(1 << 20, seed=11)
        own = t.register_memory([MemoryRegion(src.ctypes.data, src.nbytes)])
        name = t.add_peer(mem.metadata, peer.invite(own))
        assert t._peers[name].mapping is not None
        _hold_off_the_exit_watcher(t, name)
        peer.kill()
        rem = np.array([[mem.layout.planes[0].base + (1 << 20), 1 << 20, 0]])
        h = t.submit(Op.WRITE, name, np.array([[src.ctypes.data, 1 << 20, 0]]), rem)
        assert t.wait(h, 10) is HandleState.FAILED
        assert h.error is not None and "No such process" in h.error


def test_remove_peer_unmaps_its_memory(pair: tuple[ShmTransport, ShmTransport]) -> None:
    owner, mapper = pair
    buf = _buffer(2 * MiB, seed=12)
    name = mapper.add_peer(owner.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)]),
                           _proof(owner, mapper))
    ino = os.fstat(owner._areas[0].fd).st_ino
    assert len(memfd._maps_of(os.getpid(), {ino})) >= 2  # the owner's and the mapper's
    mapper.remove_peer(name)
    mapper.close()  # the worker ran the retirement
    assert len(memfd._maps_of(os.getpid(), {ino})) == 1


# -- the native range copy ------------------------------------------------------------------------


def test_range_copy_copies_rows_and_stops_when_told() -> None:
    copy = _rangecopy.load()
    assert copy is not None
    src = np.random.default_rng(13).integers(0, 256, 200 * 100, dtype=np.uint8)
    dst = np.zeros_like(src)
    perm = np.random.default_rng(14).permutation(200)
    rows = np.stack([dst.ctypes.data + perm * 100, src.ctypes.data + np.arange(200) * 100,
                     np.full(200, 100)], 1).astype(np.uint64)
    stop = ctypes.c_int32(0)
    assert copy(rows, stop) == 200
    np.testing.assert_array_equal(dst.reshape(200, 100)[perm], src.reshape(200, 100))
    stop.value = 1
    assert copy(rows, stop) == 0


def test_a_hugetlbfs_memfd_is_refused(pair: tuple[ShmTransport, ShmTransport]) -> None:
    """A hugetlbfs file faults with SIGBUS when its pool runs dry: never mapped."""
    owner, mapper = pair
    huge = 2 * MiB
    try:
        probe = os.memfd_create("forged-huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        pytest.skip(f"no hugetlbfs memfd here: {exc}")
    os.close(probe)
    buf = _buffer(huge, seed=15)
    meta = owner.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])

    def hugetlb() -> list[int]:
        fd = os.memfd_create("forged-huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, huge)
        fcntl.fcntl(fd, memfd.F_ADD_SEALS, memfd.F_SEAL_SHRINK)
        return [fd]

    _forge(owner, [(buf.ctypes.data, huge, 0, 0)], hugetlb)
    with pytest.raises(PeerUnreachable, match="not on tmpfs"):
        mapper.add_peer(meta, _proof(owner, mapper))
    for fd in owner._forged:  # type: ignore[attr-defined]
        os.close(fd)
    assert _received() == []


def test_registering_shared_memory_again_does_not_share_it_twice(
    pair: tuple[ShmTransport, ShmTransport]
) -> None:
    """A second registration overlapping the first stays as it is (a second memfd would leave
    peers a stale mapping); peers still map the first and every byte moves."""
    owner, mapper = pair
    buf = _buffer(2 * MiB, seed=16)
    owner.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    meta = owner.register_memory([MemoryRegion(buf.ctypes.data + MiB, MiB)])
    assert len(owner._areas) == 1
    got = _buffer(buf.nbytes)
    own = mapper.register_memory([MemoryRegion(got.ctypes.data, got.nbytes)])
    name = mapper.add_peer(meta, owner.invite(own))
    mapper.transfer(Op.READ, name, np.array([[got.ctypes.data, got.nbytes, 0]]),
                    np.array([[buf.ctypes.data, buf.nbytes, 0]]))
    np.testing.assert_array_equal(got, buf)
    assert mapper.mapped_bytes == buf.nbytes


def test_close_gives_heap_memory_private_pages_again_and_fork_works() -> None:
    """What broke a CI run: numpy buffers from the heap were shared (and MADV_DONTFORK) when
    their transport registered them, freed, and reused by the allocator for Python objects;
    a later fork's child (Python's preexec_fn) touched them and died of SIGSEGV. close()
    gives the pages back private ones with the same bytes, so a forked child can read them
    and its writes stay its own."""
    buf = np.random.default_rng(17).integers(0, 256, 4 * MiB, dtype=np.uint8)  # malloc'd
    ref = buf.copy()
    t = ShmTransport("restore", {"map_memory": True})
    t.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    (area,) = t._areas
    ino = os.fstat(area.fd).st_ino
    assert memfd._maps_of(os.getpid(), {ino})
    t.close()
    assert memfd._maps_of(os.getpid(), {ino}) == [], "still mapped from the memfd"
    np.testing.assert_array_equal(buf, ref)
    pid = os.fork()
    if pid == 0:  # the child reads and writes every page, then exits without cleanup
        ok = int(buf[::PAGE].sum() == ref[::PAGE].sum())
        buf[::PAGE] = 0
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(buf, ref)  # the child's writes were its own


def test_close_leaves_alone_memory_the_owner_unmapped() -> None:
    lib = memfd._Sys.lib()
    base = lib.mmap(None, 2 * MiB, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    t = ShmTransport("unmapped", {"map_memory": True})
    t.register_memory([MemoryRegion(base, 2 * MiB)])
    assert lib.munmap(base, 2 * MiB) == 0  # the owner broke the contract and unmapped it
    t.close()  # must not map anything there again
    with open("/proc/self/maps") as f:
        assert not any(int(line.split("-")[0], 16) == base for line in f)


def _smaps_rss_kib(start: int) -> int:
    """Rss of the mapping of this process that starts at ``start``."""
    text = open("/proc/self/smaps").read()
    found = False
    for line in text.splitlines():
        if "-" in line.split(" ", 1)[0] and not line.startswith(("Rss", "Size")):
            found = int(line.split("-", 1)[0], 16) == start
        elif found and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping at 0x{start:x}")


def test_the_peer_mapping_is_huge_page_aligned_and_populated(
    pair: tuple[ShmTransport, ShmTransport]
) -> None:
    """The first engine run with mapped copies took 15.6 ms for a 22.5 MiB push WRITE against
    4.5 ms by CMA: every page of the peer's mapping faulted on its first touch. The mapping is
    now 2 MiB-aligned (the memfd's huge pages map whole) and populated at the handshake."""
    owner, mapper = pair
    buf, meta = _registered(owner, 8 * MiB, 18)
    name = mapper.add_peer(meta, _proof(owner, mapper))
    mapping = mapper._peers[name].mapping
    assert mapping is not None
    ((base, size),) = mapping._maps
    assert base % (2 * MiB) == 0
    (piece,) = owner._areas[0].pieces
    assert _smaps_rss_kib(base) * 1024 >= piece.length  # mapped before any transfer


@pytest.mark.parametrize("key", ["map_memory", "map_peers"])
def test_a_bad_switch_is_a_config_error_naming_it(key: str) -> None:
    with pytest.raises(ConfigError, match=f"shm option {key}"):
        ShmTransport("bad", {key: "maybe"})
