"""The address a control channel advertises: never a wildcard (issue 33, item 3)."""

from __future__ import annotations

import socket

import pytest

from kvbridge.advertise import advertised_host, bind_endpoint, format_address, is_wildcard
from kvbridge.config import Config
from kvbridge.errors import ConfigError


def _route(v4: str | None = "10.0.0.7", v6: str | None = None):  # type: ignore[no-untyped-def]
    return lambda family: v6 if family == socket.AF_INET6 else v4


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "*", " 0.0.0.0 ", "0:0::0"])
def test_wildcards_are_recognised(host: str) -> None:
    assert is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "::1", "[fd00::2]", "node-3.local",
                                  "localhost"])
def test_concrete_hosts_are_not_wildcards(host: str) -> None:
    assert not is_wildcard(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "", "*"])
def test_an_ipv4_wildcard_advertises_the_default_route_interface(host: str) -> None:
    assert advertised_host(host, None, _route("10.0.0.7")) == "10.0.0.7"


@pytest.mark.parametrize("host", ["::", "[::]"])
def test_an_ipv6_wildcard_prefers_ipv6_then_ipv4(host: str) -> None:
    assert advertised_host(host, None, _route("10.0.0.7", "fd00::2")) == "fd00::2"
    assert advertised_host(host, None, _route("10.0.0.7", None)) == "10.0.0.7"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "*"])
def test_a_wildcard_without_a_route_is_refused_naming_advertise_host(host: str) -> None:
    with pytest.raises(ConfigError, match="advertise_host.*KVBRIDGE_ADVERTISE_HOST"):
        advertised_host(host, None, _route(None, None))
    with pytest.raises(ConfigError, match="advertise_host"):  # a route answering a wildcard
        advertised_host(host, None, _route("0.0.0.0", "::"))


def test_a_concrete_bind_is_advertised_as_bound() -> None:
    refuse = _route(None, None)
    assert advertised_host("10.1.2.3", None, refuse) == "10.1.2.3"
    assert advertised_host("[fd00::2]", None, refuse) == "fd00::2"
    assert advertised_host("node-3.local", None, refuse) == "node-3.local"


def test_advertise_host_wins_and_is_checked() -> None:
    assert advertised_host("0.0.0.0", "10.9.8.7", _route(None)) == "10.9.8.7"
    assert advertised_host("0.0.0.0", "[fd00::9]", _route(None)) == "fd00::9"
    assert advertised_host("10.1.2.3", "gateway.example", _route(None)) == "gateway.example"
    assert advertised_host("0.0.0.0", "", _route("10.0.0.7")) == "10.0.0.7"  # empty: unset
    for bad in ("0.0.0.0", "::", "[::]", "*", "10.0.0.1:5000/x", "a b", "h\n", "x" * 300):
        with pytest.raises(ConfigError, match="advertise_host"):
            advertised_host("0.0.0.0", bad, _route("10.0.0.7"))


def test_endpoints_bracket_ipv6() -> None:
    assert bind_endpoint("*") == bind_endpoint("") == "tcp://0.0.0.0"
    assert bind_endpoint("::", 5) == bind_endpoint("[::]", 5) == "tcp://[::]:5"
    assert format_address("fd00::2", 7) == format_address("[fd00::2]", 7) == "tcp://[fd00::2]:7"
    assert format_address("10.1.2.3", 7) == "tcp://10.1.2.3:7"


def test_advertise_host_is_a_configuration_key() -> None:
    cfg = Config.load({"advertise_host": "10.9.8.7"}, env={})
    assert cfg.advertise_host == "10.9.8.7"
    assert Config.load({}, env={"KVBRIDGE_ADVERTISE_HOST": "h1"}).advertise_host == "h1"
    assert Config.load({}, env={}).advertise_host is None
