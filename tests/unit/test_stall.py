"""A hand-off that makes no progress is given up within ``stall_s`` (issue 33), not after
``push_timeout_s`` or ``transfer_timeout_s``, and nothing stays pinned on either side.

In-process transfer loops over the ``memory`` transport; the decode side's transport is a
:class:`~kvbridge.testing.faults.FaultyBackend` (it speaks ``memory``) that stalls one
``add_peer`` (a connection set-up that never finishes, as NIXL's can on a shared core) or one
READ (its handle stays PENDING until the test lets it go). The prefill side that does not
answer at all is a real loop whose thread the test blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.faults import FaultyBackend
from kvbridge.testing.handoffs import FAST, pull, send, tokens

STALL_S = 1.0
#: everything that bounded these hand-offs before stall_s: far above what the tests allow
SLOW = {**FAST, "lease_s": 30, "push_timeout_s": 30, "transfer_timeout_s": 30}


def _faulty(name: str, **faults: Any) -> FaultyBackend:
    return FaultyBackend(name, {"inner": "memory", "faults": faults})


@pytest.fixture
def closing() -> Iterator[list[LocalAgent]]:
    agents: list[LocalAgent] = []
    yield agents
    for a in agents:
        a.close()


def _pending_within(agent: LocalAgent, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    pending: int = agent.loop.snapshot()["pending"]
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = agent.loop.snapshot()["pending"]
    return pending


def test_a_handshake_that_never_finishes_fails_within_stall_s(
        closing: list[LocalAgent]) -> None:
    p = LocalAgent("prefill", extra=SLOW)
    stuck = _faulty("decode", stall_add_peer=1)
    d = LocalAgent("decode", extra={**SLOW, "stall_s": STALL_S}, transport=stuck)
    closing += [p, d]
    p.stage(send("p", "t", [1, 2]))
    t0 = time.monotonic()
    d.pull(pull("d", "t", p, [5, 6], [1, 2]))
    rd = d.drain({"d"}, timeout=STALL_S + 5)
    took = time.monotonic() - t0
    assert rd["results"]["failed_recving"] == {"d"} == rd["results"]["finished_recving"]
    assert rd["results"]["invalid_blocks"] == set()  # nothing was posted: safe at once
    assert STALL_S * 0.9 <= took < STALL_S + 3, took
    assert stuck.injected == [("stall_add_peer", 1)]
    assert rd["stats"]["handoff_stalled"] == 1 and rd["pending"] == 0
    why = d.outcome("t") or ""
    assert "no progress" in why and "handshake" in why and p.address in why, why
    # P is told, so its blocks do not wait out the lease
    assert _pending_within(p, 3) == 0
    assert "cancelled by decode" in (p.outcome("t") or "")


def test_a_stalled_read_fails_within_its_bound_and_blocks_return_when_it_stops(
        closing: list[LocalAgent]) -> None:
    p = LocalAgent("prefill", extra=SLOW)
    p.fill(3)
    stuck = _faulty("decode", stall=1)
    d = LocalAgent("decode", extra={**SLOW, "stall_s": STALL_S}, transport=stuck)
    closing += [p, d]
    p.stage(send("p", "t", [1, 2]))
    t0 = time.monotonic()
    d.pull(pull("d", "t", p, [5, 6], [1, 2]))
    deadline = time.monotonic() + STALL_S + 5
    failed: set[int] = set()
    while not failed and time.monotonic() < deadline:
        failed |= d.loop.drain().invalid_blocks
        time.sleep(0.01)
    took = time.monotonic() - t0
    assert failed == {5, 6}, "the stalled READ was not given up"  # the request fails now ...
    assert took < STALL_S + 3, took
    assert stuck.injected == [("stall", 1)]
    why = d.outcome("t") or ""
    assert "no progress" in why and "READ" in why, why
    assert _pending_within(p, 3) == 0  # P released at D's word
    assert d.loop.heartbeats.watched(p.address) == set()  # and D no longer renews its lease
    rd = d.drain({"d"}, timeout=1.0)
    assert "d" not in rd["results"]["finished_recving"]  # ... D's blocks wait for the READ
    assert rd["stats"]["handoff_stalled"] == 1 and rd["pending"] == 1
    stuck.unstall()
    rd = d.drain({"d"}, timeout=5)
    assert rd["results"]["finished_recving"] == {"d"} and rd["pending"] == 0


def test_a_handshake_stuck_on_one_prefill_holds_up_no_other(closing: list[LocalAgent]) -> None:
    slow_p, p = LocalAgent("prefill-a", extra=SLOW), LocalAgent("prefill-b", extra=SLOW)
    p.fill(4)
    stuck = _faulty("decode", stall_add_peer=1)
    d = LocalAgent("decode", extra={**SLOW, "stall_s": 10}, transport=stuck)
    closing += [slow_p, p, d]
    slow_p.stage(send("a", "ta", [1, 2]))
    p.stage(send("b", "tb", [3, 4]))
    d.pull(pull("da", "ta", slow_p, [5, 6], [1, 2]))
    time.sleep(0.3)  # the first handshake is stuck in add_peer
    d.pull(pull("db", "tb", p, [7, 8], [3, 4]))
    rd = d.drain({"db"}, timeout=5)
    assert rd["results"]["finished_recving"] == {"db"} and rd["results"]["failed_recving"] == set()
    assert (d.blocks([7, 8]) == p.blocks([3, 4])).all()
    assert d.outcome("ta") == "in progress: pulling"  # still waiting, within its stall_s


def test_a_claim_nobody_answers_is_not_called_refused_and_prefill_is_told(
        closing: list[LocalAgent]) -> None:
    p = LocalAgent("prefill", extra=SLOW)
    d = LocalAgent("decode", extra={**SLOW, "control_timeout_s": 1, "stall_s": 10})
    closing += [p, d]
    p.stage(send("p0", "t0", [1, 2]))
    d.pull(pull("d0", "t0", p, [5, 6], [1, 2]))  # handshaken (cached from now on)
    assert d.drain({"d0"}, timeout=5)["results"]["failed_recving"] == set()
    p.stage(send("p1", "t1", [3, 4], prompt=tokens(2, seed=1)))
    assert _pending_within(p, 0) == 1
    frozen, stuck = threading.Event(), threading.Event()

    def freeze() -> None:
        stuck.set()
        frozen.wait(30.0)

    p.loop.submit(freeze)  # P's loop answers nothing (a starved engine)...
    assert stuck.wait(5)  # ...from now on, before D claims (not after it answered the claim)
    try:
        t0 = time.monotonic()
        d.pull(pull("d1", "t1", p, [7, 8], [3, 4], prompt=tokens(2, seed=1)))
        rd = d.drain({"d1"}, timeout=5)
        assert rd["results"]["failed_recving"] == {"d1"}
        assert time.monotonic() - t0 < 3
        why = d.outcome("t1") or ""
        assert "did not answer the claim" in why and "refused" not in why, why
        assert "within 1.0 s" in why, why
    finally:
        frozen.set()
    # the claim P reads late is followed by D's Cancel: released now, not after the lease
    assert _pending_within(p, 3) == 0
    assert "cancelled by decode" in (p.outcome("t1") or "")
