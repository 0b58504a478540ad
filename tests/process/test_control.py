"""The control channel: asynchronous calls, bounded waits, bind policy, hostile frames."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvbridge.control import ControlClient, ControlServer, RpcClient, is_loopback
from kvbridge.errors import ConfigError, KVBridgeError, PeerUnreachable
from kvbridge.messages import Ack, Codec, Heartbeat, Message, StatsQuery


class _Serve:
    """A ControlServer answered by a thread (the loop does this in production)."""

    def __init__(self, codec: Codec, answer: bool = True) -> None:
        self.server = ControlServer(codec)
        self.seen: list[Message] = []
        self.answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.server.socket.poll(50):
                continue
            for ctx, msg in self.server.receive():
                self.seen.append(msg)
                if not self.answer:
                    continue
                if isinstance(msg, Heartbeat):
                    self.server.reply(ctx, Ack(error=",".join(msg.transfer_ids)))
                    self.server.reply(ctx, Ack(error="second"))  # a streamed second answer
                else:
                    self.server.reply(ctx, Ack(ok=False, error="boom"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


@pytest.fixture
def served() -> Iterator[_Serve]:
    s = _Serve(Codec())
    try:
        yield s
    finally:
        s.close()


def test_blocking_request_reply(served: _Serve) -> None:
    client = ControlClient(Codec(), 5.0)
    try:
        reply = client.request(served.server.address,
                               Heartbeat(generation="*", transfer_ids=["a", "b"]))
        assert reply == Ack(error="a,b")
        reply = client.request(served.server.address, StatsQuery())
        assert isinstance(reply, Ack) and not reply.ok
    finally:
        client.close()


def _pump(rpc: RpcClient, socks: set[zmq.Socket[bytes]], until: float) -> None:
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    while time.monotonic() < until:
        for sock, _ in poller.poll(20):
            rpc.on_readable(sock)  # type: ignore[arg-type]
        rpc.expire()


def test_async_calls_stream_and_time_out_independently(served: _Serve) -> None:
    socks: set[zmq.Socket[bytes]] = set()
    rpc = RpcClient(Codec(), lambda s, added: socks.add(s) if added else socks.discard(s))
    got: dict[str, list[object]] = {"live": [], "dead": [], "stream": []}
    try:
        rpc.call("tcp://127.0.0.1:1", StatsQuery(), 0.3,
                 lambda r: bool(got["dead"].append(r)))
        rpc.call(served.server.address, StatsQuery(), 5.0,
                 lambda r: bool(got["live"].append(r)))
        rpc.call(served.server.address, Heartbeat(generation="*", transfer_ids=["x"]), 5.0,
                 lambda r: got["stream"].append(r) is None and len(got["stream"]) < 2)
        _pump(rpc, socks, time.monotonic() + 1.0)
    finally:
        rpc.close()
    assert len(got["live"]) == 1 and isinstance(got["live"][0], Ack)  # not held up by "dead"
    assert len(got["dead"]) == 1 and isinstance(got["dead"][0], PeerUnreachable)
    assert [getattr(r, "error", None) for r in got["stream"]] == ["x", "second"]


def test_forget_fails_pending_calls(served: _Serve) -> None:
    socks: set[zmq.Socket[bytes]] = set()
    rpc = RpcClient(Codec(), lambda s, added: socks.add(s) if added else socks.discard(s))
    failures: list[object] = []
    rpc.call("tcp://127.0.0.1:1", StatsQuery(), None, lambda r: bool(failures.append(r)))
    rpc.forget("tcp://127.0.0.1:1")
    assert isinstance(failures[0], KVBridgeError) and rpc.pending() == 0
    rpc.close()


def test_wrong_secret_is_dropped_not_answered() -> None:
    s = _Serve(Codec("right"))
    client = ControlClient(Codec("wrong"), 0.5)
    try:
        with pytest.raises(PeerUnreachable):
            client.request(s.server.address, StatsQuery())
        good = ControlClient(Codec("right"), 5.0)
        assert isinstance(good.request(s.server.address, StatsQuery()), Ack)
        good.close()
        assert s.server.dropped_auth == 1
    finally:
        client.close()
        s.close()


def test_oversize_requests_never_reach_the_handler() -> None:
    s = _Serve(Codec(max_bytes=1 << 16))
    client = ControlClient(Codec(max_bytes=1 << 22), 0.5)
    try:
        with pytest.raises(PeerUnreachable):
            client.request(s.server.address, Heartbeat(
                generation="*", transfer_ids=[f"{i:0120d}" for i in range(4000)]))
        assert s.seen == []
    finally:
        client.close()
        s.close()


def test_malformed_frames_get_a_malformed_answer_without_a_secret(served: _Serve) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(served.server.address)
    try:
        sock.send_multipart([b"12345678", b"\x01" + b"\0" * 24 + b"\xc1"])
        assert sock.poll(5000)
        rid, data = sock.recv_multipart()
        reply = Codec().decode(data, b"A" + rid)
        assert isinstance(reply, Ack) and reply.kind is not None and not reply.ok
    finally:
        sock.close()


def test_no_secret_refuses_a_routable_bind() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(ConfigError, match="without a shared secret"):
        ControlServer(Codec(), "0.0.0.0")
    ControlServer(Codec("k"), "0.0.0.0").close()  # with a secret: allowed
    ControlServer(Codec(), "0.0.0.0", allow_insecure=True).close()  # explicitly allowed
