"""Transfer loops in two real processes over ``shm``: bytes, kills, checksums, layouts."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.testing.agents import AgentProcess
from kvbridge.testing.handoffs import FAST, expect, pull, send, tokens

SHAPE = (2, 64, 16, 64)
EXTRA = {**FAST, "control_timeout_s": 10}  # generous: the host may be loaded


@pytest.fixture
def pd() -> Iterator[tuple[AgentProcess, AgentProcess]]:
    procs: list[AgentProcess] = []
    try:
        procs.append(AgentProcess("prefill", SHAPE, EXTRA))
        procs.append(AgentProcess("decode", SHAPE, EXTRA))
        procs[0].fill(1)
        procs[1].fill(2)
        yield procs[0], procs[1]
    finally:
        for p in procs:
            p.close()


def test_pull_and_push_move_exact_blocks(pd: tuple[AgentProcess, AgentProcess]) -> None:
    p, d = pd
    src, dst = [3, 4, 5, 9, 20], [10, 11, 30, 31, 2]
    p.stage(send("p1", "t1", src))
    d.pull(pull("d1", "t1", p, dst, src))
    assert d.drain({"d1"})["results"]["failed_recving"] == set()
    np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
    d.expect(expect("d2", "t2", p, [40, 41, 42], prompt=tokens(5), skip=2))
    p.ready(send("p2", "t2", [1, 2, 3, 4, 5]))
    rd = d.drain({"d2"})
    assert rd["results"]["failed_recving"] == set()
    np.testing.assert_array_equal(d.blocks([40, 41, 42]), p.blocks([3, 4, 5]))
    rp = p.drain({"p1", "p2"})
    assert rp["results"]["finished_sending"] == {"p1", "p2"} and rp["pending"] == 0


def test_decode_killed_while_registered_releases_prefill(
        pd: tuple[AgentProcess, AgentProcess]) -> None:
    p, d = pd
    d.expect(expect("d", "t5", p, [7, 8]))
    time.sleep(0.5)
    d.kill()
    p.ready(send("p", "t5", [1, 2]))
    rp = p.drain({"p"}, timeout=20)
    assert rp["results"]["finished_sending"] == {"p"}
    assert rp["pending"] == 0


def test_prefill_killed_is_noticed_within_a_heartbeat() -> None:
    """D waits for a push; P's process dies. D must fail the request in about one heartbeat
    (connection refused), not after the push timeout."""
    p = AgentProcess("prefill", SHAPE, EXTRA)
    d = AgentProcess("decode", SHAPE, {**EXTRA, "push_timeout_s": 120})
    try:
        d.expect(expect("d", "t", p, [7, 8]))
        time.sleep(0.5)
        p.kill()
        t0 = time.monotonic()
        rd = d.drain({"d"}, timeout=30)
        assert rd["results"]["failed_recving"] == {"d"}
        assert time.monotonic() - t0 < 15, "not noticed within a few heartbeats"
        assert rd["stats"]["peer_gone"] == 1
        assert rd["pending"] == 0
    finally:
        p.close()
        d.close()


def test_layout_mismatch_is_named() -> None:
    p = AgentProcess("prefill", (2, 64, 16, 64), EXTRA)
    d = AgentProcess("decode", (2, 64, 16, 32), EXTRA)
    try:
        p.stage(send("p", "t7", [1]))
        d.pull(pull("d", "t7", p, [1], [1]))
        assert d.drain({"d"})["results"]["failed_recving"] == {"d"}
        why = d.outcome("t7") or ""
        assert "bytes per block" in why and "layer.0" in why, why
    finally:
        p.close()
        d.close()


def test_checksum_catches_a_byte_flipped_in_transit() -> None:
    """Negative control: a corrupted WRITE (push) and a corrupted READ (pull) are both caught."""
    extra = {**EXTRA, "checksum": True}
    p = AgentProcess("prefill", SHAPE, extra, faults={"corrupt": {1}})
    d = AgentProcess("decode", SHAPE, extra, faults={"corrupt": {1}})
    try:
        p.fill(1)
        d.fill(2)
        d.expect(expect("d-push", "c1", p, [10, 11]))
        p.ready(send("p-push", "c1", [1, 2]))
        rd = d.drain({"d-push"})
        assert rd["results"]["failed_recving"] == {"d-push"}
        assert rd["stats"]["checksum_mismatch"] == 1
        p.stage(send("p-pull", "c2", [3, 4]))
        d.pull(pull("d-pull", "c2", p, [20, 21], [3, 4]))
        assert d.drain({"d-pull"})["results"]["failed_recving"] == {"d-pull"}
        # control: the next transfer is clean and passes
        p.stage(send("p-ok", "c3", [5, 6]))
        d.pull(pull("d-ok", "c3", p, [30, 31], [5, 6]))
        assert d.drain({"d-ok"})["results"]["failed_recving"] == set()
        np.testing.assert_array_equal(d.blocks([30, 31]), p.blocks([5, 6]))
    finally:
        p.close()
        d.close()


def test_a_reused_transfer_id_is_released_not_leaked(pd: tuple[AgentProcess, AgentProcess]) -> None:
    p, _d = pd
    p.stage(send("p-1", "dup", [1, 2]))
    p.stage(send("p-2", "dup", [3, 4]))  # the same transfer_id again: refused, blocks released
    rp = p.drain({"p-2"}, timeout=5)
    assert rp["results"]["finished_sending"] == {"p-2"}
    assert rp["stats"]["duplicate_transfer"] == 1
    assert rp["pending"] == 1  # the first one still waits for its decode


def test_prefill_abort_fails_the_waiting_decode_at_once(
        pd: tuple[AgentProcess, AgentProcess]) -> None:
    p, d = pd
    d.expect(expect("d", "ab", p, [5, 6]))
    time.sleep(0.3)  # D's registration is waiting at P
    p.cancel_send("ab")
    rd = d.drain({"d"}, timeout=10)
    assert rd["results"]["failed_recving"] == {"d"}
    assert rd["stats"].get("push_timeout", 0) == 0
    d.expect(expect("d2", "ab", p, [7]))  # a registration after the abort is refused at once
    assert d.drain({"d2"}, timeout=10)["results"]["failed_recving"] == {"d2"}


def test_a_claim_that_overtakes_the_stage_is_held_until_it(
        pd: tuple[AgentProcess, AgentProcess]) -> None:
    """D may claim before P's worker has staged the blocks (its answer reached D first)."""
    p, d = pd
    d.pull(pull("d", "early", p, [9, 10], [1, 2]))
    time.sleep(0.2)
    p.stage(send("p", "early", [1, 2]))
    rd = d.drain({"d"})
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    rp = p.drain({"p"}, timeout=5)
    assert rp["results"]["finished_sending"] == {"p"}
    assert rp["stats"].get("lease_expired", 0) == 0


def test_checksum_is_negotiated_when_only_one_side_asks_for_it() -> None:
    """A flipped byte is caught even if only the decode side enables checksums: P learns it at
    the handshake and must send a digest (a result without one is refused)."""
    p = AgentProcess("prefill", SHAPE, EXTRA, faults={"corrupt": {1}})
    # faults={} wraps D's transport without faults (both sides must name the same backend)
    d = AgentProcess("decode", SHAPE, {**EXTRA, "checksum": True}, faults={})
    try:
        p.fill(1)
        d.expect(expect("d", "n1", p, [10, 11]))
        p.ready(send("p", "n1", [1, 2]))
        rd = d.drain({"d"})
        assert rd["results"]["failed_recving"] == {"d"}
        assert rd["stats"]["checksum_mismatch"] == 1
        d.expect(expect("d2", "n2", p, [12, 13]))  # the next, clean one passes
        p.ready(send("p2", "n2", [3, 4]))
        assert d.drain({"d2"})["results"]["failed_recving"] == set()
        np.testing.assert_array_equal(d.blocks([12, 13]), p.blocks([3, 4]))
    finally:
        p.close()
        d.close()
