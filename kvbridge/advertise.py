"""Which address an engine's control channel binds, and which one it advertises to peers.

The control channel binds ``side_channel_host``; every peer (and the router, through the
``remote_host`` of P's answer) dials the address the engine *advertises*. A wildcard bind
(``0.0.0.0``, ``::``, ``[::]``, ``*`` or empty) listens on every interface but is no address
another host can dial, so it is never advertised. :func:`advertised_host` picks, in order:

1. ``advertise_host``, when set: advertised as given (an IP address or a host name; a wildcard
   or a value with characters no address has is a :class:`ConfigError` naming the option);
2. a concrete ``side_channel_host``, as bound;
3. for a wildcard bind, the address of this host's interface that routes to the default route
   (:func:`route_source`: a UDP socket's ``connect()`` makes the kernel pick the source address;
   no packet is sent), IPv6 first for an IPv6 wildcard;
4. else a :class:`ConfigError` naming ``advertise_host``: start-up fails rather than advertising
   an address no peer can dial.

Pure apart from :func:`route_source` (one unconnected-then-connected UDP socket, closed at once).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable

from kvbridge.errors import ConfigError

__all__ = ["is_wildcard", "bind_endpoint", "advertised_host", "route_source", "format_address",
           "ROUTE_TARGETS"]

#: Addresses whose route finds the default-route interface (never contacted: connect() on a UDP
#: socket only consults the routing table).
ROUTE_TARGETS: dict[int, str] = {socket.AF_INET: "8.8.8.8", socket.AF_INET6: "2001:4860:4860::8888"}

# what an IP address or a host name may hold (kvbridge.params accepts the same in remote_host)
_HOST = re.compile(r"[A-Za-z0-9.:%_-]{1,253}\Z")

Route = Callable[[int], "str | None"]


def _bare(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_wildcard(host: str) -> bool:
    """True for a bind address that means "every interface": ``0.0.0.0``, ``::``, ``[::]``,
    ``*``, empty (and any other unspecified IP address spelling)."""
    bare = _bare(host.strip())
    if bare in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        return False


def _is_v6(host: str) -> bool:
    return ":" in _bare(host)


def bind_endpoint(host: str, port: int | None = None) -> str:
    """The ZeroMQ endpoint that binds ``host`` (``tcp://0.0.0.0`` for ``*`` and empty,
    brackets around an IPv6 address), with ``:port`` when given."""
    bare = _bare(host.strip())
    if bare in ("", "*"):
        bare = "0.0.0.0"
    shown = f"[{bare}]" if ":" in bare else bare
    return f"tcp://{shown}" + ("" if port is None else f":{port}")


def format_address(host: str, port: int) -> str:
    """``tcp://host:port`` as peers dial it (an IPv6 address in brackets)."""
    bare = _bare(host)
    return f"tcp://[{bare}]:{port}" if ":" in bare else f"tcp://{bare}:{port}"


def route_source(family: int, target: str | None = None) -> str | None:
    """The address of the interface this host would use to reach ``target`` (default: an
    address behind the default route, :data:`ROUTE_TARGETS`), or None without such a route.
    Sends nothing."""
    target = target or ROUTE_TARGETS[family]
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((target, 9))
            addr = str(sock.getsockname()[0])
    except OSError:
        return None
    return None if is_wildcard(addr) else addr.split("%", 1)[0]


def advertised_host(bind_host: str, advertise_host: str | None = None,
                    route: Route = route_source) -> str:
    """The host (no brackets) peers dial for a control channel bound on ``bind_host``; see the
    module docstring for the order. ``route(family)`` finds the default-route interface's
    address (tests pass their own). Raises :class:`ConfigError` naming ``advertise_host``."""
    if advertise_host:
        bare = _bare(advertise_host)
        if is_wildcard(bare) or not _HOST.match(bare):
            raise ConfigError(
                f"advertise_host {advertise_host!r} is not an address peers can dial: give this "
                "host's IP address (or name) on the network its peers reach it through")
        return bare
    if not is_wildcard(bind_host):
        return _bare(bind_host.strip())
    families = ([socket.AF_INET6, socket.AF_INET] if _is_v6(bind_host)
                else [socket.AF_INET])
    for family in families:
        found = route(family)
        if found and not is_wildcard(found):
            return _bare(found)
    raise ConfigError(
        f"side_channel_host {bind_host!r} binds every interface, and this host has no default "
        "route to tell which address its peers should dial: set advertise_host "
        "(KVBRIDGE_ADVERTISE_HOST) to this host's address on the peers' network, or bind "
        "side_channel_host to that address")
