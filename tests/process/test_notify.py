"""The notification inbox (``kvbridge.transports.notify``): fair limits per sending agent.

Issue 25 item 5: the inbox's bounds were global and the newest message was dropped when full,
so one sender could fill it for every other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvbridge.transports.notify import NotificationInbox, NotificationSender

KIB = 1024


def _until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def senders() -> Iterator[list[NotificationSender]]:
    made: list[NotificationSender] = []
    yield made
    for s in made:
        s.close()


def _sender(inbox: NotificationInbox, agent: str,
            made: list[NotificationSender]) -> NotificationSender:
    s = NotificationSender(inbox.address, agent)
    made.append(s)
    return s


def _arrived(inbox: NotificationInbox, n: int, size: int) -> Callable[[], bool]:
    """``n`` messages of ``size`` bytes arrived since the last drain (queued or dropped)."""
    return lambda: inbox.held_bytes // size + inbox.dropped_full >= n


def test_a_flooding_sender_cannot_starve_another(senders: list[NotificationSender]) -> None:
    inbox = NotificationInbox(max_messages=8, max_bytes=1 << 20)
    try:
        flood = _sender(inbox, "flood", senders)
        for i in range(50):
            flood.send(b"f%03d" % i)
        _until(_arrived(inbox, 50, 4))
        assert inbox.dropped_full == 42  # the bound is full, all of it the flood's
        quiet = _sender(inbox, "quiet", senders)
        for i in range(6):
            quiet.send(b"q%03d" % i)
        _until(_arrived(inbox, 56, 4))
        # past the bound, "quiet" gets its fair share, 8 // 2 senders = 4; "flood" holds more
        assert inbox.dropped_full == 42 + 2
        flood.send(b"fxxx")
        _until(_arrived(inbox, 57, 4))
        assert inbox.dropped_full == 42 + 3
        # more senders, one message each: each under its share (at least 1) until 2 x 8 = 16
        for k in range(6):
            _sender(inbox, f"s{k}", senders).send(b"s%03d" % k)
        _until(_arrived(inbox, 63, 4))
        assert inbox.dropped_full == 42 + 3 + 2 and inbox.held_bytes == 16 * 4  # hard bound
        got = inbox.drain()
        assert [m for a, m in got if a == "flood"] == [b"f%03d" % i for i in range(8)]
        assert [m for a, m in got if a == "quiet"] == [b"q%03d" % i for i in range(4)]
        assert len(got) == 16
        # drained: the bound is free again, for anyone
        flood.send(b"f050")
        _until(lambda: inbox.held_bytes == 4)
        assert inbox.drain() == [("flood", b"f050")]
    finally:
        inbox.close()


def test_bytes_are_shared_fairly_too(senders: list[NotificationSender]) -> None:
    inbox = NotificationInbox(max_messages=1000, max_bytes=8 * KIB)
    try:
        flood = _sender(inbox, "flood", senders)
        for _ in range(20):
            flood.send(b"f" * KIB)
        _until(_arrived(inbox, 20, KIB))
        assert inbox.dropped_full == 12 and inbox.held_bytes == 8 * KIB
        quiet = _sender(inbox, "quiet", senders)
        for _ in range(6):
            quiet.send(b"q" * KIB)
        _until(_arrived(inbox, 26, KIB))
        # its fair share of bytes is 8 KiB // 2 senders = 4 KiB
        assert inbox.dropped_full == 12 + 2 and inbox.held_bytes == 12 * KIB
        assert sum(a == "quiet" for a, _ in inbox.drain()) == 4
        # a single message larger than max_bytes is never queued, even into an empty inbox
        quiet.send(b"q" * (9 * KIB))
        _until(lambda: inbox.dropped_full == 15)
        assert inbox.held_bytes == 0 and inbox.drain() == []
    finally:
        inbox.close()
