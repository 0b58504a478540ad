"""The mooncake backend against a real second process over 127.0.0.1 (Transfer Engine, TCP).

Every transfer test checks every byte. Backend-specific behaviour lives here: splitting lists
larger than the engine's batch limit, a dead peer failing fast, metadata and option errors,
and the one-line install hints. The shared contract is in
backends/kvbridge_mooncake/tests/test_conformance.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.errors import (
    ConfigError,
    DescriptorError,
    MessageError,
    PeerUnreachable,
    TransferFailed,
    TransportClosed,
    UnknownPeer,
)
from kvbridge.transport import HandleState, MemoryRegion, Op

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None, reason="mooncake is not installed"
    ),
]

SIZE = 8 << 20


def pattern(seed: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _peer_main(cmd_q: Any, res_q: Any, options: dict[str, Any], seed: int) -> None:
    """A second engine rank: owns a patterned buffer and answers commands."""
    from kvbridge_mooncake import MooncakeTransport

    t = MooncakeTransport("peer", options)
    buf = pattern(seed)
    meta = t.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    res_q.put((meta, buf.ctypes.data))
    received: list[tuple[str, bytes]] = []
    while True:
        cmd, arg = cmd_q.get()
        if cmd == "notifs":  # wait until `arg` notifications arrived (or 10 s)
            deadline = time.monotonic() + 10
            while len(received) < arg and time.monotonic() < deadline:
                received += t.get_notifications()
                time.sleep(0.01)
            res_q.put(list(received))
            received.clear()
        elif cmd == "digest":
            res_q.put(hashlib.blake2b(buf.tobytes()).hexdigest())
        elif cmd == "add_peer":
            res_q.put(t.add_peer(*arg))
        elif cmd == "invite":
            res_q.put(t.invite(arg))
        elif cmd == "notify":
            peer, msg = arg
            t.send_notification(peer, msg)
            res_q.put(True)
        elif cmd == "stop":
            t.close()
            res_q.put(True)
            return


class Peer:
    """Handle on the peer process; ``call`` sends one command and returns its answer."""

    def __init__(self, options: dict[str, Any] | None = None, seed: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.cmd_q, self.res_q = ctx.Queue(), ctx.Queue()
        self.seed = seed
        self.proc = ctx.Process(
            target=_peer_main, args=(self.cmd_q, self.res_q, options or {}, seed), daemon=True
        )
        self.proc.start()
        self.meta, self.base = self.res_q.get(timeout=60)
        self.data = pattern(seed)

    def call(self, cmd: str, arg: Any = None, timeout: float = 30) -> Any:
        self.cmd_q.put((cmd, arg))
        return self.res_q.get(timeout=timeout)

    def invite(self, peer_metadata: bytes | None = None) -> bytes:
        """A fresh proof the peer's transport attested (:meth:`Transport.invite`)."""
        return bytes(self.call("invite", peer_metadata))

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=15)
            except Exception:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def local() -> Iterator[tuple[Any, np.ndarray]]:
    from kvbridge_mooncake import MooncakeTransport

    t = MooncakeTransport("local", {})
    buf = np.zeros(SIZE, dtype=np.uint8)
    t.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    try:
        yield t, buf
    finally:
        t.close()


def scattered(
    base_l: int, base_r: int, block: int, count: int, seed: int = 7
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` blocks at permuted slots on both sides (no two descriptors touch)."""
    slots = SIZE // block
    rng = np.random.default_rng(seed)
    ls = rng.permutation(slots)[:count]
    rs = rng.permutation(slots)[:count]
    loc = np.stack([base_l + ls * block, np.full(count, block), np.zeros(count)], 1)
    rem = np.stack([base_r + rs * block, np.full(count, block), np.zeros(count)], 1)
    return loc.astype(np.int64), rem.astype(np.int64)


def test_read_every_byte_and_notification(local: Any, peer: Peer) -> None:
    t, buf = local
    name = t.add_peer(peer.meta, peer.invite())
    assert name == "peer"
    loc, rem = scattered(buf.ctypes.data, peer.base, 64 << 10, 100)
    h = t.transfer(Op.READ, name, loc, rem, notification=b"read-done", timeout=30)
    assert h.state is HandleState.DONE
    for (la, ln, _), (ra, _, _) in zip(loc, rem, strict=True):
        lo, ro = la - buf.ctypes.data, ra - peer.base
        assert np.array_equal(buf[lo : lo + ln], peer.data[ro : ro + ln])
    assert peer.call("notifs", 1) == [("local", b"read-done")]


def test_write_every_byte(local: Any, peer: Peer) -> None:
    t, buf = local
    buf[:] = pattern(99)
    name = t.add_peer(peer.meta, peer.invite())
    loc, rem = scattered(buf.ctypes.data, peer.base, 32 << 10, 120)
    t.transfer(Op.WRITE, name, loc, rem, notification=b"w", timeout=30)
    expected = peer.data.copy()
    for (la, ln, _), (ra, _, _) in zip(loc, rem, strict=True):
        lo, ro = la - buf.ctypes.data, ra - peer.base
        expected[ro : ro + ln] = buf[lo : lo + ln]
    assert peer.call("notifs", 1) == [("local", b"w")]  # after the bytes, so digest is final
    assert peer.call("digest") == hashlib.blake2b(expected.tobytes()).hexdigest()


@pytest.mark.parametrize("options", [{}, {"max_batch": 64, "window": 3}])
def test_lists_beyond_the_engine_batch_limit_are_split(peer: Peer, options: dict[str, Any]) -> None:
    from kvbridge_mooncake import MooncakeTransport

    with MooncakeTransport("local", options) as t:
        buf = np.zeros(SIZE, dtype=np.uint8)
        t.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
        name = t.add_peer(peer.meta, peer.invite())
        loc, rem = scattered(buf.ctypes.data, peer.base, 4096, 1500, seed=3)
        h = t.transfer(Op.READ, name, loc, rem, timeout=60)
        assert h.count == 1500
        for (la, ln, _), (ra, _, _) in zip(loc, rem, strict=True):
            lo, ro = la - buf.ctypes.data, ra - peer.base
            assert np.array_equal(buf[lo : lo + ln], peer.data[ro : ro + ln])


def test_notifications_both_ways(local: Any, peer: Peer) -> None:
    t, _ = local
    name = t.add_peer(peer.meta, peer.invite(t._metadata()))
    assert peer.call("add_peer", (t._metadata(), t.invite(peer.meta))) == "local"
    for i in range(5):
        t.send_notification(name, b"to-peer-%d" % i)
    assert peer.call("notifs", 5) == [("local", b"to-peer-%d" % i) for i in range(5)]
    for i in range(3):
        peer.call("notify", ("local", b"to-local-%d" % i))
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        got += t.get_notifications()
        time.sleep(0.01)
    assert got == [("peer", b"to-local-%d" % i) for i in range(3)]


def test_validation_before_anything_is_posted(local: Any, peer: Peer) -> None:
    t, buf = local
    name = t.add_peer(peer.meta, peer.invite())
    good = [[buf.ctypes.data, 4096, 0]]
    with pytest.raises(DescriptorError, match="outside registered memory"):
        t.submit(Op.READ, name, good, [[peer.base + SIZE - 100, 4096, 0]])
    with pytest.raises(DescriptorError, match="local"):
        t.submit(Op.READ, name, [[buf.ctypes.data + SIZE, 4096, 0]], [[peer.base, 4096, 0]])
    with pytest.raises(UnknownPeer):
        t.submit(Op.READ, "nobody", good, [[peer.base, 4096, 0]])
    with pytest.raises(MessageError):
        t.add_peer(b"\x00not metadata", peer.invite())
    assert peer.call("notifs", 0) == []  # nothing was sent


def test_dead_peer_fails_fast(local: Any) -> None:
    t, buf = local
    p = Peer(seed=5)
    try:
        name = t.add_peer(p.meta, p.invite())
        proof = p.invite()  # for the handshake below, attested while p lived
        loc, rem = scattered(buf.ctypes.data, p.base, 64 << 10, 16)
        t.transfer(Op.READ, name, loc, rem, timeout=30)  # the session works first
        p.proc.kill()
        p.proc.join(10)
        start = time.monotonic()
        with pytest.raises(TransferFailed, match="peer"):
            t.transfer(Op.WRITE, name, loc, rem, notification=b"never", timeout=20)
        assert time.monotonic() - start < 15
        # a fresh transport that never talked to it fails fast too: the handshake (a READ of
        # the dead peer's proof board) finds it unreachable, and nothing is loaded
        from kvbridge_mooncake import MooncakeTransport

        with MooncakeTransport("other", {}) as t2:
            t2.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
            start = time.monotonic()
            with pytest.raises(PeerUnreachable, match="unreachable"):
                t2.add_peer(p.meta, proof)
            assert time.monotonic() - start < 15
            with pytest.raises(UnknownPeer):
                t2.submit(Op.READ, name, loc, rem)
    finally:
        p.stop()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: the signal is delivered
    asynchronously, and a peer thread still running could serve the next READ (once in
    CI, the likely cause: the READ completed and the timeout never came)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # the thread ended
        if states and all(st in "Tt" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"peer {pid} did not stop within 10 s")


def test_hung_peer_is_a_timeout_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped (not dead) peer: the engine's timeout ends the transfer as FAILED, never DONE."""
    from kvbridge_mooncake import MooncakeTransport

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # the engine's minimum; read at construction
    p = Peer(seed=9)
    t = MooncakeTransport("local", {})
    try:
        buf = np.zeros(SIZE, dtype=np.uint8)
        t.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
        name = t.add_peer(p.meta, p.invite())
        loc, rem = scattered(buf.ctypes.data, p.base, 256 << 10, 16)
        t.transfer(Op.READ, name, loc, rem, timeout=30)
        _stop(p.proc.pid)
        start = time.monotonic()
        h = t.submit(Op.READ, name, loc, rem, notification=b"never")
        with pytest.raises(TransferFailed):
            t.wait(h, 1.0)  # TransferTimeout (a TransferFailed): the handle keeps running
        assert h.state is HandleState.PENDING
        assert t.wait(h, 40) is HandleState.FAILED
        assert "timed out" in (h.error or ""), h.error
        assert time.monotonic() - start < 40
        os.kill(p.proc.pid, signal.SIGCONT)
        assert p.call("notifs", 0) == []  # a failed transfer sends no notification
    finally:
        if p.proc.is_alive():
            os.kill(p.proc.pid, signal.SIGCONT)
        t.close()
        p.stop()


def test_close_is_idempotent_and_final(peer: Peer) -> None:
    from kvbridge_mooncake import MooncakeTransport

    t = MooncakeTransport("local", {})
    buf = np.zeros(1 << 20, dtype=np.uint8)
    t.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    name = t.add_peer(peer.meta, peer.invite())
    h = t.submit(Op.READ, name, [[buf.ctypes.data, 1 << 20, 0]], [[peer.base, 1 << 20, 0]])
    t.close()
    t.close()
    assert h.state.terminal  # finished or failed, never left pending
    with pytest.raises(TransportClosed):
        t.submit(Op.READ, name, [[buf.ctypes.data, 4096, 0]], [[peer.base, 4096, 0]])


def test_options_are_checked() -> None:
    from kvbridge_mooncake import MooncakeTransport

    with pytest.raises(ConfigError, match="protocol"):
        MooncakeTransport("x", {"protocol": "carrier-pigeon"})
    with pytest.raises(ConfigError, match="max_batch"):
        MooncakeTransport("x", {"max_batch": 0})


def test_registry_creates_it() -> None:
    from kvbridge import registry

    t = registry.create("mooncake", "via-registry", {})
    try:
        assert t.name == "mooncake"
        assert t.probe().startswith("ok")
    finally:
        t.close()


_BLOCKER = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "mooncake.engine":
            raise ImportError({msg!r})
        if name == "mooncake" and {missing!r}:
            raise ModuleNotFoundError("No module named 'mooncake'", name="mooncake")
sys.meta_path.insert(0, Block())
from kvbridge.errors import BackendUnavailable
from kvbridge_mooncake import MooncakeTransport
try:
    MooncakeTransport("x", {{}})
except BackendUnavailable as exc:
    print(exc)
"""


@pytest.mark.parametrize(
    "msg, missing, hint",
    [
        ("", True, "pip install mooncake-transfer-engine-non-cuda"),
        (
            "libibverbs.so.1: cannot open shared object file: No such file or directory",
            False,
            "apt-get install -y libibverbs1",
        ),
        ("libcudart.so.12: cannot open shared object file", False, "non-cuda"),
    ],
)
def test_missing_dependency_is_one_clear_line(msg: str, missing: bool, hint: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _BLOCKER.format(msg=msg, missing=missing)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout + out.stderr
    assert hint in lines[0]


# -- raw session (the paired bench's raw column) --------------------------------------------------


@pytest.mark.timeout(180)
def test_raw_session_alternates_ops_and_verifies() -> None:
    from kvbridge_mooncake.bench import raw_bench, raw_session

    with raw_session(2 << 20, seed=3) as session:
        for op in ("write", "read"):
            for block in (65536, 262144):
                session.reset(op, block)  # zeroes the destination: verify proves the copy
                assert session.run(op, block) > 0
                session.verify(op, block)
        session._local[7] ^= 0xFF  # noqa: SLF001 - corrupt one byte on purpose
        with pytest.raises(TransferFailed, match="bytes differ"):
            session.verify("read", 65536)
        with pytest.raises(ConfigError):
            session.run("copy", 65536)
    assert raw_bench(65536, 1 << 20, "read", 1) > 0
