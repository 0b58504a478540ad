"""kvbridge.hashing: XXH3-128 fed to xxhash in pieces small enough that python-xxhash keeps the
GIL (over 64 KiB it gives it up, and an engine thread running Python beside it then makes every
piece wait out a switch interval). Every digest of kvbridge goes through it: the hand-off
digests and the tier seals are checked here to hand xxhash no piece over :data:`PIECE`, and to
give the digest one call over all the bytes would."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from kvbridge import hashing
from kvbridge.hashing import PIECE
from kvbridge.offload import seal
from kvbridge.scheduling import digests

_XXH3_128 = xxhash.xxh3_128


class _Recording:
    """An xxh3_128 that records the size of every piece it is fed."""

    sizes: list[int] = []

    def __init__(self) -> None:
        self._h = _XXH3_128()

    def update(self, data: memoryview) -> None:
        _Recording.sizes.append(len(data))
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()

    def reset(self) -> None:
        self._h.reset()


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    _Recording.sizes = []
    monkeypatch.setattr(hashing.xxhash, "xxh3_128", _Recording)
    yield _Recording.sizes


@pytest.mark.parametrize("size", [0, 1, PIECE - 1, PIECE, PIECE + 1, 5 * PIECE + 17, 3 << 20])
def test_pieces_digest_as_one_call(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert hashing.xxh3_128(data) == xxhash.xxh3_128_digest(data)
    assert hashing.xxh3_128(memoryview(data)) == xxhash.xxh3_128_digest(data)


def test_a_view_of_wider_items_is_hashed_as_its_bytes() -> None:
    words = np.arange(100_000, dtype=np.uint32)
    assert hashing.xxh3_128(memoryview(words)) == xxhash.xxh3_128_digest(words.tobytes())


def test_tier_seals_feed_no_piece_over_the_limit(recording: list[int]) -> None:
    payload = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    chunk = seal.seal(payload)
    assert chunk[-seal.DIGEST_BYTES:] == xxhash.xxh3_128_digest(payload)
    assert seal.unseal(chunk, len(payload)) is not None
    assert recording and max(recording) <= PIECE


def test_hand_off_digests_feed_no_piece_over_the_limit(recording: list[int]) -> None:
    """A part in ranges of 1 MiB (contiguous blocks coalesce into ranges that large)."""
    buf = np.random.default_rng(2).integers(0, 256, 8 << 20, dtype=np.uint8)
    descs = np.array([(buf.ctypes.data + i * (1 << 20), 1 << 20, 0) for i in range(8)],
                     dtype=np.int64)
    got = digests.compute_python(descs, digests.CHUNK_BYTES)  # the path without _digest
    assert recording and max(recording) <= PIECE
    assert len(got) == 32 * digests.DIGEST_BYTES
    want = b"".join(xxhash.xxh3_128_digest(buf[i:i + digests.CHUNK_BYTES].tobytes())
                    for i in range(0, buf.nbytes, digests.CHUNK_BYTES))
    assert got == want
