"""Digests behind the writer: a push's receiver hashes the bytes as the sender's copy lands them.

A push's decode rank checks the prefill rank's digests against what landed
(:mod:`~kvbridge.scheduling.push_wait`). Hashing the part after P's ``PushResult`` puts one cold
pass over every byte on the hand-off's path (22.5 MiB: 3.8–4.8 ms here, against 0.6–0.9 ms
without digests). Where P's copy is one through memory it mapped of D's (shm, every range
mapped), P can say how far it got, and D hashes behind it on its own core:

* D's :class:`Board` is a few pages of words, one per push receive that offers one, registered
  with D's transport beside its KV (so P's transport maps it like the KV; see
  ``ShmTransport.register_memory``).
* D names its word in the ``PushRegister`` (``progress``). P's copy stores the stream bytes
  copied so far after each piece of at most 64 KiB (release), and wakes D's follower once,
  after the first (:func:`~kvbridge.scheduling.digests.copy_compute` with ``progress``).
* D's :class:`Follower`, on its own thread, sleeps on the word until the copy starts, then
  hashes each chunk once the word passes its end, while P copies the next ones.
* At P's ``PushResult`` (every WRITE stopped), D sets the word to the end itself and takes the
  digests from the follower (:meth:`Follower.finish`): what is left to hash is what the follower
  had not caught up with, and the loop's thread hashes it from the stream's back while the
  follower goes on from the front (a shared count of the chunks taken). Where P never moved
  the word (another transport, ranges moved by cross-memory attach, an older P), nothing was
  hashed and D hashes it all as before.

Trust: the word says only *when* to read. A word that runs ahead of the bytes (a P that lies, a
bug, anything else that writes D's memory) makes D hash what was there before, whose digest then
differs from P's: the receive fails as any mismatch does, and no KV is used unchecked. The word
sits in D's memory, on a board that holds nothing else; a word is given back only when the
receive is forgotten, which for a confirmed push is once P said every WRITE stopped, or P was
proven gone (the same rule that keeps the blocks), so a late store cannot reach the next
receive's word.

Thread safety: a :class:`Board` belongs to the transfer loop's thread; a :class:`Follower`'s
methods are called from one thread (the loop's), its own thread runs only the native hash (the
GIL let go).
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading

import numpy as np

from kvbridge.layout import DescriptorArray
from kvbridge.scheduling import digests

__all__ = ["Board", "Follower", "available"]

#: bytes between two words (one cache line each: a store to one does not slow its neighbours)
SLOT_BYTES = 64
#: words on a board: receives that can follow at once (more fall back to hashing after)
SLOTS = 1024
#: the follower looks at a moving word at least this often (microseconds)
MAX_WAIT_US = 200


def available() -> bool:
    """Whether this build can follow a copy (the native extension and its check passed)."""
    return digests.native_behind() is not None and digests.native_copy() is not None


class Board:
    """:data:`SLOTS` words in whole pages of their own (:attr:`region`, for the transport to
    register). :meth:`take` gives a zeroed word's address, :meth:`give` takes it back. Lives as
    long as the engine (the transport may have moved its pages into shared memory)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self._mem = mmap.mmap(-1, -(-slots * SLOT_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE)
        self._view = ctypes.c_char.from_buffer(self._mem)  # pins the mapping: never closed
        self.address = ctypes.addressof(self._view)
        self._words = np.frombuffer(self._mem, dtype=np.uint64)
        self._free = collections.deque(range(slots))
        self._taken: set[int] = set()

    @property
    def region(self) -> tuple[int, int]:
        """``(address, length)``: the board's memory, to register with the transport."""
        return self.address, len(self._mem)

    def take(self) -> int | None:
        """A free word, set to 0; None when every word is taken."""
        if not self._free:
            return None
        i = self._free.popleft()
        self._words[i * SLOT_BYTES // 8] = 0
        self._taken.add(i)
        return self.address + i * SLOT_BYTES

    def give(self, word: int) -> None:
        """Take back a word :meth:`take` gave (once no copy can store into it any more)."""
        i = (word - self.address) // SLOT_BYTES
        if i in self._taken:
            self._taken.remove(i)
            self._free.append(i)

    def __len__(self) -> int:
        """Words taken."""
        return len(self._taken)

    def words(self) -> list[int]:
        """The addresses of the words taken, in address order."""
        return [self.address + i * SLOT_BYTES for i in sorted(self._taken)]


class Follower:
    """Digests ``stream`` (this process's memory, in stream order) behind a writer that keeps
    the uint64 at ``word`` at the stream bytes it landed; started at once on its own thread.

    The caller keeps the stream's memory and the word alive until :meth:`finish` or
    :meth:`stop` returned."""

    def __init__(self, stream: DescriptorArray, word: int, max_wait_us: int = MAX_WAIT_US
                 ) -> None:
        fns = digests.native_behind()
        if fns is None:
            raise RuntimeError("kvbridge was built without its native digests")
        self._fns = fns
        self._rows = np.ascontiguousarray(stream[:, :2], dtype=np.uint64)
        self.total = int(self._rows[:, 1].sum())
        self._size = digests.chunk_size(self.total)
        self._out = np.zeros(digests.DIGEST_BYTES * -(-self.total // self._size), dtype=np.uint8)
        self._taken = np.zeros(1, dtype=np.uint64)  # chunks taken, by the follower or the back
        self._word = ctypes.c_uint64.from_address(word)
        self._stop = ctypes.c_int32(0)
        self._done = False
        args = (self._rows, self._size, self._out, self._taken, word,
                ctypes.addressof(self._stop), max_wait_us)

        def run() -> None:
            self._done = fns.follow(*args)

        self._thread = threading.Thread(target=run, name="kvbridge-follow", daemon=True)
        self._thread.start()

    @property
    def moved(self) -> bool:
        """Whether the writer moved the word (its copy started)."""
        return self._word.value != 0

    def finish(self) -> bytes | None:
        """Every byte landed (the writer stopped): the stream's digests. What the follower had
        not taken yet is hashed here too, from the stream's back, while it goes on from the
        front. None where the writer never moved the word (nothing was hashed: the caller
        hashes the stream itself, on more threads). Blocks until both are done."""
        if not self.moved:
            self.stop()
            return None
        self._word.value = self.total
        self._fns.wake(ctypes.addressof(self._word))
        self._fns.back(self._rows, self._size, self._out, self._taken)
        self._thread.join()
        return self._out.tobytes() if self._done else None

    def stop(self) -> None:
        """Stop following (idempotent); blocks until the follower's thread ended (at most one
        chunk's hash)."""
        self._stop.value = 1
        self._fns.wake(ctypes.addressof(self._word))
        self._thread.join()
