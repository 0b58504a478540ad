"""The LookupBuffer contract (kvbridge.lookup), on the bare buffer with each overflow policy.

Each home of a buffer (staged pulls, the push table, receives, offload tiers) runs the same
conformance class with the buffer as it builds it: see the tests of those homes.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.lookup import LookupBuffer, LookupMiss, Overflow
from kvbridge.testing.conformance import FakeClock, LookupBufferConformance


class TestRefusing(LookupBufferConformance):
    def make(self, capacity: int, clock: FakeClock) -> LookupBuffer[Any, Any]:
        return LookupBuffer("refusing", capacity, clock=clock)


class TestEvicting(LookupBufferConformance):
    def make(self, capacity: int, clock: FakeClock) -> LookupBuffer[Any, Any]:
        return LookupBuffer("evicting", capacity, overflow=Overflow.EVICT_LRU, clock=clock)

    def key(self, i: int) -> Any:
        return (f"content-{i:04d}", i)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        LookupBuffer("x", 0)


def test_a_miss_reads_plainly() -> None:
    buf: LookupBuffer[str, int] = LookupBuffer("plain", 1)
    with pytest.raises(LookupMiss) as err:
        buf.drop_select("k")
    assert str(err.value) == "plain: nothing held under 'k'"


def test_touch_orders_a_prefix_head_last() -> None:
    buf: LookupBuffer[str, int] = LookupBuffer("lru", 3, overflow=Overflow.EVICT_LRU)
    for k in "abc":
        buf.insert(k, ord(k))
    assert buf.touch(["a", "b", "zz"]) == 2
    assert buf.keys() == ["c", "b", "a"]
    assert buf.insert("d", 0) == [("c", ord("c"))]


class TestOffloadTierIndex(LookupBufferConformance):
    """The scheduler's view of a managed offload tier (kvbridge.offload.manager.tier_index)."""

    def make(self, capacity: int, clock: FakeClock) -> LookupBuffer[Any, Any]:
        from kvbridge.offload.index import tier_index
        return tier_index("dram", capacity, clock=clock)

    def key(self, i: int) -> Any:
        from kvbridge.offload.keys import tier_key
        return tier_key(f"block-{i}", "layout", 0, 1)

    def ref(self, i: int) -> Any:
        return None


def test_offload_hold_evicts_a_chain_from_its_tail() -> None:
    from kvbridge.offload.index import hold, tier_index
    index = tier_index("dram", 4)
    assert hold(index, ["a", "b", "c"], [b"ha", b"hb", b"hc"]) == []
    assert hold(index, ["x", "y"]) == [("c", b"hc")]  # 5 keys into 4: the chain's tail goes
    assert index.keys() == ["b", "a", "y", "x"]
    assert hold(index, ["a"]) == [] and index.keys()[-1] == "a"
    assert index["a"] == b"ha"  # touched without a hash: it keeps the one it has
    hold(index, ["y"], [b"hy"])  # a hash learnt later is kept
    assert index["y"] == b"hy" and index.keys()[-1] == "y"


class TestStagedPulls(LookupBufferConformance):
    """P's staged pulls (kvbridge.scheduling.pull.staged_buffer), keyed by transfer id."""

    def make(self, capacity: int, clock: FakeClock) -> LookupBuffer[Any, Any]:
        from kvbridge.scheduling.pull import staged_buffer
        return staged_buffer(capacity, clock=clock)

    def key(self, i: int) -> Any:
        return f"prefill-engine-0-cmpl-{i:08x}-0"


class TestPushTable(LookupBufferConformance):
    """P's pushes (kvbridge.scheduling.push_state.push_table), keyed by transfer id."""

    def make(self, capacity: int, clock: FakeClock) -> LookupBuffer[Any, Any]:
        from kvbridge.scheduling.push_state import push_table
        return push_table(capacity, clock=clock)

    def key(self, i: int) -> Any:
        return f"proxy-{i:032x}"


class TestOffloadLookups(LookupBufferConformance):
    """One rank's staged tier lookups (kvbridge.offload.manager.staging_buffer)."""

    def make(self, capacity: int, clock: FakeClock) -> LookupBuffer[Any, Any]:
        from kvbridge.offload.manager import staging_buffer
        return staging_buffer(capacity, clock=clock)

    def key(self, i: int) -> Any:
        return f"lookup-cmpl-{i}-0"


class TestReceives(LookupBufferConformance):
    """D's receives, pull and push (kvbridge.scheduling.receive.receive_table)."""

    def make(self, capacity: int, clock: FakeClock) -> LookupBuffer[Any, Any]:
        from kvbridge.scheduling.receive import receive_table
        return receive_table(capacity, clock=clock)

    def ref(self, i: int) -> Any:
        return [("part", i)]
