"""The LookupBuffer: KV waiting to be taken, found by key (one of the core's two hand-off
abstractions; the other is the FIFO pipe, :mod:`kvbridge.transports.pipe`).

A :class:`LookupBuffer` is a keyed, bounded store of *references* to KV (block ids, a staged
plan, a chunk index entry — never the bytes themselves) with a lease per entry::

    buf = LookupBuffer[str, Plan]("pull-staged", capacity=4096)
    buf.insert(tid, plan, lease=30.0)      # DuplicateKey if held; BufferFull when full
    buf.extend(tid, 30.0)                  # a heartbeat: the lease now ends 30 s from now
    buf.lookup([k0, k1, k2])               # 2: the longest prefix of these keys held
    plan = buf.drop_select(tid)            # the matching side showed up: take it out
    for key, plan in buf.expire(): ...     # entries whose lease ended, removed; free them

Homes (docs/concepts.md, "The core: LookupBuffer and FIFO pipe"): P's staged pulls and P's push
table (keyed by transfer id), D's receives waiting for their KV (keyed by transfer id), and each
managed offload tier as the scheduler sees it (keyed by content key, least recently used evicted
instead of refusing).

Contract:

- **Owner.** One thread owns a buffer (the transfer loop for the hand-off homes; the offload
  manager's lock for the tier homes). Nothing here locks: the hot path is a dict access. Calls
  from several threads without the owner's serialisation are a bug.
- **Leases.** ``lease`` is seconds from now, on the buffer's ``clock`` (monotonic); ``None`` is
  no lease (the entry stays until dropped or evicted). An entry whose lease ended is over at
  once: :meth:`get`, :meth:`lookup`, :meth:`drop_select`, :meth:`extend`, ``in`` and
  :meth:`touch` no longer see it, even before :meth:`expire` collects it — a lease that ended
  never serves. It still counts against ``capacity`` until collected, and :meth:`insert` of its
  key raises :class:`DuplicateKey` (the owner must collect it, and free what it references,
  first). :meth:`next_deadline` says when :meth:`expire` next has work.
- **Capacity.** At most ``capacity`` entries. When full, ``overflow`` decides: ``REFUSE``
  (back-pressure: :meth:`insert` raises :class:`BufferFull` and nothing changes; the caller
  refuses or retries later) or ``EVICT_LRU`` (the least recently used entries are removed and
  returned by :meth:`insert`, for caches whose references can be recomputed).
- **Keys** are hostile until checked: hashable; a ``str``/``bytes`` key at most
  ``max_key_len`` long; tuples of such. Anything else raises :class:`InvalidKey` naming the
  buffer, and changes nothing. Every method either completes or raises before changing
  anything (no partial failure).
"""

from __future__ import annotations

import enum
import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from kvbridge.errors import KVBridgeError

__all__ = [
    "BufferFull",
    "DuplicateKey",
    "InvalidKey",
    "LookupBuffer",
    "LookupMiss",
    "Overflow",
    "MAX_KEY_LEN",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")

#: the longest ``str``/``bytes`` key a buffer accepts unless told otherwise
MAX_KEY_LEN = 512


class BufferFull(KVBridgeError):
    """The buffer holds ``capacity`` entries and refuses more (back-pressure)."""


class DuplicateKey(KVBridgeError, ValueError):
    """The key is already held (possibly by an entry whose lease ended and was not collected)."""


class InvalidKey(KVBridgeError, ValueError):
    """The key is not one this buffer accepts (wrong type, unhashable, too long)."""


class LookupMiss(KVBridgeError, KeyError):
    """No live entry has this key."""

    def __str__(self) -> str:  # KeyError quotes its argument; say it plainly
        return str(self.args[0]) if self.args else "lookup miss"


class Overflow(enum.Enum):
    """What :meth:`LookupBuffer.insert` does when the buffer is full."""

    REFUSE = "refuse"
    EVICT_LRU = "evict-lru"


@dataclass
class _Entry(Generic[V]):
    ref: V
    deadline: float  # math.inf: no lease


class LookupBuffer(Generic[K, V]):
    """See the module docstring. Not thread-safe: one owner."""

    def __init__(self, name: str, capacity: int, *, overflow: Overflow = Overflow.REFUSE,
                 clock: Callable[[], float] = time.monotonic,
                 max_key_len: int = MAX_KEY_LEN) -> None:
        if capacity < 1:
            raise ValueError(f"LookupBuffer {name}: capacity must be >= 1, not {capacity}")
        self.name = name
        self.capacity = capacity
        self.overflow = overflow
        self.max_key_len = max_key_len
        self._clock = clock
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()  # least recently used first
        self._heap: list[tuple[float, int, K]] = []  # (deadline, seq, key); stale rows skipped
        self._seq = 0

    # -- checks --------------------------------------------------------------------------------

    def _check_key(self, key: object, depth: int = 0) -> None:
        if isinstance(key, (str, bytes)):
            if len(key) > self.max_key_len:
                raise InvalidKey(f"{self.name}: key of {len(key)} characters (at most "
                                 f"{self.max_key_len})")
            return
        if isinstance(key, bool) or key is None:
            raise InvalidKey(f"{self.name}: key {key!r} is not an identifier")
        if isinstance(key, int):
            return
        if isinstance(key, tuple) and depth == 0:
            if len(key) > 8:
                raise InvalidKey(f"{self.name}: tuple key of {len(key)} parts (at most 8)")
            for part in key:
                self._check_key(part, 1)
            return
        raise InvalidKey(f"{self.name}: key of type {type(key).__name__} (str, bytes, int or "
                         "a tuple of them)")

    def _deadline(self, lease: float | None) -> float:
        if lease is None:
            return math.inf
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not (
                math.isfinite(lease) and lease >= 0):
            raise ValueError(f"{self.name}: lease must be a finite number of seconds >= 0, "
                             f"not {lease!r}")
        return self._clock() + float(lease)

    def _live(self, key: object) -> _Entry[V] | None:
        """The entry of ``key`` if its lease holds (``key`` already checked or hashable)."""
        try:
            entry = self._entries.get(key)  # type: ignore[arg-type]
        except TypeError:
            return None
        if entry is None or entry.deadline <= self._clock():
            return None
        return entry

    def _push(self, key: K, deadline: float) -> None:
        if deadline == math.inf:
            return
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key))
        if len(self._heap) > 2 * len(self._entries) + 64:  # many extensions: drop stale rows
            self._heap = [(d, s, k) for d, s, k in self._heap
                          if k in self._entries and self._entries[k].deadline == d]
            heapq.heapify(self._heap)

    # -- the contract --------------------------------------------------------------------------

    def insert(self, key: K, ref: V, lease: float | None = None) -> list[tuple[K, V]]:
        """Hold ``ref`` under ``key`` for ``lease`` seconds; return the entries evicted to make
        room (always empty with ``Overflow.REFUSE``). Raises :class:`InvalidKey`,
        :class:`DuplicateKey`, :class:`BufferFull` or ``ValueError`` (bad lease), changing
        nothing."""
        self._check_key(key)
        deadline = self._deadline(lease)
        if key in self._entries:
            raise DuplicateKey(f"{self.name}: {key!r} is already held")
        evicted: list[tuple[K, V]] = []
        if len(self._entries) >= self.capacity:
            if self.overflow is Overflow.REFUSE:
                raise BufferFull(f"{self.name}: full ({self.capacity} entries held)")
            while len(self._entries) >= self.capacity:
                old, entry = self._entries.popitem(last=False)
                evicted.append((old, entry.ref))
        self._entries[key] = _Entry(ref, deadline)
        self._push(key, deadline)
        return evicted

    @overload
    def get(self, key: K) -> V | None: ...

    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        """The live entry's reference, or ``default`` (does not count as a use for LRU)."""
        entry = self._live(key)
        return default if entry is None else entry.ref

    def __getitem__(self, key: K) -> V:
        """The live entry's reference; :class:`LookupMiss` (a ``KeyError``) if none."""
        entry = self._live(key)
        if entry is None:
            raise LookupMiss(f"{self.name}: nothing held under {key!r}")
        return entry.ref

    def __contains__(self, key: object) -> bool:
        return self._live(key) is not None

    def lookup(self, keys: Sequence[K], start: int = 0) -> int:
        """How many of ``keys[start:]`` are held, consecutively from ``start`` (the longest
        prefix held). Does not count as a use; a hostile key ends the prefix."""
        n = 0
        for key in keys[start:]:
            if self._live(key) is None:
                break
            n += 1
        return n

    def touch(self, keys: Iterable[K]) -> int:
        """Mark the live ``keys`` most recently used, the first of them last (so a prefix's
        head is evicted after its tail); return how many were live."""
        n = 0
        for key in reversed(list(keys)):
            if self._live(key) is not None:
                self._entries.move_to_end(key)
                n += 1
        return n

    def drop_select(self, key: K) -> V:
        """Remove the live entry of ``key`` and return its reference; :class:`LookupMiss` if
        there is none (an entry whose lease ended stays for :meth:`expire`)."""
        if self._live(key) is None:
            raise LookupMiss(f"{self.name}: nothing held under {key!r}")
        return self._entries.pop(key).ref

    def discard(self, key: K) -> V | None:
        """Remove ``key``'s entry whatever its lease (the owner frees what it references);
        return its reference, or None if absent."""
        try:
            entry = self._entries.pop(key, None)
        except TypeError:
            return None
        return None if entry is None else entry.ref

    def extend(self, key: K, lease: float | None) -> bool:
        """Renew a live entry's lease: it now ends ``lease`` seconds from now (None: never).
        False if there is no live entry (a lease that ended is not revived)."""
        deadline = self._deadline(lease)
        entry = self._live(key)
        if entry is None:
            return False
        entry.deadline = deadline
        self._push(key, deadline)
        return True

    def expire(self, now: float | None = None) -> list[tuple[K, V]]:
        """Remove and return every entry whose lease ended by ``now`` (default: the clock),
        earliest deadline first."""
        now = self._clock() if now is None else now
        out: list[tuple[K, V]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, key = heapq.heappop(heap)
            entry = self._entries.get(key)
            if entry is not None and entry.deadline == deadline:
                del self._entries[key]
                out.append((key, entry.ref))
        return out

    def next_deadline(self) -> float | None:
        """The clock time of the earliest lease still to end, or None."""
        heap = self._heap
        while heap:
            deadline, _, key = heap[0]
            entry = self._entries.get(key)
            if entry is not None and entry.deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        """Entries held, those whose lease ended but were not collected included."""
        return len(self._entries)

    @property
    def free(self) -> int:
        return self.capacity - len(self._entries)

    def keys(self) -> list[K]:
        """Live keys, least recently used first."""
        now = self._clock()
        return [k for k, e in self._entries.items() if e.deadline > now]

    def items(self) -> Iterator[tuple[K, V]]:
        """Live entries, least recently used first (a snapshot: the owner may change the
        buffer while iterating)."""
        now = self._clock()
        return iter([(k, e.ref) for k, e in self._entries.items() if e.deadline > now])

    def values(self) -> list[V]:
        return [v for _, v in self.items()]

    def __iter__(self) -> Iterator[K]:
        """Live keys, least recently used first (a snapshot)."""
        return iter(self.keys())

    def held(self) -> list[tuple[K, V]]:
        """Every entry, those whose lease ended but were not collected included (for an owner
        shutting down: everything it must free)."""
        return [(k, e.ref) for k, e in self._entries.items()]

    def __repr__(self) -> str:
        return (f"LookupBuffer({self.name!r}, {len(self._entries)}/{self.capacity}, "
                f"{self.overflow.value})")
