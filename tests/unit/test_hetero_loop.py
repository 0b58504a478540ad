"""Heterogeneous TP and block size through real transfer loops (``memory``, this process).

Each rank is a :class:`~kvbridge.testing.hetero.HeteroAgent` on head-major caches; the bytes
every decode rank ends with are checked against the numpy reference, and the protocol around
them: a prefill rank keeps its blocks until every decode rank that reads from it finished,
a decode rank reading from several prefill ranks finishes when all landed, the failure of any
part fails the whole hand-off (nothing pinned, blocks invalid until nothing can land), and
forged claims, confirmations and handshakes are refused with a message naming the field.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.config import TransferMode
from kvbridge.control import ControlClient
from kvbridge.errors import LayoutMismatch, MessageError
from kvbridge.heads import HeadSplit
from kvbridge.layout import KVLayout
from kvbridge.messages import (
    Ack,
    Cancel,
    ClaimPart,
    Codec,
    EngineInfo,
    ErrorKind,
    Hello,
    PullClaim,
    PullDone,
    PushConfirm,
)
from kvbridge.params import PeerRef
from kvbridge.scheduling.handoff import RecvOrder, StepPlan
from kvbridge.scheduling.mapping import sources
from kvbridge.scheduling.peers import check_compatible, make_info
from kvbridge.scheduling.planner import prompt_digest
from kvbridge.scheduling.rank import RankSide
from kvbridge.scheduling.specs import PullSpec, PushSpec, SendPlan, Source
from kvbridge.testing.clients import engine_client
from kvbridge.testing.faults import FaultyTransport
from kvbridge.testing.handoffs import FAST
from kvbridge.testing.hetero import HeteroAgent, engine, expected_decode
from kvbridge.transport import HandleState, Op, TransferHandle, Transport
from kvbridge.transports.memory import MemoryTransport

TOTAL = 2  # KV heads, as the tiny model's


def _agents(name: str, tp: int, block: int, seed: int, extra: dict[str, Any] | None = None,
            total: int = TOTAL, faulty: bool = False) -> list[HeteroAgent]:
    """Every rank of an engine; ``faulty``: behind a FaultyTransport that injects nothing (a
    peer of one that does must name the same backend)."""
    return [HeteroAgent(name, r, {**FAST, **(extra or {})},
                        transport=FaultyTransport(MemoryTransport(f"{name}-{i}"))
                        if faulty else None)
            for i, r in enumerate(engine(tp, block, total=total, seed=seed))]


@pytest.fixture
def closing() -> Iterator[list[HeteroAgent]]:
    agents: list[HeteroAgent] = []
    yield agents
    for a in agents:
        a.close()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def _ids(n_tokens: int, block: int, offset: int) -> list[int]:
    return [offset + 2 * i for i in range(-(-n_tokens // block))]  # not contiguous


def _srcs(prefill: Sequence[HeteroAgent], d: HeteroAgent, total: int = TOTAL) -> tuple[Source,
                                                                                       ...]:
    shares = sources(total, len(prefill), d.loop.tp_size, d.loop.rank)
    return tuple(Source(prefill[s.rank].address, prefill[s.rank].generation, s.rank,
                        len(prefill)) for s in shares)


def _pull(req: str, tid: str, prefill: Sequence[HeteroAgent], d: HeteroAgent,
          d_ids: list[int], p_ids: list[int], prompt: list[int], skip: int = 0) -> PullSpec:
    srcs = _srcs(prefill, d)
    first = skip * d.layout.block_size
    p_first = first // prefill[0].layout.block_size
    return PullSpec(req, tid, srcs[0].address, tuple(d_ids[skip:]), tuple(p_ids[p_first:]),
                    skip, len(prompt), prompt_digest(prompt), srcs[0].generation,
                    remote_skip=p_first, sources=srcs)


def _expect(req: str, tid: str, prefill: Sequence[HeteroAgent], d: HeteroAgent,
            d_ids: list[int], prompt: list[int], skip: int = 0) -> PushSpec:
    srcs = _srcs(prefill, d)
    return PushSpec(req, tid, srcs[0].address, tuple(d_ids[skip:]), skip, len(prompt),
                    prompt_digest(prompt), srcs[0].generation, sources=srcs)


def _send(tid: str, p_ids: list[int], prompt: list[int]) -> SendPlan:
    return SendPlan("p", tid, tuple(p_ids), len(prompt), prompt_digest(prompt))


def _check(prefill: Sequence[HeteroAgent], decode: Sequence[HeteroAgent], p_ids: list[int],
           d_ids: list[int], first: int, n: int, before: list[list[np.ndarray[Any, Any]]]
           ) -> None:
    """Each decode rank holds the reference; ``before``: its layers before the hand-off."""
    for d, layers in zip(decode, before, strict=True):
        saved = [a.copy() for a in d.cache.layers]
        for a, b in zip(d.cache.layers, layers, strict=True):
            a[...] = b
        want = expected_decode([p.cache for p in prefill], p_ids, d.cache, d_ids, first, n)
        for a, s in zip(d.cache.layers, saved, strict=True):
            a[...] = s
        for got, exp in zip(d.cache.layers, want, strict=True):
            np.testing.assert_array_equal(got, exp)


def _snapshot(decode: Sequence[HeteroAgent]) -> list[list[np.ndarray[Any, Any]]]:
    return [[a.copy() for a in d.cache.layers] for d in decode]


# -- bytes and protocol, pull and push --------------------------------------------------------

SHAPES = [(1, 2, 32, 32), (2, 1, 32, 32), (1, 1, 32, 64), (1, 1, 64, 32), (2, 1, 32, 64),
          (1, 2, 64, 32), (1, 4, 32, 32)]  # the last: 2 KV heads, each on two decode ranks


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "tp{}to{}-b{}to{}".format(*s))
def test_handoff_lands_byte_exact_and_releases_every_rank(
        closing: list[HeteroAgent], shape: tuple[int, int, int, int], mode: str) -> None:
    p_tp, d_tp, pb, db = shape
    extra = {"checksum": True}  # both sides' digests of their halves must agree
    prefill = _agents("prefill", p_tp, pb, 1, extra)
    decode = _agents("decode", d_tp, db, 2, extra)
    closing += prefill + decode
    prompt = _prompt(200)
    skip = 1  # a local prefix hit of one decode block: only the rest moves
    p_ids, d_ids = _ids(200, pb, 1), _ids(200, db, 0)
    before = _snapshot(decode)
    if mode == "pull":
        for p in prefill:
            p.stage(_send("t", p_ids, prompt))
        for d in decode:
            d.pull(_pull("d", "t", prefill, d, d_ids, p_ids, prompt, skip))
    else:
        for d in decode:
            d.expect(_expect("d", "t", prefill, d, d_ids, prompt, skip))
        for p in prefill:
            p.ready(_send("t", p_ids, prompt))
    for d in decode:
        rd = d.drain({"d"})
        assert rd["results"]["finished_recving"] == {"d"}, rd
        assert not rd["results"]["failed_recving"]
    _check(prefill, decode, p_ids, d_ids, skip * db, 200, before)
    for p in prefill:
        rp = p.drain({"p"})
        assert rp["results"]["finished_sending"] == {"p"} and rp["pending"] == 0


def test_prefill_keeps_its_blocks_until_every_consumer_read(closing: list[HeteroAgent]) -> None:
    (p,) = _agents("prefill", 1, 32, 1)
    decode = _agents("decode", 2, 32, 2)
    closing += [p, *decode]
    prompt, p_ids, d_ids = _prompt(96), [1, 2, 3], [7, 8, 9]
    p.stage(_send("t", p_ids, prompt))
    decode[0].pull(_pull("d", "t", [p], decode[0], d_ids, p_ids, prompt))
    assert decode[0].drain({"d"})["results"]["failed_recving"] == set()
    rp = p.drain({"p"}, timeout=0.5)
    assert rp["results"]["finished_sending"] == set() and rp["pending"] == 1  # rank 1 not yet
    decode[1].pull(_pull("d", "t", [p], decode[1], d_ids, p_ids, prompt))
    assert decode[1].drain({"d"})["results"]["failed_recving"] == set()
    rp = p.drain({"p"})
    assert rp["results"]["finished_sending"] == {"p"} and rp["stats"]["pull_served"] == 1


def test_push_prefill_waits_for_every_decode_rank_to_register(
        closing: list[HeteroAgent]) -> None:
    (p,) = _agents("prefill", 1, 32, 1)
    decode = _agents("decode", 2, 32, 2)
    closing += [p, *decode]
    prompt, p_ids, d_ids = _prompt(96), [1, 2, 3], [7, 8, 9]
    before = _snapshot(decode)
    decode[0].expect(_expect("d", "t", [p], decode[0], d_ids, prompt))
    p.ready(_send("t", p_ids, prompt))
    assert decode[0].drain({"d"})["results"]["failed_recving"] == set()
    rp = p.drain({"p"}, timeout=0.5)
    assert rp["results"]["finished_sending"] == set() and rp["pending"] == 1  # rank 1 not yet
    decode[1].expect(_expect("d", "t", [p], decode[1], d_ids, prompt))
    assert decode[1].drain({"d"})["results"]["failed_recving"] == set()
    _check([p], decode, p_ids, d_ids, 0, 96, before)
    rp = p.drain({"p"})
    assert rp["results"]["finished_sending"] == {"p"} and rp["stats"]["push_sent"] == 2


def test_push_decode_rank_that_never_registers_fails_the_push_after_the_lease(
        closing: list[HeteroAgent]) -> None:
    (p,) = _agents("prefill", 1, 32, 1, {"lease_s": 1})
    decode = _agents("decode", 2, 32, 2)
    closing += [p, *decode]
    prompt = _prompt(64)
    p.ready(_send("t", [1, 2], prompt))
    decode[0].expect(_expect("d", "t", [p], decode[0], [5, 6], prompt))
    rd = decode[0].drain({"d"}, timeout=10)
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    rp = p.drain({"p"}, timeout=10)  # rank 0 got its heads; P waits for rank 1 a lease only
    assert rp["results"]["finished_sending"] == {"p"} and rp["pending"] == 0
    assert p.outcome("t") == "failed: lease expired (decode rank(s) [1] never registered)"
    decode[1].expect(_expect("d", "t", [p], decode[1], [5, 6], prompt))  # too late: refused
    assert decode[1].drain({"d"})["results"]["failed_recving"] == {"d"}


def test_replicated_prefill_heads_are_read_once_and_idle_ranks_released(
        closing: list[HeteroAgent]) -> None:
    """2 KV heads on prefill TP 4 (each head on two ranks), decode TP 1 through RankSide: rank
    0 and 2 are read, 1 and 3 are released when the request arrives, not after a lease."""
    prefill = _agents("prefill", 4, 32, 1, {"lease_s": 30})
    (d,) = _agents("decode", 1, 32, 2)
    closing += [*prefill, d]
    prompt, p_ids, d_ids = _prompt(64), [1, 2], [5, 6]
    for p in prefill:
        p.stage(_send("t", p_ids, prompt))
    peers = tuple(PeerRef(p.address, p.generation) for p in prefill)
    side = RankSide(d.loop)
    side.apply(StepPlan(watches=[("t", peers)]))
    for r in (1, 3):
        rp = prefill[r].drain({"p"}, timeout=10)
        assert rp["results"]["finished_sending"] == {"p"} and rp["pending"] == 0
    before = _snapshot([d])
    side.apply(StepPlan(unwatches=[("t", peers)], recvs=[RecvOrder(
        "d", "t", TransferMode.PULL, peers, tuple(d_ids), tuple(p_ids), 0, 64,
        prompt_digest(prompt), remote_skip=0)]))
    deadline = time.monotonic() + 15
    recving: set[str] = set()
    while "d" not in recving and time.monotonic() < deadline:
        recving |= side.results(set())[1]
        time.sleep(0.01)
    assert recving == {"d"}
    _check([prefill[0], prefill[0], prefill[2], prefill[2]], [d], p_ids, d_ids, 0, 64, before)
    for r in (0, 2):
        assert prefill[r].drain({"p"})["results"]["finished_sending"] == {"p"}


def test_a_failed_part_fails_the_whole_receive_and_gives_up_the_other_part(
        closing: list[HeteroAgent]) -> None:
    prefill = _agents("prefill", 2, 32, 1, {"lease_s": 30})
    (d,) = _agents("decode", 1, 32, 2)
    closing += [*prefill, d]
    prompt, p_ids, d_ids = _prompt(64), [1, 2], [5, 6]
    # rank 1 prefilled another prompt (its claim is refused at once); rank 0 has not staged
    # yet, so its claim waits there: only the failure of the other part can end it now
    prefill[1].stage(_send("t", p_ids, _prompt(64, seed=9)))
    d.pull(_pull("d", "t", prefill, d, d_ids, p_ids, prompt))
    rd = d.drain({"d"}, timeout=1.5)
    assert rd["results"]["failed_recving"] == {"d"} and rd["stats"]["recv_failed"] == 1
    assert rd["results"]["invalid_blocks"] == set()  # nothing could land: safe at once
    assert (prefill[0].outcome("t") or "").startswith("cancelled by decode")
    # so when rank 0's prefill finishes, its blocks are free at once (not after 30 s)
    prefill[0].stage(_send("t", p_ids, prompt))
    assert prefill[0].drain({"p"}, timeout=5)["results"]["finished_sending"] == {"p"}


def test_a_consumer_that_gives_up_ends_the_transfer_for_every_consumer(
        closing: list[HeteroAgent]) -> None:
    (p,) = _agents("prefill", 1, 32, 1, {"lease_s": 30})
    decode = _agents("decode", 2, 32, 2)
    closing += [p, *decode]
    prompt, p_ids, d_ids = _prompt(64), [1, 2], [5, 6]
    p.stage(_send("t", p_ids, prompt))
    decode[0].pull(_pull("d", "t", [p], decode[0], d_ids, p_ids, prompt))
    assert decode[0].drain({"d"})["results"]["failed_recving"] == set()
    # decode rank 1 gives up before it claimed (its connection never claimed): accepted
    client = engine_client(5.0)
    try:
        reply = client.request(p.address, Cancel(transfer_id="t", reason="rank 1 failed"))
    finally:
        client.close()
    assert not isinstance(reply, Ack)
    rp = p.drain({"p"}, timeout=10)
    assert rp["results"]["finished_sending"] == {"p"} and rp["pending"] == 0
    decode[1].pull(_pull("d", "t", [p], decode[1], d_ids, p_ids, prompt))
    assert decode[1].drain({"d"})["results"]["failed_recving"] == {"d"}


def test_parts_in_flight_keep_the_blocks_until_both_stopped(closing: list[HeteroAgent]) -> None:
    prefill = _agents("prefill", 2, 32, 1, faulty=True)
    rank = engine(1, 32, total=TOTAL, seed=2)[0]
    slow = FaultyTransport(MemoryTransport("slow-decode"), delay=2.0)
    d = HeteroAgent("decode", rank, FAST, transport=slow)
    closing += [*prefill, d]
    prompt, p_ids, d_ids = _prompt(64), [1, 2], [5, 6]
    for p in prefill:
        p.stage(_send("t", p_ids, prompt))
    d.pull(_pull("d", "t", prefill, d, d_ids, p_ids, prompt))
    time.sleep(0.5)  # both READs are posted and take 2 s
    d.cancel_recv("t")
    rd = d.drain({"d"}, timeout=0.5)
    assert rd["results"]["invalid_blocks"] == {5, 6}  # the request fails now ...
    assert "d" not in rd["results"]["finished_recving"]  # ... its blocks come back later
    rd = d.drain({"d"}, timeout=10)
    assert rd["results"]["finished_recving"] == {"d"} == rd["results"]["failed_recving"]
    assert rd["stats"]["recv_failed"] == 1


def test_a_corrupted_part_fails_the_checksum(closing: list[HeteroAgent]) -> None:
    prefill = _agents("prefill", 2, 32, 1, {"checksum": True}, faulty=True)
    rank = engine(1, 64, total=TOTAL, seed=2)[0]
    bad = FaultyTransport(MemoryTransport("bad-decode"), corrupt={2}, corrupt_offset=100)
    d = HeteroAgent("decode", rank, {"checksum": True}, transport=bad)
    closing += [*prefill, d]
    prompt, p_ids, d_ids = _prompt(128), [1, 2, 3, 4], [5, 6]
    for p in prefill:
        p.stage(_send("t", p_ids, prompt))
    d.pull(_pull("d", "t", prefill, d, d_ids, p_ids, prompt))
    rd = d.drain({"d"})
    assert rd["results"]["failed_recving"] == {"d"}
    assert rd["stats"]["checksum_mismatch"] == 1  # found where the bytes landed


class _FinishesWhilePolled(Transport):
    """Wraps a transport: a handle's first poll answers PENDING and the handle finishes right
    after, as when the transport's thread completes it while the loop is polling."""

    name = "memory"

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.agent_name)
        self.inner = inner
        self.raced = 0
        self._inner: dict[int, TransferHandle] = {}

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
        outer = TransferHandle(op, peer, inner.nbytes, inner.count)
        self._inner[id(outer)] = inner
        return outer

    def poll(self, handle: TransferHandle) -> HandleState:
        inner = self._inner.pop(id(handle), None)
        if inner is None:
            return handle.state
        self.inner.wait(inner, 10)
        if inner.state is HandleState.DONE:  # finishes just after the poller looked
            handle.succeed()
        else:
            handle.fail(inner.error or "transfer failed")
        self.raced += 1
        return HandleState.PENDING

    def send_notification(self, peer: str, message: bytes) -> None:
        self.inner.send_notification(peer, message)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.get_notifications()

    def close(self, timeout: float = 5.0) -> None:
        self.inner.close(timeout)


def test_a_transfer_finishing_while_the_loop_polls_is_not_lost(
        closing: list[HeteroAgent]) -> None:
    """The loop must not drop a handle that finished during its poll: the READ would then sit
    unseen until ``transfer_timeout_s`` and fail a transfer that had landed."""
    prefill = _agents("prefill", 2, 32, 1)
    racy = _FinishesWhilePolled(MemoryTransport("racy-decode"))
    d = HeteroAgent("decode", engine(1, 32, total=TOTAL, seed=2)[0], FAST, transport=racy)
    closing += [*prefill, d]
    prompt, p_ids, d_ids = _prompt(64), [1, 2], [5, 6]
    for p in prefill:
        p.stage(_send("t", p_ids, prompt))
    d.pull(_pull("d", "t", prefill, d, d_ids, p_ids, prompt))
    rd = d.drain({"d"}, timeout=10)
    assert racy.raced == 2
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]


# -- hostile input ----------------------------------------------------------------------------


def _claim(p: HeteroAgent, part: ClaimPart | None, ids: list[int], prompt: list[int],
           client: ControlClient, tid: str = "t") -> Any:
    return client.request(p.address, PullClaim(
        transfer_id=tid, generation=p.generation, skip_blocks=0, block_ids=ids,
        num_tokens=len(prompt), prompt_digest=prompt_digest(prompt), part=part))


@pytest.mark.parametrize(("part", "why"), [
    (ClaimPart(tp_size=2, rank=2, block_size=32, first_token=0), "outside"),
    (ClaimPart(tp_size=3, rank=0, block_size=32, first_token=0), "cannot be split"),
    (ClaimPart(tp_size=2, rank=0, block_size=48, first_token=0), "divide"),
    (ClaimPart(tp_size=2, rank=0, block_size=32, first_token=16), "first token 16"),
    (ClaimPart(tp_size=1, rank=0, block_size=64, first_token=64), "first token 64"),
    # prefill rank 1 of TP 2 holds head 1: decode rank 0 of TP 2 reads nothing from it
    (ClaimPart(tp_size=2, rank=0, block_size=32, first_token=0), "reads nothing"),
], ids=["rank", "tp", "block", "offset", "skip", "unserved"])
def test_forged_claims_are_refused_naming_the_problem(closing: list[HeteroAgent],
                                                      part: ClaimPart, why: str) -> None:
    prefill = _agents("prefill", 2, 32, 1)
    closing += prefill
    p = prefill[1]
    prompt = _prompt(64)
    p.stage(_send("t", [1, 2], prompt))
    client = engine_client(5.0)
    try:
        reply = _claim(p, part, [1, 2], prompt, client)
    finally:
        client.close()
    assert isinstance(reply, Ack) and not reply.ok and reply.kind is ErrorKind.MISMATCH
    assert why in (reply.error or ""), reply.error
    assert p.loop.snapshot()["pending"] == 1  # still staged for its rightful reader


def test_claims_are_bound_to_one_connection_and_one_tp_size(closing: list[HeteroAgent]) -> None:
    (p,) = _agents("prefill", 1, 32, 1)
    closing.append(p)
    prompt = _prompt(64)
    p.stage(_send("t", [1, 2], prompt))
    a, b = engine_client(5.0), engine_client(5.0)
    try:
        ok = _claim(p, ClaimPart(tp_size=2, rank=0, block_size=32, first_token=0), [1, 2],
                    prompt, a)
        assert isinstance(ok, Ack) and ok.ok
        for client, part, kind in [
            (b, ClaimPart(tp_size=2, rank=0, block_size=32, first_token=0), ErrorKind.FORBIDDEN),
            (a, ClaimPart(tp_size=2, rank=1, block_size=32, first_token=0), ErrorKind.FORBIDDEN),
            (b, ClaimPart(tp_size=4, rank=1, block_size=32, first_token=0), ErrorKind.MISMATCH),
        ]:
            reply = _claim(p, part, [1, 2], prompt, client)
            assert isinstance(reply, Ack) and reply.kind is kind, reply
        # a DONE with a forged byte count ends the transfer for everyone
        done = a.request(p.address, PullDone(transfer_id="t", nbytes=1))
        assert isinstance(done, Ack) and not done.ok and "bytes" in (done.error or "")
    finally:
        a.close()
        b.close()
    assert p.drain({"p"})["results"]["finished_sending"] == {"p"}


def test_push_confirmation_naming_another_prefill_rank_is_refused(
        closing: list[HeteroAgent]) -> None:
    prefill = _agents("prefill", 2, 32, 1)
    (d,) = _agents("decode", 1, 32, 2)
    closing += [*prefill, d]
    prompt = _prompt(64)
    d.expect(_expect("d", "t", prefill, d, [5, 6], prompt))
    time.sleep(0.3)  # registered with both ranks
    client = engine_client(5.0)
    try:
        for rank in (None, 5):  # ambiguous (two parts wait) / no such rank
            reply = client.request(d.address, PushConfirm(
                transfer_id="t", generation=d.generation, block_ids=[5, 6], rank=rank))
            assert isinstance(reply, Ack) and not reply.ok
            assert reply.kind is ErrorKind.UNKNOWN_TRANSFER
    finally:
        client.close()
    for p in prefill:
        p.ready(_send("t", [1, 2], prompt))
    assert d.drain({"d"})["results"]["failed_recving"] == set()


# -- the handshake ----------------------------------------------------------------------------


def _info(tp: int, rank: int, block: int, heads: HeadSplit | None | str = "auto",
          total: int = TOTAL, head_dim: int = 8) -> EngineInfo:
    r = engine(tp, block, total=total, head_dim=head_dim)[rank]
    split = r.shape.heads if heads == "auto" else heads
    assert not isinstance(split, str)
    return make_info(engine_id=f"e-tp{tp}-b{block}", generation="g", rank=rank, tp_size=tp,
                     backend="memory", agent=f"e-tp{tp}-b{block}:g:{rank}",
                     transport_metadata=b"", layout=r.layout,
                     control_address="tcp://127.0.0.1:1", compat={"model": "m"},
                     checksum=False, heads=split)


def test_handshake_maps_tp_and_block_size() -> None:
    layout = check_compatible(_info(2, 1, 32), _info(1, 0, 64))
    assert isinstance(layout, KVLayout) and layout.block_size == 64
    check_compatible(_info(1, 0, 128), _info(2, 0, 32))


@pytest.mark.parametrize(("mine", "theirs", "why"), [
    (_info(2, 0, 32), _info(1, 0, 32, heads=None),
     "tensor-parallel 2 and block_size 32 here, 1 and 32 at e-tp1-b32"),
    (_info(1, 0, 32, heads=None), _info(1, 0, 64),
     "this engine does not describe its KV heads"),
    (_info(1, 0, 32), _info(1, 0, 48), "block_size 32 here and 48 at the peer"),
    (_info(1, 0, 32), _info(2, 1, 32, heads=HeadSplit(total_heads=2, first_head=0, heads=1,
                                                      head_dim=8)),
     "says rank 1 of tensor-parallel 2 holds KV heads [0, 1)"),
    (_info(1, 0, 32), _info(2, 0, 32, total=4), "KV total_heads differs: 2 here, 4"),
    (_info(1, 0, 32), _info(1, 0, 32, head_dim=16), "KV head_dim differs: 8 here, 16"),
    (_info(2, 0, 32, heads=None), _info(2, 1, 32, heads=None), "must talk to the matching rank"),
], ids=["peer-no-heads", "mine-no-heads", "block", "forged-offset", "heads", "head-dim",
        "legacy-rank"])
def test_handshake_refuses_what_it_cannot_map(mine: EngineInfo, theirs: EngineInfo,
                                              why: str) -> None:
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(mine, theirs)
    assert why in str(info.value), str(info.value)


def test_forged_tp_size_in_a_handshake_is_refused() -> None:
    good = _info(2, 1, 32)
    lying = EngineInfo(**{f: getattr(good, f) for f in good.__struct_fields__
                          if f != "tp_size"}, tp_size=3)
    with pytest.raises(LayoutMismatch, match="cannot be split"):
        check_compatible(_info(1, 0, 32), lying)
    beyond = EngineInfo(**{f: getattr(good, f) for f in good.__struct_fields__
                           if f != "rank"}, rank=7)
    with pytest.raises(LayoutMismatch, match="rank 7 of tensor-parallel 2"):
        check_compatible(_info(1, 0, 32), beyond)


@pytest.mark.parametrize("heads", [
    {"total_heads": 0, "first_head": 0, "heads": 1, "head_dim": 8},
    {"total_heads": 1 << 20, "first_head": 0, "heads": 1, "head_dim": 8},
    {"total_heads": 2, "first_head": -1, "heads": 1, "head_dim": 8},
    {"total_heads": 2, "first_head": 0, "heads": 1, "head_dim": 8, "outer": 3},
    {"total_heads": 2, "first_head": 0, "heads": 1, "head_dim": 8, "inner": 0},
    {"total_heads": 2, "first_head": 0, "heads": "1", "head_dim": 8},
    ["not", "a", "struct"],
])
def test_malformed_head_split_on_the_wire_is_refused(heads: Any) -> None:
    codec = Codec()
    info = msgspec.to_builtins(_info(1, 0, 32))
    info["heads"] = heads
    challenge = os.urandom(32)
    body = msgspec.msgpack.encode({"type": "Hello", "info": info, "challenge": challenge})
    frame = codec.encode(Hello(info=_info(1, 0, 32), challenge=challenge))
    frame = frame[:25] + body  # same header, hostile body
    with pytest.raises(MessageError):
        codec.decode(frame)


@pytest.mark.parametrize("part", [
    {"tp_size": 0, "rank": 0, "block_size": 32, "first_token": 0},
    {"tp_size": 1 << 20, "rank": 0, "block_size": 32, "first_token": 0},
    {"tp_size": 2, "rank": -1, "block_size": 32, "first_token": 0},
    {"tp_size": 2, "rank": 0, "block_size": 0, "first_token": 0},
    {"tp_size": 2, "rank": 0, "block_size": 32, "first_token": 1 << 40},
    {"tp_size": 2, "rank": 0, "block_size": 32},
], ids=["tp0", "tp-huge", "rank-neg", "block0", "token-huge", "missing"])
def test_malformed_claim_part_is_refused(part: dict[str, int]) -> None:
    codec = Codec()
    claim = msgspec.to_builtins(PullClaim(transfer_id="t", generation="g", block_ids=[1],
                                          num_tokens=1, prompt_digest="x"))
    claim["part"] = part
    frame = codec.encode(Ack())[:25] + msgspec.msgpack.encode(claim)
    with pytest.raises(MessageError):
        codec.decode(frame)


@pytest.mark.parametrize("rank", [-1, 1 << 20, "0", 1.5])
def test_malformed_confirming_rank_is_refused(rank: Any) -> None:
    codec = Codec()
    confirm = msgspec.to_builtins(PushConfirm(transfer_id="t", generation="g", block_ids=[1]))
    confirm["rank"] = rank
    frame = codec.encode(Ack())[:25] + msgspec.msgpack.encode(confirm)
    with pytest.raises(MessageError):
        codec.decode(frame)
