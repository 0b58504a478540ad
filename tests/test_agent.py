"""The transfer agent's pull and push state machines between two real processes over shm."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.testing.agents import AgentProcess

SHAPE = (2, 64, 16, 64)


@pytest.fixture
def pd() -> Iterator[tuple[AgentProcess, AgentProcess]]:
    procs: list[AgentProcess] = []
    try:
        extra = {"lease_s": 3, "heartbeat_s": 1, "push_timeout_s": 4,
                 "control_timeout_s": 20}  # generous: the host may be loaded
        procs.append(AgentProcess("prefill", SHAPE, extra))
        procs.append(AgentProcess("decode", SHAPE, extra))
        procs[0].call("fill", 1)
        procs[1].call("fill", 2)
        yield procs[0], procs[1]
    finally:
        for p in procs:
            p.close()


def test_pull_moves_exact_blocks(pd: tuple[AgentProcess, AgentProcess]) -> None:
    p, d = pd
    src, dst = [3, 4, 5, 9, 20], [10, 11, 30, 31, 2]
    p.call("stage", "p-req", "t1", src)
    d.call("pull", "d-req", "t1", p.address, tuple(dst), tuple(src))
    rd = d.drain({"d-req"})
    assert rd["results"]["finished_recving"] == {"d-req"}
    assert not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.call("blocks", dst), p.call("blocks", src))
    rp = p.drain({"p-req"})
    assert rp["results"]["finished_sending"] == {"p-req"}
    assert rp["pending"] == 0


@pytest.mark.parametrize("decode_first", [True, False])
def test_push_either_arrival_order(pd: tuple[AgentProcess, AgentProcess],
                                   decode_first: bool) -> None:
    p, d = pd
    src, dst = [1, 2, 3, 4], [40, 41, 42, 50]
    if decode_first:
        d.call("expect", "d-req", "t2", p.address, tuple(dst), 0)
        time.sleep(0.2)
        p.call("ready", "p-req", "t2", src)
    else:
        p.call("ready", "p-req", "t2", src)
        time.sleep(0.2)
        d.call("expect", "d-req", "t2", p.address, tuple(dst), 0)
    rd = d.drain({"d-req"})
    assert rd["results"]["finished_recving"] == {"d-req"}
    assert not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.call("blocks", dst), p.call("blocks", src))
    assert p.drain({"p-req"})["results"]["finished_sending"] == {"p-req"}


def test_push_partial_prefix_moves_only_missing_blocks(
    pd: tuple[AgentProcess, AgentProcess]
) -> None:
    p, d = pd
    src = [5, 6, 7, 8, 9]
    dst_missing = [20, 21, 22]  # decode already holds the first two prompt blocks
    before = d.call("blocks", [10, 11])
    d.call("expect", "d-req", "t3", p.address, tuple(dst_missing), 2)
    p.call("ready", "p-req", "t3", src)
    rd = d.drain({"d-req"})
    assert not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.call("blocks", dst_missing), p.call("blocks", src[2:]))
    np.testing.assert_array_equal(d.call("blocks", [10, 11]), before)
    assert rd["stats"]["push_received_bytes"] == 3 * 2 * 2 * 16 * 64 * 4


def test_lease_expiry_releases_and_fences_late_reader(
    pd: tuple[AgentProcess, AgentProcess]
) -> None:
    p, d = pd
    p.call("stage", "p-req", "t4", [1, 2])
    rp = p.drain({"p-req"}, timeout=10)  # nobody comes: lease (3 s) ends
    assert rp["results"]["finished_sending"] == {"p-req"}
    assert rp["stats"]["lease_expired"] == 1
    d.call("pull", "d-req", "t4", p.address, (5, 6), (1, 2))
    rd = d.drain({"d-req"})
    assert rd["results"]["failed_recving"] == {"d-req"}
    assert rd["results"]["invalid_blocks"] == {5, 6}


def test_push_to_dead_decode_releases_prefill(pd: tuple[AgentProcess, AgentProcess]) -> None:
    p, d = pd
    d.call("expect", "d-req", "t5", p.address, (7, 8), 0)
    time.sleep(0.3)
    d.kill()
    p.call("ready", "p-req", "t5", [1, 2])
    rp = p.drain({"p-req"}, timeout=15)
    assert rp["results"]["finished_sending"] == {"p-req"}
    assert rp["pending"] == 0


def test_push_timeout_when_prefill_never_comes(pd: tuple[AgentProcess, AgentProcess]) -> None:
    p, d = pd
    d.call("expect", "d-req", "t6", p.address, (7, 8), 0)
    rd = d.drain({"d-req"}, timeout=15)
    assert rd["results"]["failed_recving"] == {"d-req"}
    assert rd["stats"].get("push_timeout", 0) >= 1, rd["stats"]


def test_layout_mismatch_is_named() -> None:
    p = AgentProcess("prefill", (2, 64, 16, 64))
    d = AgentProcess("decode", (2, 64, 16, 32))
    try:
        p.call("stage", "p-req", "t7", [1])
        d.call("pull", "d-req", "t7", p.address, (1,), (1,))
        rd = d.drain({"d-req"})
        assert rd["results"]["failed_recving"] == {"d-req"}
    finally:
        p.close()
        d.close()


def test_checksum_catches_a_byte_flipped_in_transit() -> None:
    """Negative control: a corrupted WRITE (push) and a corrupted READ (pull) are both caught."""
    extra = {"checksum": True}
    p = AgentProcess("prefill", SHAPE, extra, faults={"corrupt": {1}})
    d = AgentProcess("decode", SHAPE, extra, faults={"corrupt": {1}})
    try:
        p.call("fill", 1)
        d.call("fill", 2)
        # push: P's first WRITE carries a flipped byte
        d.call("expect", "d-push", "c1", p.address, (10, 11), 0)
        p.call("ready", "p-push", "c1", [1, 2])
        rd = d.drain({"d-push"})
        assert rd["results"]["failed_recving"] == {"d-push"}
        assert rd["stats"]["checksum_mismatch"] == 1
        # pull: D's first READ lands with a flipped byte
        p.call("stage", "p-pull", "c2", [3, 4])
        d.call("pull", "d-pull", "c2", p.address, (20, 21), (3, 4))
        rd = d.drain({"d-pull"})
        assert rd["results"]["failed_recving"] == {"d-pull"}
        # control: the next transfers are clean and pass
        p.call("stage", "p-ok", "c3", [5, 6])
        d.call("pull", "d-ok", "c3", p.address, (30, 31), (5, 6))
        rd = d.drain({"d-ok"})
        assert not rd["results"]["failed_recving"]
        np.testing.assert_array_equal(d.call("blocks", [30, 31]), p.call("blocks", [5, 6]))
    finally:
        p.close()
        d.close()


def test_layerwise_push_posts_each_layer_then_completes(
    pd: tuple[AgentProcess, AgentProcess]
) -> None:
    p, d = pd
    src, dst = [1, 2, 3], [30, 31, 32]
    d.call("expect", "d-req", "lw", p.address, tuple(dst), 0)
    time.sleep(0.3)  # D registered: each layer is written as soon as it is ready
    p.call("layer", "p-req", "lw", src, "layer.0")
    p.call("layer", "p-req", "lw", src, "layer.1")
    p.call("ready", "p-req", "lw", src)
    rd = d.drain({"d-req"})
    assert rd["results"]["finished_recving"] == {"d-req"}
    assert not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.call("blocks", dst), p.call("blocks", src))
    rp = p.drain({"p-req"})
    assert rp["results"]["finished_sending"] == {"p-req"}
    assert rp["stats"]["push_layerwise"] == 1


def test_a_reused_transfer_id_is_released_not_leaked(pd: tuple[AgentProcess, AgentProcess]) -> None:
    p, _d = pd
    p.call("stage", "p-1", "dup", [1, 2])
    p.call("stage", "p-2", "dup", [3, 4])  # the same transfer_id again: refused, blocks released
    rp = p.drain({"p-2"}, timeout=5)
    assert rp["results"]["finished_sending"] == {"p-2"}
    assert rp["stats"]["internal_errors"] == 1
    assert rp["pending"] == 1  # the first one still waits for its decode


def test_prefill_abort_fails_the_waiting_decode_at_once(
    pd: tuple[AgentProcess, AgentProcess]
) -> None:
    """P's request was aborted before its KV was ready: D hears FAIL now, not after a timeout."""
    p, d = pd
    d.call("expect", "d-req", "ab", p.address, (5, 6), 0)
    time.sleep(0.3)  # D's registration is waiting at P
    t0 = time.monotonic()
    p.call("cancel_send", "p-req", "ab")
    rd = d.drain({"d-req"}, timeout=10)
    assert rd["results"]["failed_recving"] == {"d-req"}
    assert time.monotonic() - t0 < 3.0  # well before push_timeout_s (4 s) would have fired
    assert rd["stats"].get("push_timeout", 0) == 0
    # and a registration arriving after the abort is refused at once as well
    d.call("expect", "d-req2", "ab", p.address, (7,), 0)
    assert d.drain({"d-req2"}, timeout=10)["results"]["failed_recving"] == {"d-req2"}


def test_pull_done_before_the_stage_releases_on_stage(
    pd: tuple[AgentProcess, AgentProcess]
) -> None:
    """D may READ and say DONE before P's worker has staged the blocks: P must still release."""
    p, d = pd
    d.call("pull", "d-req", "early", p.address, (9, 10), (1, 2))
    rd = d.drain({"d-req"})
    assert rd["results"]["finished_recving"] == {"d-req"}
    assert not rd["results"]["failed_recving"]
    p.call("stage", "p-req", "early", [1, 2])
    rp = p.drain({"p-req"}, timeout=2)  # at once, not after the 3 s lease
    assert rp["results"]["finished_sending"] == {"p-req"}
    assert rp["stats"].get("lease_expired", 0) == 0
    assert rp["pending"] == 0
