"""Hand-off digests (kvbridge.scheduling.digests): the same stream digests alike however each
side cuts it into ranges; a flipped byte is found and located; sizes stay bounded."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest

from kvbridge.messages import MAX_DIGEST_BYTES
from kvbridge.scheduling import digests
from kvbridge.scheduling.digests import CHUNK_BYTES, DIGEST_BYTES, MAX_CHUNKS


def _descs(buf: np.ndarray, cuts: list[int]) -> np.ndarray:
    """Descriptors covering ``buf`` in order, cut at ``cuts`` (byte offsets)."""
    base = buf.ctypes.data
    edges = [0, *cuts, buf.nbytes]
    return np.array([(base + a, b - a, 0) for a, b in zip(edges, edges[1:], strict=False) if b > a],
                    dtype=np.int64)


@pytest.fixture
def stream() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, 3 * CHUNK_BYTES + 1000, dtype=np.uint8)


def test_one_digest_per_chunk_and_the_cut_into_ranges_does_not_matter(
        stream: np.ndarray) -> None:
    whole = digests.compute(_descs(stream, []))
    assert len(whole) == 4 * DIGEST_BYTES  # three full chunks and a tail
    for cuts in ([1], [CHUNK_BYTES], [5, 4096, CHUNK_BYTES + 3, 2 * CHUNK_BYTES - 1]):
        assert digests.compute(_descs(stream, cuts)) == whole
    assert digests.mismatch(whole, _descs(stream, [17])) is None


def test_the_stream_is_read_in_place_across_separate_buffers(stream: np.ndarray) -> None:
    """Two buffers, in descriptor order, digest as their concatenation (the other side's
    stream may live in one)."""
    a, b = stream[:100_000].copy(), stream[100_000:].copy()
    descs = np.array([(a.ctypes.data, a.nbytes, 0), (b.ctypes.data, b.nbytes, 0)],
                     dtype=np.int64)
    assert digests.compute(descs) == digests.compute(_descs(stream, []))


@pytest.mark.parametrize("offset", [0, CHUNK_BYTES - 1, CHUNK_BYTES, 3 * CHUNK_BYTES + 999])
def test_a_flipped_byte_is_found_and_located(stream: np.ndarray, offset: int) -> None:
    sent = digests.compute(_descs(stream, []))
    landed = stream.copy()
    landed[offset] ^= 0x01
    problem = digests.mismatch(sent, _descs(landed, [offset]))
    chunk, total = offset // CHUNK_BYTES, stream.nbytes
    end = min((chunk + 1) * CHUNK_BYTES, total) - 1
    assert problem == (f"digest mismatch in 1 of 4 chunks, the first at bytes "
                       f"{chunk * CHUNK_BYTES}–{end} of the part's {total}-byte stream")


def test_missing_short_or_foreign_digests_are_mismatches(stream: np.ndarray) -> None:
    descs = _descs(stream, [])
    assert digests.mismatch(None, descs) == "the sender sent no digests"
    assert "digested 2 chunks, 4 landed" in (digests.mismatch(b"\0" * 32, descs) or "")
    assert "4 of 4 chunks" in (digests.mismatch(b"\0" * 64, descs) or "")


def test_empty_stream_has_no_digests() -> None:
    assert digests.compute(np.zeros((0, 3), dtype=np.int64)) == b""


def test_chunks_grow_past_the_cap_so_digests_fit_one_message() -> None:
    assert MAX_CHUNKS * DIGEST_BYTES == MAX_DIGEST_BYTES
    assert digests.chunk_size(1) == CHUNK_BYTES
    assert digests.chunk_size(CHUNK_BYTES * MAX_CHUNKS) == CHUNK_BYTES
    for total in (CHUNK_BYTES * MAX_CHUNKS + 1, 64 << 30, 1 << 40):
        size = digests.chunk_size(total)
        assert size % 4096 == 0 and -(-total // size) <= MAX_CHUNKS


@pytest.mark.skipif(digests.native() is None, reason="kvbridge built without _digest")
@pytest.mark.parametrize("keep_gil", [False, True])
@pytest.mark.parametrize("threads", [0, 1, 2])
def test_native_digests_equal_pythons_for_any_cut(threads: int, keep_gil: bool) -> None:
    """The native digests (one call: the caller alone, with a helper taking chunks from the back,
    or the helper's path alone: threads 0) against the Python ones, for streams cut into ranges
    every which way: ranges across chunk ends, a short tail, chunks of other sizes, empty ranges
    inside and at the end, and the two threads meeting inside a range; the GIL kept or let go."""
    fn = digests.native()
    assert fn is not None
    rng = np.random.default_rng(threads)
    buf = rng.integers(0, 256, 5 * CHUNK_BYTES + 777, dtype=np.uint8)
    for cuts in ([], [1], [CHUNK_BYTES], sorted(rng.integers(0, buf.nbytes, 40)),
                 [3 * CHUNK_BYTES - 1, 3 * CHUNK_BYTES + 1]):
        descs = _descs(buf, [int(c) for c in cuts])
        rows = np.ascontiguousarray(descs[:, :2], dtype=np.uint64)
        for size in (CHUNK_BYTES, 3 * 4096, 2 * CHUNK_BYTES):
            want = digests.compute_python(descs, size)
            assert fn(rows, size, threads, keep_gil) == want, (cuts, size)
    base = buf.ctypes.data
    empty_inside = np.array([(base, 1000), (base + 1000, 0), (base + 1000, buf.nbytes - 1000)],
                            dtype=np.uint64)
    assert fn(empty_inside, CHUNK_BYTES, threads, keep_gil) == digests.compute_python(
        _descs(buf, []), CHUNK_BYTES)
    empty_last = np.array([(base, buf.nbytes), (base + buf.nbytes, 0)], dtype=np.uint64)
    assert fn(empty_last, CHUNK_BYTES, threads, keep_gil) == digests.compute_python(
        _descs(buf, []), CHUNK_BYTES)


def test_compute_is_the_same_with_and_without_the_extension(
        monkeypatch: pytest.MonkeyPatch) -> None:
    buf = np.random.default_rng(3).integers(0, 256, digests.SPLIT_BYTES + 4321, dtype=np.uint8)
    descs = _descs(buf, [17, CHUNK_BYTES + 5])
    native = digests.compute(descs)  # two threads where the extension is built
    monkeypatch.setattr(digests, "native", lambda: None)
    assert digests.compute(descs) == native


@pytest.mark.parametrize("which", ["digests", "copy-and-digest"])
def test_native_digests_that_differ_from_xxhash_are_not_used(
        monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """The loaders check each native path against xxhash on a test stream: a native function
    giving other digests (a changed signature would) leaves it unused (digests: hashed in
    Python; the copy-and-digest: the READ hashed after its copy)."""
    loaded, load = ((digests.native, digests._load_native) if which == "digests"
                    else (digests.native_copy, digests._load_copy))
    if loaded() is None:
        pytest.skip("kvbridge built without _digest")
    real = digests.compute_python
    monkeypatch.setattr(digests, "compute_python",
                        lambda descs, size: bytes(len(real(descs, size))))
    assert load() is None


@pytest.mark.skipif(digests.native() is None, reason="kvbridge built without _digest")
def test_a_native_digest_that_keeps_the_gil_lets_no_python_run_meanwhile() -> None:
    """Kept, the GIL stays with the caller for the whole hash (a thread counting in Python does
    not move); the helper thread hashes without it."""
    fn = digests.native()
    assert fn is not None
    buf = np.random.default_rng(5).integers(0, 256, 8 << 20, dtype=np.uint8)
    rows = np.ascontiguousarray(_descs(buf, [])[:, :2], dtype=np.uint64)
    want = fn(rows, CHUNK_BYTES, 1, False)
    count, stop = [0], threading.Event()

    def counting() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=counting)
    thread.start()
    try:
        while count[0] < 1000:
            time.sleep(0.001)
        for threads in (1, 2):
            before = count[0]
            assert fn(rows, CHUNK_BYTES, threads, True) == want
            assert count[0] == before
    finally:
        stop.set()
        thread.join()


def test_compute_keeps_the_gil_for_streams_under_keep_gil_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking the GIL back waits up to a switch interval while another thread runs Python: a
    stream that hashes in less keeps it; a larger one lets it go."""
    calls: list[tuple[int, bool]] = []
    monkeypatch.setattr(digests, "native",
                        lambda: lambda rows, size, threads, keep: calls.append((threads, keep))
                        or b"")
    for total in (4096, digests.SPLIT_BYTES, digests.KEEP_GIL_BYTES - 1, digests.KEEP_GIL_BYTES):
        digests.compute(np.array([(1 << 40, total, 0)], dtype=np.int64))
    two = 2 if len(os.sched_getaffinity(0)) > 1 else 1
    assert calls == [(1, True), (two, True), (two, True), (two, False)]


def _scattered(rng: np.random.Generator, src: np.ndarray, dst: np.ndarray,
               cuts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Moves of ``src`` cut at ``cuts`` into ``dst``, each range at a place of its own (the
    ranges shuffled in ``dst``, so the destination stream is not ``dst`` in address order), and
    the destination's descriptors in row (stream) order."""
    edges = [0, *cuts, src.nbytes]
    sizes = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    places, at = {}, 0
    for i in rng.permutation(len(sizes)):
        places[int(i)] = at
        at += sizes[int(i)]
    moves = np.array([(dst.ctypes.data + places[i], src.ctypes.data + a, n)
                      for i, (a, n) in enumerate(zip(edges, sizes, strict=False))],
                     dtype=np.uint64)
    return moves, np.array([(int(m[0]), int(m[2]), 0) for m in moves], dtype=np.int64)


@pytest.mark.skipif(digests.native_copy() is None, reason="kvbridge built without _digest")
@pytest.mark.parametrize("source", [False, True])
@pytest.mark.parametrize("keep_gil", [False, True])
@pytest.mark.parametrize("threads", [0, 1, 2])
def test_a_copy_digested_in_one_pass_lands_every_byte_and_digests_what_landed(
        threads: int, keep_gil: bool, source: bool) -> None:
    """The fused copy (each piece hashed right after it is copied): every byte lands where its
    row says, and the digests are those of the destination stream (the dsts in row order; with
    ``source`` the srcs: what a WRITE sent) that :func:`compute` gives: ranges across chunk
    ends, a short tail, empty ranges, pieces longer than the 64 KiB the copy runs ahead, the
    two threads meeting inside a range."""
    fn = digests.native_copy()
    assert fn is not None
    rng = np.random.default_rng(10 + threads)
    src = rng.integers(0, 256, 5 * CHUNK_BYTES + 777, dtype=np.uint8)
    for cuts in ([], [1], [CHUNK_BYTES], sorted({int(c) for c in rng.integers(1, src.nbytes, 40)}),
                 [3 * CHUNK_BYTES - 1, 3 * CHUNK_BYTES + 1], [100, 100, 5000]):
        for size in (CHUNK_BYTES, 3 * 4096, 2 * CHUNK_BYTES):
            dst = np.zeros_like(src)
            moves, landed = _scattered(rng, src, dst, cuts)
            got = fn(moves, size, threads, keep_gil, 0, source)
            sent = np.array([(int(m[1]), int(m[2]), 0) for m in moves], dtype=np.int64)
            assert got == digests.compute_python(sent if source else landed, size), (cuts, size)
            for d, s, n in moves.tolist():  # every byte where its row says
                assert np.array_equal(dst[d - dst.ctypes.data:][:n], src[s - src.ctypes.data:][:n])


@pytest.mark.skipif(digests.native_copy() is None, reason="kvbridge built without _digest")
def test_copy_compute_equals_a_copy_then_compute_and_a_stop_copies_nothing() -> None:
    rng = np.random.default_rng(21)
    src = rng.integers(0, 256, digests.SPLIT_BYTES + 4321, dtype=np.uint8)  # with the helper
    dst = np.zeros_like(src)
    moves, landed = _scattered(rng, src, dst, [17, CHUNK_BYTES + 5, 3 << 20])
    want_dst = np.zeros_like(src)
    for d, s, n in moves.tolist():
        want_dst[d - dst.ctypes.data:][:n] = src[s - src.ctypes.data:][:n]
    stop = ctypes.c_int32(1)  # stopped before the first chunk: nothing copied, no digests
    assert digests.copy_compute(moves, ctypes.addressof(stop)) is None
    assert not dst.any()
    stop.value = 0
    got = digests.copy_compute(moves, ctypes.addressof(stop))
    assert np.array_equal(dst, want_dst)
    assert got == digests.compute(landed)


@pytest.mark.skipif(digests.native_copy() is None, reason="kvbridge built without _digest")
def test_a_landing_copy_digests_its_stream_however_the_moves_cut_or_order_it() -> None:
    """The pull sink's READ copy (:func:`digests.landing`): the moves name the stream cut
    otherwise (the transport's own ranges) and it digests in the same pass; moves in another
    order than the stream still all land, and the digests are the stream's, hashed after."""
    rng = np.random.default_rng(31)
    src = rng.integers(0, 256, 3 * CHUNK_BYTES + 99, dtype=np.uint8)
    dst = np.zeros_like(src)
    moves, landed = _scattered(rng, src, dst, [5000, CHUNK_BYTES + 1])
    # the stream as the sink sees it: the same bytes in the same order, each range cut in two
    stream = np.array([row for a, n in landed[:, :2].tolist()
                       for row in ((a, n // 3, 0), (a + n // 3, n - n // 3, 0))], dtype=np.int64)
    copy = digests.landing(stream)
    assert copy is not None
    assert copy(moves, 0) == digests.compute(stream)
    dst[:] = 0
    assert copy(np.ascontiguousarray(moves[::-1]), 0) == digests.compute(stream)
    assert np.array_equal(np.sort(dst), np.sort(src))
    # a WRITE's copy: the stream is its sources (the sender's KV, digested as it is read)
    sent = np.array([(int(m[1]), int(m[2]), 0) for m in moves], dtype=np.int64)
    writing = digests.landing(sent, source=True)
    assert writing is not None
    dst[:] = 0
    assert writing(moves, 0) == digests.compute(sent) == digests.compute(landed)
    assert writing(np.ascontiguousarray(moves[::-1]), 0) == digests.compute(sent)
    assert digests.landing(np.zeros((0, 3), dtype=np.int64)) is None


def test_a_thread_pinned_to_one_core_hashes_without_a_helper(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper would only take turns with the caller on one core: an engine pinned to one
    core (as kvbridge's benches and engine tests pin each engine, ``cpu_bind``) hashes on its
    own thread."""
    calls: list[int] = []
    monkeypatch.setattr(digests, "native",
                        lambda: lambda rows, size, threads, keep: calls.append(threads) or b"")
    big = np.array([(1 << 40, digests.SPLIT_BYTES, 0)], dtype=np.int64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    digests.compute(big)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    digests.compute(big)
    assert calls == [1, 2]
