"""kvbridge.transports.pipe: the in-memory pair and the ZeroMQ pipe (senders in real processes)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvbridge.errors import AuthError, MessageError, PipeClosed
from kvbridge.messages import Cancel, Codec, PipeFrame
from kvbridge.tools.engines import free_port
from kvbridge.transports.pipe import PipeReceiver, PipeSender, memory_pipe

pytestmark = pytest.mark.timeout(60)

# -- memory pair ----------------------------------------------------------------------------------


def test_memory_pipe_keeps_order() -> None:
    tx, rx = memory_pipe()
    for i in range(100):
        tx.send(b"%d" % i)
    assert [rx.recv(timeout=1)[1] for _ in range(100)] == [b"%d" % i for i in range(100)]


def test_memory_pipe_across_threads_keeps_order() -> None:
    tx, rx = memory_pipe(capacity=4)
    items = [b"item-%d" % i for i in range(500)]

    def produce() -> None:
        for item in items:
            tx.send(item, timeout=10)
        tx.close()

    thread = threading.Thread(target=produce)
    thread.start()
    got = []
    try:
        while True:
            got.append(rx.recv(timeout=10)[1])
    except PipeClosed:
        pass
    thread.join(10)
    assert got == items


def test_memory_pipe_back_pressure() -> None:
    tx, rx = memory_pipe(capacity=2)
    tx.send(b"a")
    tx.send(b"b")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="pipe full"):
        tx.send(b"c", timeout=0.1)
    assert time.monotonic() - t0 >= 0.09

    sent = threading.Event()

    def blocked_send() -> None:
        tx.send(b"c", timeout=10)
        sent.set()

    thread = threading.Thread(target=blocked_send)
    thread.start()
    time.sleep(0.05)
    assert not sent.is_set()  # still blocked while full
    assert rx.recv(timeout=1) == ("memory", b"a")
    assert sent.wait(5)
    thread.join(5)
    assert [rx.recv(timeout=1)[1], rx.recv(timeout=1)[1]] == [b"b", b"c"]


def test_memory_pipe_eos_after_drain() -> None:
    tx, rx = memory_pipe()
    tx.send(b"1")
    tx.send(b"2")
    tx.close()
    assert rx.recv() == ("memory", b"1") and rx.recv() == ("memory", b"2")
    with pytest.raises(PipeClosed, match="end of stream"):
        rx.recv(timeout=1)
    with pytest.raises(PipeClosed):
        tx.send(b"3")


def test_memory_pipe_receiver_close_wakes_blocked_sender() -> None:
    tx, rx = memory_pipe(capacity=1)
    tx.send(b"x")
    errors: list[BaseException] = []

    def blocked_send() -> None:
        try:
            tx.send(b"y", timeout=10)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=blocked_send)
    thread.start()
    time.sleep(0.05)
    rx.close()
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PipeClosed)
    with pytest.raises(PipeClosed):
        rx.recv(timeout=0.1)


def test_memory_pipe_close_wakes_blocked_receiver() -> None:
    tx, rx = memory_pipe()
    errors: list[BaseException] = []

    def blocked_recv() -> None:
        try:
            rx.recv(timeout=10)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=blocked_recv)
    thread.start()
    time.sleep(0.05)
    tx.close()
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], PipeClosed)


def test_memory_and_zmq_halves_give_the_same_types(receiver: PipeReceiver) -> None:
    """The contract's promise: the in-process pair gives ``(sender, payload)`` like ZeroMQ's,
    and both refuse a payload that is not bytes."""
    tx, rx = memory_pipe(sender="layers")
    tx.send(bytearray(b"L0"))
    zx = PipeSender(receiver.address, "layers")
    try:
        zx.send(b"L0")
        assert rx.recv(timeout=1) == receiver.recv(timeout=5) == ("layers", b"L0")
        for half in (tx, zx):
            with pytest.raises(TypeError, match="bytes"):
                half.send("text")  # type: ignore[arg-type]
    finally:
        zx.close()


def test_memory_pipe_recv_timeout() -> None:
    _tx, rx = memory_pipe()
    with pytest.raises(TimeoutError, match="nothing received"):
        rx.recv(timeout=0.05)


# -- ZeroMQ pipe ----------------------------------------------------------------------------------

# The sender terminates ZeroMQ's context before it exits: that waits (up to the socket's linger)
# until the queued frames left. Without it a sender that queues everything and exits before its
# connection is up loses them all: a loaded CI host once showed one of three senders exit 0 with
# nothing delivered. PipeSender.close says so.
_SENDER = """
import sys
import zmq
from kvbridge.messages import Codec
from kvbridge.transports.pipe import PipeSender
address, name, count, secret = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tx = PipeSender(address, name, Codec(secret or None))
for i in range(count):
    tx.send(f"{name}:{i}".encode(), timeout=20)
tx.close()
print("closed", flush=True)
zmq.Context.instance().term()
"""


@pytest.fixture
def receiver() -> Iterator[PipeReceiver]:
    rx = PipeReceiver("127.0.0.1", 0)
    try:
        yield rx
    finally:
        rx.close()


def start_sender(address: str, name: str, count: int, secret: str = "",
                 stdout: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _SENDER, address, name, str(count), secret],
        stdout=stdout,
        stderr=subprocess.PIPE,
    )


def reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for proc in procs:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def drain(rx: PipeReceiver, senders: int,
          procs: list[subprocess.Popen[bytes]] | None = None) -> dict[str, list[bytes]]:
    """Receive until every sender reached end-of-stream. On a timeout, fail with what the
    sender processes said (a CI run once timed out here and showed nothing else)."""
    got: dict[str, list[bytes]] = {}
    ended = 0
    while ended < senders:
        try:
            sender, payload = rx.recv(timeout=30)
        except PipeClosed:
            ended += 1
            continue
        except TimeoutError:
            said = []
            for proc in procs or []:
                try:
                    _, err = proc.communicate(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    _, err = proc.communicate()
                said.append(f"rc={proc.returncode} stderr={err.decode(errors='replace')[-2000:]}")
            counts = {k: len(v) for k, v in got.items()}
            pytest.fail(f"nothing received for 30 s; got {counts}, {ended} ended; senders: "
                        + " | ".join(said))
        got.setdefault(sender, []).append(payload)
    return got


def test_zmq_pipe_order_and_eos_from_another_process(receiver: PipeReceiver) -> None:
    proc = start_sender(receiver.address, "p0", 200)
    try:
        got = drain(receiver, 1, [proc])
    finally:
        reap([proc])
    assert proc.returncode == 0
    assert got == {"p0": [b"p0:%d" % i for i in range(200)]}
    with pytest.raises(TimeoutError):
        receiver.recv(timeout=0.05)


def test_zmq_pipe_a_sender_that_exits_before_the_receiver_binds_still_delivers() -> None:
    """The sender queues everything and exits while nothing listens yet (its connection cannot
    be up): terminating ZeroMQ's context at exit, as PipeSender.close asks, delivers every frame
    once the receiver binds within the linger."""
    port = free_port()
    proc = start_sender(f"tcp://127.0.0.1:{port}", "early", 20, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"closed\n"  # queued and closed; exiting waits in term()
        time.sleep(0.3)
        rx = PipeReceiver("127.0.0.1", port)
        try:
            got = drain(rx, 1, [proc])
        finally:
            rx.close()
    finally:
        reap([proc])
    assert proc.returncode == 0
    assert got == {"early": [b"early:%d" % i for i in range(20)]}


def test_zmq_pipe_eos_names_the_sender(receiver: PipeReceiver) -> None:
    proc = start_sender(receiver.address, "engine-d", 1)
    try:
        assert receiver.recv(timeout=30) == ("engine-d", b"engine-d:0")
        with pytest.raises(PipeClosed, match="end of stream from 'engine-d'"):
            receiver.recv(timeout=30)
    finally:
        reap([proc])


def test_zmq_pipe_multiple_senders_keep_per_sender_order(receiver: PipeReceiver) -> None:
    names = ["a", "b", "c"]
    procs = [start_sender(receiver.address, n, 100) for n in names]
    try:
        got = drain(receiver, len(names), procs)
    finally:
        reap(procs)
    assert all(p.returncode == 0 for p in procs)
    assert got == {n: [f"{n}:{i}".encode() for i in range(100)] for n in names}


def test_zmq_pipe_in_process_and_reset_sender(receiver: PipeReceiver) -> None:
    tx = PipeSender(receiver.address, "local")
    try:
        tx.send(b"one")
        assert receiver.recv(timeout=10) == ("local", b"one")
    finally:
        tx.close()
    with pytest.raises(PipeClosed):
        receiver.recv(timeout=10)
    with pytest.raises(PipeClosed, match="is closed"):
        tx.send(b"late")
    tx.close()  # idempotent
    # the same sender name restarts: without reset its frames are refused
    tx2 = PipeSender(receiver.address, "local")
    try:
        tx2.send(b"again")
        with pytest.raises(MessageError, match="after its end-of-stream"):
            receiver.recv(timeout=10)
        receiver.reset_sender("local")
        tx2.send(b"after-reset")
        with pytest.raises(MessageError, match="frame 1, expected 0"):
            receiver.recv(timeout=10)
    finally:
        tx2.close()


def test_zmq_pipe_wrong_secret_is_refused() -> None:
    rx = PipeReceiver("127.0.0.1", 0, Codec("right"))
    proc = start_sender(rx.address, "intruder", 1, secret="wrong")
    try:
        with pytest.raises(AuthError):
            rx.recv(timeout=30)
    finally:
        reap([proc])
        rx.close()


def test_zmq_pipe_shared_secret_works() -> None:
    rx = PipeReceiver("127.0.0.1", 0, Codec("s3cret"))
    proc = start_sender(rx.address, "friend", 3, secret="s3cret")
    try:
        assert drain(rx, 1) == {"friend": [b"friend:0", b"friend:1", b"friend:2"]}
    finally:
        reap([proc])
        rx.close()


@pytest.fixture
def raw_push(receiver: PipeReceiver) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.address)
    try:
        yield sock
    finally:
        sock.close()


def test_zmq_pipe_reports_gaps(receiver: PipeReceiver, raw_push: zmq.Socket[bytes]) -> None:
    raw_push.send_multipart([b"gappy", Codec().encode(PipeFrame(seq=5, payload=b"x"))])
    with pytest.raises(MessageError, match="frame 5, expected 0"):
        receiver.recv(timeout=10)


def test_zmq_pipe_rejects_malformed_frames(
    receiver: PipeReceiver, raw_push: zmq.Socket[bytes]
) -> None:
    raw_push.send_multipart([b"bad", b"\x01" + b"\0" * 24 + b"\xc1garbage"])
    with pytest.raises(MessageError, match="malformed control message"):
        receiver.recv(timeout=10)
    raw_push.send_multipart([b"one-part-only"])
    with pytest.raises(MessageError, match="pipe frame with 1 parts"):
        receiver.recv(timeout=10)
    raw_push.send_multipart([b"wrong-kind", Codec().encode(Cancel(transfer_id="t", reason="r"))])
    with pytest.raises(MessageError, match="expected a pipe frame, got Cancel"):
        receiver.recv(timeout=10)


def test_zmq_receiver_timeout_and_close() -> None:
    rx = PipeReceiver("127.0.0.1", 0)
    assert rx.address.startswith("tcp://127.0.0.1:")
    with pytest.raises(TimeoutError):
        rx.recv(timeout=0.05)
    rx.close()
    rx.close()
    with pytest.raises(PipeClosed, match="receiver is closed"):
        rx.recv(timeout=0.05)


def test_memory_pipe_of_another_kind_refuses_any_other_type() -> None:
    tx, rx = memory_pipe(kind=int)
    tx.send(7)
    with pytest.raises(TypeError, match="carries int, not str"):
        tx.send("7")  # type: ignore[arg-type]
    assert rx.recv(timeout=1) == ("memory", 7)
    btx, _ = memory_pipe()
    with pytest.raises(TypeError, match="carries bytes"):
        btx.send(7)  # type: ignore[arg-type]
