"""Digests behind the writer (kvbridge.scheduling.follow): a push's receiver hashes each chunk
once the sender's copy says it landed. Here the writer is a thread of this process (the
cross-process path, through a real shm mapping, is tests/process/test_shm_mapped.py)."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import numpy as np
import pytest

from kvbridge.scheduling import digests, follow
from kvbridge.scheduling.digests import CHUNK_BYTES

pytestmark = pytest.mark.skipif(not follow.available(), reason="kvbridge built without _digest")


def _stream(nbytes: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A source, a zeroed destination, and the destination's descriptors cut in uneven ranges
    (in address order: the stream)."""
    src = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    edges = sorted({e for e in (0, 777, CHUNK_BYTES + 5, 2 * CHUNK_BYTES) if e < nbytes}
                   | {nbytes})
    descs = np.array([(dst.ctypes.data + a, b - a, 0) for a, b in zip(edges, edges[1:],
                                                                      strict=False)],
                     dtype=np.int64)
    return src, dst, descs


def _moves(src: np.ndarray, dst: np.ndarray, descs: np.ndarray) -> np.ndarray:
    return np.array([(a, src.ctypes.data + a - dst.ctypes.data, n) for a, n, _ in descs.tolist()],
                    dtype=np.uint64)


def test_the_board_gives_distinct_zeroed_words_and_takes_them_back() -> None:
    board = follow.Board(slots=70)
    address, length = board.region
    assert address % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
    assert length >= 70 * follow.SLOT_BYTES
    words = [board.take() for _ in range(70)]
    assert None not in words and len(set(words)) == 70 and len(board) == 70
    assert all(w is not None and w % follow.SLOT_BYTES == 0 and address <= w < address + length
               for w in words)
    assert board.take() is None  # full: that receive hashes after the result
    w = words[3]
    assert w is not None
    ctypes.c_uint64.from_address(w).value = 123
    board.give(w)
    board.give(w)  # twice: once given back, nothing more
    assert len(board) == 69
    assert board.take() == w and ctypes.c_uint64.from_address(w).value == 0  # zeroed again


def test_a_follower_behind_a_copy_has_the_streams_digests() -> None:
    """The writer keeps the word as it copies (copy_compute with ``progress``, one thread, in
    order); the follower's digests equal the stream's, and the writer's of what it read."""
    src, dst, descs = _stream(3 * CHUNK_BYTES + 4321, 1)
    board = follow.Board(slots=4)
    word = board.take()
    assert word is not None
    follower = follow.Follower(descs, word)
    sent = digests.copy_compute(_moves(src, dst, descs), 0, True, word)
    assert ctypes.c_uint64.from_address(word).value == src.nbytes  # the copy kept it
    assert follower.moved
    assert follower.finish() == sent == digests.compute(descs)
    np.testing.assert_array_equal(dst, src)


def test_the_follower_hashes_chunks_as_the_word_passes_them() -> None:
    """Chunk by chunk: a writer that lands one chunk and moves the word; the follower hashed
    what had landed before the last chunk did (its digests of the first chunks are those of
    the bytes at the time: here the final ones)."""
    src, dst, descs = _stream(3 * CHUNK_BYTES + 10, 2)
    board = follow.Board(slots=1)
    word = board.take()
    assert word is not None
    follower = follow.Follower(descs, word, max_wait_us=50)
    value = ctypes.c_uint64.from_address(word)
    for end in (CHUNK_BYTES, 2 * CHUNK_BYTES, 3 * CHUNK_BYTES):
        dst[end - CHUNK_BYTES:end] = src[end - CHUNK_BYTES:end]
        value.value = end
        time.sleep(0.02)
    dst[3 * CHUNK_BYTES:] = src[3 * CHUNK_BYTES:]
    assert follower.finish() == digests.compute(descs)


def test_a_word_that_runs_ahead_of_the_bytes_gives_digests_that_differ() -> None:
    """A lying or broken writer (or anything else that writes the word): the follower hashes
    what was there, and the receiver's comparison with the sender's digests fails."""
    src, dst, descs = _stream(2 * CHUNK_BYTES, 3)
    board = follow.Board(slots=1)
    word = board.take()
    assert word is not None
    follower = follow.Follower(descs, word)
    ctypes.c_uint64.from_address(word).value = 1 << 40  # "all landed", before any byte did
    time.sleep(0.05)
    dst[:] = src  # the bytes land after the follower read the zeros
    theirs = digests.compute(descs)  # the sender's: the bytes it sent
    problem = digests.mismatch(theirs, descs, follower.finish())
    assert problem is not None and "2 of 2 chunks" in problem


def test_a_word_never_moved_leaves_the_hash_to_the_caller_and_stop_is_prompt() -> None:
    src, dst, descs = _stream(CHUNK_BYTES + 1, 4)
    board = follow.Board(slots=2)
    word = board.take()
    assert word is not None
    follower = follow.Follower(descs, word)
    time.sleep(0.02)
    assert not follower.moved
    assert follower.finish() is None  # nothing hashed: the caller hashes it all
    # stop ends a follower asleep on the word (and wakes it: it does not wait for its next look)
    other = board.take()
    assert other is not None
    asleep = follow.Follower(descs, other)
    time.sleep(0.02)
    asleep.stop()
    assert not asleep._thread.is_alive()
    asleep.stop()  # idempotent


def test_a_landing_copy_keeps_the_word_only_when_its_moves_are_the_stream_in_order() -> None:
    src, dst, descs = _stream(2 * CHUNK_BYTES + 3, 5)
    moves = _moves(src, dst, descs)
    word = np.zeros(1, dtype=np.uint64)
    copy = digests.landing(descs)
    assert copy is not None
    assert copy(np.ascontiguousarray(moves[::-1]), 0, word.ctypes.data) == digests.compute(descs)
    assert int(word[0]) == 0  # out of order: a follower would hash bytes not yet there
    dst[:] = 0
    assert copy(moves, 0, word.ctypes.data) == digests.compute(descs)
    assert int(word[0]) == src.nbytes


def test_the_native_calls_refuse_a_misaligned_word() -> None:
    fns = digests.native_behind()
    assert fns is not None
    rows = np.zeros((1, 2), dtype=np.uint64)
    buf, out = np.zeros(4, dtype=np.uint64), np.zeros(16, dtype=np.uint8)
    taken = np.zeros(1, dtype=np.uint64)
    with pytest.raises(ValueError, match="8-byte aligned"):
        fns.wake(buf.ctypes.data + 4)
    with pytest.raises(ValueError, match="8-byte aligned"):
        fns.follow(rows, 64, out, taken, buf.ctypes.data + 4, 0, 100)
    for bad in (0, 1_000_000):  # a nap is more than nothing and less than a second
        with pytest.raises(ValueError, match="max_wait_us"):
            fns.follow(rows, 64, out, taken, buf.ctypes.data, 0, bad)
    moves = np.array([(buf.ctypes.data, buf.ctypes.data + 16, 8)], dtype=np.uint64)
    with pytest.raises(ValueError, match="8-byte aligned"):
        digests.copy_compute(moves, 0, False, buf.ctypes.data + 12)


def test_many_followers_at_once_each_get_their_own_stream() -> None:
    board = follow.Board(slots=8)
    jobs = []
    for seed in range(8):
        src, dst, descs = _stream(CHUNK_BYTES + 100 * seed, 10 + seed)
        word = board.take()
        assert word is not None
        jobs.append((src, dst, descs, word, follow.Follower(descs, word)))
    writers = [threading.Thread(target=digests.copy_compute,
                                args=(_moves(src, dst, descs), 0, True, word))
               for src, dst, descs, word, _ in jobs]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    for _src, _dst, descs, _, follower in jobs:
        assert follower.finish() == digests.compute(descs)


@pytest.mark.parametrize("landed_first", [1, 40 * CHUNK_BYTES])
def test_finish_hashes_what_the_follower_had_not_taken_from_the_back(landed_first: int) -> None:
    """At the result, the loop's thread takes the chunks nobody took yet from the stream's back
    while the follower goes on from the front (one shared count): each chunk hashed once, the
    digests the stream's, whether the follower had barely started or was half way."""
    src, dst, descs = _stream(80 * CHUNK_BYTES + 17, 6)
    dst[:] = src  # every byte is there; the word says otherwise until finish
    board = follow.Board(slots=1)
    word = board.take()
    assert word is not None
    follower = follow.Follower(descs, word)
    ctypes.c_uint64.from_address(word).value = landed_first
    time.sleep(0.01)
    assert follower.finish() == digests.compute(descs)
    assert int(follower._taken[0]) >= 81  # every chunk taken once (later takes find none)


def test_following_leaves_the_callers_timer_slack_as_it_was() -> None:
    """The follower naps with a 1 us timer slack, and gives the calling thread its own back
    (the loader runs it once on whichever thread first asks: an engine's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_get_timerslack = 30
    before = libc.prctl(pr_get_timerslack, 0, 0, 0, 0)
    src, dst, descs = _stream(CHUNK_BYTES, 7)
    dst[:] = src
    fns = digests.native_behind()
    assert fns is not None
    rows = np.ascontiguousarray(descs[:, :2], dtype=np.uint64)
    out = np.zeros(digests.DIGEST_BYTES, dtype=np.uint8)
    word = np.array([src.nbytes], dtype=np.uint64)
    assert fns.follow(rows, CHUNK_BYTES, out, np.zeros(1, dtype=np.uint64), word.ctypes.data, 0,
                      100)
    assert out.tobytes() == digests.compute(descs)
    assert libc.prctl(pr_get_timerslack, 0, 0, 0, 0) == before > 0
