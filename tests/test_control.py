"""The control channel: typed request/reply, bounded waits, authentication, size limits."""

from __future__ import annotations

import time

import pytest

from kvbridge.control import ControlClient, ControlServer
from kvbridge.errors import PeerUnreachable
from kvbridge.messages import Ack, Codec, Heartbeat, Message, StatsQuery


def _echo(msg: Message) -> Message:
    if isinstance(msg, Heartbeat):
        return Ack(ok=True, error=",".join(msg.transfer_ids))
    raise RuntimeError("boom")


def test_request_reply_and_handler_errors_are_answered() -> None:
    codec = Codec()
    server = ControlServer(_echo, codec)
    client = ControlClient(codec, 5.0)
    try:
        assert client.request(server.address, Heartbeat(transfer_ids=["a", "b"])) == Ack(
            ok=True, error="a,b")
        reply = client.request(server.address, StatsQuery())
        assert isinstance(reply, Ack) and not reply.ok and "boom" in (reply.error or "")
    finally:
        client.close()
        server.close()


def test_no_answer_is_peer_unreachable_within_the_timeout() -> None:
    codec = Codec()
    server = ControlServer(_echo, codec)
    address = server.address
    server.close()
    client = ControlClient(codec, 0.3)
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable, match="no answer"):
        client.request(address, Heartbeat(transfer_ids=["x"]))
    assert time.monotonic() - t0 < 5
    client.close()


def test_wrong_secret_is_dropped_not_answered() -> None:
    server = ControlServer(_echo, Codec("right"))
    client = ControlClient(Codec("wrong"), 0.5)
    try:
        with pytest.raises(PeerUnreachable):
            client.request(server.address, Heartbeat(transfer_ids=["x"]))
        good = ControlClient(Codec("right"), 5.0)
        assert isinstance(good.request(server.address, Heartbeat(transfer_ids=["y"])), Ack)
        good.close()
    finally:
        client.close()
        server.close()


def test_oversize_requests_never_reach_the_handler() -> None:
    seen: list[Message] = []

    def handler(msg: Message) -> Message:
        seen.append(msg)
        return Ack()

    server = ControlServer(handler, Codec(max_bytes=4096))
    client = ControlClient(Codec(max_bytes=1 << 20), 0.5)
    try:
        with pytest.raises(PeerUnreachable):
            client.request(server.address, Heartbeat(transfer_ids=["x" * 10000]))
        assert seen == []
    finally:
        client.close()
        server.close()
