"""The composer beyond conformance: member parsing, hostile envelopes, and member failures.

Members here are real in-process ``memory`` transports (two per side, named ``a`` and ``b``), one
of them wrapped in :class:`~kvbridge.testing.faults.FaultyTransport` where a failure is needed,
so every byte still really moves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.blocks import prepare_blocks, submit_blocks
from kvbridge.config import Config
from kvbridge.errors import (
    ConfigError,
    DescriptorError,
    KVBridgeError,
    MessageError,
    PeerUnreachable,
    TransportClosed,
)
from kvbridge.layout import KVLayout, KVPlane
from kvbridge.testing.faults import FaultyTransport
from kvbridge.transport import HandleState, MemoryRegion, Op, Transport
from kvbridge.transports.compose import ComposeTransport
from kvbridge.transports.compose_spec import MAX_MEMBERS, ComposeMetadata, parse_members
from kvbridge.transports.memory import MemoryTransport

pytestmark = [pytest.mark.timeout(60)]

SIZE = 1 << 16


# -- member parsing ------------------------------------------------------------------------------


def test_members_classified_in_order() -> None:
    specs = parse_members(["shm", {"name": "nixl", "backends": ["UCX"]}, "lmcache", "disk"])
    assert [(s.name, s.kind) for s in specs] == [
        ("shm", "transport"), ("nixl", "transport"), ("lmcache", "tier"), ("disk", "tier")]
    assert specs[1].options == {"backends": ["UCX"]}


@pytest.mark.parametrize("raw, needle", [
    (None, "non-empty list"),
    ([], "non-empty list"),
    ("shm,nixl", "non-empty list"),
    ([42], "members[0]: expected a member name"),
    ([{"backends": []}], "members[0]: expected a member name"),
    (["shm", "nixl", "shm"], "members[2]: member 'shm' listed twice"),
    (["compose"], "members[0]: a compose backend cannot contain compose"),
    (["shm", "nicl"], "members[1]: unknown member 'nicl'"),
    (["lmcache", "disk"], "no transport member"),
    ([{"name": "shm", "kind": "tier"}], "members[0]: unknown member 'shm'"),
    (["shm"] * (MAX_MEMBERS + 1), f"at most {MAX_MEMBERS} members"),
])
def test_bad_members_name_the_entry(raw: Any, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_members(raw)
    assert needle in str(err.value)


def test_config_hands_tier_members_to_offload() -> None:
    cfg = Config.load({"backend": "compose",
                       "backend_options": {"members": ["shm", {"name": "disk", "path": "/x"}],
                                           "secret_free": 1},
                       "offload": {"tiers": ["dram"]}}, env={})
    off = cfg.offload_config()
    assert [t.name for t in off.tiers] == ["dram", "disk"]
    assert off.tiers[1].options == {"path": "/x"}
    with pytest.raises(ConfigError, match="members"):
        Config.load({"backend": "compose"}, env={})
    env = {"KVBRIDGE_BACKEND": "compose", "KVBRIDGE_BACKEND_OPTIONS": '{"members": ["shm"]}'}
    assert Config.load({}, env=env).compose_members()[0].name == "shm"


def test_unloadable_member_fails_with_its_name() -> None:
    with pytest.raises(KVBridgeError, match="compose member 'shm': iov_max"):
        ComposeTransport("x", {"members": ["memory", {"name": "shm", "iov_max": -3}]})


# -- two composes in this process ----------------------------------------------------------------


class Side:
    def __init__(self, agent: str, a: Transport | None = None) -> None:
        self.buf = np.zeros(SIZE, dtype=np.uint8)
        self.a = a or MemoryTransport(agent)
        self.b = MemoryTransport(agent)
        self.t = ComposeTransport(agent, members=[("a", self.a), ("b", self.b)])
        self.meta = self.t.register_memory([MemoryRegion(self.buf.ctypes.data, SIZE)])

    def descs(self, offset: int = 0, n: int = 4096) -> list[list[int]]:
        return [[self.buf.ctypes.data + offset, n, 0]]


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    here, there = Side("here"), Side("there")
    yield here, there
    here.t.close()
    there.t.close()


def connect(here: Side, there: Side) -> str:
    name = here.t.add_peer(there.meta, there.t.invite(here.meta))
    assert there.t.add_peer(here.meta, here.t.invite(there.meta)) == "here"
    return name


def test_first_member_carries_and_all_hold_the_peer(pair: tuple[Side, Side]) -> None:
    here, there = pair
    peer = connect(here, there)
    assert peer == "there"
    assert here.t.member_for(peer) == "a"
    assert here.t.members_for(peer) == ["a", "b"]
    there.buf[:4096] = 7
    assert here.t.transfer(Op.READ, peer, here.descs(), there.descs()).state is HandleState.DONE
    assert (here.buf[:4096] == 7).all()


def test_failed_read_is_reposted_on_the_next_member() -> None:
    here = Side("here", FaultyTransport(MemoryTransport("here"), fail=1))
    there = Side("there")
    try:
        peer = connect(here, there)
        there.buf[:] = np.arange(SIZE) % 251
        h = here.t.submit(Op.READ, peer, here.descs(), there.descs(), b"read-done")
        assert here.t.wait(h, 10) is HandleState.DONE
        np.testing.assert_array_equal(here.buf[:4096], there.buf[:4096])
        assert h.attempts and h.attempts[0].startswith("a: ")
        assert here.t.member_for(peer) == "b"  # demoted for later transfers
        assert ("fail", 1) in here.a.injected  # type: ignore[attr-defined]
        got = _notes(there.t, 1)
        assert got == [("here", b"read-done")]  # once, from the retry that succeeded
    finally:
        here.t.close()
        there.t.close()


def test_failed_write_is_never_retried() -> None:
    here = Side("here", FaultyTransport(MemoryTransport("here"), fail=1))
    there = Side("there")
    try:
        peer = connect(here, there)
        h = here.t.submit(Op.WRITE, peer, here.descs(), there.descs(), b"landed")
        assert here.t.wait(h, 10) is HandleState.FAILED
        assert h.error is not None and h.error.startswith("a: ")
        assert len(h.attempts) == 1
        assert here.t.member_for(peer) == "b"
        assert _notes(there.t, 0) == []  # a failed WRITE's notification is never sent
        here.buf[:4096] = 9
        h2 = here.t.transfer(Op.WRITE, peer, here.descs(), there.descs(), b"second")
        assert h2.state is HandleState.DONE and (there.buf[:4096] == 9).all()
    finally:
        here.t.close()
        there.t.close()


def test_member_that_raises_falls_through_before_posting(pair: tuple[Side, Side]) -> None:
    here, there = pair
    peer = connect(here, there)
    here.a.close()
    there.buf[:4096] = 5
    h = here.t.transfer(Op.READ, peer, here.descs(), there.descs())
    assert h.state is HandleState.DONE and (here.buf[:4096] == 5).all()
    assert here.t.member_for(peer) == "b"
    here.t.send_notification(peer, b"hi")
    assert _notes(there.t, 1) == [("here", b"hi")]
    here.b.close()
    with pytest.raises(PeerUnreachable, match="every member failed"):
        here.t.submit(Op.READ, peer, here.descs(), there.descs())


def _layout(side: Side) -> KVLayout:
    return KVLayout((KVPlane("kv", side.buf.ctypes.data, 4096, 4096),), SIZE // 4096, 16, "u8")


def test_blocks_fall_through_and_retry_like_descriptors() -> None:
    """The block path: a failed READ is re-posted on the next member (which prepares the pair
    then), a member that raises (closed: it cannot prepare) is passed over, a wrapper member
    without the block path gets descriptor arrays."""
    here = Side("here", FaultyTransport(MemoryTransport("here"), fail=1))
    there = Side("there")
    try:
        peer = connect(here, there)
        there.buf[:] = np.arange(SIZE) % 251
        bp = prepare_blocks(here.t, peer, _layout(here), _layout(there))
        h = submit_blocks(here.t, Op.READ, bp, [0, 1], [3, 2], b"read-done")
        assert here.t.wait(h, 10) is HandleState.DONE
        np.testing.assert_array_equal(here.buf[:4096], there.buf[3 * 4096:4 * 4096])
        np.testing.assert_array_equal(here.buf[4096:8192], there.buf[2 * 4096:3 * 4096])
        assert h.attempts[0].startswith("a: ") and here.t.member_for(peer) == "b"
        assert _notes(there.t, 1) == [("here", b"read-done")]
        here.b.close()
        with pytest.raises(PeerUnreachable, match="every member failed"):
            submit_blocks(here.t, Op.READ, bp, [0], [1])
    finally:
        here.t.close()
        there.t.close()


def test_blocks_member_that_raises_falls_through(pair: tuple[Side, Side]) -> None:
    here, there = pair
    peer = connect(here, there)
    bp = prepare_blocks(here.t, peer, _layout(here), _layout(there))
    here.a.close()
    there.buf[4096:8192] = 6
    h = submit_blocks(here.t, Op.READ, bp, [5], [1])
    assert here.t.wait(h, 10) is HandleState.DONE
    assert (here.buf[5 * 4096:6 * 4096] == 6).all() and here.t.member_for(peer) == "b"
    longer = KVLayout(_layout(there).planes, 4 * SIZE // 4096, 16, "u8")
    with pytest.raises(DescriptorError):  # the caller's error: no member tried after it
        submit_blocks(here.t, Op.READ, prepare_blocks(here.t, peer, _layout(here), longer),
                      [0], [SIZE // 4096 + 1])


def test_descriptor_errors_are_not_retried(pair: tuple[Side, Side]) -> None:
    here, there = pair
    peer = connect(here, there)
    with pytest.raises(DescriptorError):
        here.t.submit(Op.READ, peer, here.descs(n=SIZE * 2), there.descs(n=SIZE * 2))
    assert here.t.member_for(peer) == "a"


def test_close_is_idempotent_and_refuses_work(pair: tuple[Side, Side]) -> None:
    here, there = pair
    peer = connect(here, there)
    here.t.close()
    here.t.close()
    assert here.a.closed and here.b.closed
    with pytest.raises(TransportClosed):
        here.t.submit(Op.READ, peer, here.descs(), there.descs())


def test_member_refusing_memory_is_dropped_at_first_registration() -> None:
    class NoDram(MemoryTransport):
        def register_memory(self, regions: Any) -> bytes:
            raise DescriptorError("no DRAM here")

    buf = np.zeros(SIZE, dtype=np.uint8)
    t = ComposeTransport("x", members=[("picky", NoDram("x")), ("b", MemoryTransport("x"))])
    try:
        meta = t.register_memory([MemoryRegion(buf.ctypes.data, SIZE)])
        assert t.member_names == ["b"]
        assert [n for n, _ in msgspec.msgpack.decode(meta, type=ComposeMetadata).members] == ["b"]
    finally:
        t.close()


# -- hostile envelopes ---------------------------------------------------------------------------


def _envelope(**kw: Any) -> bytes:
    fields: dict[str, Any] = {"v": 1, "agent": "evil", "members": [("a", b"x")]}
    fields.update(kw)
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize("blob, needle", [
    (b"", "empty"),
    (b"\xc1garbage", "malformed"),
    (_envelope(v=2), "'v'"),
    (_envelope(agent=""), "'agent'"),
    (_envelope(agent="x" * 300), "'agent'"),
    (_envelope(members=[]), "'members'"),
    (_envelope(members=[("a", b"1")] * 2), "duplicate"),
    (_envelope(members=[(f"m{i}", b"1") for i in range(MAX_MEMBERS + 1)]), "'members'"),
    (_envelope(extra=1), "malformed"),
    (_envelope(members=[("a", b"not msgpack for memory")]), "compose peer 'evil'"),
])
def test_hostile_envelope_is_a_message_error(pair: tuple[Side, Side], blob: bytes,
                                             needle: str) -> None:
    here, there = pair
    with pytest.raises(MessageError) as err:
        here.t.add_peer(blob, there.t.invite(here.meta))
    assert needle in str(err.value)


def test_oversized_envelope_refused_before_decoding(pair: tuple[Side, Side]) -> None:
    here, there = pair
    with pytest.raises(MessageError, match="bytes"):
        here.t.add_peer(b"\x00" * (MAX_MEMBERS * (8 << 20) + 1), there.t.invite(here.meta))


def test_no_shared_member_names_each_reason(pair: tuple[Side, Side]) -> None:
    here, there = pair
    with pytest.raises(PeerUnreachable) as err:
        here.t.add_peer(_envelope(members=[("nixl", b"x")]), there.t.invite(here.meta))
    assert "a: the peer has no such member" in str(err.value)
    assert "b: the peer has no such member" in str(err.value)


def _notes(t: Transport, want: int, timeout: float = 5.0) -> list[tuple[str, bytes]]:
    import time

    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + (timeout if want else 0.3)
    while time.monotonic() < deadline:
        got.extend(t.get_notifications())
        if want and len(got) >= want:
            break
        time.sleep(0.01)
    return got


def test_capabilities_are_derived_from_members() -> None:
    from kvbridge.transport import Capabilities

    class ReadOnlyFar(MemoryTransport):
        capabilities = Capabilities(write=False, cross_host=True, shared_core_safe=False)

    t = ComposeTransport("x", members=[("m", MemoryTransport("x")), ("r", ReadOnlyFar("x"))])
    try:
        caps = t.capabilities
        assert caps.read and not caps.write  # any member may carry a peer: all must write
        assert caps.cross_host  # one member reaches other hosts
        assert not caps.device_memory
        assert not caps.shared_core_safe  # one member can stall on a shared core: warn
    finally:
        t.close()
    t = ComposeTransport("y", {"members": ["memory", "shm"]})
    try:
        assert t.capabilities == Capabilities(read=True, write=True, notifications=True,
                                              device_memory=False, cross_host=False,
                                              shared_core_safe=True)
        assert t.member_names == ["memory", "shm"]
    finally:
        t.close()
