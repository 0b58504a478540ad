"""LookupBuffer: keyed hand-off with leases, full-scan expiry and back-pressure."""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge.errors import KVBridgeError, LookupBufferFull
from kvbridge.lookup_buffer import LookupBuffer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_insert_then_drop_select_returns_once() -> None:
    buf: LookupBuffer[str, int] = LookupBuffer()
    buf.insert("a", 1, lease_s=10)
    assert "a" in buf and len(buf) == 1
    assert buf.drop_select("a") == 1
    assert buf.drop_select("a") is None
    assert len(buf) == 0


def test_drop_select_waits_for_the_other_side() -> None:
    buf: LookupBuffer[str, int] = LookupBuffer()
    threading.Timer(0.05, lambda: buf.insert("late", 7, lease_s=10)).start()
    assert buf.drop_select("late", timeout=5) == 7


def test_duplicate_key_is_refused() -> None:
    buf: LookupBuffer[str, int] = LookupBuffer()
    buf.insert("a", 1, lease_s=10)
    with pytest.raises(KVBridgeError, match="already present"):
        buf.insert("a", 2, lease_s=10)


def test_expiry_scans_every_entry_not_only_the_oldest() -> None:
    clock = FakeClock()
    buf: LookupBuffer[str, int] = LookupBuffer(clock=clock)
    buf.insert("long", 1, lease_s=100)  # inserted first, lives longest
    buf.insert("short", 2, lease_s=1)
    buf.insert("mid", 3, lease_s=5)
    clock.now = 2
    assert buf.expire() == [("short", 2)]
    clock.now = 6
    assert buf.expire() == [("mid", 3)]
    assert buf.next_deadline() == 100


def test_extend_renews_a_lease() -> None:
    clock = FakeClock()
    buf: LookupBuffer[str, int] = LookupBuffer(clock=clock)
    buf.insert("a", 1, lease_s=1)
    clock.now = 0.9
    assert buf.extend("a", 1)
    clock.now = 1.5
    assert buf.expire() == []
    assert not buf.extend("missing", 1)


def test_capacity_gives_back_pressure() -> None:
    buf: LookupBuffer[str, int] = LookupBuffer(capacity=1)
    buf.insert("a", 1, lease_s=10)
    with pytest.raises(LookupBufferFull, match="full"):
        buf.insert("b", 2, lease_s=10, timeout=0.05)
    threading.Timer(0.05, lambda: buf.drop_select("a")).start()
    t0 = time.monotonic()
    buf.insert("b", 2, lease_s=10, timeout=5)  # waits until "a" leaves
    assert time.monotonic() - t0 < 5
    assert buf.peek("b") == 2


def test_bad_capacity() -> None:
    with pytest.raises(KVBridgeError):
        LookupBuffer(capacity=0)
