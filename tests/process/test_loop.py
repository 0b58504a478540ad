"""The transfer loop's pull and push state machines, in this process over ``memory``.

Each test names the issue item (core v2) whose defect it would have caught.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.control import ControlClient
from kvbridge.errors import TransferFailed
from kvbridge.messages import (
    Ack,
    Cancel,
    Codec,
    ErrorKind,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    PullClaim,
    PullDone,
    PushRegister,
    PushResult,
    StatsQuery,
    StatsReply,
)
from kvbridge.scheduling.planner import prompt_digest
from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.clients import engine_client, engine_codec
from kvbridge.testing.handoffs import FAST, expect, pull, send, tokens
from kvbridge.transport import HandleState, Op, TransferHandle, Transport

PD = tuple[LocalAgent, LocalAgent]


def test_pull_moves_exact_blocks(local_pd: PD) -> None:
    p, d = local_pd
    src, dst = [3, 4, 5, 9, 20], [10, 11, 30, 31, 2]
    p.stage(send("p", "t1", src))
    d.pull(pull("d", "t1", p, dst, src))
    rd = d.drain({"d"})
    assert rd["results"]["finished_recving"] == {"d"}
    assert not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
    rp = p.drain({"p"})
    assert rp["results"]["finished_sending"] == {"p"} and rp["pending"] == 0


@pytest.mark.parametrize("decode_first", [True, False])
def test_push_either_arrival_order(local_pd: PD, decode_first: bool) -> None:
    p, d = local_pd
    src, dst = [1, 2, 3, 4], [40, 41, 42, 50]
    if decode_first:
        d.expect(expect("d", "t2", p, dst))
        time.sleep(0.1)
        p.ready(send("p", "t2", src))
    else:
        p.ready(send("p", "t2", src))
        time.sleep(0.1)
        d.expect(expect("d", "t2", p, dst))
    rd = d.drain({"d"})
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
    assert p.drain({"p"})["results"]["finished_sending"] == {"p"}


def test_push_partial_prefix_moves_only_missing_blocks(local_pd: PD) -> None:
    p, d = local_pd
    src, missing = [5, 6, 7, 8, 9], [20, 21, 22]
    before = d.blocks([10, 11])
    d.expect(expect("d", "t3", p, missing, prompt=tokens(5), skip=2))
    p.ready(send("p", "t3", src))
    rd = d.drain({"d"})
    assert not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.blocks(missing), p.blocks(src[2:]))
    np.testing.assert_array_equal(d.blocks([10, 11]), before)
    assert rd["stats"]["push_received_bytes"] == 3 * 2 * 2 * 16 * 64 * 4


def test_layerwise_push_posts_each_layer(local_pd: PD) -> None:
    p, d = local_pd
    src, dst = [1, 2, 3], [30, 31, 32]
    d.expect(expect("d", "lw", p, dst))
    time.sleep(0.2)  # D registered and confirmed: each layer is written as it is ready
    plan = send("p", "lw", src, layerwise=True)
    p.layer(plan, "layer.0")
    p.layer(plan, "layer.1")
    p.ready(plan)
    rd = d.drain({"d"})
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
    rp = p.drain({"p"})
    assert rp["stats"]["push_layerwise"] == 1


# -- item 2: D reads only what P leased to that transfer, for that prompt ---------------------


@pytest.mark.parametrize("what", ["blocks", "tokens", "prompt", "unknown"])
def test_claim_must_match_what_prefill_leased(local_pd: PD, what: str) -> None:
    p, d = local_pd
    src = [1, 2, 3]
    p.stage(send("p", "t", src, prompt=tokens(3, seed=1)))
    spec = {
        "blocks": pull("d", "t", p, [7, 8, 9], [4, 5, 6], prompt=tokens(3, seed=1)),
        "tokens": pull("d", "t", p, [7, 8, 9], src, prompt=tokens(3, seed=1)[:-1]),
        "prompt": pull("d", "t", p, [7, 8, 9], src, prompt=tokens(3, seed=2)),
        "unknown": pull("d", "never-staged", p, [7, 8, 9], src, prompt=tokens(3, seed=1)),
    }[what]
    before = d.blocks([7, 8, 9])
    d.pull(spec)
    rd = d.drain({"d"}, timeout=15)
    assert rd["results"]["failed_recving"] == {"d"}
    assert rd["stats"]["claim_refused"] == 1
    np.testing.assert_array_equal(d.blocks([7, 8, 9]), before)  # nothing was read
    # the rightful decode still gets its KV afterwards
    d.pull(pull("d2", "t", p, [7, 8, 9], src, prompt=tokens(3, seed=1)))
    assert d.drain({"d2"})["results"]["failed_recving"] == set()
    np.testing.assert_array_equal(d.blocks([7, 8, 9]), p.blocks(src))


def test_push_registration_for_another_prompt_is_refused(local_pd: PD) -> None:
    p, d = local_pd
    p.ready(send("p", "t", [1, 2], prompt=tokens(2, seed=1)))
    d.expect(expect("d", "t", p, [5, 6], prompt=tokens(2, seed=9)))
    rd = d.drain({"d"})
    assert rd["results"]["failed_recving"] == {"d"}
    assert p.drain({"p"})["results"]["finished_sending"] == {"p"}


# -- item 7: forged Hello / registration -------------------------------------------------------


def _client() -> ControlClient:
    return engine_client(5.0)


def test_unsolicited_hello_adds_no_peer(local_pd: PD) -> None:
    p, d = local_pd
    c = _client()
    try:
        reply = c.request(p.address, Hello(info=d.loop.info, challenge=os.urandom(32)))
        assert isinstance(reply, HelloReply)
    finally:
        c.close()
    assert len(p.loop.peers) == 0  # learnt only by dialling


def test_forged_registration_naming_a_real_decode_writes_nothing(local_pd: PD) -> None:
    """An attacker registers a transfer into D's blocks in D's name: P dials D to confirm, D
    never registered it, so P writes nothing."""
    p, d = local_pd
    victim = [40, 41]
    before = d.blocks(victim)
    c = _client()
    try:
        ack = c.request(p.address, PushRegister(
            transfer_id="t-evil", generation=p.generation, engine_id="decode",
            sender_generation=d.generation, control_address=d.address, block_ids=victim,
            num_tokens=32, prompt_digest=prompt_digest(tokens(2)),
            layout_fingerprint=p.loop.info.layout_fingerprint))
        assert isinstance(ack, Ack) and ack.ok  # registered, pending D's confirmation
        p.ready(send("p", "t-evil", [1, 2]))
        rp = p.drain({"p"})
    finally:
        c.close()
    assert rp["results"]["finished_sending"] == {"p"}
    assert rp["stats"]["confirm_refused"] == 1
    assert rp["stats"].get("push_sent", 0) == 0
    np.testing.assert_array_equal(d.blocks(victim), before)


def test_registration_naming_an_address_of_another_engine_is_refused(local_pd: PD) -> None:
    """Refused alone (issue 33 item 5): the rightful decode, registering after it, still gets
    the push."""
    p, d = local_pd
    other = LocalAgent("other", extra=FAST)
    try:
        c = _client()
        try:
            c.request(p.address, PushRegister(
                transfer_id="t-x", generation="*", engine_id="decode",
                sender_generation=d.generation, control_address=other.address,
                block_ids=[1], num_tokens=16, prompt_digest=prompt_digest(tokens(1)),
                layout_fingerprint=p.loop.info.layout_fingerprint))
        finally:
            c.close()
        p.ready(send("p", "t-x", [1]))
        deadline = time.monotonic() + 5
        while not p.loop.snapshot()["stats"].get("register_refused"):
            assert time.monotonic() < deadline, "the forged registration was not refused"
            time.sleep(0.02)
        d.expect(expect("d", "t-x", p, [5]))
        assert d.drain({"d"})["results"]["failed_recving"] == set()
        np.testing.assert_array_equal(d.blocks([5]), p.blocks([1]))
        rp = p.drain({"p"})
        assert rp["results"]["finished_sending"] == {"p"}
        assert rp["stats"]["register_refused"] == 1 and rp["stats"]["push_sent"] == 1
        assert rp["stats"].get("push_failed", 0) == 0
    finally:
        other.close()


# -- item 8 and 13: hostile frames and floods ----------------------------------------------------


def test_hostile_frames_do_not_stop_the_control_plane(local_pd: PD) -> None:
    import zmq

    p, d = local_pd
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(p.address)
    try:
        nested = b"\x91" * 100_000 + b"\xc0"  # [[[[...]]]] 100 000 deep, 100 KB
        junk = [
            b"", b"x" * 7, b"\x01" + b"\0" * 24 + nested,
            b"\x01" + b"\0" * 24 + b"\x81\xa4type\xa9Heartbeat" + b"\x81\xa1a" + nested,
            Codec().encode(Heartbeat(generation="*", transfer_ids=[])) + b"trailing",
            b"\x09" * 40, b"\x01" + b"\0" * 24 + b"\xc1" * 1000,
        ]
        for body in junk:
            sock.send_multipart([b"12345678", body])
            sock.send_multipart([b"short", body])  # a bad request id as well
        sock.send_multipart([b"12345678", b"\x01" * (5 << 20)])  # above the size limit
    finally:
        sock.close()
    # the control plane still answers, and transfers still work
    c = _client()
    try:
        assert isinstance(c.request(p.address, StatsQuery()), StatsReply)
    finally:
        c.close()
    p.stage(send("p", "ok", [1]))
    d.pull(pull("d", "ok", p, [2], [1]))
    assert d.drain({"d"})["results"]["failed_recving"] == set()


def test_oversized_heartbeat_is_refused_not_processed(local_pd: PD) -> None:
    p, _ = local_pd
    c = engine_client(5.0, max_bytes=64 << 20)
    try:
        # more ids than a heartbeat may carry (constructing a struct does not check bounds: a
        # hostile peer's encoder ignores them), signed with the secret: only the parser refuses
        import zmq

        from kvbridge.control import request_context

        codec = engine_codec()
        frame = codec.encode(Heartbeat(generation="*",
                                       transfer_ids=[f"t{i}" for i in range(50_000)]),
                             request_context(b"12345678"))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(p.address)
        try:
            sock.send_multipart([b"12345678", frame])
            assert sock.poll(5000)
            _rid, data = sock.recv_multipart()
        finally:
            sock.close()
        reply = codec.decode(data, b"A12345678")
        assert isinstance(reply, Ack) and reply.kind is ErrorKind.MALFORMED
        assert isinstance(c.request(p.address, StatsQuery()), StatsReply)
    finally:
        c.close()


@pytest.fixture
def silent() -> Iterator[str]:
    """An address that accepts connections and never answers (a hung engine)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        sock.close()


def test_registration_flood_is_bounded_per_connection(silent: str) -> None:
    p = LocalAgent("prefill", extra={**FAST, "max_pending_per_peer": 4})
    c = _client()
    try:
        outcomes = []
        for i in range(10):
            ack = c.request(p.address, PushRegister(
                transfer_id=f"junk-{i}", generation="*", engine_id="x", sender_generation="g",
                control_address=silent, block_ids=[1], num_tokens=16,
                prompt_digest="x", layout_fingerprint=p.loop.info.layout_fingerprint))
            assert isinstance(ack, Ack)
            outcomes.append(ack.kind)
        assert outcomes.count(ErrorKind.BUSY) >= 6
        assert p.loop.snapshot()["stats"]["register_refused_busy"] >= 6
    finally:
        c.close()
        p.close()


def test_hello_flood_does_not_grow_peer_tables(local_pd: PD) -> None:
    p, d = local_pd
    c = _client()
    try:
        for _ in range(200):
            c.request(p.address, Hello(info=d.loop.info, challenge=os.urandom(32)))
    finally:
        c.close()
    assert len(p.loop.peers) == 0


def test_with_a_secret_replays_and_strangers_are_dropped() -> None:
    extra = {**FAST, "secret": "s3cret"}
    p = LocalAgent("prefill", extra=extra)
    d = LocalAgent("decode", extra=extra)
    try:
        stranger = ControlClient(Codec(), 1.0)
        with pytest.raises(Exception, match="no answer"):
            stranger.request(p.address, StatsQuery())
        stranger.close()
        # a captured frame replayed verbatim is dropped
        import zmq

        codec = Codec("s3cret")
        frame = codec.encode(StatsQuery(), b"Q" + b"r" * 8)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(p.address)
        try:
            sock.send_multipart([b"r" * 8, frame])
            assert sock.poll(5000)
            sock.recv_multipart()
            sock.send_multipart([b"r" * 8, frame])
            assert not sock.poll(1000)
        finally:
            sock.close()
        assert p.loop.server.dropped_auth >= 2
        # and peers with the secret work
        p.stage(send("p", "s", [1, 2]))
        d.pull(pull("d", "s", p, [3, 4], [1, 2]))
        assert d.drain({"d"})["results"]["failed_recving"] == set()
    finally:
        p.close()
        d.close()


# -- item 9: late writes, cancel races, forged completions ------------------------------------


class _SlowWrites(Transport):
    """Wraps a transport: every transfer completes only when the test says so."""

    name = "memory"

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.agent_name)
        self.inner = inner
        self.held: list[tuple[TransferHandle, TransferHandle]] = []
        self.hold = threading.Event()
        self.hold.set()

    def register_memory(self, regions: Any) -> bytes:
        return self.inner.register_memory(regions)

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        self.inner.attest(proof, peer_metadata)

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        return self.inner.add_peer(metadata, proof)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def _submit(self, op: Op, peer: str, local: Any, remote: Any,
                notification: bytes | None) -> TransferHandle:
        inner = self.inner.submit(op, peer, local, remote, notification)
        if not self.hold.is_set():
            return inner
        outer = TransferHandle(op, peer, inner.nbytes, inner.count)
        self.held.append((outer, inner))
        return outer

    def release(self) -> None:
        for outer, inner in self.held:
            self.inner.wait(inner, 10)
            if inner.state is HandleState.DONE:
                outer.succeed()
            else:
                outer.fail(inner.error or "transfer failed")
        self.held.clear()

    def poll(self, handle: TransferHandle) -> HandleState:
        return handle.state

    def send_notification(self, peer: str, message: bytes) -> None:
        self.inner.send_notification(peer, message)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.get_notifications()

    def close(self, timeout: float = 5.0) -> None:
        self.release()
        self.inner.close(timeout)


def _slow_prefill(extra: dict[str, Any] | None = None) -> tuple[LocalAgent, _SlowWrites]:
    from kvbridge.transports.memory import MemoryTransport

    slow = _SlowWrites(MemoryTransport("slow-prefill"))
    return LocalAgent("prefill", extra={**FAST, **(extra or {})}, transport=slow), slow


def test_cancel_while_a_write_is_in_flight_holds_blocks_until_it_stopped() -> None:
    p, slow = _slow_prefill()
    d = LocalAgent("decode", extra=FAST)
    try:
        d.expect(expect("d", "t", p, [5, 6]))
        p.ready(send("p", "t", [1, 2]))
        deadline = time.monotonic() + 5
        while not slow.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow.held, "the WRITE was not posted"
        d.cancel_recv("t")  # the request is aborted on D while P's WRITE is in flight
        rd = d.drain({"d"}, timeout=1.0)
        assert "d" not in rd["results"]["finished_recving"]  # blocks NOT given back yet
        assert rd["results"]["invalid_blocks"] == {5, 6}  # but the request fails now
        slow.release()
        rd = d.drain({"d"}, timeout=5)
        assert rd["results"]["finished_recving"] == {"d"}  # now they are safe
        assert rd["results"]["failed_recving"] == {"d"}
    finally:
        p.close()
        d.close()


def test_push_timeout_before_confirmation_is_safe_at_once() -> None:
    p = LocalAgent("prefill", extra=FAST)
    d = LocalAgent("decode", extra={**FAST, "push_timeout_s": 1})
    try:
        d.loop.observe.admit("prefill")  # as D's handshake with P does (peer table)
        d.expect(expect("d", "t", p, [5, 6]))  # P's request never comes
        time.sleep(0.2)
        rd = d.drain({"d"}, timeout=10)
        assert rd["results"]["failed_recving"] == {"d"}
        assert rd["stats"]["push_timeout"] == 1
        events = {tuple(e[:4]): e[4] for e in d.loop.observe.drain()["events"]}
        # the same failures, labelled for vLLM's metrics by mode, backend and P's engine id
        assert events[("push_timeout", "push", "memory", "prefill")] == 1
        assert events[("recv_failed", "push", "memory", "prefill")] == 1
    finally:
        p.close()
        d.close()


def test_push_result_from_anyone_but_the_registration_is_not_accepted(local_pd: PD) -> None:
    p, d = local_pd
    d.expect(expect("d", "t", p, [5, 6]))
    time.sleep(0.2)
    c = _client()
    try:
        reply = c.request(d.address, PushResult(transfer_id="t", ok=True, nbytes=1 << 20))
        assert isinstance(reply, Ack) and not reply.ok
    finally:
        c.close()
    assert d.drain({"d"}, timeout=0.5)["results"]["finished_recving"] == set()
    p.ready(send("p", "t", [1, 2]))
    assert d.drain({"d"})["results"]["failed_recving"] == set()


def test_forged_done_from_another_connection_is_refused(local_pd: PD) -> None:
    p, d = local_pd
    p.stage(send("p", "t", [1, 2]))
    c = _client()
    try:
        reply = c.request(p.address, PullDone(transfer_id="t", nbytes=2 * 8192))
        assert isinstance(reply, Ack) and not reply.ok
        reply = c.request(p.address, Cancel(transfer_id="t", reason="x"))
    finally:
        c.close()
    # P still holds it for the rightful decode... unless the unclaimed cancel released it
    d.pull(pull("d", "t2", p, [3], [1]))
    d.drain({"d"}, timeout=5)
    assert p.loop.snapshot()["stats"].get("forged_done", 0) == 1


def test_done_from_the_claimant_with_a_wrong_byte_count_releases_and_fails(
        local_pd: PD) -> None:
    p, _ = local_pd
    p.stage(send("p", "t", [1, 2]))
    c = _client()  # one connection: it claims, then reports a wrong byte count
    try:
        claim = c.request(p.address, PullClaim(
            transfer_id="t", generation=p.generation, block_ids=[1, 2], num_tokens=32,
            prompt_digest=prompt_digest(tokens(2))))
        assert isinstance(claim, Ack) and claim.ok
        done = c.request(p.address, PullDone(transfer_id="t", nbytes=12345))
        assert isinstance(done, Ack) and done.kind is ErrorKind.MISMATCH
    finally:
        c.close()
    rp = p.drain({"p"})
    assert rp["results"]["finished_sending"] == {"p"} and rp["pending"] == 0  # not pinned
    assert (p.outcome("t") or "").startswith("failed")


# -- item 10 and 12: failures are failures; nothing hangs ------------------------------------


class _FailingSubmit(_SlowWrites):
    def _submit(self, op: Op, peer: str, local: Any, remote: Any,
                notification: bytes | None) -> TransferHandle:
        raise TransferFailed("injected: the NIC refused the WRITE")


def test_a_write_that_cannot_be_posted_is_a_failure_not_a_success() -> None:
    from kvbridge.transports.memory import MemoryTransport

    p = LocalAgent("prefill", extra=FAST, transport=_FailingSubmit(MemoryTransport("fp")))
    d = LocalAgent("decode", extra=FAST)
    try:
        d.expect(expect("d", "t", p, [5, 6]))
        p.ready(send("p", "t", [1, 2]))
        rd = d.drain({"d"})
        assert rd["results"]["failed_recving"] == {"d"}
        assert rd["stats"].get("push_received_bytes", 0) == 0
        assert p.drain({"p"})["results"]["finished_sending"] == {"p"}
    finally:
        p.close()
        d.close()


def test_a_stuck_write_is_a_failure_and_d_keeps_its_blocks_until_it_stopped() -> None:
    p, slow = _slow_prefill({"transfer_timeout_s": 0.5})
    d = LocalAgent("decode", extra=FAST)
    try:
        d.expect(expect("d", "t", p, [5, 6]))
        p.ready(send("p", "t", [1, 2]))
        time.sleep(1.5)  # the WRITE is posted and stuck past transfer_timeout_s
        assert p.loop.snapshot()["stats"]["transfer_timeout"] == 1
        rd = d.drain({"d"}, timeout=0.5)
        assert "d" not in rd["results"]["finished_recving"]  # no answer while it may land
        slow.release()  # the WRITE stops: P answers, a timeout is a failure
        rd = d.drain({"d"}, timeout=5)
        assert rd["results"]["failed_recving"] == {"d"}
        assert p.drain({"p"})["results"]["finished_sending"] == {"p"}
    finally:
        p.close()
        d.close()


def test_a_stuck_read_times_out_once_and_is_released_when_it_stops(
        caplog: pytest.LogCaptureFixture) -> None:
    from kvbridge.transports.memory import MemoryTransport

    p = LocalAgent("prefill", extra=FAST)
    slow = _SlowWrites(MemoryTransport("slow-decode"))
    d = LocalAgent("decode", extra={**FAST, "transfer_timeout_s": 0.5}, transport=slow)
    try:
        p.stage(send("p", "t", [1, 2]))
        with caplog.at_level(logging.WARNING, logger="kvbridge"):
            d.pull(pull("d", "t", p, [5, 6], [1, 2]))
            rd = d.drain({"d"}, timeout=2.0)
        assert rd["results"]["invalid_blocks"] == {5, 6}  # failed now
        assert "d" not in rd["results"]["finished_recving"]  # but the READ may still land
        assert rd["stats"]["transfer_timeout"] == 1
        noisy = [r for r in caplog.records if "t" in r.getMessage()]
        assert len(noisy) < 10  # one line per event, not hundreds per second
        slow.release()
        rd = d.drain({"d"}, timeout=5)
        assert rd["results"]["finished_recving"] == {"d"}
        assert rd["pending"] == 0
    finally:
        p.close()
        d.close()


def test_loop_death_fails_everything_instead_of_hanging(local_pd: PD) -> None:
    p, d = local_pd
    d.expect(expect("d", "t", p, [5, 6]))
    time.sleep(0.2)

    def boom() -> None:
        raise SystemExit("injected loop death")

    d.loop.submit(boom)
    rd = d.drain({"d"}, timeout=5)
    assert rd["results"]["invalid_blocks"] == {5, 6}
    assert d.loop.dead is not None
    d.pull(pull("d2", "x", p, [1], [1]))  # later requests fail at once
    assert d.drain({"d2"}, timeout=2)["results"]["failed_recving"] == {"d2"}


def test_a_prefill_shutting_down_fails_its_pushes_at_once() -> None:
    p = LocalAgent("prefill", extra=FAST)
    d = LocalAgent("decode", extra={**FAST, "push_timeout_s": 60})
    try:
        d.expect(expect("d", "t", p, [5, 6]))
        time.sleep(0.3)
        t0 = time.monotonic()
        p.close()  # it answers every open registration before it goes
        rd = d.drain({"d"}, timeout=10)
        assert rd["results"]["failed_recving"] == {"d"}
        assert time.monotonic() - t0 < 5  # not the 60 s push timeout
    finally:
        d.close()


def test_restarted_prefill_is_recognised_by_generation() -> None:
    from kvbridge.tools.engines import free_port

    port = free_port()
    p1 = LocalAgent("prefill", extra={**FAST, "side_channel_port": port})
    d = LocalAgent("decode", extra=FAST)
    try:
        p1.stage(send("p", "t1", [1]))
        d.pull(pull("d1", "t1", p1, [2], [1]))
        assert d.drain({"d1"})["results"]["failed_recving"] == set()
        old = p1.generation
        p1.close()
        p2 = LocalAgent("prefill", extra={**FAST, "side_channel_port": port})
        try:
            p2.stage(send("p", "t2", [1]))
            # a request still naming the old generation fails fast with a clear reason
            d.pull(pull("d2", "t2", p2, [2], [1], generation=old))
            rd = d.drain({"d2"}, timeout=10)
            assert rd["results"]["failed_recving"] == {"d2"}
            # and one naming the new generation works at once (re-handshaken)
            d.pull(pull("d3", "t2", p2, [2], [1]))
            assert d.drain({"d3"})["results"]["failed_recving"] == set()
        finally:
            p2.close()
    finally:
        d.close()


def test_heartbeats_keep_a_queued_pull_alive_past_the_lease(local_pd: PD) -> None:
    p, d = local_pd
    p.stage(send("p", "t", [1, 2]))
    d.loop.watch("t", p.address, p.generation)  # the decode request waits in D's queue
    time.sleep(4.0)  # longer than the 3 s lease
    d.loop.unwatch("t", p.address)
    d.pull(pull("d", "t", p, [3, 4], [1, 2]))
    assert d.drain({"d"})["results"]["failed_recving"] == set()


def test_lease_expiry_releases_and_fences_a_late_reader(local_pd: PD) -> None:
    p, d = local_pd
    p.stage(send("p", "t", [1, 2]))
    rp = p.drain({"p"}, timeout=10)
    assert rp["results"]["finished_sending"] == {"p"}
    assert rp["stats"]["lease_expired"] == 1
    assert ["lease_expired", "pull", "memory", "-", 1] in p.loop.observe.drain()["events"]
    d.loop.observe.admit("prefill")  # as D's handshake with P does (peer table)
    d.pull(pull("d", "t", p, [5, 6], [1, 2]))
    assert d.drain({"d"})["results"]["failed_recving"] == {"d"}
    events = {tuple(e[:4]): e[4] for e in d.loop.observe.drain().get("events", [])}
    assert events[("recv_failed", "pull", "memory", "prefill")] == 1  # D knew its P


# -- item 11: head-of-line blocking ------------------------------------------------------------


def test_hung_and_dead_peers_do_not_delay_a_healthy_pull(local_pd: PD, silent: str) -> None:
    p, d = local_pd
    for i, dead in enumerate([silent, silent, "tcp://127.0.0.1:1"]):
        d.loop.start_pull(_at(pull(f"x{i}", f"tx{i}", p, [9 + i], [1]), dead))
    p.stage(send("p", "t", [1, 2]))
    d.pull(pull("d", "t", p, [5, 6], [1, 2]))
    rd = d.drain({"d"}, timeout=10)
    assert "d" in rd["results"]["finished_recving"] and "d" not in rd["results"]["failed_recving"]
    # the healthy pull finished while the hung-peer ones were still waiting on their handshakes
    assert not ({"x0", "x1"} & rd["results"]["finished_recving"])
    failed = rd["results"]["failed_recving"]  # the refused one may already have failed
    rd = d.drain({"x0", "x1"}, timeout=10)  # and the hung ones fail by themselves, bounded
    assert failed | rd["results"]["failed_recving"] == {"x0", "x1", "x2"}


def _at(spec: Any, address: str) -> Any:
    from dataclasses import replace

    return replace(spec, peer_address=address, peer_generation="*")


# -- item 14: tensor parallelism -----------------------------------------------------------------


def test_each_decode_rank_talks_to_the_matching_prefill_rank() -> None:
    ps = [LocalAgent("prefill", extra=FAST, rank=r, tp_size=2) for r in range(2)]
    ds = [LocalAgent("decode", extra=FAST, rank=r, tp_size=2) for r in range(2)]
    try:
        for r in range(2):
            ps[r].fill(10 + r)
            ps[r].stage(send("p", "tp", [1, 2]))
            ds[r].pull(pull("d", "tp", ps[r], [3, 4], [1, 2]))
        for r in range(2):
            assert ds[r].drain({"d"})["results"]["failed_recving"] == set()
            np.testing.assert_array_equal(ds[r].blocks([3, 4]), ps[r].blocks([1, 2]))
        # a rank that dials the wrong rank is refused with a message naming it
        ps[0].stage(send("p2", "tp2", [1]))
        ds[1].pull(pull("d2", "tp2", ps[0], [3], [1]))
        rd = ds[1].drain({"d2"})
        assert rd["results"]["failed_recving"] == {"d2"}
    finally:
        for a in ps + ds:
            a.close()


# -- item 16: device fences ----------------------------------------------------------------------


class _FakeFence:
    """A device event the test completes by hand (no GPU here)."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0

    def ready(self) -> bool:
        self.queries += 1
        return self.done


def test_push_waits_for_the_device_fence_before_writing(local_pd: PD) -> None:
    p, d = local_pd
    d.expect(expect("d", "t", p, [5, 6]))
    time.sleep(0.2)
    fence = _FakeFence()
    p.loop.push_ready(send("p", "t", [1, 2]), fence)
    time.sleep(0.5)
    assert fence.queries > 0
    assert p.loop.snapshot()["stats"].get("push_sent", 0) == 0  # kernels not done: no WRITE
    assert d.drain({"d"}, timeout=0.2)["results"]["finished_recving"] == set()
    fence.done = True
    rd = d.drain({"d"})
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.blocks([5, 6]), p.blocks([1, 2]))


class _WaitableFence(_FakeFence):
    """A device event a thread can wait for (CUDA blocking sync, here a threading.Event)."""

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()
        self.waits = 0

    def ready(self) -> bool:
        self.queries += 1
        return self.event.is_set()

    def wait(self) -> None:
        self.waits += 1
        assert self.event.wait(30)


def test_a_waitable_fence_is_waited_not_polled_and_the_write_follows_it(local_pd: PD) -> None:
    p, d = local_pd
    d.expect(expect("d", "t", p, [5, 6]))
    time.sleep(0.2)
    fence = _WaitableFence()
    p.loop.push_ready(send("p", "t", [1, 2]), fence)
    time.sleep(0.5)  # the loop would have polled a plain fence hundreds of times by now
    assert fence.waits == 1 and fence.queries <= 1
    assert p.loop.snapshot()["stats"].get("push_sent", 0) == 0
    fence.event.set()  # the kernels finished: the waiter thread wakes the loop, which posts
    rd = d.drain({"d"})
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.blocks([5, 6]), p.blocks([1, 2]))


class _BrokenWait(_FakeFence):
    def wait(self) -> None:
        raise RuntimeError("no device")


def test_a_fence_whose_wait_fails_is_polled_instead(local_pd: PD) -> None:
    p, d = local_pd
    d.expect(expect("d", "t", p, [5, 6]))
    time.sleep(0.2)
    fence = _BrokenWait()
    p.loop.push_ready(send("p", "t", [1, 2]), fence)
    time.sleep(0.3)
    assert fence.queries > 1  # polled
    fence.done = True
    assert d.drain({"d"})["results"]["finished_recving"] == {"d"}


def test_flush_returns_once_the_loop_ran_what_was_submitted_before(local_pd: PD) -> None:
    p, _ = local_pd
    ran: list[str] = []
    gate = threading.Event()
    p.loop.submit(lambda: (gate.wait(10), ran.append("slow")))
    p.loop.submit(ran.append, "next")
    assert not p.loop.flush(0.05)  # the loop is still busy: bounded, False
    gate.set()
    assert p.loop.flush(10) and ran == ["slow", "next"]
    fut: list[bool] = []
    p.loop.submit(lambda: fut.append(p.loop.flush(1)))  # from the loop thread: never waits
    assert p.loop.flush(10) and fut == [False]


def test_heartbeat_reply_names_generation_and_unknown_transfers(local_pd: PD) -> None:
    p, _ = local_pd
    c = _client()
    try:
        reply = c.request(p.address, Heartbeat(generation="*", transfer_ids=["nope"]))
        assert isinstance(reply, HeartbeatReply)
        assert reply.generation == p.generation and reply.unknown == ["nope"]
    finally:
        c.close()


@pytest.mark.parametrize("stale", [True, False])
def test_an_unknown_answer_to_a_heartbeat_older_than_the_confirmation_is_ignored(
        local_pd: PD, stale: bool) -> None:
    """Seen under `vllm bench serve` (push, 4 req/s): D's heartbeat reached P before its
    registration, P answered "unknown", took the registration and confirmed it on its own
    connection; D read the confirmation first, then the stale answer, and failed a healthy
    push ("prefill no longer holds this push")."""
    p, d = local_pd
    d.expect(expect("d", "t", p, [5, 6]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # P's confirmation reaches D (P's KV is not ready)
        parts = d.loop.push_sink.jobs.get("t", [])
        if parts and parts[0].state.value == "confirmed":
            break
        time.sleep(0.01)
    w = d.loop.push_sink.jobs["t"][0]
    asked = w.confirmed_after + (0 if stale else 1)
    done = threading.Event()
    d.loop.submit(lambda: (d.loop.transfers_unknown(w.address, ["t"], asked), done.set()))
    assert done.wait(10)
    p.ready(send("p", "t", [1, 2]))
    rd = d.drain({"d"})
    if stale:
        assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
        np.testing.assert_array_equal(d.blocks([5, 6]), p.blocks([1, 2]))
    else:  # an answer to a heartbeat sent after the confirmation does count
        assert rd["results"]["failed_recving"] == {"d"}


# -- a push prepared while the forward runs (hand-off issue: P posts within 0.5 ms) ------------

BACKENDS = pytest.mark.parametrize("local_pd", [{}, {"backend": "nixl"}], indirect=True,
                                   ids=["memory", "nixl"])
"""``memory`` (nothing native to build ahead: the generic path) and ``nixl`` (the WRITE is a
NIXL request made ahead), where nixl loads."""


def _settled(p: LocalAgent) -> None:
    """Wait until P's loop has handled the events submitted so far."""
    assert p.loop.flush(5.0)


@BACKENDS
@pytest.mark.parametrize("registered_first", [True, False])
def test_push_prepared_ahead_writes_the_kv_as_it_is_at_ready(
        local_pd: PD, registered_first: bool) -> None:
    """The WRITE is built before the forward writes the KV (and before or after D confirms),
    and posted at ready: D gets the bytes as they are then, not as they were when built."""
    p, d = local_pd
    src, dst = [5, 6, 7, 20], [30, 2, 3, 4]
    plan = send("p", "tp1", src)
    if registered_first:
        d.expect(expect("d", "tp1", p, dst))
        time.sleep(0.2)  # D registered, P dialled it and it confirmed
    p.loop.push_prepare(plan)
    if not registered_first:
        _settled(p)
        d.expect(expect("d", "tp1", p, dst))
        time.sleep(0.2)
    _settled(p)
    for layer in p.caches.values():  # the forward writes the KV now
        layer[src] = np.random.default_rng(9).standard_normal(layer[src].shape)
    p.ready(plan)
    rd = d.drain({"d"})
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
    assert p.drain({"p"})["results"]["finished_sending"] == {"p"}
    stats = getattr(p.loop.transport, "stats", {})
    if "block_prepared_ahead" in stats:  # nixl: the post used the request made ahead
        assert stats["block_prepared_ahead"] == 1
        assert p.loop.transport._ahead == 0


@pytest.mark.parametrize("local_pd", [{}], indirect=True)
def test_write_posted_is_stamped_before_the_post(local_pd: PD,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``write_posted -> write_done`` is the transport's whole time, also where it copies inside
    the post (NIXL over CMA does): the bench's "hand-off minus wire" depends on it."""
    from kvbridge.scheduling import push

    real = push.submit_parts

    def slow_post(*args: object, **kwargs: object) -> object:
        time.sleep(0.05)  # a transport copying synchronously
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(push, "submit_parts", slow_post)
    monkeypatch.setattr(push, "prepare_parts", lambda *args, **kwargs: None)  # builds nothing
    p, d = local_pd
    d.expect(expect("d", "tw", p, [3]))
    time.sleep(0.2)
    p.ready(send("p", "tw", [4]))
    assert d.drain({"d"})["results"]["finished_recving"] == {"d"}
    assert p.drain({"p"})["results"]["finished_sending"] == {"p"}
    t = p.loop.recorder.get("tw")
    assert t is not None
    assert t["write_done"] - t["write_posted"] >= 0.05, t
    assert t["write_posted"] - t["ready_seen"] < 0.05, t  # nothing else waited that long


@BACKENDS
def test_a_prepared_push_that_is_cancelled_posts_nothing_and_frees_it(local_pd: PD) -> None:
    p, d = local_pd
    src, dst = [8, 9], [10, 11]
    before = d.blocks(dst).copy()
    d.expect(expect("d", "tp2", p, dst))
    time.sleep(0.2)
    plan = send("p", "tp2", src)
    p.loop.push_prepare(plan)
    _settled(p)
    d.cancel_recv("tp2")  # D's request ended before P's KV was ready
    rd = d.drain({"d"})
    assert rd["results"]["failed_recving"] == {"d"}
    p.ready(plan)  # the forward finished anyway: nothing is written
    assert p.drain({"p"})["results"]["finished_sending"] == {"p"}
    np.testing.assert_array_equal(d.blocks(dst), before)
    assert p.drain(set(), 0.5)["pending"] == 0
    if hasattr(p.loop.transport, "_ahead"):
        assert p.loop.transport._ahead == 0  # the NIXL request was released


# -- a pull's READ built while its claim is in flight --------------------------------------------


def _ahead(agent: LocalAgent) -> tuple[int, int]:
    """(requests NIXL built ahead, of which still unposted); (0, 0) where nothing is."""
    t = agent.loop.transport
    return getattr(t, "stats", {}).get("block_prepared_ahead", 0), getattr(t, "_ahead", 0)


@BACKENDS
def test_pull_prepared_while_claiming_moves_exact_blocks(local_pd: PD) -> None:
    p, d = local_pd
    src, dst = [3, 4, 9, 20], [10, 11, 30, 2]
    p.stage(send("p", "pa", src))
    d.pull(pull("d", "pa", p, dst, src))
    rd = d.drain({"d"})
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
    built, unposted = _ahead(d)
    assert unposted == 0
    if hasattr(d.loop.transport, "_ahead"):  # nixl: the READ posted is the one built ahead
        assert built == 1


@BACKENDS
def test_a_pull_whose_claim_is_refused_frees_the_read_built_ahead(local_pd: PD) -> None:
    p, d = local_pd
    p.stage(send("p", "pr", [1, 2, 3], prompt=tokens(3, seed=1)))
    before = d.blocks([7, 8, 9]).copy()
    d.pull(pull("d", "pr", p, [7, 8, 9], [4, 5, 6], prompt=tokens(3, seed=1)))  # wrong blocks
    rd = d.drain({"d"}, timeout=15)
    assert rd["results"]["failed_recving"] == {"d"} and rd["stats"]["claim_refused"] == 1
    np.testing.assert_array_equal(d.blocks([7, 8, 9]), before)
    built, unposted = _ahead(d)
    assert unposted == 0  # built ahead (nixl), never posted, released
    if hasattr(d.loop.transport, "_ahead"):
        assert built == 1


# -- issue 25 item 5: fair limits -----------------------------------------------------------------


def _junk(p: LocalAgent, i: int, control_address: str) -> PushRegister:
    """A registration naming ``control_address`` (a silent one: its handshake never ends)."""
    return PushRegister(
        transfer_id=f"junk-{i}", generation="*", engine_id="x", sender_generation="g",
        control_address=control_address, block_ids=[1], num_tokens=16,
        prompt_digest=prompt_digest(tokens(1)), layout_fingerprint=p.loop.info.layout_fingerprint)


def _silent_ports(n: int) -> tuple[Any, list[str]]:
    """One ROUTER that accepts connections on ``n`` ports and never answers."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    ports = [sock.bind_to_random_port("tcp://127.0.0.1") for _ in range(n)]
    return sock, [f"tcp://127.0.0.1:{port}" for port in ports]


def _held(p: LocalAgent) -> dict[str, int]:
    """P's registration counts (:meth:`PushSource.held`), read on its loop thread."""
    from concurrent.futures import Future

    fut: Future[dict[str, int]] = Future()
    p.loop.submit(lambda: fut.set_result(p.loop.push_source.held()))
    return fut.result(10)


def _answered(p: LocalAgent, n: int, timeout: float = 30.0) -> dict[str, int]:
    """Wait until P answered ``n`` registrations (admitted or refused); its stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = p.loop.snapshot()["stats"]
        done = stats.get("push_registrations", 0) + stats.get("register_refused_busy", 0)
        if done >= n or time.monotonic() > deadline:
            assert done >= n, f"P answered {done} of {n} registrations"
            return stats
        time.sleep(0.05)


def test_registration_flood_from_many_connections_does_not_starve_a_decode() -> None:
    """poc_flood_bigframe.py (I): 9 connections x 512 junk registrations naming silent control
    addresses filled the global 4096, and a real decode engine's registration was refused BUSY
    for as long as the junk was held (here: longer than the whole test)."""
    import zmq

    from kvbridge.control import request_context

    silent, addresses = _silent_ports(9)
    held = {"control_timeout_s": 60, "prefill_wait_s": 60, "push_timeout_s": 60}
    p = LocalAgent("prefill", extra={**FAST, **held})
    d = LocalAgent("decode", extra=FAST)
    codec, socks = engine_codec(), []
    try:
        for c, address in enumerate(addresses):  # 9 x 512 = 4608 > max_pending (4096)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(p.address)
            socks.append(sock)
            for j in range(512):
                rid = f"{c:02d}{j:06d}".encode()
                sock.send_multipart([rid, codec.encode(_junk(p, c * 1000 + j, address),
                                                       request_context(rid))])
        before = _answered(p, 9 * 512)
        assert before["push_registrations"] >= 4096  # the junk is held: the global bound is full
        src, dst = [1, 2, 3, 4], [40, 41, 42, 50]
        t0 = time.monotonic()
        d.expect(expect("d", "legit", p, dst))
        p.ready(send("p", "legit", src))
        rd = d.drain({"d"})
        assert rd["results"]["finished_recving"] == {"d"}, rd
        assert not rd["results"]["failed_recving"]
        assert time.monotonic() - t0 < 10  # at once, not when the junk expires (60 s)
        np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
        after = p.loop.snapshot()["stats"]
        assert after["register_refused_busy"] == before["register_refused_busy"]  # not BUSY
        assert after["push_registrations"] == before["push_registrations"] + 1
        held_now = _held(p)
        assert held_now["total"] <= 2 * p.config.max_pending  # the hard bound
        assert held_now["peers"] == 9  # the junk is still held; the legit push ended
    finally:
        p.close()
        d.close()
        for sock in socks:
            sock.close()
        silent.close()


def test_registration_limits_are_fair_and_given_back() -> None:
    """Per control address (across connections) and per connection ``max_pending_per_peer``;
    past ``max_pending``, a fair share per control address; never more than 2 x max_pending;
    every slot comes back when the registrations fail (their handshakes time out)."""
    silent, addresses = _silent_ports(20)
    p = LocalAgent("prefill", extra={**FAST, "max_pending": 8, "max_pending_per_peer": 4,
                                     "control_timeout_s": 3})
    clients = [_client() for _ in range(16)]
    seq = iter(range(10_000))

    def register(client: ControlClient, address: str) -> ErrorKind | None:
        ack = client.request(p.address, _junk(p, next(seq), address))
        assert isinstance(ack, Ack)
        assert ack.ok or ack.kind is ErrorKind.BUSY, ack
        return None if ack.ok else ack.kind

    def outcomes(client: ControlClient, address: str, n: int) -> list[bool]:
        return [register(client, address) is None for _ in range(n)]

    try:
        s1, s2, s3, *rest = addresses
        assert outcomes(clients[0], s1, 6) == [True] * 4 + [False] * 2  # per address/connection
        assert outcomes(clients[1], s1, 2) == [False] * 2  # keyed by address, not connection
        assert outcomes(clients[1], s2, 4) == [True] * 4  # 8 held: max_pending reached
        # past max_pending: a fresh address gets its fair share, 8 // 3 addresses = 2
        assert outcomes(clients[2], s3, 4) == [True] * 2 + [False] * 2
        assert _held(p) == {"total": 10, "peers": 3, "connections": 3}
        # many addresses, one registration each (share >= 1) until 2 x max_pending = 16
        got = [register(clients[3 + i], rest[i]) is None for i in range(12)]
        assert got == [True] * 6 + [False] * 6
        assert _held(p)["total"] == 16
        assert p.loop.snapshot()["stats"]["register_refused_busy"] == 2 + 2 + 2 + 6
        # the handshakes with the silent addresses time out (3 s): every slot comes back
        deadline = time.monotonic() + 15
        while _held(p)["total"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _held(p) == {"total": 0, "peers": 0, "connections": 0}
        assert p.loop.snapshot()["stats"]["push_registrations"] == 16
        assert outcomes(clients[0], s1, 4) == [True] * 4
    finally:
        for client in clients:
            client.close()
        p.close()
        silent.close()
