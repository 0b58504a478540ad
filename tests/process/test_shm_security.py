"""shm trusts nothing a peer claims: forged metadata, hostile listeners and clients, floods.

Real processes only: a *victim* child holding a buffer of ``A`` bytes at a known address, an
*attacker* child running a listener that answers whatever it likes, real kvbridge peers
(:class:`PeerProcess`). Every child is killed in ``finally``; every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.errors import (
    DescriptorError,
    MessageError,
    MessageTooLarge,
    PeerUnreachable,
    UnknownPeer,
)
from kvbridge.messages import Ack, Codec, PipeFrame
from kvbridge.testing.peer import PeerProcess, collect_notifications
from kvbridge.transport import PROOF_BYTES, HandleState, MemoryRegion, Op
from kvbridge.transports.pipe import PipeReceiver, PipeSender
from kvbridge.transports.shm import (
    MAX_METADATA_BYTES,
    ShmMetadata,
    ShmTransport,
    _boot_id,
    _encoder,
    _Listener,
    _pid_ns,
    _Query,
    _Refused,
    _reg_decoder,
    _Registration,
)

pytestmark = pytest.mark.timeout(90)

SIZE = 4096
A = b"A" * SIZE

_VICTIM = """
import ctypes, sys
buf = ctypes.create_string_buffer(b'A' * 4096, 4096)
print(ctypes.addressof(buf), flush=True)
for line in sys.stdin:
    print(buf.raw.hex(), flush=True)
"""

# A listener that is not the victim but answers for it: pid and regions as the attacker likes.
_ATTACKER = """
import os, sys, msgspec
from kvbridge.messages import Codec
from kvbridge.transports.shm import _Listener, _Registration
claim_pid, addr, length = (int(v) for v in sys.argv[1:4])
def answer(proof, want_fds, pid):  # lets anyone in: it echoes whatever proof it is shown
    return msgspec.msgpack.encode(_Registration(
        agent="evil", pid=claim_pid or os.getpid(), version=1, regions=[(addr, length)],
        notify_address="tcp://127.0.0.1:9", proof=proof)), []
listener = _Listener(Codec(), answer, 5.0, 4, "attacker")
print(listener.name.encode().hex(), os.getpid(), flush=True)
sys.stdin.readline()
"""


def _python_for(user: int | None) -> str | None:
    """An interpreter ``user`` may run (the venv's may sit under a private home)."""
    if user is None:
        return sys.executable
    for exe in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3",
                shutil.which("python3")):
        if exe and _may_exec(exe, user):
            return exe
    return None


def _may_exec(exe: str, user: int) -> bool:
    try:
        subprocess.run([exe, "-c", "pass"], user=user, capture_output=True, timeout=30,
                       check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


class Child:
    """A ``python -c`` child speaking lines on stdin/stdout; killed by :meth:`close`."""

    def __init__(self, script: str, *args: str, user: int | None = None) -> None:
        exe = _python_for(user)
        if exe is None:
            pytest.skip(f"no Python interpreter that uid {user} may run")
        self.proc = subprocess.Popen(
            [exe, "-c", script, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, user=user,
        )
        self.pid = self.proc.pid

    def line(self) -> str:
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        assert out, f"child {self.pid} ended (exit code {self.proc.poll()})"
        return out.strip()

    def send(self, text: str = "") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class Victim(Child):
    def __init__(self) -> None:
        super().__init__(_VICTIM)
        self.addr = int(self.line())

    def dump(self) -> bytes:
        self.send()
        return bytes.fromhex(self.line())


@pytest.fixture
def victim() -> Iterator[Victim]:
    v = Victim()
    try:
        yield v
    finally:
        v.close()


@pytest.fixture
def shm() -> Iterator[ShmTransport]:
    t = ShmTransport("target", {"handshake_timeout": 2.0})
    try:
        yield t
    finally:
        t.close()


@pytest.fixture
def local_buf(shm: ShmTransport) -> np.ndarray[Any, np.dtype[np.uint8]]:
    buf = np.random.default_rng(7).integers(0, 256, 4 * SIZE, dtype=np.uint8)
    shm.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    return buf


def forged(**fields: Any) -> bytes:
    """Metadata as an attacker builds it: any field, any value (extra keys are ignored)."""
    base: dict[str, Any] = {
        "type": "kvbridge.shm.v2", "agent": "evil", "pid": os.getpid(),
        "hostname": socket.gethostname(), "boot_id": _boot_id(), "pid_ns": _pid_ns(),
        "socket": "\0kvbridge-shm-" + "0" * 32, "version": 1,
    }
    base.update(fields)
    return msgspec.msgpack.encode(base)


def meta_of(blob: bytes) -> ShmMetadata:
    return msgspec.msgpack.decode(blob, type=ShmMetadata)


def any_proof() -> bytes:
    """A proof for a peer that is not a kvbridge transport (an attacker's listener echoes
    whatever it is shown, a raw server never reads it) or for metadata refused before any
    handshake."""
    return os.urandom(PROOF_BYTES)


def assert_no_transfer_reaches(
    t: ShmTransport, peer: str, local: np.ndarray[Any, Any], addr: int
) -> None:
    """READ and WRITE of ``[addr, +SIZE)`` at ``peer`` are refused before anything is posted."""
    loc = np.array([[local.ctypes.data, SIZE, 0]])
    rem = np.array([[addr, SIZE, 0]])
    for op in (Op.WRITE, Op.READ):
        with pytest.raises((UnknownPeer, DescriptorError)):
            t.submit(op, peer, loc, rem, b"note")


# -- forged metadata: the victim is never touched --------------------------------------------------


def test_attacker_socket_with_victim_pid(
    shm: ShmTransport, local_buf: np.ndarray[Any, Any], victim: Victim
) -> None:
    """(a) The metadata names the victim's pid and buffer but the socket of a listener the
    attacker runs (another process): the kernel-proven pid is the attacker's, so it is refused;
    if the attacker tells the truth about its pid, transfers go to the attacker's own memory."""
    attacker = Child(_ATTACKER, "0", str(victim.addr), str(SIZE))
    try:
        name_hex, pid = attacker.line().split()
        sock = bytes.fromhex(name_hex).decode()
        with pytest.raises(PeerUnreachable, match=f"claims pid {victim.pid}.*is pid {pid}"):
            shm.add_peer(forged(pid=victim.pid, socket=sock,
                                regions=[(victim.addr, SIZE)]), any_proof())
        assert_no_transfer_reaches(shm, "evil", local_buf, victim.addr)
        # the truthful attacker (it answers the proof of a handshake it took part in):
        # accepted, but every CMA call targets the attacker itself
        assert shm.add_peer(forged(pid=int(pid), socket=sock), any_proof()) == "evil"
        assert shm._peer("evil").pid == int(pid) != victim.pid
        loc = np.array([[local_buf.ctypes.data, SIZE, 0]])
        rem = np.array([[victim.addr, SIZE, 0]])
        for op in (Op.WRITE, Op.READ):
            h = shm.submit(op, "evil", loc, rem)
            assert shm.wait(h, 10) in (HandleState.DONE, HandleState.FAILED)
    finally:
        attacker.close()
    assert victim.dump() == A


def test_attacker_listener_answering_for_the_victim(
    shm: ShmTransport, local_buf: np.ndarray[Any, Any], victim: Victim
) -> None:
    """(a') The attacker's listener *answers* with the victim's pid: the answer is refused."""
    attacker = Child(_ATTACKER, str(victim.pid), str(victim.addr), str(SIZE))
    try:
        name_hex, pid = attacker.line().split()
        sock = bytes.fromhex(name_hex).decode()
        with pytest.raises(PeerUnreachable, match=f"answers as pid {victim.pid}.*pid {pid}"):
            shm.add_peer(forged(pid=int(pid), socket=sock), any_proof())
        with pytest.raises(PeerUnreachable, match="claims pid"):
            shm.add_peer(forged(pid=victim.pid, socket=sock), any_proof())
        assert_no_transfer_reaches(shm, "evil", local_buf, victim.addr)
    finally:
        attacker.close()
    assert victim.dump() == A


def test_real_peer_socket_with_victim_pid_or_regions(
    shm: ShmTransport, local_buf: np.ndarray[Any, Any], victim: Victim
) -> None:
    """(b) The socket of a real kvbridge transport in another process, with the victim's pid
    and regions in the metadata: a wrong pid or agent is refused; the real pid is accepted, but
    only the regions the real peer answered are reachable — the victim's are refused. Each
    handshake shows a proof the real peer attested for this process: only the claim is forged."""
    own = shm.register_memory([])
    with PeerProcess("shm", timeout=20) as peer:
        mem = peer.setup(1, 4, SIZE, 3)
        real = meta_of(mem.metadata)
        evil = {**msgspec.structs.asdict(real), "type": "kvbridge.shm.v2"}
        with pytest.raises(PeerUnreachable, match=f"claims pid {victim.pid}"):
            shm.add_peer(forged(**{**evil, "pid": victim.pid, "regions": [(victim.addr, SIZE)]}),
                         peer.invite(own))
        with pytest.raises(PeerUnreachable, match="but the metadata names agent 'victim'"):
            shm.add_peer(forged(**{**evil, "agent": "victim"}), peer.invite(own))
        assert_no_transfer_reaches(shm, peer.name, local_buf, victim.addr)
        # right pid, forged regions: the regions are not even read from the metadata
        name = shm.add_peer(forged(**{**evil, "regions": [(victim.addr, SIZE)]}),
                            peer.invite(own))
        assert name == peer.name
        assert shm._peer(name).pid == peer.pid
        assert_no_transfer_reaches(shm, name, local_buf, victim.addr)
        # ... and the legitimate memory of that peer still works, every byte
        base = mem.layout.planes[0].base
        loc = np.array([[local_buf.ctypes.data, SIZE, 0]])
        shm.transfer(Op.WRITE, name, loc, np.array([[base, SIZE, 0]]), timeout=10)
        np.testing.assert_array_equal(peer.buffer(mem.index)[:SIZE], local_buf[:SIZE])
    assert victim.dump() == A


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a listener as another user")
def test_listener_of_another_user_is_refused(shm: ShmTransport) -> None:
    other = Child(
        "import os, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); n = '\\0kvbridge-shm-' + os.urandom(16).hex()\n"
        "s.bind(n); s.listen(4); print(n.encode().hex(), os.getpid(), flush=True)\n"
        "sys.stdin.readline()\n",
        user=65534,
    )
    try:
        name_hex, pid = other.line().split()
        with pytest.raises(PeerUnreachable, match="belongs to uid 65534"):
            shm.add_peer(forged(pid=int(pid), socket=bytes.fromhex(name_hex).decode()),
                         any_proof())
    finally:
        other.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_client_of_another_user_gets_no_answer(shm: ShmTransport) -> None:
    """A client of another uid is refused before a byte is read, even with a well-formed query
    showing a proof the engine attested for no particular process (so only the uid check stands
    in its way): the very same query from this uid is answered."""
    sock = meta_of(shm.register_memory([])).socket
    proof = shm.invite()
    request = _request(shm, proof)
    before = shm._listener.refused
    client = Child(
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.settimeout(5)\n"
        "s.connect(bytes.fromhex(sys.argv[1]).decode())\n"
        "try:\n"
        "    s.sendall(bytes.fromhex(sys.argv[2])); n = len(s.recv(100))\n"
        "except OSError:\n"
        "    n = 0\n"
        "print(n, flush=True)\n",
        sock.encode().hex(), request.hex(), user=65534,
    )
    try:
        assert client.line() == "0"
    finally:
        client.close()
    assert shm._listener.refused == before + 1
    reply, _ = _ask(shm, sock, request)  # the control: the proof was valid, and is unused
    assert isinstance(reply, _Registration) and reply.proof == proof


# -- hostile listeners: add_peer fails in bounded time ---------------------------------------------


class RawServer:
    """An abstract-socket server in this process answering every connection with ``behave``."""

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.name = "\0kvbridge-shm-" + os.urandom(16).hex()
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.name)
        self.sock.listen(4)
        self.behave = behave
        self.conns: list[socket.socket] = []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            conn, _ = self.sock.accept()
            self.conns.append(conn)
            if self.stop:
                return
            try:
                self.behave(conn)
            except OSError:
                pass

    def close(self) -> None:
        self.stop = True
        with socket.socket(socket.AF_UNIX) as wake:
            wake.connect(self.name)
            self.thread.join(5)
        self.sock.close()
        for c in self.conns:
            c.close()


def _reply_with(data: bytes) -> Callable[[socket.socket], None]:
    def behave(conn: socket.socket) -> None:
        conn.settimeout(5)
        conn.recv(8192)
        conn.sendall(data)
        conn.close()
    return behave


@pytest.mark.parametrize(
    "behave",
    [
        _reply_with(os.urandom(64)),
        _reply_with(b"\xff\xff\xff\xff" + os.urandom(64)),
        _reply_with((64).to_bytes(4, "big") + os.urandom(64)),
        _reply_with((4).to_bytes(4, "big") + b"abc"),  # short, then closed
        _reply_with(b""),
        lambda conn: None,  # accepts, never answers
    ],
    ids=["random", "huge-length", "garbage-frame", "truncated", "closed", "silent"],
)
def test_hostile_listener_is_refused_in_bounded_time(
    behave: Callable[[socket.socket], None]
) -> None:
    t = ShmTransport("client", {"handshake_timeout": 0.5})
    server = RawServer(behave)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable):
            t.add_peer(forged(socket=server.name), any_proof())
        assert time.monotonic() - t0 < 3.0
        # the transport still works
        buf = np.zeros(64, np.uint8)
        meta = t.register_memory([MemoryRegion(buf.ctypes.data, 64)])
        assert t.add_peer(meta, t.invite(meta)) == "client"
    finally:
        server.close()
        t.close()


def _lying_listener(**change: Any) -> _Listener:
    def answer(proof: bytes, want_fds: bool, pid: int) -> tuple[bytes, list[int]]:
        reg = _Registration(agent="evil", pid=os.getpid(), version=1, regions=[],
                            notify_address="tcp://127.0.0.1:9", proof=proof)
        return msgspec.msgpack.encode(msgspec.structs.replace(reg, **change)), []
    return _Listener(Codec(), answer, 2.0, 4, "liar")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"proof": b"\0" * PROOF_BYTES}, "did not echo the proof"),
        ({"agent": "someone-else"}, "is agent 'someone-else'"),
        ({"version": 0}, "older than the metadata's 1"),
        ({"notify_address": "tcp://no such host"}, "unusable notification address"),
        # the shared-memory pieces (shm mapped copies): out of the field's bounds
        ({"shared": [(4096, 4096, 16, 0)]}, "malformed registration"),
        ({"shared": [(4096, 4096, 0, -1)]}, "malformed registration"),
        ({"shared": [(0, 4096, 0, 0)]}, "malformed registration"),
        ({"shared": [(4096, 4096, 0)]}, "malformed registration"),
        ({"shared": [(4096, 4096, 0, 0)] * 16385}, "malformed registration"),
        # well-formed, but no fd came with it
        ({"shared": [(4096, 4096, 0, 0)]}, "pieces use fds"),
    ],
)
def test_answers_that_do_not_match_are_refused(
    shm: ShmTransport, change: dict[str, Any], match: str
) -> None:
    liar = _lying_listener(**change)
    try:
        with pytest.raises(PeerUnreachable, match=match):
            shm.add_peer(forged(socket=liar.name), any_proof())
    finally:
        liar.close()


# -- hostile clients: the listener neither crashes nor blocks --------------------------------------


def _connect(name: str) -> socket.socket:
    """Connect, waiting while the listener's backlog is full (Unix sockets say EAGAIN then)."""
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        try:
            s.connect(name)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _request(t: ShmTransport, proof: bytes) -> bytes:
    """A well-formed handshake query to ``t``'s listener (asking for memfds too)."""
    frame = t._hs_codec.encode(
        PipeFrame(seq=0, payload=_encoder.encode(_Query(proof=proof, fds=True))))
    return len(frame).to_bytes(4, "big") + frame


def _ask(t: ShmTransport, name: str, request: bytes) -> tuple[_Registration | _Refused, int]:
    """Send ``request`` to the listener ``name`` of ``t``: its decoded answer and how many
    fds came with it (closed here)."""
    data, fds = b"", []
    with _connect(name) as s:
        s.sendall(request)
        while True:
            msg, got, _, _ = socket.recv_fds(s, 1 << 16, 16)
            fds += got
            if not msg:
                break
            data += msg
    for fd in fds:
        os.close(fd)
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    frame = t._hs_codec.decode(data[4:])
    assert isinstance(frame, PipeFrame)
    return _reg_decoder.decode(frame.payload), len(fds)


def _closed_without_answer(s: socket.socket) -> bool:
    """True if the listener closed the connection (a reset counts: it left bytes unread)."""
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True


def test_garbage_on_the_socket_does_not_stop_transfers() -> None:
    t = ShmTransport("srv", {"listener_timeout": 2.0, "listener_max_connections": 8,
                             "map_memory": True})
    buf = np.random.default_rng(1).integers(0, 256, 4 * SIZE, dtype=np.uint8)
    meta = t.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])
    name = meta_of(meta).socket
    junk_frame = Codec().encode(Ack(ok=True))
    bad_payload = Codec().encode(PipeFrame(seq=0, payload=os.urandom(40)))
    idle: list[socket.socket] = []
    try:
        with PeerProcess("shm", timeout=20) as peer:
            # slow clients that never finish a request, held open across the legit handshake
            idle = [_connect(name) for _ in range(3)]
            idle[1].sendall(b"\x00\x00")
            idle[2].sendall((100).to_bytes(4, "big") + b"x" * 10)
            for blob in (
                os.urandom(200),
                b"\xff\xff\xff\xff" + os.urandom(100),
                b"\x00\x00\x00\x00",
                (200).to_bytes(4, "big") + os.urandom(200),
                len(junk_frame).to_bytes(4, "big") + junk_frame,
                len(bad_payload).to_bytes(4, "big") + bad_payload,
            ):
                s = _connect(name)
                s.sendall(blob)
                assert _closed_without_answer(s), blob
                s.close()
            # a well-formed query from a process of this user that no handshake let in (a
            # made-up proof): a refusal, and nothing else — no registration, no memfd
            for _ in range(2):
                reply, fds = _ask(t, name, _request(t, any_proof()))
                assert isinstance(reply, _Refused) and fds == 0, reply
                assert "no handshake of this engine attested the proof" in reply.reason
            # the legit peer handshakes with us and moves every byte meanwhile
            mem = peer.setup(1, 4, SIZE, 2)
            pname = t.add_peer(mem.metadata, peer.invite(meta))
            assert peer.add_peer(meta, t.invite(mem.metadata)) == "srv"
            base = mem.layout.planes[0].base
            state, error = peer.transfer(
                Op.READ, "srv", np.array([[base, 4 * SIZE, 0]]),
                np.array([[buf.ctypes.data, 4 * SIZE, 0]]),
            )
            assert state == "done", error
            np.testing.assert_array_equal(peer.buffer(mem.index)[: 4 * SIZE], buf)
            back = np.zeros_like(buf)
            t.register_memory([MemoryRegion(back.ctypes.data, back.nbytes)])
            t.transfer(Op.READ, pname, np.array([[back.ctypes.data, 4 * SIZE, 0]]),
                       np.array([[base, 4 * SIZE, 0]]), timeout=10)
            np.testing.assert_array_equal(back, buf)
            # the slow clients are cut off after listener_timeout
            for s in idle:
                s.settimeout(10)
                assert _closed_without_answer(s)
            # a flood beyond listener_max_connections: the extras are closed at once
            flood = [_connect(name) for _ in range(20)]
            try:
                closed = 0
                for s in flood:
                    s.settimeout(10)
                    closed += _closed_without_answer(s)
                assert closed == 20  # 12 at once, 8 after listener_timeout
            finally:
                for s in flood:
                    s.close()
            assert t._listener._thread.is_alive()
            assert t._listener.refused >= 6 + 2 + 3 + 20
            # and handshakes keep working afterwards (new handshakes: new proofs)
            assert peer.add_peer(meta, t.invite(mem.metadata)) == "srv"
            assert t.add_peer(mem.metadata, peer.invite(meta)) == pname
    finally:
        for s in idle:
            s.close()
        t.close()
    assert not t._listener._thread.is_alive()


# -- the notification inbox ------------------------------------------------------------------------


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_unauthenticated_flood_is_dropped_and_counted() -> None:
    t = ShmTransport("inbox", {"secret": "s3cret"})
    senders = [PipeSender(t._inbox.address, "evil#1", Codec()),
               PipeSender(t._inbox.address, "evil#2", Codec("guess"))]
    try:
        for i in range(100):
            senders[i % 2].send(b"x" * (64 << 10))
        assert _wait_for(lambda: t.dropped_notifications == 100)
        assert t._inbox.dropped_invalid == 100
        assert t.get_notifications() == []
        assert t._inbox.held_bytes == 0
        # a genuine sender is still heard
        good = PipeSender(t._inbox.address, "good#1", Codec("s3cret"))
        try:
            good.send(b"hello")
            assert collect_notifications(t, 1, 5) == [("good", b"hello")]
        finally:
            good.close()
    finally:
        for s in senders:
            s.close()
        t.close()


def test_valid_flood_beyond_the_bound_is_dropped_and_counted() -> None:
    t = ShmTransport("bounded", {"max_notifications": 50, "max_notification_bytes": 1 << 20})
    tx = PipeSender(t._inbox.address, "noisy#1", Codec())
    try:
        for i in range(200):
            tx.send(b"%d" % i)
        assert _wait_for(lambda: t.dropped_notifications == 150)
        assert t._inbox.dropped_full == 150
        got = t.get_notifications()
        assert [m for _, m in got] == [b"%d" % i for i in range(50)]  # the newest were dropped
        # bytes bound: 64 KiB messages, at most 1 MiB held
        for _ in range(40):
            tx.send(b"y" * (64 << 10))
        assert _wait_for(lambda: t.dropped_notifications == 150 + 24)
        assert t._inbox.held_bytes == 16 * (64 << 10)
        assert len(t.get_notifications()) == 16
        tx.send(b"room again")
        assert collect_notifications(t, 1, 5) == [("noisy", b"room again")]
    finally:
        tx.close()
        t.close()


# -- malformed metadata and descriptors ------------------------------------------------------------


def _valid() -> dict[str, Any]:
    return msgspec.msgpack.decode(forged())  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        forged()[:-5],
        forged()[:10],
        forged(pid="123"),
        forged(pid=-1),
        forged(pid=0),
        forged(version=-1),
        forged(agent=""),
        forged(agent="x" * 300),
        forged(agent=["list"]),
        forged(socket="/tmp/kvbridge.sock"),
        forged(socket="\0/tmp/.X11-unix/X0"),
        forged(socket="\0kvbridge-shm-" + "g" * 32),
        forged(type="kvbridge.shm.v1"),
        forged(type="kvbridge.memory.v1"),
        msgspec.msgpack.encode({k: v for k, v in _valid().items() if k != "socket"}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode("a string"),
        b"\xc1" * 8,
        b"\x91" * 2000 + b"\x00",  # deeply nested
        bytearray(forged()[:-1]),
    ],
)
def test_malformed_metadata_raises_message_error(shm: ShmTransport, blob: bytes) -> None:
    with pytest.raises(MessageError):
        shm.add_peer(blob, any_proof())


@pytest.mark.parametrize("blob", [None, "text", 42, ["x"]])
def test_metadata_of_the_wrong_type_raises_message_error(shm: ShmTransport, blob: Any) -> None:
    with pytest.raises(MessageError):
        shm.add_peer(blob, any_proof())


def test_oversized_metadata_raises_before_decoding(shm: ShmTransport) -> None:
    with pytest.raises(MessageTooLarge):
        shm.add_peer(forged(hostname="h" * (MAX_METADATA_BYTES + 1)), any_proof())
    with pytest.raises(MessageTooLarge):
        shm.add_peer(b"\x00" * (MAX_METADATA_BYTES + 1), any_proof())


def test_descriptor_lengths_that_overflow_are_refused(shm: ShmTransport) -> None:
    """``address + length`` wrapping around int64 must not pass the range check."""
    src, dst = np.ones(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    meta = shm.register_memory([MemoryRegion(src.ctypes.data, SIZE),
                                MemoryRegion(dst.ctypes.data, SIZE)])
    name = shm.add_peer(meta, shm.invite(meta))
    low = min(src.ctypes.data, dst.ctypes.data)
    wrap = 2**63 - low + 8  # low + wrap (and anything above) overflows to a negative end
    for op in (Op.WRITE, Op.READ):
        with pytest.raises(DescriptorError, match="above 2..62|past the end of the address"):
            shm.submit(op, name, np.array([[src.ctypes.data, wrap, 0]]),
                       np.array([[dst.ctypes.data, wrap, 0]]))
    with pytest.raises(DescriptorError):
        shm.register_memory([MemoryRegion(2**62 + 1, SIZE)])
    assert not dst.any()


def test_made_up_sender_names_do_not_grow_the_receiver() -> None:
    """The inbox's pipe remembers a bounded number of senders and refuses giant names."""
    rx = PipeReceiver("127.0.0.1", 0, max_senders=8)
    senders = [PipeSender(rx.address, f"made-up-{i}#x") for i in range(30)]
    try:
        for s in senders:
            s.send(b"x")
        for _ in senders:
            rx.recv(timeout=10)
        assert len(rx._next) == 8
        senders.append(PipeSender(rx.address, "n" * 2000))
        senders[-1].send(b"x")
        with pytest.raises(MessageError, match="sender name of 2000 bytes"):
            rx.recv(timeout=10)
    finally:
        for s in senders:
            s.close()
        rx.close()
