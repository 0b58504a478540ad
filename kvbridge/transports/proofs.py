"""How transports prove a peer answered this handshake (:mod:`kvbridge.identity`).

A transport's :meth:`~kvbridge.transport.Transport.attest` records a proof token its engine's
control plane handed out; a dialler's ``add_peer(metadata, proof)`` loads the peer only if the
peer's data plane shows that token. Two ways to show it, one helper each:

* :class:`Attestations` — for a transport whose responder answers the dialler's data-plane
  handshake itself (shm's listener, the in-process ``memory`` transport): the responder lets a
  dialler in only with a token it attested, once, before it expires, and — where the attesting
  handshake named the dialler's process — only to that process.
* :class:`ProofBoard` — for one-sided transports whose responder never sees the dialler's
  ``add_peer`` (NIXL, Mooncake): the responder writes each attested token into a small board of
  registered memory that is not part of its KV regions; the dialler READs the board of the peer
  its metadata names and looks for the token. A relayed or replayed metadata blob leads the READ
  to a board that never held this handshake's token.

Both are bounded (:data:`MAX_ATTESTED` tokens; the oldest are forgotten first) and thread-safe.
"""

from __future__ import annotations

import hmac
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import DescriptorError, PeerForged
from kvbridge.identity import PROOF_BYTES
from kvbridge.transport import MemoryRegion

__all__ = ["MAX_ATTESTED", "ATTEST_TTL_S", "Attestations", "ProofBoard", "check_proof"]

#: most tokens one transport holds at once (each is one handshake in progress)
MAX_ATTESTED = 512
#: how long an attested token lets a dialler in (the dialler's handshake runs within its
#: control timeout, seconds)
ATTEST_TTL_S = 60.0


def check_proof(proof: object) -> bytes:
    """``proof`` as bytes of the right length, else :class:`DescriptorError`."""
    if not isinstance(proof, bytes | bytearray) or len(proof) != PROOF_BYTES:
        raise DescriptorError(f"a peer proof is {PROOF_BYTES} bytes, got "
                              f"{len(proof) if isinstance(proof, bytes | bytearray) else proof!r}")
    return bytes(proof)


@dataclass(frozen=True)
class _Entry:
    expires: float
    pid: int | None


class Attestations:
    """Tokens a responder lets in, each at most once (see the module docstring)."""

    def __init__(self, ttl: float = ATTEST_TTL_S, capacity: int = MAX_ATTESTED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._capacity, self._clock = ttl, capacity, clock
        self._tokens: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, proof: bytes, pid: int | None = None) -> None:
        """Let in the dialler that shows ``proof`` (only process ``pid``, where given)."""
        proof = check_proof(proof)
        with self._lock:
            self._tokens.pop(proof, None)
            self._tokens[proof] = _Entry(self._clock() + self._ttl, pid)
            while len(self._tokens) > self._capacity:
                self._tokens.popitem(last=False)

    def take(self, proof: bytes, pid: int | None = None) -> str | None:
        """Consume ``proof`` for a dialler that is process ``pid``; None if it may come in,
        else why not (the token stays usable by the process it was attested for)."""
        now = self._clock()
        with self._lock:
            while self._tokens:
                oldest, entry = next(iter(self._tokens.items()))
                if entry.expires > now:
                    break
                del self._tokens[oldest]
            found = self._tokens.get(bytes(proof))
            if found is None:
                return ("no handshake of this engine attested the proof (relayed, replayed or "
                        "expired metadata, or a process that is not a peer)")
            if found.pid is not None and pid != found.pid:
                return (f"the proof was attested for process {found.pid}, the socket belongs to "
                        f"process {pid}")
            del self._tokens[bytes(proof)]
            return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)


class ProofBoard:
    """Registered memory holding the last :data:`MAX_ATTESTED` attested tokens (the *board*,
    peers READ it) and a scratch area of the same size this side READs peers' boards into.

    The owning transport registers :meth:`regions` with its native library (never as KV
    memory: the core's transfers cannot reach them), advertises :attr:`board` in its metadata,
    and calls :meth:`verify` from ``add_peer`` with a function that READs one range.
    """

    def __init__(self, slots: int = MAX_ATTESTED) -> None:
        self.slots = slots
        self.nbytes = slots * PROOF_BYTES
        size = -(-2 * self.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._map = mmap.mmap(-1, size)  # page-aligned, zero-filled, never moved
        arr = np.frombuffer(self._map, dtype=np.uint8)
        self._board = arr[: self.nbytes]
        self._scratch = arr[self.nbytes: 2 * self.nbytes]
        self._next = 0
        self._lock = threading.Lock()  # slots
        self._read_lock = threading.Lock()  # the scratch area

    @property
    def board(self) -> tuple[int, int]:
        """``(address, length)`` of the board, for the metadata."""
        return int(self._board.ctypes.data), self.nbytes

    @property
    def scratch(self) -> tuple[int, int]:
        return int(self._scratch.ctypes.data), self.nbytes

    def regions(self) -> list[MemoryRegion]:
        """Board and scratch, as one DRAM region to register."""
        return [MemoryRegion(int(self._board.ctypes.data), 2 * self.nbytes, 0, "DRAM")]

    def attest(self, proof: bytes) -> None:
        """Write ``proof`` into the next slot (the oldest is overwritten)."""
        proof = check_proof(proof)
        with self._lock:
            i = self._next
            self._next = (i + 1) % self.slots
            self._board[i * PROOF_BYTES:(i + 1) * PROOF_BYTES] = np.frombuffer(proof, np.uint8)

    def verify(self, read: Callable[[int, int, int], None], board: tuple[int, int],
               proof: bytes, who: str) -> None:
        """READ the peer's ``board`` with ``read(local_address, remote_address, length)``
        (blocking; raises on failure) and raise :class:`PeerForged` unless it holds
        ``proof``."""
        proof = check_proof(proof)
        address, length = board
        if length != self.nbytes or address <= 0:
            raise PeerForged(f"{who} advertises a proof board of {length} bytes at "
                             f"0x{address:x}; this side expects {self.nbytes}")
        with self._read_lock:
            self._scratch[:] = 0
            read(int(self._scratch.ctypes.data), address, length)
            seen = self._scratch.tobytes()
        for i in range(0, length, PROOF_BYTES):
            if hmac.compare_digest(seen[i:i + PROOF_BYTES], proof):
                return
        raise PeerForged(f"{who}'s data plane does not show this handshake's proof: its "
                         "metadata was relayed or replayed by another endpoint, or it is "
                         "another engine, generation or rank than claimed")

    def close(self) -> None:
        """Release the memory (after the owner deregistered it)."""
        try:
            self._board = self._scratch = np.zeros(0, np.uint8)
            self._map.close()
        except BufferError:  # a view still exists somewhere: leave it to the GC
            pass
