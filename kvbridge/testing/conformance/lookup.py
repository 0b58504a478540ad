"""The LookupBuffer conformance suite: a pytest class each home of a
:class:`~kvbridge.lookup.LookupBuffer` subclasses, with the buffer as that home builds it.

Usage::

    from kvbridge.testing.conformance import LookupBufferConformance

    class TestStagedPulls(LookupBufferConformance):
        def make(self, capacity, clock):       # the home's own factory, its key shape
            return staged_buffer(capacity, clock=clock)

        def key(self, i):                      # the i-th distinct key a home really uses
            return f"engine-{i}"

What is checked, with a fake clock the test moves: insert → get/in/lookup/drop_select; a
duplicate key refused and the first entry intact; leases end exactly at their deadline and an
ended lease never serves (``get``, ``in``, ``lookup``, ``drop_select``, ``extend``) even before
:meth:`~kvbridge.lookup.LookupBuffer.expire` collects it; ``extend`` moves the deadline (many
times, without the buffer growing); ``expire`` returns what ended, earliest first, once;
``lookup`` is the longest held prefix; capacity: back-pressure (``REFUSE``: ``BufferFull``,
nothing changed) or least-recently-used eviction (``EVICT_LRU``: the evicted entries returned,
``touch`` protects); hostile keys and leases (oversized, unhashable, wrong type, NaN, negative)
raise without changing anything.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvbridge.lookup import (
    BufferFull,
    DuplicateKey,
    InvalidKey,
    LookupBuffer,
    LookupMiss,
    Overflow,
)

__all__ = ["FakeClock", "LookupBufferConformance"]


class FakeClock:
    """A clock a test moves by hand (``clock.now += 1.0``)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class LookupBufferConformance:
    """Subclass with :meth:`make` (and :meth:`key`, :meth:`ref` where the home's differ)."""

    def make(self, capacity: int, clock: FakeClock) -> LookupBuffer[Any, Any]:
        raise NotImplementedError

    def key(self, i: int) -> Any:
        return f"transfer-{i}"

    def ref(self, i: int) -> Any:
        return ("ref", i)

    # -- helpers ---------------------------------------------------------------------------

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    def _buf(self, clock: FakeClock, capacity: int = 16) -> LookupBuffer[Any, Any]:
        buf = self.make(capacity, clock)
        assert isinstance(buf, LookupBuffer)
        assert buf.capacity == capacity
        return buf

    # -- tests -----------------------------------------------------------------------------

    def test_insert_get_drop_select(self, clock: FakeClock) -> None:
        buf = self._buf(clock)
        k = self.key(1)
        assert buf.insert(k, self.ref(1), lease=10.0) == []
        assert k in buf and buf.get(k) == buf[k] == self.ref(1) and len(buf) == 1
        assert buf.drop_select(k) == self.ref(1)
        assert k not in buf and len(buf) == 0
        with pytest.raises(LookupMiss):
            buf.drop_select(k)
        assert buf.get(k) is None and buf.get(k, ()) == () and buf.discard(k) is None

    def test_duplicate_key_refused_first_entry_intact(self, clock: FakeClock) -> None:
        buf = self._buf(clock)
        k = self.key(2)
        buf.insert(k, self.ref(1), lease=5.0)
        with pytest.raises(DuplicateKey):
            buf.insert(k, self.ref(2), lease=50.0)
        assert buf.get(k) == self.ref(1) and len(buf) == 1
        clock.now += 5.0
        assert buf.expire() == [(k, self.ref(1))]  # the refused insert did not extend it

    def test_an_ended_lease_never_serves_even_before_it_is_collected(
            self, clock: FakeClock) -> None:
        buf = self._buf(clock)
        k = self.key(3)
        buf.insert(k, self.ref(3), lease=2.0)
        clock.now += 1.999
        assert k in buf
        clock.now += 0.001
        assert k not in buf and buf.get(k) is None and buf.lookup([k]) == 0
        with pytest.raises(KeyError):
            buf[k]
        assert not buf.extend(k, 100.0)
        with pytest.raises(LookupMiss):
            buf.drop_select(k)
        assert len(buf) == 1  # still to be collected: the owner frees what it references
        with pytest.raises(DuplicateKey):
            buf.insert(k, self.ref(4), lease=1.0)
        assert list(buf) == [] and buf.held() == [(k, self.ref(3))]
        assert buf.expire() == [(k, self.ref(3))]
        assert buf.expire() == [] and len(buf) == 0 and buf.held() == []
        buf.insert(k, self.ref(4), lease=1.0)  # collected: the key is free again

    def test_extend_moves_the_deadline_without_growing(self, clock: FakeClock) -> None:
        buf = self._buf(clock)
        k = self.key(4)
        buf.insert(k, self.ref(4), lease=1.0)
        for _ in range(10_000):  # heartbeats
            clock.now += 0.5
            assert buf.extend(k, 1.0)
        assert len(buf._heap) < 200
        assert buf.next_deadline() == pytest.approx(clock.now + 1.0)
        clock.now += 0.99
        assert buf.expire() == [] and k in buf
        clock.now += 0.01
        assert buf.expire() == [(k, self.ref(4))]
        assert buf.next_deadline() is None

    def test_expire_returns_what_ended_earliest_first(self, clock: FakeClock) -> None:
        buf = self._buf(clock)
        for i, lease in enumerate((3.0, 1.0, 2.0, None)):
            buf.insert(self.key(i), self.ref(i), lease=lease)
        assert buf.next_deadline() == pytest.approx(clock.now + 1.0)
        clock.now += 2.5
        assert buf.expire() == [(self.key(1), self.ref(1)), (self.key(2), self.ref(2))]
        assert buf.expire(now=clock.now + 100.0) == [(self.key(0), self.ref(0))]
        assert self.key(3) in buf  # no lease: stays
        assert buf.extend(self.key(3), 1.0)
        clock.now += 1.0
        assert buf.expire() == [(self.key(3), self.ref(3))]

    def test_lookup_is_the_longest_held_prefix(self, clock: FakeClock) -> None:
        buf = self._buf(clock)
        keys = [self.key(i) for i in range(6)]
        for i in (0, 1, 2, 4):
            buf.insert(keys[i], self.ref(i), lease=10.0)
        assert buf.lookup(keys) == 3
        assert buf.lookup(keys, start=1) == 2
        assert buf.lookup(keys, start=3) == 0
        assert buf.lookup(keys[4:5]) == 1
        assert buf.lookup([]) == 0
        assert buf.lookup([[1, 2], keys[0]]) == 0  # a hostile key ends the prefix
        buf.extend(keys[0], 0.5)
        clock.now += 0.5
        assert buf.lookup(keys) == 0

    def test_capacity(self, clock: FakeClock) -> None:
        buf = self._buf(clock, capacity=4)
        for i in range(4):
            assert buf.insert(self.key(i), self.ref(i), lease=10.0) == []
        assert buf.free == 0
        if buf.overflow is Overflow.REFUSE:
            with pytest.raises(BufferFull):
                buf.insert(self.key(9), self.ref(9), lease=10.0)
            assert len(buf) == 4 and self.key(9) not in buf
            buf.drop_select(self.key(0))
            buf.insert(self.key(9), self.ref(9), lease=10.0)
        else:
            assert buf.touch([self.key(0)]) == 1  # now most recently used
            evicted = buf.insert(self.key(9), self.ref(9), lease=10.0)
            assert evicted == [(self.key(1), self.ref(1))]
            assert self.key(0) in buf and self.key(9) in buf and len(buf) == 4
            assert buf.keys()[-1] == self.key(9)

    @pytest.mark.parametrize("bad", [
        "x" * 100_000, b"y" * 100_000, ["list"], {"a": 1}, None, True, 1.5, object(),
        ("a",) * 100, (("nested",),), ("ok", ["list"]),
    ], ids=["long-str", "long-bytes", "list", "dict", "none", "bool", "float", "object",
            "long-tuple", "nested-tuple", "tuple-with-list"])
    def test_hostile_keys_raise_and_change_nothing(self, clock: FakeClock, bad: Any) -> None:
        buf = self._buf(clock)
        buf.insert(self.key(0), self.ref(0), lease=10.0)
        with pytest.raises(InvalidKey) as err:
            buf.insert(bad, self.ref(1), lease=10.0)
        assert buf.name in str(err.value)
        assert len(buf) == 1 and buf.get(self.key(0)) == self.ref(0)
        assert bad not in buf
        assert buf.get(bad) is None and not buf.extend(bad, 1.0) and buf.discard(bad) is None
        with pytest.raises(LookupMiss):
            buf.drop_select(bad)

    @pytest.mark.parametrize("lease", [math.nan, -1.0, math.inf, "10", True])
    def test_hostile_leases_raise_and_change_nothing(self, clock: FakeClock,
                                                     lease: Any) -> None:
        buf = self._buf(clock)
        buf.insert(self.key(0), self.ref(0), lease=10.0)
        with pytest.raises(ValueError):
            buf.insert(self.key(1), self.ref(1), lease=lease)
        with pytest.raises(ValueError):
            buf.extend(self.key(0), lease)
        assert len(buf) == 1 and self.key(1) not in buf
        clock.now += 10.0
        assert buf.expire() == [(self.key(0), self.ref(0))]

    def test_many_keys(self, clock: FakeClock) -> None:
        buf = self._buf(clock, capacity=2048)
        for i in range(2048):
            buf.insert(self.key(i), self.ref(i), lease=float(i % 7 + 1))
        clock.now += 3.5
        ended = buf.expire()
        assert len(ended) == sum(1 for i in range(2048) if i % 7 + 1 <= 3)
        assert all(buf.get(self.key(i)) == self.ref(i) for i in range(2048) if i % 7 + 1 > 3)

