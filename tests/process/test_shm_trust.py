"""shm gives memory only to proven peers and takes it back when they die (issue 25, part 3).

../shared/security-pocs/poc_memfd_nonpeer_write.sh: a process of the engine's uid that is not
a peer (another container of the pod, a process in another PID namespace, where ptrace and CMA
fail) asked the listener for its memfd and rewrote the KV cache. poc_memfd_dead_peer_leak.py:
after P was killed, D kept P's whole KV cache mapped until it happened to forget the peer.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.errors import PeerError
from kvbridge.testing.agents import AgentProcess, LocalAgent
from kvbridge.testing.handoffs import FAST, pull, send
from kvbridge.transport import MemoryRegion
from kvbridge.transports.shm import ShmTransport
from kvbridge.transports.shm import rangecopy as _rangecopy

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(_rangecopy.load() is None,
                       reason="range copy not built (no C compiler at install)"),
]

MAPPED = {**FAST, "backend": "shm", "backend_options": {"map_memory": True}}

# A same-uid process that is not a peer: finds every kvbridge shm listener in /proc/net/unix,
# asks each for its registration and memfds (with whatever proof it can make up, or one it
# stole for another process), and tries to map and overwrite what it gets.
ATTACKER = textwrap.dedent('''
    import json, mmap, os, socket, sys
    from kvbridge.messages import Codec, PipeFrame
    from kvbridge.transports.shm import _Query, _reg_decoder, _encoder, _Registration

    proof = bytes.fromhex(sys.argv[1]) if len(sys.argv) > 1 else os.urandom(32)
    names = [l.split()[-1] for l in open("/proc/net/unix") if "@kvbridge-shm-" in l]
    out = {"listeners": len(set(names)), "fds": 0, "registrations": 0, "written": 0,
           "refused": []}
    for name in set(names):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect("\\0" + name[1:])
            try:
                query = _Query(proof=proof, fds=True)
            except TypeError:  # the protocol of 84a1d95 (before proofs): the old attack
                query = _Query(challenge=os.urandom(16), fds=True)
            req = Codec(None).encode(PipeFrame(seq=0, payload=_encoder.encode(query)))
            s.sendall(len(req).to_bytes(4, "big") + req)
            data, fds = b"", []
            while True:
                msg, got, _, _ = socket.recv_fds(s, 1 << 16, 16)
                fds += got
                if not msg:
                    break
                data += msg
        except OSError as exc:
            out["refused"].append(str(exc))
            continue
        finally:
            s.close()
        out["fds"] += len(fds)
        try:
            reg = _reg_decoder.decode(Codec(None).decode(data[4:]).payload)
        except Exception as exc:
            out["refused"].append(repr(exc))
            continue
        if not isinstance(reg, _Registration):
            out["refused"].append(reg.reason)
            continue
        out["registrations"] += 1
        for addr, length, idx, off in reg.shared:
            m = mmap.mmap(fds[idx], length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                          offset=off)
            m[:5] = b"PWNED"
            m.close()
            out["written"] += 5
    print(json.dumps(out))
''')


@pytest.fixture
def victim() -> Iterator[tuple[ShmTransport, np.ndarray[Any, Any]]]:
    """A transport with mapped copies (the connector's default for a CPU KV cache) holding an
    8 MiB "KV cache" of 0x11 bytes; no peer ever added."""
    area = mmap.mmap(-1, 8 << 20)
    kv = np.frombuffer(area, dtype=np.uint8)
    kv[:] = 0x11
    t = ShmTransport("victim-engine", {"map_memory": True})
    t.register_memory([MemoryRegion(kv.ctypes.data, kv.nbytes)])
    try:
        yield t, kv
    finally:
        t.close()


def _attack(tmp_path: Path, *argv: str, prefix: list[str] | None = None) -> dict[str, Any]:
    script = tmp_path / "attacker.py"
    script.write_text(ATTACKER)
    proc = subprocess.run([*(prefix or []), sys.executable, str(script), *argv],
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_same_user_process_that_is_not_a_peer_gets_nothing(
        victim: tuple[ShmTransport, np.ndarray[Any, Any]], tmp_path: Path) -> None:
    """Fails on 84a1d95: the attacker got the registration and the memfd and wrote 'PWNED'."""
    t, kv = victim
    out = _attack(tmp_path)
    assert out["listeners"] >= 1
    assert out["fds"] == 0 and out["registrations"] == 0 and out["written"] == 0, out
    assert out["refused"], out
    assert int(np.count_nonzero(kv != 0x11)) == 0
    assert t._listener.refused >= 1


def test_a_proof_attested_for_another_process_lets_nobody_else_in(
        victim: tuple[ShmTransport, np.ndarray[Any, Any]], tmp_path: Path) -> None:
    """Even a real token, attested for the peer process the handshake named, is useless to a
    process that stole it: the listener checks the kernel's pid of the connection."""
    t, kv = victim
    peer = ShmTransport("the-real-peer", {})
    try:
        buf = np.zeros(4096, np.uint8)
        peer_meta = peer.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
        token = os.urandom(32)
        t.attest(token, peer_meta)  # for this process (the real peer's pid)
        out = _attack(tmp_path, token.hex())
        assert out["fds"] == 0 and out["written"] == 0, out
        assert any("attested for process" in r for r in out["refused"]), out
        assert int(np.count_nonzero(kv != 0x11)) == 0
    finally:
        peer.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) for a PID namespace")
def test_a_non_peer_in_another_pid_namespace_gets_nothing(
        victim: tuple[ShmTransport, np.ndarray[Any, Any]], tmp_path: Path) -> None:
    """The setting of poc_memfd_nonpeer_write.sh: same uid, same network namespace, its own
    PID namespace (ptrace and CMA fail with ESRCH there), not a peer."""
    _, kv = victim
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode()[:200]}")
    out = _attack(tmp_path, prefix=["unshare", "--pid", "--fork", "--mount-proc"])
    assert out["listeners"] >= 1
    assert out["fds"] == 0 and out["written"] == 0, out
    assert int(np.count_nonzero(kv != 0x11)) == 0


def _memfd_mappings(name: str) -> int:
    """Bytes of this process's mappings of memfds whose name has ``name``."""
    total = 0
    for line in open("/proc/self/maps"):
        if "memfd:" in line and name in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            total += hi - lo
    return total


def test_a_dead_peers_memory_is_unmapped_and_forgotten_at_once() -> None:
    """Fails on 84a1d95: after P was killed D kept P's whole KV cache mapped ("256 MiB
    resident of 256 MiB mapped") until it happened to forget the peer."""
    shape = (2, 256, 16, 256)  # 2 layers x 256 blocks x 16 KiB x K/V: 32 MiB of KV
    p = AgentProcess("dying-prefill", shape=shape, extra=MAPPED)
    d = LocalAgent("decode", shape=shape, extra=MAPPED)
    try:
        p.fill(1)
        p.stage(send("r", "t1", [1, 2]))
        d.pull(pull("r", "t1", p, [3, 4], [1, 2]))
        assert d.drain({"r"})["results"]["finished_recving"] == {"r"}
        assert d.loop.transport.mapped_bytes > 0
        assert _memfd_mappings("kvbridge-shm-dying-prefill") > 0
        assert len(d.loop.peers) == 1
        p.kill()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
                _memfd_mappings("kvbridge-shm-dying-prefill") or len(d.loop.peers)):
            time.sleep(0.05)
        assert _memfd_mappings("kvbridge-shm-dying-prefill") == 0
        assert not d.loop.transport._peers
        assert d.loop.snapshot()["stats"]["peer_gone"] >= 1
        assert len(d.loop.peers) == 0
    finally:
        d.close()
        p.close()


def test_a_peer_that_exits_is_reported_lost() -> None:
    """Transport level: on_peer_lost names the peer, after it was forgotten."""
    from kvbridge.testing.peer import PeerProcess

    t = ShmTransport("watcher", {})
    lost: list[str] = []
    t.on_peer_lost(lost.append)
    buf = np.zeros(1 << 16, np.uint8)
    meta = t.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    peer = PeerProcess("shm").start()
    try:
        mem = peer.setup(2, 4, 4096, 1)
        name = t.add_peer(mem.metadata, peer.invite(meta))
        peer.kill()
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost == [name]
        assert name not in t._peers
        with pytest.raises(PeerError):  # the old metadata loads nothing any more
            t.add_peer(mem.metadata, os.urandom(32))
    finally:
        peer.close()
        t.close()
