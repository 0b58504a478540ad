"""A control channel bound to a wildcard advertises an address peers can dial (issue 33, item 3).

Only 127.0.0.1 (and this host's own default-route address, which never leaves the host) is
dialled."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvbridge import advertise
from kvbridge.control import ControlClient, ControlServer
from kvbridge.errors import ConfigError
from kvbridge.messages import Ack, Codec, Message, StatsQuery
from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.handoffs import FAST, pull, send


def _answer_one(server: ControlServer, address: str, codec: Codec) -> Message:
    """Dial ``address`` with one request while a thread answers on ``server``."""
    done = threading.Event()

    def run() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not done.is_set():
            if server.socket.poll(50):
                for ctx, _msg in server.receive():
                    server.reply(ctx, Ack(error="seen"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    client = ControlClient(codec, 5.0)
    try:
        return client.request(address, StatsQuery())
    finally:
        done.set()
        thread.join(5)
        client.close()


def test_route_source_names_the_interface_towards_a_target() -> None:
    assert advertise.route_source(socket.AF_INET, "127.0.0.1") == "127.0.0.1"


def test_a_wildcard_bind_advertises_advertise_host() -> None:
    codec = Codec("k")
    server = ControlServer(codec, "0.0.0.0", advertise_host="127.0.0.1")
    try:
        assert server.address == f"tcp://127.0.0.1:{server.port}"
        reply = _answer_one(server, server.address, codec)
        assert isinstance(reply, Ack) and reply.error == "seen"
    finally:
        server.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "", "*"])
def test_a_wildcard_bind_advertises_the_default_route_address(host: str) -> None:
    """Unset ``advertise_host``: the address of the default-route interface (never the
    wildcard), dialable; a host without a default route refuses, naming the option."""
    codec = Codec("k")
    found = advertise.route_source(socket.AF_INET)
    if found is None:
        with pytest.raises(ConfigError, match="advertise_host"):
            ControlServer(codec, host)
        return
    server = ControlServer(codec, host)
    try:
        assert server.address == f"tcp://{found}:{server.port}"
        assert not advertise.is_wildcard(found)
        reply = _answer_one(server, server.address, codec)  # this host's own address: local
        assert isinstance(reply, Ack) and reply.error == "seen"
    finally:
        server.close()


def test_engines_bound_to_every_interface_hand_off_through_the_advertised_address() -> None:
    """Two transfer loops with a fleet secret, bound to 0.0.0.0: each advertises
    ``advertise_host`` (handshakes check the address dialled against the one advertised) and a
    pull between them moves the blocks."""
    extra = {**FAST, "secret": "s3cret", "side_channel_host": "0.0.0.0",
             "advertise_host": "127.0.0.1"}
    p = LocalAgent("prefill", extra=extra)
    d = LocalAgent("decode", extra=extra)
    try:
        for agent in (p, d):
            assert agent.address.startswith("tcp://127.0.0.1:")
            assert agent.loop.info.control_address == agent.address
        p.stage(send("p", "w", [1, 2]))
        d.pull(pull("d", "w", p, [3, 4], [1, 2]))
        assert d.drain({"d"})["results"]["failed_recving"] == set()
        np.testing.assert_array_equal(d.blocks([3, 4]), p.blocks([1, 2]))
    finally:
        p.close()
        d.close()
