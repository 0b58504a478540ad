"""kvbridge.proxy.arrival: how long a request's bytes waited in a socket, from the kernel."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator

import pytest

from kvbridge.proxy.arrival import TICK_NS, last_data_recv_ms, socket_wait_ns

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO: Linux")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    with client, accepted:
        yield client, accepted


def test_the_tick_is_the_coarse_clocks_resolution() -> None:
    assert 1_000_000 <= TICK_NS <= 10_000_000


def test_a_wait_is_a_lower_bound_within_two_ticks(
        pair: tuple[socket.socket, socket.socket]) -> None:
    client, accepted = pair
    client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    sent = time.monotonic_ns()
    time.sleep(0.05)
    before = time.monotonic_ns()
    wait = socket_wait_ns(accepted)
    after = time.monotonic_ns()
    assert wait is not None
    assert wait <= after - sent + 1_000_000  # never more than the time since the send
    assert wait >= before - sent - 2 * TICK_NS - 1_000_000  # at most two ticks short


def test_a_fresh_arrival_reads_as_no_wait(pair: tuple[socket.socket, socket.socket]) -> None:
    client, accepted = pair
    client.sendall(b"x")
    accepted.recv(1)
    wait = socket_wait_ns(accepted)
    assert wait is not None and wait < 2 * TICK_NS  # a short wait is never overstated


def test_what_is_not_a_tcp_socket_says_nothing() -> None:
    a, b = socket.socketpair()
    with a, b, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert socket_wait_ns(a) is None and last_data_recv_ms(udp) is None
    assert socket_wait_ns(None) is None and socket_wait_ns(object()) is None
    closed = socket.socket()
    closed.close()
    assert socket_wait_ns(closed) is None
