"""How long a request waited in the proxy's socket before the proxy's handler ran.

A process that is not running cannot take a timestamp: the proxy's flight starts when its
handler runs (``receive``), so a request whose bytes sat in the socket while the host ran
something else, or while the proxy's event loop was busy with other requests, left that wait
outside every record. The kernel keeps, per TCP socket, when data last arrived
(``tcpi_last_data_recv`` of ``TCP_INFO``: milliseconds since the last data segment, counted in
scheduler ticks). :func:`socket_wait_ns` turns it into a **lower bound** of the wait: the
count less one tick (whose length is the resolution of ``CLOCK_MONOTONIC_COARSE``: 4 ms at
``HZ=250``, 1 ms at ``HZ=1000``), so a short wait reads as 0 and a long one is never
overstated. Called when the handler starts, the last data is the request itself (HTTP/1.1
sends a request's headers and body before it waits for the answer; a body still arriving only
makes the bound smaller).

Linux only; elsewhere, for a socket that is not TCP (a Unix socket) or when the kernel's
answer is shorter than expected, it returns None. One ``getsockopt`` call (about a
microsecond); thread-safe; never raises.
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from typing import Any

__all__ = ["TICK_NS", "socket_wait_ns", "last_data_recv_ms"]

# struct tcp_info: 8 bytes of u8 fields, then u32 rto, ato, snd_mss, rcv_mss, unacked, sacked,
# lost, retrans, fackets, last_data_sent, last_ack_sent, last_data_recv, ...
_LAST_DATA_RECV = 8 + 11 * 4
_U32 = struct.Struct("=I")
_LINUX = sys.platform.startswith("linux")
# other systems' TCP_INFO (FreeBSD's) has another layout: read Linux's only
_TCP_INFO = getattr(socket, "TCP_INFO", None) if _LINUX else None
_COARSE = getattr(time, "CLOCK_MONOTONIC_COARSE", 6)  # Linux's clock id


def _tick_ns() -> int:
    """The kernel's scheduler tick (the unit of ``tcpi_last_data_recv``), or 10 ms when the
    coarse clock cannot say (the longest tick Linux has: ``HZ=100``)."""
    if not _LINUX:
        return 10_000_000
    try:
        res = time.clock_getres(_COARSE)
    except (OSError, AttributeError):
        return 10_000_000
    return int(res * 1e9) if 0 < res <= 0.01 else 10_000_000


TICK_NS = _tick_ns()


def last_data_recv_ms(sock: Any) -> int | None:
    """``tcpi_last_data_recv`` of ``sock`` (a socket or asyncio's wrapper of one), or None."""
    if _TCP_INFO is None or sock is None:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _LAST_DATA_RECV + _U32.size)
    except (OSError, AttributeError, ValueError):
        return None
    if not isinstance(info, bytes) or len(info) < _LAST_DATA_RECV + _U32.size:
        return None
    return int(_U32.unpack_from(info, _LAST_DATA_RECV)[0])


def socket_wait_ns(sock: Any) -> int | None:
    """A lower bound (ns, ≥ 0) of the time since data last arrived on ``sock``, or None when
    the kernel cannot say (see the module docstring)."""
    ms = last_data_recv_ms(sock)
    if ms is None:
        return None
    return max(0, ms * 1_000_000 - TICK_NS)
