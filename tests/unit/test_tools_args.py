"""kvbridge.tools.args: the command-line values the subcommands share."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools.args import parse_control_address


@pytest.mark.parametrize(("text", "address"), [
    ("127.0.0.1:5600", "tcp://127.0.0.1:5600"),
    ("tcp://127.0.0.1:5600", "tcp://127.0.0.1:5600"),
    (" engine-0.example:5601 ", "tcp://engine-0.example:5601"),
    ("[::1]:5600", "tcp://[::1]:5600"),
    ("tcp://[::1]:5600", "tcp://[::1]:5600"),
])
def test_control_address_accepts_host_port_and_tcp(text: str, address: str) -> None:
    assert parse_control_address(text, "kvbridge stats") == address


@pytest.mark.parametrize(("text", "why"), [
    ("127.0.0.1", "has no port"),
    ("tcp://127.0.0.1", "has no port"),
    ("http://127.0.0.1:8100", "is an HTTP URL"),
    ("https://engine.example", "is an HTTP URL"),
    ("udp://127.0.0.1:5600", "is a udp URL"),
    ("127.0.0.1:http", "port 'http'"),
    ("127.0.0.1:70000", "port '70000'"),
    ("::1:5600", "IPv6 host goes in brackets"),
])
def test_control_address_says_it_is_not_the_http_url(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_control_address(text, "kvbridge stats")
    message = str(info.value)
    assert message.startswith("kvbridge stats: ") and why in message
    assert "tcp://HOST:PORT" in message and "not the engine's HTTP URL" in message
